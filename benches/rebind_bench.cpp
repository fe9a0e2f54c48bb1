// The input-rebinding table of graphed_bench (docs/benchmarks.md section
// 7): host time of a forward replay whose input is rebound
// (GRAPHED_TENSOR_FLAGS_REBIND), alternating between two buffers, against
// the same buffer every time; the difference per graph node updated.
#include "rebind_bench.hpp"

#include "common.hpp"
#include "layers.hpp"

#include <string>
#include <vector>

namespace bench {

using kit::Buffer;

void rebind_table(kit::Device& dev, std::ostream& report, const std::string& label, bool header, int per_batch) {
    if (header)
        report << "\n## 7. Rebinding an input: cost per node\n\n"
              "Host time of a forward replay of a 4-layer MLP's first layer whose input is rebound "
              "(GRAPHED_TENSOR_FLAGS_REBIND), alternating between two input buffers (every replay rebinds: one "
              "graph-node update per reference in the layer's forward, backward and clone-slot graphs) against "
                  "the same buffer every time (nothing to update); the difference per node updated.\n\n"
                  "| layers' kernels | nodes per rebind | replay, same input (us) | replay, alternating (us) | per node (us) |\n"
                  "|---|---|---|---|---|\n";
    kit::Mlp m(dev, 4, 16, 64, 41);
    Buffer xa = m.tensor(kit::random_floats(16 * 64, 42)), xb = m.tensor(kit::random_floats(16 * 64, 43));
    graphed::Session s(graphed::session_config(dev.graphed_kind()));
    m.register_layers(s, xa.get(), kit::Wiring{true, true, false});
    s.capture();
    const graphed_session_stats st = s.stats();
    if (st.inputs_rebound != 1) {
        report << "| " << label << " | refused: " << copied_because(s) << " | | | |\n";
        return;
    }
    std::vector<graphed::Ref> outs;
    graphed::Replay r;
    r.stream(dev.stream()).callable(0);
    bool flip = false;
    double same = host_us(dev, [&] { s.forward(r.data(xa.get()), outs); }, per_batch, 21);
    double alt = host_us(
        dev,
        [&] {
            flip = !flip;
            s.forward(r.data(flip ? xb.get() : xa.get()), outs);
        },
        per_batch, 21);
    report << "| " << label << " | " << st.rebind_nodes << " | " << fmt("%.2f", same)
           << " | " << fmt("%.2f", alt) << " | " << fmt("%.2f", (alt - same) / st.rebind_nodes) << " |\n";
}

}  // namespace bench
