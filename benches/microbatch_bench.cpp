// The microbatch-step table of graphed_bench (docs/benchmarks.md section
// 11): gradient accumulation over N microbatches as one step graph
// against N replays of a one-microbatch step, for a small MLP: GPU time
// per optimizer step, host time per optimizer step, capture (and
// instantiate) time, and memory by the library's accounting and by the
// driver. Checked first: the N-microbatch step's grads equal eager
// accumulation over the same microbatches, bit for bit.
#include "microbatch_bench.hpp"

#include "layers.hpp"

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>

namespace bench {

namespace {

std::string fmt(const char* f, double v) {
    char b[64];
    std::snprintf(b, sizeof b, f, v);
    return b;
}

double ms_since(std::chrono::steady_clock::time_point a) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
}

}  // namespace

int microbatch_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width, int batch,
                     const std::vector<uint32_t>& counts, int samples) {
    int failures = 0;
    report << "\n## 11. Gradient accumulation in one launch: N microbatches in one step graph\n\n"
           << layers << " Linear(" << width << ") + ReLU layers and the squared-error loss, batch " << batch
           << " per microbatch, fp32, ACCUMULATE_INTO fixed buffers. **one graph**: a step declared with "
              "`microbatches = N` and io copies (each microbatch's input and target read from one buffer by "
              "the graph's own copies); **N launches**: a step of one microbatch (the same io) replayed N times. "
              "GPU time: CUDA-event median of "
           << samples
           << " optimizer steps after warm-up. Host time: the median wall time of the call(s) that enqueue one "
              "optimizer step, the device synchronized between samples. Capture: `graphed_session_capture` wall "
              "time (warmup, capture, instantiate, verification). Memory: the library's static and scratch bytes, "
              "and the driver's free memory before and after capture.\n\n"
           << "| N | GPU ms, one graph | GPU ms, N launches | ratio | host us, one graph | host us, N launches | "
              "capture ms, one graph | static + scratch bytes | driver bytes taken by capture |\n"
           << "|---|---|---|---|---|---|---|---|---|\n";
    const size_t act = size_t(batch) * width * 4;
    std::vector<uint32_t> all;
    for (uint32_t i = 0; i <= uint32_t(layers); ++i) all.push_back(i);
    for (uint32_t n : counts) {
        kit::Mlp eager(dev, layers, batch, width, 61), looped(dev, layers, batch, width, 61),
            single(dev, layers, batch, width, 61);
        kit::Buffer xs = eager.tensor(kit::random_floats(size_t(batch) * width * n, 62));
        kit::Buffer ts = eager.tensor(kit::random_floats(size_t(batch) * width * n, 63, 0.1f));
        std::vector<kit::Buffer> dst;
        std::vector<void*> dl, ds;
        for (int i = 0; i < layers; ++i) {
            looped.layer(i).param_policy = GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
            single.layer(i).param_policy = GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
        }
        for (int k = 0; k < 2; ++k) {
            for (int i = 0; i < layers; ++i) {
                dst.push_back(eager.tensor(std::vector<float>(size_t(width) * width, 0.0f)));
                dst.push_back(eager.tensor(std::vector<float>(size_t(width), 0.0f)));
            }
        }
        for (int i = 0; i < 2 * layers; ++i) dl.push_back(dst[i].get());
        for (int i = 2 * layers; i < 4 * layers; ++i) ds.push_back(dst[i].get());
        const std::vector<graphed_step_io> io = {
            graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, xs.get(), act),
            graphed::Session::step_io(uint32_t(layers), GRAPHED_BUFFER_ROLE_INPUT, 1, ts.get(), act)};
        graphed_session_config c = graphed::session_config(dev.graphed_kind());
        graphed::Session s_loop(c), s_one(c);
        looped.register_layers(s_loop, xs.get(), kit::Wiring{true, false, true});
        single.register_layers(s_one, xs.get(), kit::Wiring{true, false, true});
        const uint32_t step_loop = s_loop.add_step(all, dl, n, io);
        const uint32_t step_one = s_one.add_step(all, ds, 1, io);
        dev.sync();
        const size_t free_before = tools.driver_free();
        const auto t0 = std::chrono::steady_clock::now();
        s_loop.capture();
        dev.sync();
        const double capture_ms = ms_since(t0);
        const size_t free_after = tools.driver_free();
        s_one.capture();
        // Correct first: one replay from zeroed destinations holds eager
        // accumulation's sums.
        for (int i = 0; i < 2 * layers; ++i) {
            std::vector<float> zero(dst[i].bytes() / 4, 0.0f);
            dev.upload(dst[i].get(), zero.data(), dst[i].bytes());
        }
        std::vector<graphed::Ref> grads;
        s_loop.step(step_loop, dev.stream(), grads);
        dev.sync();
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
        bool same = true;
        for (int l = 0; l < layers; ++l) {
            same = same && want.w[l] == kit::fetch<float>(dev, dl[2 * l], size_t(width) * width);
            same = same && want.b[l] == kit::fetch<float>(dev, dl[2 * l + 1], size_t(width));
        }
        if (!same) {
            std::fprintf(stderr, "CHECK FAILED: %u microbatches in one step graph: grads equal eager accumulation\n",
                         n);
            ++failures;
        }
        auto one_graph = [&] { s_loop.step(step_loop, dev.stream(), grads); };
        auto n_launches = [&] {
            for (uint32_t i = 0; i < n; ++i) s_one.step(step_one, dev.stream(), grads);
        };
        const double gpu_loop = tools.median_ms(one_graph, [] {}, 5, samples, 1);
        const double gpu_one = tools.median_ms(n_launches, [] {}, 5, samples, int(n));
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
        const double host_loop = host_us(one_graph), host_one = host_us(n_launches);
        const graphed_session_stats st = s_loop.stats();
        report << "| " << n << " | " << fmt("%.4f", gpu_loop) << " | " << fmt("%.4f", gpu_one) << " | "
               << fmt("%.3fx", gpu_loop / gpu_one) << " | " << fmt("%.1f", host_loop) << " | "
               << fmt("%.1f", host_one) << " | " << fmt("%.1f", capture_ms) << " | "
               << (st.static_bytes + st.scratch_bytes) << " | "
               << (free_before >= free_after ? std::to_string(free_before - free_after) : std::string("n/a"))
               << " |\n";
        std::printf("microbatches %u: gpu %.4f vs %.4f ms, host %.1f vs %.1f us, capture %.1f ms\n", n, gpu_loop,
                    gpu_one, host_loop, host_one, capture_ms);
    }
    return failures;
}

}  // namespace bench
