// graphed benchmarks: the cost of returning gradients safely, the host cost
// of replay, and end-to-end training steps, each measured next to its
// reference in the same process. Writes a markdown report.
//
//   graphed_bench [--backend cuda|host] [--quick] [--out FILE]
//
// On CUDA, device times come from CUDA events (medians after warm-up); on
// the host backend (the ctest, small sizes) from wall clocks. Every
// measurement is preceded by a correctness check; a failed check exits 1.
#include "layers.hpp"
#include "tools.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using kit::Buffer;

int failures = 0;
std::ostringstream report;

void check(bool ok, const std::string& what) {
    if (!ok) {
        std::fprintf(stderr, "CHECK FAILED: %s\n", what.c_str());
        ++failures;
    }
}

std::string fmt(const char* f, double v) {
    char b[64];
    std::snprintf(b, sizeof b, f, v);
    return b;
}

std::string bytes_str(size_t b) {
    if (b >= (1u << 20)) return fmt("%.0f MiB", b / 1048576.0);
    return fmt("%.0f KiB", b / 1024.0);
}

// One callable whose backward writes `n` parameter grads of `bytes` each
// (a copy of a source tensor into each slot), returned per `policy`.
class GradSource {
  public:
    GradSource(kit::Device& dev, size_t n, size_t bytes, uint32_t policy, bool clones)
        : dev_(dev), n_(n), bytes_(bytes), src_(dev, bytes), param_(dev, bytes), session_(config(dev, clones)) {
        auto v = kit::random_floats(bytes / 4, 7);
        dev.upload(src_.get(), v.data(), bytes);
        graphed::Callable c;
        c.name = "grads";
        c.inputs = {graphed::tensor_desc(256)};
        c.outputs = {graphed::tensor_desc(256, GRAPHED_DTYPE_F32, true)};
        c.params.assign(n, graphed::param_desc(param_.get(), bytes, GRAPHED_DTYPE_F32, policy));
        c.forward = [](const graphed_pass_ctx* ctx, void* self) -> int32_t {
            auto* g = static_cast<GradSource*>(self);
            return g->dev_.copy(ctx->stream, ctx->outputs[0], ctx->inputs[0], 256);
        };
        c.backward = [](const graphed_pass_ctx* ctx, void* self) -> int32_t {
            auto* g = static_cast<GradSource*>(self);
            for (size_t i = 0; i < g->n_; ++i)
                if (int e = g->dev_.copy(ctx->stream, ctx->param_grads[i], g->src_.get(), g->bytes_)) return e;
            return 0;
        };
        c.user_data = this;
        session_.add_callable(c);
        session_.capture();
        if (policy == GRAPHED_GRAD_POLICY_ACCUMULATE_INTO || policy == GRAPHED_GRAD_POLICY_COPY_INTO) {
            for (size_t i = 0; i < n; ++i) {
                dsts_.emplace_back(dev, bytes);
                dst_ptrs_.push_back(dsts_.back().get());
            }
        }
        replay_.stream(dev.stream());
        if (!dst_ptrs_.empty()) replay_.param_dsts(dst_ptrs_);
    }

    // One backward replay; the returned grads are in refs().
    void backward() { session_.backward(replay_, grads_); }
    // Gives the CLONE grads back.
    void release() {
        for (auto& r : grads_.params) r.release();
    }
    std::vector<void*> ptrs() const {
        std::vector<void*> v;
        for (auto& r : grads_.params) v.push_back(r.ptr());
        return v;
    }
    std::vector<void*> slots() { return session_.buffers(0, 0, GRAPHED_BUFFER_ROLE_PARAM_GRADS); }
    const std::vector<graphed::Ref>& refs() const { return grads_.params; }
    const std::vector<void*>& dsts() const { return dst_ptrs_; }
    const void* source() const { return src_.get(); }

  private:
    static graphed_session_config config(kit::Device& dev, bool clones) {
        graphed_session_config c = graphed::session_config(dev.graphed_kind());
        c.clone_param_grads_on_return = clones;
        c.warmup_iterations = 1;
        return c;
    }

