// The buckets table of graphed_bench (docs/benchmarks.md section 12): an
// MLP whose batch takes several sizes, captured as one session with a
// bucket per size, against one session of the largest shape alone and
// against a session per size (one graph set per shape, what re-recording
// per shape gives): memory by the library's accounting and by the driver; the host
// and GPU time of a training step (forward and backward of every layer)
// with the bucket chosen on the host, against the one-shape session of
// that bucket's size; and with the bucket chosen on the device (a SWITCH
// node, the size in device memory). Checked first: the device's choice
// gives the host's choice's grads bit for bit.
#include "bucket_bench.hpp"

#include "layers.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>

namespace bench {

namespace {

// One session over `layers` Linear layers and what its training steps need.
struct Model {
    std::unique_ptr<kit::Mlp> m;
    std::unique_ptr<graphed::Session> s;
    size_t library = 0, driver = 0;
    std::vector<graphed::Ref> outs;
    std::vector<graphed::Grads> grads;
};

}  // namespace

int bucket_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width,
                 const std::vector<uint64_t>& sizes, uint64_t actual, int samples) {
    int failures = 0;
    const uint64_t largest = sizes.back();
    const uint64_t bucket = *std::find_if(sizes.begin(), sizes.end(), [&](uint64_t b) { return b >= actual; });
    kit::Mlp shapes(dev, layers, int(largest), width, 71);
    kit::Buffer x = shapes.tensor(kit::random_floats(size_t(largest) * width, 72));
    kit::Buffer gy = shapes.tensor(kit::random_floats(size_t(largest) * width, 73, 0.1f));
    kit::Buffer device_size(dev, 8);
    dev.upload(device_size.get(), &actual, 8);

    // A session of `rows` (one shape) or of every size (buckets; on the
    // device too when `device`), its memory measured around its capture.
    auto make = [&](int rows, bool buckets, bool device) {
        Model v;
        v.m = std::make_unique<kit::Mlp>(dev, layers, rows, width, 71);
        graphed_session_config c = graphed::session_config(dev.graphed_kind());
        c.bucket_choice_on_device = device ? 1 : 0;
        v.s = std::make_unique<graphed::Session>(c);
        kit::Wiring w;
        if (buckets) w.buckets = sizes;
        v.m->register_layers(*v.s, x.get(), w);
        dev.sync();
        const size_t before = tools.driver_free();
        v.s->capture();
        dev.sync();
        const size_t after = tools.driver_free();
        v.driver = before >= after ? before - after : 0;
        const graphed_session_stats st = v.s->stats();
        v.library = st.static_bytes + st.scratch_bytes + st.clone_bytes_cached;
        v.grads.resize(size_t(layers));
        return v;
    };
    // One training step: every forward, then every backward; `size` 0 for
    // one-shape sessions, else the host's choice, or the device's.
    auto step = [&](Model& v, uint64_t size, bool on_device) {
        graphed::Replay r;
        r.stream(dev.stream());
        if (on_device)
            r.device_size(static_cast<const uint64_t*>(device_size.get()));
        else
            r.size(size);
        const void* in = x.get();
        for (int i = 0; i < layers; ++i) {
            v.s->forward(r.callable(uint32_t(i)).data(in), v.outs);
            in = v.outs[0].ptr();
        }
        r.size(0).device_size(nullptr);
        const void* g = gy.get();
        for (int i = layers - 1; i >= 0; --i) {
            v.s->backward(r.callable(uint32_t(i)).data(g), v.grads[size_t(i)]);
            if (i > 0) g = v.grads[size_t(i)].inputs[0].ptr();
        }
    };
    auto host_us = [&](const std::function<void()>& op) {
        std::vector<double> v;
        for (int k = 0; k < 4 * samples; ++k) {
            const auto a = std::chrono::steady_clock::now();
            op();
            v.push_back(1000.0 * ms_since(a));
            dev.sync();
        }
        return median(v);
    };

    Model bucketed = make(int(largest), true, false);
    Model device = make(int(largest), true, true);
    Model alone = make(int(largest), false, false);
    Model same = make(int(bucket), false, false);
    size_t each_library = 0, each_driver = 0;
    for (uint64_t n : sizes) {
        Model one = make(int(n), false, false);
        each_library += one.library;
        each_driver += one.driver;
    }
    // The device's choice against the host's: the same bucket's graphs.
    step(bucketed, actual, false);
    dev.sync();
    std::vector<std::vector<float>> host_grads;
    for (auto& g : bucketed.grads) host_grads.push_back(kit::fetch<float>(dev, g.params[0].ptr(), g.params[0].bytes() / 4));
    step(device, 0, true);
    dev.sync();
    bool equal = true;
    for (int i = 0; i < layers; ++i)
        equal = equal && host_grads[size_t(i)] == kit::fetch<float>(dev, device.grads[size_t(i)].params[0].ptr(),
                                                                     device.grads[size_t(i)].params[0].bytes() / 4);
    if (!equal) {
        std::fprintf(stderr, "CHECK FAILED: buckets chosen on the device give the host's choice's grads\n");
        ++failures;
    }
    auto release = [&](Model& v) {
        for (auto& g : v.grads) g = graphed::Grads{};
    };
    auto run_host = [&] { step(bucketed, actual, false); };
    // Sizes that change every step inside the bucket: the size is written
    // and the padding zeroed at every forward.
    const auto at = std::find(sizes.begin(), sizes.end(), bucket);
    const uint64_t below = at == sizes.begin() ? 0 : *(at - 1);
    const uint64_t other = actual - (actual - below) / 2;
    bool flip = false;
    auto run_varying = [&] {
        flip = !flip;
        step(bucketed, flip ? other : actual, false);
    };
    // Buckets that change every step (each its own graphs).
    const uint64_t small = sizes.front() > 1 ? sizes.front() - 1 : sizes.front();
    bool flip_bucket = false;
    auto run_buckets = [&] {
        flip_bucket = !flip_bucket;
        step(bucketed, flip_bucket ? small : actual, false);
    };
    auto run_device = [&] { step(device, 0, true); };
    auto run_same = [&] { step(same, 0, false); };
    std::vector<double> gh, gv, gb, gd, gs;
    const int per_round = std::max(1, samples / 5);
    const int launches = 4 * layers;
    for (int round = 0; round < 5; ++round) {
        gh.push_back(tools.median_ms(run_host, [&] { release(bucketed); }, 2, per_round, launches));
        gv.push_back(tools.median_ms(run_varying, [&] { release(bucketed); }, 2, per_round, launches));
        gb.push_back(tools.median_ms(run_buckets, [&] { release(bucketed); }, 2, per_round, launches));
        gd.push_back(tools.median_ms(run_device, [&] { release(device); }, 2, per_round, launches));
        gs.push_back(tools.median_ms(run_same, [&] { release(same); }, 2, per_round, launches));
    }
    const double hh = host_us([&] { run_host(); release(bucketed); });
    const double hv = host_us([&] { run_varying(); release(bucketed); });
    const double hb = host_us([&] { run_buckets(); release(bucketed); });
    const double hd = host_us([&] { run_device(); release(device); });
    const double hs = host_us([&] { run_same(); release(same); });
    const double mib = 1024.0 * 1024.0;
    report << "\n## 12. Buckets: shapes that change\n\n"
           << layers << " Linear(" << width << ") + ReLU layers (the last without), fp32, CLONE grads; the batch "
           << "dimension takes " << sizes.size() << " sizes (";
    for (size_t i = 0; i < sizes.size(); ++i) report << (i ? ", " : "") << sizes[i];
    const std::string nb = std::to_string(sizes.size()) + " buckets";
    report << "). **" << nb << "**: one session, every layer registered with those bucket sizes; **largest alone**: "
              "one session of " << largest << " rows; **one session per size**: " << sizes.size()
           << " sessions, one shape each (the sum). Library: static + scratch + clone slot bytes "
              "(graphed_session_stats); driver: the device memory capture took (cuMemGetInfo before and after).\n\n"
           << "| | library MiB | driver MiB |\n|---|---|---|\n"
           << "| " << nb << " | " << fmt("%.2f", bucketed.library / mib) << " | " << fmt("%.1f", bucketed.driver / mib)
           << " |\n| " << nb << ", also chosen on the device | " << fmt("%.2f", device.library / mib) << " | "
           << fmt("%.1f", device.driver / mib) << " |\n| largest alone | " << fmt("%.2f", alone.library / mib) << " | "
           << fmt("%.1f", alone.driver / mib) << " |\n| one session per size (sum) | "
           << fmt("%.2f", each_library / mib) << " | " << fmt("%.1f", each_driver / mib) << " |\n"
           << "| " << nb << " / largest alone | " << fmt("%.3fx", double(bucketed.library) / double(alone.library))
           << " | " << fmt("%.3fx", alone.driver ? double(bucketed.driver) / double(alone.driver) : 0.0) << " |\n\n"

           << "A training step of " << actual << " rows (bucket " << bucket << "): every forward, then every "
           << "backward, each replay given its data. **host's choice**: `graphed_replay_args.size` (the same size "
              "every step, or two sizes of the bucket in turn: then every forward writes the size and zeroes "
              "padding rows); **device's "
              "choice**: `device_size` (a SWITCH node picks the bucket from device memory; the data hold the "
              "largest bucket's rows); **one shape**: a session of " << bucket
           << " rows alone. GPU: CUDA-event medians of " << per_round
           << " steps in each of 5 interleaved rounds, the median of the rounds; host: the median wall time, over "
           << 4 * samples
           << " samples, of the calls that enqueue one step, the device synchronized between samples. Checked "
              "first: the "
              "device's choice gives the host's choice's grads bit for bit.\n\n"
           << "| | GPU ms | host us |\n|---|---|---|\n"
           << "| host's choice | " << fmt("%.4f", median(gh)) << " | " << fmt("%.1f", hh) << " |\n"
           << "| host's choice, " << actual << " and " << other << " rows in turn | " << fmt("%.4f", median(gv))
           << " | " << fmt("%.1f", hv) << " |\n"
           << "| host's choice, " << actual << " and " << small << " rows (two buckets) in turn | "
           << fmt("%.4f", median(gb)) << " | " << fmt("%.1f", hb) << " |\n"
           << "| device's choice | " << fmt("%.4f", median(gd)) << " | " << fmt("%.1f", hd) << " |\n"
           << "| one shape | " << fmt("%.4f", median(gs)) << " | " << fmt("%.1f", hs) << " |\n"
           << "| host's choice / one shape | " << fmt("%.3fx", median(gh) / median(gs)) << " | "
           << fmt("%.3fx", hh / hs) << " |\n"
           << "| host's choice, sizes in turn / one shape | " << fmt("%.3fx", median(gv) / median(gs)) << " | "
           << fmt("%.3fx", hv / hs) << " |\n"
           << "| host's choice, buckets in turn / one shape | " << fmt("%.3fx", median(gb) / median(gs)) << " | "
           << fmt("%.3fx", hb / hs) << " |\n"
           << "| device's choice / host's choice | " << fmt("%.3fx", median(gd) / median(gh)) << " | "
           << fmt("%.3fx", hd / hh) << " |\n";
    std::printf("buckets: library %.2f / %.2f / %.2f MiB (buckets / alone / sum), step gpu %.4f / %.4f / %.4f ms, "
                "host %.1f / %.1f / %.1f us (host / device / one shape)\n",
                bucketed.library / mib, alone.library / mib, each_library / mib, median(gh), median(gd),
                median(gs), hh, hd, hs);
    return failures;
}

}  // namespace bench
