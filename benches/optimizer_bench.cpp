// The whole-iteration table of graphed_bench (docs/benchmarks.md section
// 5, "The optimizer inside"; issue 39's C++ rows, the counterpart of
// benches/torch_step_optimizer.py --model mlp): a small MLP's training
// iteration (forward, loss, backward, the kit's SGD with momentum) as one
// graphed step with the update inside (graphed_step_desc.update_apply,
// the learning rate in the step's scalar block; with update_check too,
// the update in a conditional IF node), against the same step followed by
// the same update kernels launched eagerly, and against one graph
// hand-captured around the same kernels (the reference, CUDA only).
// Checked first: one iteration of every variant leaves the weights and
// the momentum of the eager iteration, bit for bit.
#include "optimizer_bench.hpp"

#include "common.hpp"
#include "layers.hpp"
#include "optimizer.hpp"

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace bench {

namespace {

// How a trainer runs its iteration.
enum class Variant { Eager, Inside, Checked, Outside };

// One trainer of the table: its model, its optimizer (momentum buffers),
// what the update reads, and for the graphed variants its session, step
// and grad destinations (COPY_INTO).
struct Trainer {
    std::unique_ptr<kit::Mlp> m;
    kit::SgdMomentum opt;
    std::vector<kit::Buffer> dst;
    std::vector<float*> params;
    std::vector<const float*> grads;
    std::vector<size_t> counts;
    std::unique_ptr<graphed::Session> s;
    uint32_t step = 0;

    // The weights and the momentum, on the host.
    std::vector<std::vector<float>> state(kit::Device& dev) const {
        std::vector<std::vector<float>> out;
        for (size_t p = 0; p < params.size(); ++p) {
            out.push_back(kit::fetch<float>(dev, params[p], counts[p]));
            out.push_back(kit::fetch<float>(dev, opt.m[p], counts[p]));
        }
        return out;
    }
};

std::unique_ptr<Trainer> make_trainer(kit::Device& dev, Variant v, int layers, int width, int batch, const void* x,
                                      const void* t) {
    auto tr = std::make_unique<Trainer>();
    tr->m = std::make_unique<kit::Mlp>(dev, layers, batch, width, 31);
    std::vector<size_t> bytes;
    for (int i = 0; i < layers; ++i) {
        tr->params.push_back(static_cast<float*>(tr->m->layer(i).w));
        tr->params.push_back(static_cast<float*>(tr->m->layer(i).b));
        bytes.push_back(size_t(width) * width * 4);
        bytes.push_back(size_t(width) * 4);
    }
    for (size_t b : bytes) tr->counts.push_back(b / 4);
    tr->opt = kit::SgdMomentum(dev, bytes);
    if (v == Variant::Eager) {
        for (int i = 0; i < layers; ++i) {
            tr->grads.push_back(static_cast<const float*>(tr->m->grad_w(i)));
            tr->grads.push_back(static_cast<const float*>(tr->m->grad_b(i)));
        }
        return tr;
    }
    std::vector<void*> dsts;
    for (size_t b : bytes) {
        tr->dst.emplace_back(dev, b);
        dsts.push_back(tr->dst.back().get());
        tr->grads.push_back(tr->dst.back().f32());
    }
    for (int i = 0; i < layers; ++i) tr->m->layer(i).param_policy = GRAPHED_GRAD_POLICY_COPY_INTO;
    tr->s = std::make_unique<graphed::Session>(graphed::session_config(dev.graphed_kind()));
    tr->m->register_layers(*tr->s, x, kit::Wiring{true, false, true});
    std::vector<uint32_t> all;
    for (uint32_t i = 0; i <= uint32_t(layers); ++i) all.push_back(i);
    graphed::StepUpdate update;
    if (v != Variant::Outside) {
        update.check = v == Variant::Checked ? &kit::SgdMomentum::check : nullptr;
        update.apply = &kit::SgdMomentum::apply;
        update.data = &tr->opt;
        update.scalar_bytes = sizeof(kit::SgdScalars);
    }
    tr->step = tr->s->add_step(all, dsts, 1, {}, GRAPHED_STEP_LOOP_UNROLLED, nullptr, nullptr, update);
    tr->s->capture();
    // The data in place in the static inputs (as the hand-captured graph
    // reads it in place): the timed loops copy nothing in.
    const size_t act = size_t(batch) * width * 4;
    dev.copy(dev.stream(), tr->s->buffers(0, 0, GRAPHED_BUFFER_ROLE_INPUT)[0], x, act);
    dev.copy(dev.stream(), tr->s->buffers(uint32_t(layers), 0, GRAPHED_BUFFER_ROLE_INPUT)[1], t, act);
    dev.sync();
    return tr;
}

}  // namespace

int optimizer_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width, int batch,
                    int rounds, int samples) {
    Checks check;
    const bool host = dev.backend() == kit::Backend::Host;
    report << "\n### The optimizer inside: a " << layers << "-layer small MLP's whole iteration in one launch\n\n"
           << layers << " Linear(" << width << ") + ReLU layers and the squared-error loss, batch " << batch
           << ", fp32, one microbatch; the optimizer is the kit's SGD with momentum (`kit::SgdMomentum`: one "
              "kernel per parameter, the learning rate and momentum read from device memory). The reference: "
              "one CUDA graph captured by hand (`cudaStreamBeginCapture`) around the same kernels (forward, "
              "loss grad, backward, update). **graphed step + update inside**: the layers and the loss declared "
              "as one step (COPY_INTO grad destinations) with `update_apply`, the learning rate given to each "
              "call in the step's scalar block (`Session::step_with`), or kept there (`Session::step`); "
              "**+ check**: with `update_check` too (the update in a conditional IF node, skipped on the device "
              "when a grad is not finite); **graphed step, then the update eagerly**: the same step without "
              "update, then the same kernels launched one per parameter. The data sits in the static inputs in "
              "every variant. GPU time: CUDA-event medians of "
           << samples << " iterations in each of " << rounds
           << " rounds interleaving the variants, the median of the rounds; host time: the median wall time of "
              "the call(s) that enqueue one iteration, the device synchronized between samples. Checked first: "
              "one iteration of each variant leaves the weights and the momentum of the same kernels run "
              "eagerly, bit for bit. Targets (issue 39): the step with the update inside at most 1.05x the "
              "hand-captured graph, at most 10 us of host time per call. The counterpart from Python: "
              "`benches/torch_step_optimizer.py --model mlp`.\n\n";
    if (host)
        report << "Host backend: the times below are wall clocks of the CPU emulation, not GPU figures; there is "
                  "no hand-captured graph, and the targets are not judged.\n\n";
    kit::Mlp data(dev, 1, batch, width, 31);
    kit::Buffer x = data.tensor(kit::random_floats(size_t(batch) * width, 32));
    kit::Buffer t = data.tensor(kit::random_floats(size_t(batch) * width, 33, 0.1f));
    const kit::SgdScalars sc{1e-4f, 0.9f};
    kit::Buffer scalars(dev, sizeof sc), flag(dev, 4);
    dev.upload(scalars.get(), &sc, sizeof sc);
    const uint32_t zero = 0;
    dev.upload(flag.get(), &zero, 4);
    const auto* scal = static_cast<const float*>(scalars.get());

    // The eager iteration, run first: it also loads every kernel before
    // any capture.
    auto ref = make_trainer(dev, Variant::Eager, layers, width, batch, x.get(), t.get());
    ref->m->eager_pass(dev.stream(), x.get(), t.get());
    check(ref->opt.check_eager(dev.stream(), ref->grads, ref->counts, static_cast<uint32_t*>(flag.get())) == 0,
          "the eager check runs");
    check(ref->opt.apply_eager(dev.stream(), ref->params, ref->grads, ref->counts, scal) == 0,
          "the eager update runs");
    dev.sync();
    const auto want = ref->state(dev);

    auto hand = make_trainer(dev, Variant::Eager, layers, width, batch, x.get(), t.get());
    void* graph = tools.capture([&](graphed_stream st) {
        hand->m->eager_pass(st, x.get(), t.get());
        hand->opt.apply_eager(st, hand->params, hand->grads, hand->counts, scal);
    });
    auto inside = make_trainer(dev, Variant::Inside, layers, width, batch, x.get(), t.get());
    auto kept = make_trainer(dev, Variant::Inside, layers, width, batch, x.get(), t.get());
    auto checked = make_trainer(dev, Variant::Checked, layers, width, batch, x.get(), t.get());
    auto outside = make_trainer(dev, Variant::Outside, layers, width, batch, x.get(), t.get());

    std::vector<graphed::Ref> refs;
    auto run_hand = [&] { tools.launch(graph); };
    auto run_inside = [&] { inside->s->step_with(inside->step, dev.stream(), refs, sc); };
    auto run_kept = [&] { kept->s->step(kept->step, dev.stream(), refs); };
    auto run_checked = [&] { checked->s->step_with(checked->step, dev.stream(), refs, sc); };
    auto run_outside = [&] {
        outside->s->step(outside->step, dev.stream(), refs);
        outside->opt.apply_eager(dev.stream(), outside->params, outside->grads, outside->counts, scal);
    };
    // `kept` reads the scalars its block holds: given once.
    kept->s->step_with(kept->step, dev.stream(), refs, sc);
    if (graph) run_hand();
    run_inside();
    run_checked();
    run_outside();
    dev.sync();
    if (graph) check(hand->state(dev) == want, "the hand-captured graph's iteration equals eager");
    check(inside->state(dev) == want, "the step with the update inside equals eager");
    check(kept->state(dev) == want, "the step with the update inside (scalars given once) equals eager");
    check(checked->state(dev) == want, "the step with the check and the update inside equals eager");
    check(!checked->s->skipped(checked->step).last, "the checked step did not skip its update");
    check(outside->state(dev) == want, "the step, then the update eagerly, equals eager");

    struct Row {
        std::string what;
        std::function<void()> run;
        int launches;
        std::vector<double> gpu;
    };
    std::vector<Row> rows;
    if (graph) rows.push_back({"one graph hand-captured around the same kernels (reference)", run_hand, 1, {}});
    rows.push_back({"graphed step + update inside, lr given each call", run_inside, 2, {}});
    rows.push_back({"graphed step + update inside, scalars kept", run_kept, 1, {}});
    rows.push_back({"graphed step + check + update inside (IF node), lr given each call", run_checked, 2, {}});
    rows.push_back({"graphed step, then the update eagerly", run_outside, 1 + 2 * layers, {}});
    for (int r = 0; r < rounds; ++r)
        for (Row& row : rows) row.gpu.push_back(tools.median_ms(row.run, [] {}, 3, samples, row.launches));
    const double base = graph ? median(rows.front().gpu) : std::nan("");
    const double eager_update = median(rows.back().gpu);
    report << "| variant | " << (tools.device_timing() ? "GPU ms (median)" : "wall ms (median, host backend)")
           << " | host us per call (median) | vs hand-captured graph | vs step, then the update eagerly |\n"
              "|---|---|---|---|---|\n";
    const size_t inside_row = graph ? 1 : 0;  // the row of the targets
    double inside_ms = 0, inside_us = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
        const Row& row = rows[i];
        const double ms = median(row.gpu), us = host_us(dev, row.run, 1, samples);
        if (i == inside_row) {
            inside_ms = ms;
            inside_us = us;
        }
        report << "| " << row.what << " | " << fmt("%.4f", ms) << " | " << fmt("%.1f", us) << " | "
               << (std::isnan(base) ? std::string("n/a") : fmt("%.3fx", ms / base)) << " | "
               << fmt("%.3fx", ms / eager_update) << " |\n";
        std::printf("step update: %-70s %.4f ms, %.1f us\n", row.what.c_str(), ms, us);
    }
    const graphed::Skipped skips = checked->s->skipped(checked->step);
    report << "\nThe checked step skipped " << skips.total << " of its replays (0 expected: the timed data is "
           << "finite).\n";
    check(skips.total == 0, "the checked step skipped no replay");
    if (!host && graph)
        report << "\ntarget: graphed step + update inside (lr given each call) at most 1.05x the hand-captured "
                  "graph: "
               << fmt("%.3fx", inside_ms / base) << (inside_ms <= 1.05 * base ? " met" : " NOT MET")
               << "; host at most 10 us: " << fmt("%.1f us", inside_us) << (inside_us <= 10.0 ? " met" : " NOT MET")
               << "\n";
    if (graph) tools.destroy(graph);
    return check.failed;
}

}  // namespace bench