    kit::Device& dev_;
    size_t n_, bytes_;
    Buffer src_, param_;
    std::vector<Buffer> dsts_;
    std::vector<void*> dst_ptrs_;
    graphed::Session session_;
    graphed::Replay replay_;
    graphed::Grads grads_;
};

// Compares the first and last `window` bytes (all of it when small).
bool same_bytes(kit::Device& dev, const void* a, const void* b, size_t bytes) {
    const size_t window = std::min<size_t>(bytes, 1u << 20);
    for (size_t off : {size_t(0), bytes - window}) {
        std::vector<uint8_t> x(window), y(window);
        dev.download(x.data(), static_cast<const uint8_t*>(a) + off, window);
        dev.download(y.data(), static_cast<const uint8_t*>(b) + off, window);
        if (x != y) return false;
    }
    return true;
}

struct Size {
    size_t n, bytes;
};

void clone_table(kit::Device& dev, bench::Tools& tools, const std::vector<Size>& sizes, int samples) {
    report << "\n## 1. Clone on return\n\n"
              "Backward replay with CLONE minus backward replay with ALIAS (the cost of returning owned grads), "
              "against one flat device-to-device copy of the same bytes and against one stream-ordered "
              "allocation plus one copy per tensor (cloning each grad, as a per-tensor clone with a caching "
              "allocator does). Goal: ours within 1.15x of the flat copy.\n\n"
              "| grads | total | CLONE - ALIAS (ms) | flat copy (ms) | ours / flat | per tensor (ms) | per tensor / flat |\n"
              "|---|---|---|---|---|---|---|\n";
    for (Size sz : sizes) {
        const size_t total = sz.n * sz.bytes;
        GradSource clone(dev, sz.n, sz.bytes, GRAPHED_GRAD_POLICY_DEFAULT, true);
        GradSource alias(dev, sz.n, sz.bytes, GRAPHED_GRAD_POLICY_DEFAULT, false);
        // Correct first: every clone holds the grad, in its own memory.
        clone.backward();
        bool ok = true;
        for (size_t i = 0; i < sz.n; i += std::max<size_t>(1, sz.n / 8))
            ok = ok && same_bytes(dev, clone.refs()[i].ptr(), clone.source(), sz.bytes);
        check(ok && clone.refs()[0].kind() == GRAPHED_REF_KIND_CLONE, "clones hold the grads");
        clone.release();
        const int launches = int(sz.n) + 4;
        double t_clone = tools.median_ms([&] { clone.backward(); }, [&] { clone.release(); }, 3, samples, launches);
        double t_alias = tools.median_ms([&] { alias.backward(); }, [] {}, 3, samples, launches);
        Buffer a(dev, total), b(dev, total);
        double t_flat = tools.median_ms([&] { tools.flat_copy(a.get(), b.get(), total); }, [] {}, 3, samples, 1);
        std::vector<void*> src = clone.slots(), out;
        double t_each = tools.median_ms([&] { tools.clone_each(out, src, sz.bytes); }, [&] { tools.free_each(out); },
                                        3, samples, int(2 * sz.n));
        double ours = t_clone - t_alias;
        report << "| " << sz.n << " x " << bytes_str(sz.bytes) << " | " << bytes_str(total) << " | "
               << fmt("%.4f", ours) << " | " << fmt("%.4f", t_flat) << " | " << fmt("%.2fx", ours / t_flat) << " | "
               << fmt("%.4f", t_each) << " | " << fmt("%.2fx", t_each / t_flat) << " |\n";
        std::printf("clone %zu x %s: ours %.4f ms (clone %.4f - alias %.4f), flat %.4f, per-tensor %.4f\n", sz.n,
                    bytes_str(sz.bytes).c_str(), ours, t_clone, t_alias, t_flat, t_each);
    }
}

