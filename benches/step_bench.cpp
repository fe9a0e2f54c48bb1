// The step-graph table of graphed_bench (docs/benchmarks.md section 5): a
// small MLP's training step declared as one step (CLONE grads with clone
// slots, or ACCUMULATE_INTO fixed buffers) and replayed with one launch,
// against one graph hand-captured from the same kernels, the same layers
// replayed pass by pass, and torch's per-layer graphs
// (benches/torch_reference.py's JSON). Checked first: the step's grads
// equal eager's.
#include "step_bench.hpp"

#include "common.hpp"
#include "layers.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace bench {

using kit::Buffer;

namespace {

// Wall-clock ms per call of `step` (after warm-up, median of 5 runs of `n`).
double per_call_ms(kit::Device& dev, const std::function<void()>& step, int n) {
    for (int i = 0; i < 5; ++i) step();
    dev.sync();
    std::vector<double> runs;
    for (int r = 0; r < 5; ++r) {
        auto a = std::chrono::steady_clock::now();
        for (int i = 0; i < n; ++i) step();
        dev.sync();
        auto z = std::chrono::steady_clock::now();
        runs.push_back(std::chrono::duration<double, std::milli>(z - a).count() / n);
    }
    return bench::median(runs);
}

}  // namespace

int step_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width, int batch, int steps,
               const std::string& torch_json) {
    Checks check;
    report << "\n## 5. Step graphs: a " << layers << "-layer small MLP in one launch\n\n"
           << layers << " Linear(" << width << ") + ReLU layers, batch " << batch
           << ", fp32, one training step's forward, loss grad and backward (the optimizer left out of every "
              "variant), wall clock per step (median of 5 runs of " << steps
           << " steps, variants interleaved). Ours: the layers chained and the loss inside, declared as one step "
              "(graphed_session_add_step), with CLONE grads (clone slots) or ACCUMULATE_INTO fixed buffers; and "
              "the same layers replayed pass by pass. The reference: one graph hand-captured from the same "
              "kernels. torch: `torch.cuda.make_graphed_callables` on the same layers (cuBLAS Linear + ReLU), "
              "one graph per layer, driven from Python through autograd (benches/torch_reference.py, same "
              "machine). Goals: the step within 1.10x of the hand-captured graph, and at least 4x faster than "
              "torch's per-layer graphs.\n\n";
    kit::Mlp hand(dev, layers, batch, width, 21), stepped(dev, layers, batch, width, 21),
        acc(dev, layers, batch, width, 21), passes(dev, layers, batch, width, 21);
    Buffer x = hand.tensor(kit::random_floats(size_t(batch) * width, 22));
    Buffer t = hand.tensor(kit::random_floats(size_t(batch) * width, 23, 0.1f));
    std::vector<uint32_t> all;
    for (uint32_t i = 0; i <= uint32_t(layers); ++i) all.push_back(i);
    graphed_session_config c = graphed::session_config(dev.graphed_kind());
    graphed::Session s_step(c), s_acc(c), s_pass(c);
    stepped.register_layers(s_step, x.get(), kit::Wiring{true, false, true});
    const uint32_t step_clone = s_step.add_step(all);
    std::vector<Buffer> dst;
    std::vector<void*> dsts;
    for (int i = 0; i < layers; ++i) {
        acc.layer(i).param_policy = GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
        dst.emplace_back(dev, size_t(width) * width * 4);
        dst.emplace_back(dev, size_t(width) * 4);
    }
    for (auto& d : dst) dsts.push_back(d.get());
    acc.register_layers(s_acc, x.get(), kit::Wiring{true, false, true});
    const uint32_t step_acc = s_acc.add_step(all, dsts);
    passes.register_layers(s_pass, x.get(), kit::Wiring{true, false, false});
    s_step.capture();
    s_acc.capture();
    s_pass.capture();
    // Correct first: the step's grads equal eager's.
    kit::StepGrads e = hand.eager_step(x.get(), t.get(), 0.0f);
    kit::StepGrads g = stepped.step_graph_step(s_step, step_clone, x.get(), t.get(), 0.0f);
    check(e.w == g.w && e.b == g.b, "the step graph's grads equal eager");
    // Inputs in place for the timed loops.
    const size_t act = size_t(batch) * width * 4;
    for (graphed::Session* ss : {&s_step, &s_acc}) {
        dev.copy(dev.stream(), ss->buffers(0, 0, GRAPHED_BUFFER_ROLE_INPUT)[0], x.get(), act);
        dev.copy(dev.stream(), ss->buffers(uint32_t(layers), 0, GRAPHED_BUFFER_ROLE_INPUT)[1], t.get(), act);
    }
    void* graph = tools.capture([&](graphed_stream st) { hand.eager_pass(st, x.get(), t.get()); });
    std::vector<graphed::Ref> grads;
    std::vector<double> th, ts, ta, tp;
    for (int round = 0; round < 3; ++round) {
        if (graph) th.push_back(per_call_ms(dev, [&] { tools.launch(graph); }, steps));
        ts.push_back(per_call_ms(
            dev,
            [&] {
                s_step.step(step_clone, dev.stream(), grads);
                for (auto& r : grads) r.release();
            },
            steps));
        ta.push_back(per_call_ms(dev, [&] { s_acc.step(step_acc, dev.stream(), grads); }, steps));
        tp.push_back(per_call_ms(
            dev, [&] { passes.graphed_step(s_pass, x.get(), t.get(), 0.0f, false, false, false); }, steps));
    }
    if (graph) tools.destroy(graph);
    const double h = th.empty() ? std::nan("") : bench::median(th);
    const double st = bench::median(ts), sa = bench::median(ta), sp = bench::median(tp);
    const std::string json = torch_json.empty() ? std::string() : read_file(torch_json);
    const double torch_ms = json_number(json, "per_layer_graphs_ms");
    report << "| variant | ms per step | vs hand-captured graph | torch per-layer graphs / this |\n|---|---|---|---|\n";
    auto row = [&](const std::string& what, double ms) {
        report << "| " << what << " | " << fmt("%.4f", ms) << " | "
               << (std::isnan(h) ? std::string("n/a") : fmt("%.2fx", ms / h)) << " | "
               << (std::isnan(torch_ms) ? std::string("n/a") : fmt("%.1fx", torch_ms / ms)) << " |\n";
    };
    if (!std::isnan(h)) row("one graph hand-captured from the same kernels", h);
    row("graphed step, CLONE grads (clone slots)", st);
    row("graphed step, ACCUMULATE_INTO fixed buffers", sa);
    row("graphed, pass by pass (chained)", sp);
    if (!std::isnan(torch_ms)) {
        report << "| torch make_graphed_callables, per layer, from Python (" << json_number(json, "layers")
               << " layers; torch eager " << fmt("%.3f", json_number(json, "eager_ms")) << " ms) | "
               << fmt("%.4f", torch_ms) << " | " << (std::isnan(h) ? "n/a" : fmt("%.2fx", torch_ms / h)) << " | 1.0x |\n";
    } else {
        report << "\ntorch's figure: not measured in this run (run benches/torch_reference.py and pass --torch-json).\n";
    }
    std::printf("step: hand %.4f ms, step clone %.4f, step acc %.4f, per pass %.4f, torch %.4f\n", h, st, sa, sp,
                torch_ms);
    return check.failed;
}

}  // namespace bench
