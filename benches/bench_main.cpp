// graphed benchmarks: the cost of returning gradients safely, the host cost
// of replay, and end-to-end training steps, each measured next to its
// reference in the same process. Writes a markdown report. Here, in
// steps: the arguments (parse_args), the devices (open_devices), the
// tables each mode runs (run_tables) and the report (main); each table in
// a file of its own: grads_bench.cpp (sections 1 and 2: clone on return,
// ACCUMULATE_INTO), host_cost_bench.cpp (3: host cost of replay),
// mlp_bench.cpp (4: an MLP end to end), step_bench.cpp (5: step graphs),
// optimizer_bench.cpp (5, continued: the whole iteration, the optimizer
// inside the step),
// memory_bench.cpp (6), rebind_bench.cpp (7: rebinding an input),
// capture_bench.cpp (8: capture time), param_guard_bench.cpp (10: moved
// parameters), microbatch_bench.cpp (11: microbatches in one step graph),
// bucket_bench.cpp (12: buckets); what they share in common.cpp, the
// backend's tools in tools_*.
//
//   graphed_bench [--backend cuda|host] [--quick] [--capture-only] [--param-guard] [--microbatches]
//                 [--buckets] [--host-cost] [--step-update] [--out FILE]
//
// --capture-only, --param-guard, --microbatches, --buckets, --host-cost and
// --step-update run one table alone (capture time; the cost of giving
// replays the parameters' addresses, and of moving them; N microbatches in
// one step graph, microbatch_bench.cpp; shapes that change,
// bucket_bench.cpp; the host cost of replay, with debug mode off and on,
// host_cost_bench.cpp; the whole iteration with the optimizer inside the
// step, optimizer_bench.cpp).
//
// On CUDA, device times come from CUDA events (medians after warm-up); on
// the host backend (the ctest, small sizes) from wall clocks. Every
// measurement is preceded by a correctness check; a failed check exits 1.
#include "bucket_bench.hpp"
#include "capture_bench.hpp"
#include "grads_bench.hpp"
#include "host_cost_bench.hpp"
#include "memory_bench.hpp"
#include "microbatch_bench.hpp"
#include "mlp_bench.hpp"
#include "optimizer_bench.hpp"
#include "param_guard_bench.hpp"
#include "rebind_bench.hpp"
#include "step_bench.hpp"
#include "tools.hpp"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

// What the command line asks for.
struct Args {
    std::string backend = "cuda", out, torch_json;
    bool quick = false, capture_only = false, param_guard = false, microbatches = false, buckets = false,
         host_cost = false, step_update = false;
    std::vector<uint32_t> counts = {1, 4, 16, 64};  // --microbatches: the N of the table
};

// Reads the command line into `a`; false, after printing the usage, at an
// argument it does not know.
bool parse_args(int argc, char** argv, Args& a) {
    for (int i = 1; i < argc; ++i) {
        std::string s = argv[i];
        if (s == "--backend" && i + 1 < argc) a.backend = argv[++i];
        else if (s == "--quick") a.quick = true;
        else if (s == "--capture-only") a.capture_only = true;
        else if (s == "--param-guard") a.param_guard = true;
        else if (s == "--microbatches") a.microbatches = true;
        else if (s == "--buckets") a.buckets = true;
        else if (s == "--host-cost") a.host_cost = true;
        else if (s == "--step-update") a.step_update = true;
        else if (s == "--out" && i + 1 < argc) a.out = argv[++i];
        else if (s == "--torch-json" && i + 1 < argc) a.torch_json = argv[++i];
        else if (s == "--counts" && i + 1 < argc) {
            a.counts.clear();
            std::stringstream list(argv[++i]);
            for (std::string n; std::getline(list, n, ',');) a.counts.push_back(uint32_t(std::stoul(n)));
        } else {
            std::fprintf(stderr, "usage: %s [--backend cuda|host] [--quick] [--capture-only] [--param-guard] [--microbatches] [--buckets] "
                         "[--host-cost] [--step-update] [--counts N,N,...] [--out FILE] "
                         "[--torch-json FILE]\n",
                         argv[0]);
            return false;
        }
    }
    return true;
}