void accumulate_table(kit::Device& dev, bench::Tools& tools, const std::vector<Size>& sizes, int samples) {
    report << "\n## 2. ACCUMULATE_INTO against CLONE followed by a separate add\n\n"
              "Backward replay with ACCUMULATE_INTO (one batched kernel adds every grad into the caller's "
              "buffers) against backward with CLONE followed by one add kernel per tensor; both minus the "
              "ALIAS replay. Goal: at most 0.6x (accumulating reads two tensors and writes one; clone + add "
              "moves five).\n\n"
              "| grads | total | ACCUMULATE_INTO (ms) | CLONE + add (ms) | ratio |\n|---|---|---|---|---|\n";
    for (Size sz : sizes) {
        const size_t count = sz.bytes / 4;
        GradSource acc(dev, sz.n, sz.bytes, GRAPHED_GRAD_POLICY_ACCUMULATE_INTO, true);
        GradSource clone(dev, sz.n, sz.bytes, GRAPHED_GRAD_POLICY_DEFAULT, true);
        GradSource alias(dev, sz.n, sz.bytes, GRAPHED_GRAD_POLICY_DEFAULT, false);
        // Correct first: dst = d0 + g exactly (f32).
        {
            std::vector<float> d0 = kit::random_floats(count, 11), g(count);
            dev.download(g.data(), acc.source(), sz.bytes);
            for (void* d : acc.dsts()) dev.upload(d, d0.data(), sz.bytes);
            acc.backward();
            std::vector<float> got(count);
            dev.download(got.data(), acc.dsts().back(), sz.bytes);
            bool ok = acc.refs()[0].kind() == GRAPHED_REF_KIND_ACCUMULATE_INTO;
            for (size_t i = 0; i < count; ++i) ok = ok && got[i] == d0[i] + g[i];
            check(ok, "ACCUMULATE_INTO adds the grads");
        }
        const int launches = int(sz.n) + 4;
        double t_acc = tools.median_ms([&] { acc.backward(); }, [] {}, 3, samples, launches);
        std::vector<void*> dst = acc.dsts();
        double t_ref = tools.median_ms(
            [&] {
                clone.backward();
                tools.add_each(dst, clone.ptrs(), count);
            },
            [&] { clone.release(); }, 3, samples, 2 * launches);
        double t_alias = tools.median_ms([&] { alias.backward(); }, [] {}, 3, samples, launches);
        double ours = t_acc - t_alias, ref = t_ref - t_alias;
        report << "| " << sz.n << " x " << bytes_str(sz.bytes) << " | " << bytes_str(sz.n * sz.bytes) << " | "
               << fmt("%.4f", ours) << " | " << fmt("%.4f", ref) << " | " << fmt("%.2fx", ours / ref) << " |\n";
        std::printf("accumulate %zu x %s: ours %.4f ms, clone+add %.4f ms\n", sz.n, bytes_str(sz.bytes).c_str(),
                    ours, ref);
    }
}

// Host time per call of `op`, in microseconds: median over batches.
double host_us(kit::Device& dev, const std::function<void()>& op, int per_batch, int batches) {
    std::vector<double> t;
    for (int i = 0; i < per_batch; ++i) op();
    dev.sync();
    for (int b = 0; b < batches; ++b) {
        auto a = std::chrono::steady_clock::now();
        for (int i = 0; i < per_batch; ++i) op();
        auto z = std::chrono::steady_clock::now();
        dev.sync();
        t.push_back(std::chrono::duration<double, std::micro>(z - a).count() / per_batch);
    }
    return bench::median(t);
}

