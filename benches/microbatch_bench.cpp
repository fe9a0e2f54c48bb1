// The microbatch-step table of graphed_bench (docs/benchmarks.md section
// 11): gradient accumulation over N microbatches as one step graph
// (unrolled, or one microbatch in a conditional WHILE node) against N
// replays of a one-microbatch step, for a small MLP: GPU time per
// optimizer step, host time per optimizer step, capture (and instantiate)
// time, and memory by the library's accounting and by the driver. Checked
// first: each variant's grads equal eager accumulation over the same
// microbatches, bit for bit.
#include "microbatch_bench.hpp"

#include "layers.hpp"

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>

namespace bench {

int microbatch_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width, int batch,
                     const std::vector<uint32_t>& counts, int samples) {
    int failures = 0;
    report << "\n## 11. Gradient accumulation in one launch: N microbatches in one step graph\n\n"
           << layers << " Linear(" << width << ") + ReLU layers and the squared-error loss, batch " << batch
           << " per microbatch, fp32, ACCUMULATE_INTO fixed buffers, each microbatch's input and target read "
              "from one buffer by the graph's own copies (graphed_step_io). **unrolled**: a step declared with "
              "`microbatches = N` (every microbatch captured); **while**: the same with "
              "`GRAPHED_STEP_LOOP_WHILE` (one microbatch in a conditional WHILE node, the count given per replay); "
              "**N launches**: a step of one microbatch replayed N times. GPU time: CUDA-event medians of "
           << std::max(1, samples / 5)
           << " optimizer steps after warm-up in each of 5 rounds that interleave the three variants, the median "
              "of the rounds. Host time: the median wall time of the call(s) that enqueue one "
              "optimizer step, the device synchronized between samples. Capture: `graphed_session_capture` wall "
              "time (warmup, capture, instantiate, verification). Driver: the device memory capture took "
              "(cuMemGetInfo before and after). The library's static + scratch bytes are those of one "
              "microbatch in every variant (printed in the last column). Checked first: each variant's grads "
              "equal eager accumulation bit for bit.\n\n"
           << "| N | GPU ms: unrolled / while / N launches | host us: unrolled / while / N launches | capture ms: "
              "unrolled / while | driver MiB: unrolled / while | static + scratch bytes |\n"
           << "|---|---|---|---|---|---|\n";
    const size_t act = size_t(batch) * width * 4;
    std::vector<uint32_t> all;
    for (uint32_t i = 0; i <= uint32_t(layers); ++i) all.push_back(i);
    for (uint32_t n : counts) {
        kit::Mlp eager(dev, layers, batch, width, 61);
        kit::Buffer xs = eager.tensor(kit::random_floats(size_t(batch) * width * n, 62));
        kit::Buffer ts = eager.tensor(kit::random_floats(size_t(batch) * width * n, 63, 0.1f));
        const std::vector<graphed_step_io> io = {
            graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, xs.get(), act),
            graphed::Session::step_io(uint32_t(layers), GRAPHED_BUFFER_ROLE_INPUT, 1, ts.get(), act)};
        kit::StepGrads want;
        for (uint32_t i = 0; i < n; ++i) {
            const char* x = static_cast<const char*>(xs.get()) + i * act;
            const char* t = static_cast<const char*>(ts.get()) + i * act;
            kit::StepGrads g = eager.eager_step(x, t, 0.0f);
            if (i == 0) {
                want = g;
                continue;
            }
            for (int l = 0; l < layers; ++l) {
                for (size_t k = 0; k < g.w[l].size(); ++k) want.w[l][k] += g.w[l][k];
                for (size_t k = 0; k < g.b[l].size(); ++k) want.b[l][k] += g.b[l][k];
            }
        }
        // One variant: its model, session, destinations and step.
        struct Variant {
            std::unique_ptr<kit::Mlp> m;
            std::unique_ptr<graphed::Session> s;
            std::vector<kit::Buffer> dst;
            std::vector<void*> dsts;
            uint32_t step = 0;
            double capture_ms = 0;
            size_t driver = 0;
        };
        graphed_session_config c = graphed::session_config(dev.graphed_kind());
        auto make = [&](uint32_t count, uint32_t mode) {
            Variant v;
            v.m = std::make_unique<kit::Mlp>(dev, layers, batch, width, 61);
            v.s = std::make_unique<graphed::Session>(c);
            for (int i = 0; i < layers; ++i) {
                v.m->layer(i).param_policy = GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
                v.dst.push_back(eager.tensor(std::vector<float>(size_t(width) * width, 0.0f)));
                v.dst.push_back(eager.tensor(std::vector<float>(size_t(width), 0.0f)));
            }
            for (auto& d : v.dst) v.dsts.push_back(d.get());
            v.m->register_layers(*v.s, xs.get(), kit::Wiring{true, false, true});
            v.step = v.s->add_step(all, v.dsts, count, io, mode);
            dev.sync();
            const size_t before = tools.driver_free();
            const auto t0 = std::chrono::steady_clock::now();
            v.s->capture();
            dev.sync();
            v.capture_ms = ms_since(t0);
            const size_t after = tools.driver_free();
            v.driver = before >= after ? before - after : 0;
            return v;
        };
        Variant unrolled = make(n, GRAPHED_STEP_LOOP_UNROLLED);
        Variant looped = make(n, GRAPHED_STEP_LOOP_WHILE);
        Variant single = make(1, GRAPHED_STEP_LOOP_UNROLLED);
        std::vector<graphed::Ref> grads;
        for (Variant* v : {&unrolled, &looped}) {
            for (auto& d : v->dst) {
                std::vector<float> zero(d.bytes() / 4, 0.0f);
                dev.upload(d.get(), zero.data(), d.bytes());
            }
            v->s->step(v->step, dev.stream(), grads);
            dev.sync();
            bool same = true;
            for (int l = 0; l < layers; ++l) {
                same = same && want.w[l] == kit::fetch<float>(dev, v->dsts[2 * l], size_t(width) * width);
                same = same && want.b[l] == kit::fetch<float>(dev, v->dsts[2 * l + 1], size_t(width));
            }
            if (!same) {
                std::fprintf(stderr, "CHECK FAILED: %u microbatches in one step graph (%s): grads equal eager "
                             "accumulation\n", n, v == &looped ? "while" : "unrolled");
                ++failures;
            }
        }
        auto run_unrolled = [&] { unrolled.s->step(unrolled.step, dev.stream(), grads); };
        auto run_looped = [&] { looped.s->step(looped.step, dev.stream(), grads); };
        auto run_single = [&] {
            for (uint32_t i = 0; i < n; ++i) single.s->step(single.step, dev.stream(), grads);
        };
        // Interleaved: 5 rounds of the three variants, each round a median
        // of samples / 5 steps after warm-up, the median of the rounds kept,
        // so that clock drift reaches all three alike.
        std::vector<double> ru, rw, rn;
        const int per_round = std::max(1, samples / 5);
        for (int round = 0; round < 5; ++round) {
            ru.push_back(tools.median_ms(run_unrolled, [] {}, 2, per_round, 1));
            rw.push_back(tools.median_ms(run_looped, [] {}, 2, per_round, 2));
            rn.push_back(tools.median_ms(run_single, [] {}, 2, per_round, int(n)));
        }
        const double gu = median(ru), gw = median(rw), gn = median(rn);
        auto host_us = [&](const std::function<void()>& op) {
            std::vector<double> v;
            for (int r = 0; r < samples; ++r) {
                const auto a = std::chrono::steady_clock::now();
                op();
                v.push_back(ms_since(a) * 1000.0);
                dev.sync();
            }
            return median(v);
        };
        const double hu = host_us(run_unrolled), hw = host_us(run_looped), hn = host_us(run_single);
        const graphed_session_stats st = looped.s->stats();
        const double mib = 1024.0 * 1024.0;
        report << "| " << n << " | " << fmt("%.4f", gu) << " / " << fmt("%.4f", gw) << " / " << fmt("%.4f", gn)
               << " (" << fmt("%.3fx", gu / gn) << ", " << fmt("%.3fx", gw / gn) << ") | " << fmt("%.1f", hu)
               << " / " << fmt("%.1f", hw) << " / " << fmt("%.1f", hn) << " | " << fmt("%.1f", unrolled.capture_ms)
               << " / " << fmt("%.1f", looped.capture_ms) << " | " << fmt("%.1f", unrolled.driver / mib) << " / "
               << fmt("%.1f", looped.driver / mib) << " | " << (st.static_bytes + st.scratch_bytes) << " |\n";
        std::printf("microbatches %u: gpu %.4f / %.4f / %.4f ms, host %.1f / %.1f / %.1f us, capture %.1f / %.1f ms\n",
                    n, gu, gw, gn, hu, hw, hn, unrolled.capture_ms, looped.capture_ms);
    }
    return failures;
}

}  // namespace bench