// The devices the tables run on, with their tools. Event timing records on
// its device's stream: a table run on the cuBLAS device is timed by tools
// of its own (its stream is not dev's).
struct Devices {
    std::string why;  // why there is no CUDA device, or no cuBLAS one
    std::unique_ptr<kit::Device> dev, blas;
    std::unique_ptr<bench::Tools> tools, btools;
};

// Opens the devices of `backend` into `d`; false, after saying why, when
// CUDA is asked for and there is no CUDA device.
bool open_devices(const std::string& backend, Devices& d) {
    if (backend == "cuda") {
        d.dev = kit::make_cuda_device(&d.why);
        if (!d.dev) {
            std::fprintf(stderr, "no CUDA device: %s\n", d.why.c_str());
            return false;
        }
        d.tools = bench::make_cuda_tools(*d.dev);
        d.blas = bench::make_blas_device(&d.why);
        if (d.blas) d.btools = bench::make_cuda_tools(*d.blas);
    } else {
        d.dev = kit::make_host_device();
        d.tools = bench::make_host_tools(*d.dev);
    }
    return true;
}

// Writes the tables the arguments ask for to `report`: one table alone
// (--buckets, --microbatches, --param-guard, --capture-only, --host-cost,
// --step-update), every table
// at full size (CUDA), or every table small (--quick, or the host
// backend). Returns the number of failed correctness checks.
int run_tables(const Args& a, Devices& d, std::ostream& report) {
    int failures = 0;
    kit::Device *dev = d.dev.get(), *blas = d.blas.get();
    bench::Tools *tools = d.tools.get(), *btools = d.btools.get();
    const std::string &backend = a.backend, &torch_json = a.torch_json;
    const bool quick = a.quick;
    if (a.host_cost) {
        bench::host_cost_table(*dev, *tools, report, quick ? 200 : 2000);
    } else if (a.step_update) {
        // Issue 39's model: 24 x Linear(64) + ReLU, batch 8, on the kit's
        // kernels (small GEMMs: launch-bound, as in torch).
        if (backend == "cuda" && !quick)
            failures += bench::optimizer_table(*dev, *tools, report, 24, 64, 8, 5, 200);
        else
            failures += bench::optimizer_table(*dev, *tools, report, 6, 32, 8, 2, 5);
    } else if (a.buckets) {
        const std::vector<uint64_t> sizes = {32, 64, 96, 128, 160, 192, 224, 256};
        if (blas && !quick)
            failures += bench::bucket_table(*blas, *btools, report, 8, 1024, sizes, 200, 50);
        else
            failures += bench::bucket_table(*dev, *tools, report, 3, 32, {8, 16, 24, 32}, 13, 5);
    } else if (a.microbatches) {
        if (blas && !quick)
            failures += bench::microbatch_table(*blas, *btools, report, 24, 256, 64, a.counts, 50);
        else
            failures += bench::microbatch_table(*dev, *tools, report, 6, 32, 8, {1, 4}, 5);
    } else if (a.param_guard) {
        // The guard is host work, the same on both backends: the host
        // backend measures it too (its graphs refuse moves).
        if (!quick)
            failures += bench::param_guard_table(*dev, *tools, report, {1, 8, 64, 256}, 50, 10000, 500);
        else
            failures += bench::param_guard_table(*dev, *tools, report, {1, 8}, 20, 400, 20);
        failures += bench::microbatch_table(*dev, *tools, report, 6, 32, 8, {1, 4}, 5);
    } else if (a.capture_only) {
        bench::capture_table(blas ? *blas : *dev, blas ? *btools : *tools, report, backend == "cuda" ? 24 : 6,
                             backend == "cuda" ? 256 : 32, backend == "cuda" ? 64 : 8, backend == "cuda" ? 5 : 3);
    } else if (backend == "cuda" && !quick) {
        const std::vector<bench::GradSize> sizes = {{64, 16u << 10}, {64, 4u << 20}, {8, 256u << 20}};
        failures += bench::clone_table(*dev, *tools, report, sizes, 50);
        failures += bench::accumulate_table(*dev, *tools, report, sizes, 50);
        bench::host_cost_table(*dev, *tools, report, 2000);
        if (blas) {
            failures += bench::mlp_table(*blas, *btools, report,
                                         {{1024, 32, GRAPHED_DTYPE_F32, 8}, {4096, 2048, GRAPHED_DTYPE_BF16, 8}}, 50);
            failures += bench::step_table(*blas, *btools, report, 24, 256, 64, 200, torch_json);
        } else {
            report << "\n## 4. End to end\n\nNot run: " << d.why << "\n";
        }
        // Section 5's second table: issue 39's model (24 x Linear(64) +
        // ReLU, batch 8) on the kit's kernels.
        failures += bench::optimizer_table(*dev, *tools, report, 24, 64, 8, 5, 200);
        if (blas) bench::memory_table(*blas, report, {8, 24}, 256, 64, torch_json);
        bench::rebind_table(*dev, report, "the kit's CUDA kernels", true, 2000);
        if (blas) bench::rebind_table(*blas, report, "cuBLAS GEMMs and the kit's kernels", false, 2000);
        if (blas) bench::capture_table(*blas, *btools, report, 24, 256, 64, 5);
        failures += bench::param_guard_table(*dev, *tools, report, {1, 8, 64, 256}, 50, 10000, 500);
        if (blas) failures += bench::microbatch_table(*blas, *btools, report, 24, 256, 64, {1, 4, 16, 64}, 50);
        if (blas)
            failures += bench::bucket_table(*blas, *btools, report, 8, 1024,
                                            {32, 64, 96, 128, 160, 192, 224, 256}, 200, 50);
    } else {
        const std::vector<bench::GradSize> sizes = {{64, 16u << 10}, {8, 256u << 10}};
        failures += bench::clone_table(*dev, *tools, report, sizes, 5);
        failures += bench::accumulate_table(*dev, *tools, report, sizes, 5);
        bench::host_cost_table(*dev, *tools, report, 200);
        failures += bench::mlp_table(*dev, *tools, report, {{64, 8, GRAPHED_DTYPE_F32, 8}}, 5);
        failures += bench::step_table(*dev, *tools, report, 6, 32, 8, 5, torch_json);
        failures += bench::optimizer_table(*dev, *tools, report, 6, 32, 8, 2, 5);
        bench::memory_table(*dev, report, {4}, 32, 8, torch_json);
        bench::rebind_table(*dev, report, "host tasks", true, 200);
        bench::capture_table(*dev, *tools, report, 6, 32, 8, 3);
        failures += bench::param_guard_table(*dev, *tools, report, {1, 8}, 20, 400, 20);
        failures += bench::microbatch_table(*dev, *tools, report, 6, 32, 8, {1, 4}, 5);
        failures += bench::bucket_table(*dev, *tools, report, 3, 32, {8, 16, 24, 32}, 13, 5);
    }
    return failures;
}

}  // namespace

int main(int argc, char** argv) {
    Args args;
    if (!parse_args(argc, argv, args)) return 2;
    Devices devices;
    if (!open_devices(args.backend, devices)) return 2;
    std::ostringstream report;
    int failures = 0;
    try {
        report << "Measured on " << devices.tools->describe() << " with graphed " << graphed_version() << ".\n";
        failures = run_tables(args, devices, report);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    std::printf("\n%s", report.str().c_str());
    if (!args.out.empty()) std::ofstream(args.out) << report.str();
    if (failures) std::fprintf(stderr, "%d correctness check(s) failed\n", failures);
    return failures ? 1 : 0;
}