void host_cost_table(kit::Device& dev, bench::Tools& tools, int per_batch) {
    report << "\n## 3. Host cost of replay\n\n"
              "Host time of `graphed_forward` + `graphed_backward` (no copy-in, ALIAS grads) against raw "
              "`cudaGraphLaunch` of two graphs with the same kernels, captured by the benchmark; medians over "
              "batches. Goal: within 1.10x. The replay path makes no heap allocation (tests/replay_allocations.rs "
              "counts them with a counting global allocator: zero over 2000 replays for ALIAS, COPY_INTO, "
              "ACCUMULATE_INTO and strict leases).\n\n"
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
    for (bool clones : {false, true}) {
        graphed_session_config c = graphed::session_config(dev.graphed_kind());
        c.clone_param_grads_on_return = clones;
        graphed::Session session(c);
        session.add_callable(L.callable(x.get(), true));
        session.capture();
        // The C calls themselves: this table measures the C ABI.
        graphed_session* s = session.get();
        graphed_replay_args a = graphed_replay_args_default();
        a.stream = dev.stream();
        graphed_ref out, gin, gp[2];
        double ours = host_us(
            dev,
            [&] {
                graphed_forward(s, &a, &out, 1);
                graphed_backward(s, &a, &gin, 1, gp, 2);
                if (clones) {
                    graphed_buffer_release(gp[0].owner);
                    graphed_buffer_release(gp[1].owner);
                }
            },
            per_batch, 21);
        session.destroy();
        std::string ref = "n/a (host backend)", ratio = "n/a";
        void* fg = tools.capture([&](graphed_stream st) { L.eager_forward(st, x.get(), z.get(), y.get()); });
        void* bg = tools.capture([&](graphed_stream st) {
            L.eager_backward(st, x.get(), z.get(), y.get(), gz.get(), gx.get(), gw.get(), gb.get());
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
        report << "| forward + backward, " << (clones ? "CLONE grads (+ 2 releases)" : "ALIAS grads") << " | "
               << fmt("%.2f", ours) << " | " << ref << " | " << ratio << " |\n";
        std::printf("host cost (%s): ours %.2f us, raw %s us\n", clones ? "clone" : "alias", ours, ref.c_str());
    }
}

struct MlpConfig {
    int width, batch;
    uint32_t dtype;
    int layers;
};

void mlp_table(kit::Device& dev, bench::Tools& tools, const std::vector<MlpConfig>& configs, int steps) {
    report << "\n## 4. End to end: an 8-layer MLP, forward + backward + grad return + SGD\n\n"
              "Time per training step (wall clock over " + std::to_string(steps) +
                  " steps after warm-up, median of 5 runs): eager (the same callbacks run directly on the stream), "
              "graphed with CLONE grads (the default), graphed with ALIAS grads (opt-out).\n\n"
              "| config | eager (ms) | graphed CLONE (ms) | graphed ALIAS (ms) | CLONE / eager | CLONE / ALIAS | static + scratch | driver-seen |\n"
              "|---|---|---|---|---|---|---|---|\n";
    for (const MlpConfig& m : configs) {
        const char* dt = m.dtype == GRAPHED_DTYPE_F32 ? "fp32" : "bf16";
        kit::Mlp eager(dev, m.layers, m.batch, m.width, 3, m.dtype);
        kit::Mlp g_clone(dev, m.layers, m.batch, m.width, 3, m.dtype);
        kit::Mlp g_alias(dev, m.layers, m.batch, m.width, 3, m.dtype);
        Buffer x = eager.tensor(kit::random_floats(size_t(m.batch) * m.width, 5));
        Buffer t = eager.tensor(kit::random_floats(size_t(m.batch) * m.width, 6, 0.1f));
        auto session = [&](kit::Mlp& mlp, bool clones, size_t* driver_used) {
            graphed_session_config c = graphed::session_config(dev.graphed_kind());
            c.clone_param_grads_on_return = clones;
            size_t before = tools.driver_free();
            graphed::Session s(c);
            mlp.register_layers(s, x.get());
            s.capture();
            dev.sync();
            if (driver_used) *driver_used = before - tools.driver_free();
            return s;
        };
        size_t driver_used = 0;
        graphed::Session sc = session(g_clone, true, &driver_used);
        graphed::Session sa = session(g_alias, false, nullptr);
        // Correct first: one step each, grads compared with eager.
        kit::StepGrads e = eager.eager_step(x.get(), t.get(), 0.01f);
        kit::StepGrads gc = g_clone.graphed_step(sc, x.get(), t.get(), 0.01f);
        kit::StepGrads ga = g_alias.graphed_step(sa, x.get(), t.get(), 0.01f);
        check(e.w == gc.w && e.b == gc.b, std::string("graphed CLONE grads equal eager (") + dt + ")");
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
        double te = per_step([&] { eager.eager_step(x.get(), t.get(), 0.01f, false); });
        double tc = per_step([&] { g_clone.graphed_step(sc, x.get(), t.get(), 0.01f, false, false); });
        double ta = per_step([&] { g_alias.graphed_step(sa, x.get(), t.get(), 0.01f, false, false); });
        graphed_session_stats st = sc.stats();
        sc.destroy();
        sa.destroy();
        std::string cfg = "H=" + std::to_string(m.width) + " B=" + std::to_string(m.batch) + " " + dt;
        std::string driver = tools.device_timing() ? bytes_str(driver_used) : "n/a";
        report << "| " << cfg << " | " << fmt("%.3f", te) << " | " << fmt("%.3f", tc) << " | " << fmt("%.3f", ta)
               << " | " << fmt("%.2fx", tc / te) << " | " << fmt("%.2fx", tc / ta) << " | "
               << bytes_str(st.static_bytes) << " + " << bytes_str(st.scratch_bytes) << " | " << driver << " |\n";
        std::printf("mlp %s: eager %.3f ms, graphed clone %.3f ms, graphed alias %.3f ms\n", cfg.c_str(), te, tc, ta);
    }
}

}  // namespace

int main(int argc, char** argv) {
    std::string backend = "cuda", out;
    bool quick = false;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--backend" && i + 1 < argc) backend = argv[++i];
        else if (a == "--quick") quick = true;
        else if (a == "--out" && i + 1 < argc) out = argv[++i];
        else {
            std::fprintf(stderr, "usage: %s [--backend cuda|host] [--quick] [--out FILE]\n", argv[0]);
            return 2;
        }
    }
    std::string why;
    std::unique_ptr<kit::Device> dev, blas;
    std::unique_ptr<bench::Tools> tools;
    if (backend == "cuda") {
        dev = kit::make_cuda_device(&why);
        if (!dev) {
            std::fprintf(stderr, "no CUDA device: %s\n", why.c_str());
            return 2;
        }
        tools = bench::make_cuda_tools(*dev);
        blas = bench::make_blas_device(&why);
    } else {
        dev = kit::make_host_device();
        tools = bench::make_host_tools(*dev);
    }
    try {
        report << "Measured on " << tools->describe() << " with graphed " << graphed_version() << ".\n";
        if (backend == "cuda" && !quick) {
            const std::vector<Size> sizes = {{64, 16u << 10}, {64, 4u << 20}, {8, 256u << 20}};
            clone_table(*dev, *tools, sizes, 50);
            accumulate_table(*dev, *tools, sizes, 50);
            host_cost_table(*dev, *tools, 2000);
            if (blas) {
                mlp_table(*blas, *tools, {{1024, 32, GRAPHED_DTYPE_F32, 8}, {4096, 2048, GRAPHED_DTYPE_BF16, 8}}, 50);
            } else {
                report << "\n## 4. End to end\n\nNot run: " << why << "\n";
            }
        } else {
            const std::vector<Size> sizes = {{64, 16u << 10}, {8, 256u << 10}};
            clone_table(*dev, *tools, sizes, 5);
            accumulate_table(*dev, *tools, sizes, 5);
            host_cost_table(*dev, *tools, 200);
            mlp_table(*dev, *tools, {{64, 8, GRAPHED_DTYPE_F32, 8}}, 5);
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    std::printf("\n%s", report.str().c_str());
    if (!out.empty()) std::ofstream(out) << report.str();
    if (failures) std::fprintf(stderr, "%d correctness check(s) failed\n", failures);
    return failures ? 1 : 0;
}
