// The capture-time table of graphed_bench (docs/benchmarks.md section 8):
// the capture time of a small MLP's session by phase (graphed_session_stats),
// per pass or as a step, with or without clone slots and a rebound input,
// against capturing the same kernels by hand into one graph.
#include "capture_bench.hpp"

#include "common.hpp"
#include "layers.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

namespace bench {

using kit::Buffer;

void capture_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width, int batch,
                   int repeats) {
    report << "\n## 8. Capture time: a " << layers << "-layer small MLP\n\n"
           << layers << " Linear(" << width << ") + ReLU layers, batch " << batch
           << ", fp32, with the loss, chained, 3 warmup iterations (the default). Host time of "
              "graphed_session_capture (median of " << repeats
           << " fresh sessions) and its phases from graphed_session_stats (ms, of the median session); the "
              "reference captures the same eager step by hand into one graph (stream capture, instantiate, "
              "upload), without warmup.\n\n"
           << "| variant | total | plan | warmup | record | instantiate | upload | slots | steps | rebind plan | "
              "rebind verify | graphs | templates kept |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    kit::Mlp hand(dev, layers, batch, width, 21);
    Buffer x = hand.tensor(kit::random_floats(size_t(batch) * width, 22));
    Buffer t = hand.tensor(kit::random_floats(size_t(batch) * width, 23, 0.1f));
    std::vector<uint32_t> all;
    for (uint32_t i = 0; i <= uint32_t(layers); ++i) all.push_back(i);
    auto ms = [](uint64_t ns) { return fmt("%.2f", double(ns) / 1e6); };
    struct Variant {
        const char* name;
        bool step, rebind;
        uint32_t slots;
    };
    const Variant variants[] = {{"per pass, no rebinding, no clone slots", false, false, 0},
                                {"per pass, clone slots (2)", false, false, 2},
                                {"per pass, the first input rebound", false, true, 0},
                                {"step, CLONE grads, clone slots (2)", true, false, 2}};
    for (const Variant& v : variants) {
        std::vector<std::pair<double, graphed_session_stats>> runs;
        for (int r = 0; r < repeats; ++r) {
            kit::Mlp m(dev, layers, batch, width, 21);
            graphed_session_config c = graphed::session_config(dev.graphed_kind());
            c.clone_slots = v.slots;
            graphed::Session s(c);
            // The last layer's grad-output is the loss's buffer, used in
            // place: only the first input can be rebound.
            m.register_layers(s, x.get(), kit::Wiring{true, v.rebind, true, false});
            if (v.step) s.add_step(all);
            dev.sync();
            auto a = std::chrono::steady_clock::now();
            s.capture();
            auto z = std::chrono::steady_clock::now();
            runs.emplace_back(std::chrono::duration<double, std::milli>(z - a).count(), s.stats());
        }
        std::sort(runs.begin(), runs.end(), [](const auto& p, const auto& q) { return p.first < q.first; });
        const auto& [wall, st] = runs[runs.size() / 2];
        report << "| " << v.name << " | " << fmt("%.2f", wall) << " | " << ms(st.capture_plan_ns) << " | "
               << ms(st.capture_warmup_ns) << " | " << ms(st.capture_record_ns) << " | "
               << ms(st.capture_instantiate_ns) << " | " << ms(st.capture_upload_ns) << " | "
               << ms(st.capture_slots_ns) << " | " << ms(st.capture_steps_ns) << " | "
               << ms(st.capture_rebind_plan_ns) << " | " << ms(st.capture_rebind_verify_ns) << " | "
               << st.graph_count + st.slot_graphs + st.step_graphs << " | " << st.templates_kept << " |\n";
        std::printf("capture %s: %.2f ms\n", v.name, wall);
    }
    std::vector<double> hand_ms;
    for (int r = 0; r < repeats; ++r) {
        dev.sync();
        auto a = std::chrono::steady_clock::now();
        void* g = tools.capture([&](graphed_stream st) { hand.eager_pass(st, x.get(), t.get()); });
        auto z = std::chrono::steady_clock::now();
        if (!g) break;
        tools.destroy(g);
        hand_ms.push_back(std::chrono::duration<double, std::milli>(z - a).count());
    }
    if (!hand_ms.empty())
        report << "| one graph captured by hand from the same kernels (no warmup) | "
               << fmt("%.2f", bench::median(hand_ms)) << " | | | | | | | | | | 1 | |\n";
}

}  // namespace bench
