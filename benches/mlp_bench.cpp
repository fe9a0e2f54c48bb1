// The end-to-end table of graphed_bench (docs/benchmarks.md section 4): an
// MLP's training step (forward, backward, grad return, SGD) eager against
// graphed with CLONE grads copied as a plain graphed layer does, with
// CLONE grads and nothing copied, and with ALIAS grads; wall clock per
// step, the variants interleaved, and the memory each session holds.
// Checked first: every variant's grads equal eager's.
#include "mlp_bench.hpp"

#include "common.hpp"
#include "layers.hpp"

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace bench {

using kit::Buffer;

int mlp_table(kit::Device& dev, Tools& tools, std::ostream& report, const std::vector<MlpConfig>& configs,
              int steps) {
    Checks check;
    report << "\n## 4. End to end: an 8-layer MLP, forward + backward + grad return + SGD\n\n"
              "Time per training step (wall clock over " + std::to_string(steps) +
                  " steps after warm-up, median of 5 runs): eager (the same callbacks run directly on the stream); "
              "graphed with CLONE grads copying as a plain graphed layer does (every layer's input and grad-output "
              "copied into its static buffer, the grads copied out of the slab: chaining and clone slots off); "
              "graphed with CLONE grads and nothing copied (layers chained, the first input rebound, clone slots: "
              "the defaults plus the two input flags); the same with ALIAS grads. Goal: zero-copy CLONE within "
              "1.00x of eager. Every variant's grads are checked equal to eager's first.\n\n"
              "| config | eager (ms) | CLONE, copies (ms) | CLONE, zero-copy (ms) | ALIAS, zero-copy (ms) | "
              "CLONE copies / eager | CLONE zero-copy / eager | static + scratch (copies / zero-copy) | driver-seen |\n"
              "|---|---|---|---|---|---|---|---|---|\n";
    for (const MlpConfig& m : configs) {
        const char* dt = m.dtype == GRAPHED_DTYPE_F32 ? "fp32" : "bf16";
        kit::Mlp eager(dev, m.layers, m.batch, m.width, 3, m.dtype);
        kit::Mlp g_copy(dev, m.layers, m.batch, m.width, 3, m.dtype);
        kit::Mlp g_zero(dev, m.layers, m.batch, m.width, 3, m.dtype);
        kit::Mlp g_alias(dev, m.layers, m.batch, m.width, 3, m.dtype);
        Buffer x = eager.tensor(kit::random_floats(size_t(m.batch) * m.width, 5));
        Buffer t = eager.tensor(kit::random_floats(size_t(m.batch) * m.width, 6, 0.1f));
        auto session = [&](kit::Mlp& mlp, bool clones, uint32_t slots, kit::Wiring w, size_t* driver_used) {
            graphed_session_config c = graphed::session_config(dev.graphed_kind());
            c.clone_param_grads_on_return = clones;
            c.clone_slots = slots;
            size_t before = tools.driver_free();
            graphed::Session s(c);
            mlp.register_layers(s, x.get(), w);
            s.capture();
            dev.sync();
            if (driver_used) *driver_used = before - tools.driver_free();
            return s;
        };
        const kit::Wiring zero{true, true, false};
        size_t driver_used = 0;
        graphed::Session sc = session(g_copy, true, 0, kit::Wiring{}, nullptr);
        graphed::Session sz = session(g_zero, true, 2, zero, &driver_used);
        graphed::Session sa = session(g_alias, false, 0, zero, nullptr);
        // Correct first: one step each, grads compared with eager.
        kit::StepGrads e = eager.eager_step(x.get(), t.get(), 0.01f);
        kit::StepGrads gc = g_copy.graphed_step(sc, x.get(), t.get(), 0.01f);
        kit::StepGrads gz = g_zero.graphed_step(sz, x.get(), t.get(), 0.01f);
        kit::StepGrads ga = g_alias.graphed_step(sa, x.get(), t.get(), 0.01f);
        check(e.w == gc.w && e.b == gc.b, std::string("graphed CLONE (copies) grads equal eager (") + dt + ")");
        check(e.w == gz.w && e.b == gz.b, std::string("graphed CLONE (zero-copy) grads equal eager (") + dt + ")");
        check(e.w == ga.w && e.b == ga.b, std::string("graphed ALIAS grads equal eager (") + dt + ")");
        auto per_step = [&](const std::function<void()>& step) {
            for (int i = 0; i < 3; ++i) step();
            dev.sync();
            std::vector<double> runs;
            for (int r = 0; r < 5; ++r) {
                auto a = std::chrono::steady_clock::now();
                for (int i = 0; i < steps; ++i) step();
                dev.sync();
                auto z = std::chrono::steady_clock::now();
                runs.push_back(std::chrono::duration<double, std::milli>(z - a).count() / steps);
            }
            return bench::median(runs);
        };
        // Interleaved, so that clock and thermal drift hit every variant alike.
        std::vector<double> te, tc, tz, ta;
        for (int round = 0; round < 3; ++round) {
            te.push_back(per_step([&] { eager.eager_step(x.get(), t.get(), 0.01f, false); }));
            tc.push_back(per_step([&] { g_copy.graphed_step(sc, x.get(), t.get(), 0.01f, false, false); }));
            tz.push_back(per_step([&] { g_zero.graphed_step(sz, x.get(), t.get(), 0.01f, false, false); }));
            ta.push_back(per_step([&] { g_alias.graphed_step(sa, x.get(), t.get(), 0.01f, false, false); }));
        }
        const double e_ms = bench::median(te), c_ms = bench::median(tc), z_ms = bench::median(tz),
                     a_ms = bench::median(ta);
        graphed_session_stats stc = sc.stats(), stz = sz.stats();
        // The first input asked for rebinding is rebound, or copied for a
        // reason the session states (the kernels' argument layout).
        check(stz.inputs_rebound + stz.inputs_rebind_refused == 1, "the first input is rebound or refused with a reason");
        const std::string first_input =
            stz.inputs_rebound == 1 ? std::string("rebound") : "copied (" + copied_because(sz) + ")";
        sc.destroy();
        sz.destroy();
        sa.destroy();
        std::string cfg = "H=" + std::to_string(m.width) + " B=" + std::to_string(m.batch) + " " + dt;
        std::string driver = tools.device_timing() ? bytes_str(driver_used) : "n/a";
        report << "| " << cfg << " | " << fmt("%.3f", e_ms) << " | " << fmt("%.3f", c_ms) << " | " << fmt("%.3f", z_ms)
               << " | " << fmt("%.3f", a_ms) << " | " << fmt("%.2fx", c_ms / e_ms) << " | " << fmt("%.2fx", z_ms / e_ms)
               << " | " << bytes_str(stc.static_bytes + stc.scratch_bytes) << " / "
               << bytes_str(stz.static_bytes + stz.scratch_bytes) << " | " << driver << " |\n";
        std::printf("mlp %s: eager %.3f ms, clone (copies) %.3f ms, clone (zero-copy) %.3f ms, alias %.3f ms; "
                    "first input %s\n",
                    cfg.c_str(), e_ms, c_ms, z_ms, a_ms, first_input.c_str());
    }
    return check.failed;
}

}  // namespace bench
