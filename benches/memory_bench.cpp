// The memory table of graphed_bench (docs/benchmarks.md section 6): the
// library's accounting (graphed_session_stats) of N layers, each copying
// its input or chained, with the clone slots' blocks, against the memory
// torch's per-layer graphs take (benches/torch_reference.py's JSON).
#include "memory_bench.hpp"

#include "common.hpp"
#include "layers.hpp"

#include <cmath>
#include <cstdint>
#include <string>

namespace bench {

using kit::Buffer;

void memory_table(kit::Device& dev, std::ostream& report, const std::vector<int>& layer_counts, int width, int batch,
                  const std::string& torch_json) {
    report << "\n## 6. Memory: static and scratch bytes of N layers\n\n"
              "Library accounting (graphed_session_stats) for N Linear(" << width << ") + ReLU layers, batch "
           << batch << ", fp32, CLONE grads: each layer copying its input (its own static input and input-grad "
              "buffers), and the layers chained. Scratch holds the activations saved for backward. The clone "
              "slots' blocks (two per layer by default) are held in addition, as returned grads would be. torch: "
              "`torch.cuda.memory_allocated` growth across make_graphed_callables of the same layers (its graph "
              "pool holds every layer's static inputs, outputs and grads).\n\n"
              "| layers | copying: static + scratch | chained: static + scratch | chained / copying | clone slots | "
              "torch per-layer graphs |\n|---|---|---|---|---|---|\n";
    const std::string json = torch_json.empty() ? std::string() : read_file(torch_json);
    for (int n : layer_counts) {
        kit::Mlp a(dev, n, batch, width, 31), b(dev, n, batch, width, 31);
        Buffer x = a.tensor(kit::random_floats(size_t(batch) * width, 32));
        graphed_session_config c = graphed::session_config(dev.graphed_kind());
        graphed::Session sa(c), sb(c);
        a.register_layers(sa, x.get());
        b.register_layers(sb, x.get(), kit::Wiring{true, false, false});
        sa.capture();
        sb.capture();
        const graphed_session_stats p = sa.stats(), q = sb.stats();
        const uint64_t pa = p.static_bytes + p.scratch_bytes, qa = q.static_bytes + q.scratch_bytes;
        std::string torch = "n/a";
        if (!std::isnan(json_number(json, "layers")) && int(json_number(json, "layers")) == n)
            torch = bytes_str(size_t(json_number(json, "per_layer_graphs_bytes")));
        report << "| " << n << " | " << bytes_str(p.static_bytes) << " + " << bytes_str(p.scratch_bytes) << " | "
               << bytes_str(q.static_bytes) << " + " << bytes_str(q.scratch_bytes) << " | "
               << fmt("%.2fx", double(qa) / double(pa)) << " | " << bytes_str(q.clone_bytes_cached) << " | " << torch
               << " |\n";
    }
}

}  // namespace bench
