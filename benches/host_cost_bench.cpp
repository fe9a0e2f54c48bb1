// The host-cost table of graphed_bench (docs/benchmarks.md section 3): host
// time of graphed_forward + graphed_backward through the C calls, for one
// tiny linear layer with ALIAS grads, CLONE grads from a clone slot and
// CLONE grads copied into a recycled block, against raw launches of two
// graphs the benchmark captures from the same kernels (CUDA only); then
// for a layer whose passes record no work (the library's own cost, which
// the host backend measures too), with debug mode off and on
// (graphed_session_config.debug: two synchronizations a pass). The rows
// with debug mode off, before and after a change to the replay path, say
// whether the path got dearer.
#include "host_cost_bench.hpp"

#include "common.hpp"
#include "layers.hpp"

#include <cstdint>
#include <cstdio>
#include <string>

namespace bench {

using kit::Buffer;

void host_cost_table(kit::Device& dev, Tools& tools, std::ostream& report, int per_batch) {
    report << "\n## 3. Host cost of replay\n\n"
              "Host time of `graphed_forward` + `graphed_backward` (no copy-in, ALIAS grads) against raw "
              "`cudaGraphLaunch` of two graphs with the same kernels, captured by the benchmark; medians over "
              "batches. Goals: ALIAS within 1.10x, CLONE within 1.15x. The replay path makes no heap allocation "
              "and no device allocation in steady state (tests/replay_allocations.rs counts them with a counting "
              "global allocator, the host backend's device memory included: zero over 2000 replays for ALIAS, "
              "CLONE, COPY_INTO, ACCUMULATE_INTO and strict leases): a CLONE replay takes a released block, and "
              "with a free clone slot launches the graph that writes the grads into it, with no copy. Debug mode "
              "(`graphed_session_config.debug`, `GRAPHED_DEBUG=1`) synchronizes the stream before and after each "
              "pass; off, a replay tests the flag once.\n\n"
              "| what | ours (us) | raw graph launches (us) | ratio |\n|---|---|---|---|\n";
    kit::LinearLayer L;
    Buffer w(dev, 16 * 16 * 4), b(dev, 16 * 4), x(dev, 4 * 16 * 4), z(dev, 4 * 16 * 4), y(dev, 4 * 16 * 4),
        gz(dev, 4 * 16 * 4), gx(dev, 4 * 16 * 4), gw(dev, 16 * 16 * 4), gb(dev, 16 * 4);
    L.dev = &dev;
    L.batch = 4;
    L.in = L.out = 16;
    L.relu = false;
    L.w = w.get();
    L.b = b.get();
    L.name = "tiny";
    // A layer whose passes record no work: one input, output and parameter.
    graphed::Callable idle;
    idle.name = "idle";
    idle.inputs = {graphed::tensor_desc(x.bytes(), GRAPHED_DTYPE_F32, true, x.get())};
    idle.outputs = {graphed::tensor_desc(y.bytes(), GRAPHED_DTYPE_F32, true)};
    idle.params = {graphed::param_desc(b.get(), b.bytes())};
    idle.forward = idle.backward = [](const graphed_pass_ctx*, void*) -> int32_t { return 0; };
    struct Variant {
        const char* what;
        bool clones;
        uint32_t slots;
        bool idle, debug;
    };
    for (const Variant& v : {Variant{"ALIAS grads", false, 0, false, false},
                             Variant{"CLONE grads, clone slots (+ 2 releases)", true, 2, false, false},
                             Variant{"CLONE grads, copied into a recycled block (+ 2 releases)", true, 0, false, false},
                             Variant{"a layer recording no work, ALIAS grads", false, 0, true, false},
                             Variant{"a layer recording no work, ALIAS grads, debug mode", false, 0, true, true}}) {
        const bool clones = v.clones;
        graphed_session_config c = graphed::session_config(dev.graphed_kind());
        c.clone_param_grads_on_return = clones;
        c.clone_slots = v.slots;
        c.debug = v.debug ? 1 : 0;
        graphed::Session session(c);
        if (v.idle)
            session.add_callable(idle);
        else
            session.add_callable(L.callable(x.get(), true));
        session.capture();
        // The C calls themselves: this table measures the C ABI.
        graphed_session* s = session.get();
        graphed_replay_args a = graphed_replay_args_default();
        a.stream = dev.stream();
        graphed_ref out, gin, gp[2];
        const size_t params = v.idle ? 1 : 2;
        double ours = host_us(
            dev,
            [&] {
                graphed_forward(s, &a, &out, 1);
                graphed_backward(s, &a, &gin, 1, gp, params);
                if (clones) {
                    graphed_buffer_release(gp[0].owner);
                    graphed_buffer_release(gp[1].owner);
                }
            },
            per_batch, 21);
        session.destroy();
        std::string ref = "n/a (host backend)", ratio = "n/a";
        void* fg = tools.capture([&](graphed_stream st) {
            if (!v.idle) L.eager_forward(st, x.get(), z.get(), y.get());
        });
        void* bg = tools.capture([&](graphed_stream st) {
            if (!v.idle) L.eager_backward(st, x.get(), z.get(), y.get(), gz.get(), gx.get(), gw.get(), gb.get());
        });
        if (fg && bg) {
            double raw = host_us(
                dev,
                [&] {
                    tools.launch(fg);
                    tools.launch(bg);
                },
                per_batch, 21);
            ref = fmt("%.2f", raw);
            ratio = fmt("%.2fx", ours / raw);
            tools.destroy(fg);
            tools.destroy(bg);
        }
        report << "| forward + backward, " << v.what << " | " << fmt("%.2f", ours) << " | " << ref << " | " << ratio
               << " |\n";
        std::printf("host cost (%s): ours %.2f us, raw %s us\n", v.what, ours, ref.c_str());
    }
}

}  // namespace bench
