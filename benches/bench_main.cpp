// graphed benchmarks: the cost of returning gradients safely, the host cost
// of replay, and end-to-end training steps, each measured next to its
// reference in the same process. Writes a markdown report.
//
//   graphed_bench [--backend cuda|host] [--quick] [--capture-only] [--param-guard] [--microbatches]
//                 [--buckets] [--out FILE]
//
// --capture-only, --param-guard, --microbatches and --buckets run one table
// alone (capture time; the cost of giving replays the parameters'
// addresses, and of moving them; N microbatches in one step graph,
// microbatch_bench.cpp; shapes that change, bucket_bench.cpp).
//
// On CUDA, device times come from CUDA events (medians after warm-up); on
// the host backend (the ctest, small sizes) from wall clocks. Every
// measurement is preceded by a correctness check; a failed check exits 1.
#include "bucket_bench.hpp"
#include "layers.hpp"
#include "microbatch_bench.hpp"
#include "tools.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using bench::fmt;
using kit::Buffer;

int failures = 0;
std::ostringstream report;

void check(bool ok, const std::string& what) {
    if (!ok) {
        std::fprintf(stderr, "CHECK FAILED: %s\n", what.c_str());
        ++failures;
    }
}

// Why the session copies an input it was asked to rebind: the plan
// dump's line for it.
std::string copied_because(const graphed::Session& s) {
    const std::string plan = s.plan_dump();
    const size_t at = plan.find("copied at replay: ");
    return at == std::string::npos ? "see the plan dump" : plan.substr(at + 18, plan.find('\n', at) - at - 18);
}

std::string bytes_str(size_t b) {
    if (b >= (1u << 20)) return fmt("%.0f MiB", b / 1048576.0);
    return fmt("%.0f KiB", b / 1024.0);
}

// One callable whose backward writes `n` parameter grads of `bytes` each
// (a copy of a source tensor into each slot), returned per `policy`.
class GradSource {
  public:
    GradSource(kit::Device& dev, size_t n, size_t bytes, uint32_t policy, bool clones, uint32_t slots = 2)
        : dev_(dev), n_(n), bytes_(bytes), src_(dev, bytes), param_(dev, bytes), session_(config(dev, clones, slots)) {
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
    static graphed_session_config config(kit::Device& dev, bool clones, uint32_t slots) {
        graphed_session_config c = graphed::session_config(dev.graphed_kind());
        c.clone_param_grads_on_return = clones;
        c.clone_slots = slots;
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
              "allocator does). With clone slots (the default) a replay that finds a slot free launches the "
              "graph that writes the grads into the slot's block: there is nothing to copy. The copy path (every "
              "slot held by the caller; measured with `clone_slots` 0) copies the slab's CLONE span into a "
              "recycled block. Goal: the copy path within 1.15x of the flat copy.\n\n"
              "| grads | total | CLONE - ALIAS, clone slot (ms) | CLONE - ALIAS, copy path (ms) | flat copy (ms) | "
              "copy path / flat | per tensor (ms) | per tensor / flat |\n"
              "|---|---|---|---|---|---|---|---|\n";
    for (Size sz : sizes) {
        const size_t total = sz.n * sz.bytes;
        GradSource clone(dev, sz.n, sz.bytes, GRAPHED_GRAD_POLICY_DEFAULT, true);
        GradSource copied(dev, sz.n, sz.bytes, GRAPHED_GRAD_POLICY_DEFAULT, true, 0);
        GradSource alias(dev, sz.n, sz.bytes, GRAPHED_GRAD_POLICY_DEFAULT, false);
        // Correct first: every clone holds the grad, in its own memory.
        for (GradSource* g : {&clone, &copied}) {
            g->backward();
            bool ok = true;
            for (size_t i = 0; i < sz.n; i += std::max<size_t>(1, sz.n / 8))
                ok = ok && same_bytes(dev, g->refs()[i].ptr(), g->source(), sz.bytes);
            check(ok && g->refs()[0].kind() == GRAPHED_REF_KIND_CLONE, "clones hold the grads");
            g->release();
        }
        const int launches = int(sz.n) + 4;
        double t_clone = tools.median_ms([&] { clone.backward(); }, [&] { clone.release(); }, 3, samples, launches);
        double t_copied =
            tools.median_ms([&] { copied.backward(); }, [&] { copied.release(); }, 3, samples, launches);
        double t_alias = tools.median_ms([&] { alias.backward(); }, [] {}, 3, samples, launches);
        Buffer a(dev, total), b(dev, total);
        double t_flat = tools.median_ms([&] { tools.flat_copy(a.get(), b.get(), total); }, [] {}, 3, samples, 1);
        std::vector<void*> src = clone.slots(), out;
        double t_each = tools.median_ms([&] { tools.clone_each(out, src, sz.bytes); }, [&] { tools.free_each(out); },
                                        3, samples, int(2 * sz.n));
        double ours = t_clone - t_alias, copy = t_copied - t_alias;
        report << "| " << sz.n << " x " << bytes_str(sz.bytes) << " | " << bytes_str(total) << " | "
               << fmt("%.4f", ours) << " | " << fmt("%.4f", copy) << " | " << fmt("%.4f", t_flat) << " | "
               << fmt("%.2fx", copy / t_flat) << " | " << fmt("%.4f", t_each) << " | "
               << fmt("%.2fx", t_each / t_flat) << " |\n";
        std::printf("clone %zu x %s: slot %.4f ms, copy path %.4f ms (alias %.4f), flat %.4f, per-tensor %.4f\n",
                    sz.n, bytes_str(sz.bytes).c_str(), ours, copy, t_alias, t_flat, t_each);
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
              "batches. Goals: ALIAS within 1.10x, CLONE within 1.15x. The replay path makes no heap allocation "
              "and no device allocation in steady state (tests/replay_allocations.rs counts them with a counting "
              "global allocator, the host backend's device memory included: zero over 2000 replays for ALIAS, "
              "CLONE, COPY_INTO, ACCUMULATE_INTO and strict leases): a CLONE replay takes a released block, and "
              "with a free clone slot launches the graph that writes the grads into it, with no copy.\n\n"
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
    struct Variant {
        const char* what;
        bool clones;
        uint32_t slots;
    };
    for (const Variant& v : {Variant{"ALIAS grads", false, 0}, Variant{"CLONE grads, clone slots (+ 2 releases)", true, 2},
                             Variant{"CLONE grads, copied into a recycled block (+ 2 releases)", true, 0}}) {
        const bool clones = v.clones;
        graphed_session_config c = graphed::session_config(dev.graphed_kind());
        c.clone_param_grads_on_return = clones;
        c.clone_slots = v.slots;
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
        report << "| forward + backward, " << v.what << " | " << fmt("%.2f", ours) << " | " << ref << " | " << ratio
               << " |\n";
        std::printf("host cost (%s): ours %.2f us, raw %s us\n", v.what, ours, ref.c_str());
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
}

// A number from the one-line JSON of benches/torch_reference.py (NaN when
// the key is missing).
double json_number(const std::string& text, const std::string& key) {
    const std::string k = "\"" + key + "\":";
    size_t at = text.find(k);
    if (at == std::string::npos) return std::nan("");
    return std::strtod(text.c_str() + at + k.size(), nullptr);
}

std::string read_file(const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

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

void step_table(kit::Device& dev, bench::Tools& tools, int layers, int width, int batch, int steps,
                const std::string& torch_json) {
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
}

// Capture time of the step's session, by phase (graphed_session_stats),
// against capturing the same kernels by hand into one graph.
void capture_table(kit::Device& dev, bench::Tools& tools, int layers, int width, int batch, int repeats) {
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

void memory_table(kit::Device& dev, const std::vector<int>& layer_counts, int width, int batch,
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

void rebind_table(kit::Device& dev, const std::string& label, bool header, int per_batch) {
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

// A callable with `n` parameters of `floats` f32 each, registered with
// GRAPHED_PARAM_FLAGS_REBIND, at two sets of addresses (a and b, other
// values): forward writes y = x + p_0 + ... + p_{n-1} (a copy, then one add
// kernel per parameter); backward copies the grad-output into the input
// grad and writes each parameter's grad as gy * p_k (one kernel each), so
// that every parameter is read by the forward, the backward and each clone
// slot's backward.
class ParamLayer {
  public:
    ParamLayer(kit::Device& dev, size_t n, size_t floats)
        : dev_(dev), n_(n), floats_(floats), bytes_(floats * 4), x_(dev, bytes_),
          session_(graphed::session_config(dev.graphed_kind())) {
        auto xv = kit::random_floats(floats, 3);
        dev.upload(x_.get(), xv.data(), bytes_);
        graphed::Callable c;
        c.name = "params";
        c.inputs = {graphed::tensor_desc(bytes_, GRAPHED_DTYPE_F32, true, x_.get())};
        c.outputs = {graphed::tensor_desc(bytes_, GRAPHED_DTYPE_F32, true)};
        for (size_t k = 0; k < n; ++k) {
            for (auto* set : {&a_, &b_}) {
                set->emplace_back(dev, bytes_);
                auto v = kit::random_floats(floats, uint32_t(100 + k + (set == &b_ ? 5000 : 0)));
                dev.upload(set->back().get(), v.data(), bytes_);
            }
            at_a_.push_back(a_.back().get());
            at_b_.push_back(b_.back().get());
            c.params.push_back(graphed::param_desc(a_.back().get(), bytes_, GRAPHED_DTYPE_F32,
                                                   GRAPHED_GRAD_POLICY_DEFAULT, GRAPHED_PARAM_FLAGS_REBIND));
        }
        c.forward = [](const graphed_pass_ctx* ctx, void* self) -> int32_t {
            auto* L = static_cast<ParamLayer*>(self);
            if (int e = L->dev_.copy(ctx->stream, ctx->outputs[0], ctx->inputs[0], L->bytes_)) return e;
            for (size_t k = 0; k < L->n_; ++k)
                if (int e = L->dev_.add(ctx->stream, GRAPHED_DTYPE_F32, ctx->outputs[0], ctx->params[k], L->floats_))
                    return e;
            return 0;
        };
        c.backward = [](const graphed_pass_ctx* ctx, void* self) -> int32_t {
            auto* L = static_cast<ParamLayer*>(self);
            if (int e = L->dev_.copy(ctx->stream, ctx->grad_inputs[0], ctx->grad_outputs[0], L->bytes_)) return e;
            for (size_t k = 0; k < L->n_; ++k)
                if (int e = L->dev_.mul(ctx->stream, GRAPHED_DTYPE_F32, ctx->grad_outputs[0], ctx->params[k],
                                        ctx->param_grads[k], L->floats_))
                    return e;
            return 0;
        };
        c.user_data = this;
        session_.add_callable(c);
        session_.capture();
        for (graphed::Replay* r : {&none_, &ra_, &rb_}) r->stream(dev.stream()).no_data();
        ra_.params(at_a_);
        rb_.params(at_b_);
    }
    ParamLayer(const ParamLayer&) = delete;
    ParamLayer& operator=(const ParamLayer&) = delete;

    graphed::Session& session() { return session_; }
    bool movable() const {
        for (bool m : session_.params_movable(0))
            if (!m) return false;
        return true;
    }
    // Graph-node updates one move of every parameter costs (the plan dump's
    // "movable (K node updates per move)" lines, summed).
    uint32_t nodes() const {
        const std::string plan = session_.plan_dump();
        uint32_t sum = 0;
        for (size_t at = plan.find("movable ("); at != std::string::npos; at = plan.find("movable (", at + 1))
            sum += uint32_t(std::strtoul(plan.c_str() + at + 9, nullptr, 10));
        return sum;
    }
    // Why a parameter is fixed (the plan dump's line).
    std::string why_fixed() const {
        const std::string plan = session_.plan_dump();
        const std::string key = "fixed at its registered address: ";
        const size_t at = plan.find(key);
        return at == std::string::npos ? "see the plan dump"
                                       : plan.substr(at + key.size(), plan.find('\n', at) - at - key.size());
    }

    // A forward replay: no address array; the addresses the graphs read
    // now; or moved to the other set.
    void forward_null() { session_.forward(none_, outs_); }
    void forward_unchanged() { session_.forward(on_b_ ? rb_ : ra_, outs_); }
    void forward_moved() {
        on_b_ = !on_b_;
        session_.forward(on_b_ ? rb_ : ra_, outs_);
    }
    void forward_at(bool b) {
        on_b_ = b;
        session_.forward(b ? rb_ : ra_, outs_);
    }
    // Whether the last forward's output is x + the parameters of set b (or a), summed in order in f32.
    bool output_is(bool b) {
        std::vector<float> want = kit::fetch<float>(dev_, x_.get(), floats_);
        for (size_t k = 0; k < n_; ++k) {
            std::vector<float> p = kit::fetch<float>(dev_, (b ? b_ : a_)[k].get(), floats_);
            for (size_t i = 0; i < floats_; ++i) want[i] += p[i];
        }
        return kit::fetch<float>(dev_, outs_[0].ptr(), floats_) == want;
    }
    // Tries a move where the graphs cannot follow: the status it gets.
    graphed_status try_move() {
        try {
            session_.forward(on_b_ ? ra_ : rb_, outs_);
        } catch (const graphed::Error& e) {
            return e.status();
        }
        return GRAPHED_STATUS_OK;
    }

  private:
    kit::Device& dev_;
    size_t n_, floats_, bytes_;
    Buffer x_;
    std::vector<Buffer> a_, b_;
    std::vector<const void*> at_a_, at_b_;
    graphed::Session session_;
    graphed::Replay none_, ra_, rb_;
    std::vector<graphed::Ref> outs_;
    bool on_b_ = false;
};

void param_guard_table(kit::Device& dev, bench::Tools& tools, const std::vector<size_t>& counts, int per_batch,
                       int replays, int samples) {
    const size_t floats = 256;
    report << "\n## 10. Moved parameters: the guard and the rebind\n\n"
              "Forward replays (no data, nothing copied in) of one callable with N f32 parameters of "
           << floats * 4
           << " bytes each, registered with GRAPHED_PARAM_FLAGS_REBIND (forward: one add kernel per parameter; "
              "backward and each of the 2 clone slots' backward: one kernel per parameter), three ways: "
              "`graphed_replay_args.params` NULL; the parameters' current addresses given, unchanged (the "
              "guard: one comparison per parameter); every parameter moved at every replay, between two sets "
              "of buffers (the rebind: one graph-node update per reference, over the forward, backward and "
              "clone-slot graphs). Host time per replay: medians over batches of "
           << per_batch
           << " replays (synchronized between batches, so that the launch queue never fills), the three "
              "variants interleaved over 3 rounds; device time per replay: CUDA events around each replay "
              "(median). The guard is unchanged minus NULL (goal: under 0.5 us per callable); the rebind is "
              "moved minus unchanged, per moved parameter and per node updated (nodes from the plan dump). "
              "Every variant is checked first: the output equals x plus the parameters of the set the graphs "
              "were pointed at, and `param_moves` grows by N per moved replay.\n\n"
              "| N params | nodes per move | host, NULL (us) | host, unchanged (us) | host, moved (us) | guard (us) | "
              "rebind per moved param (us) | rebind per node (us) | device, NULL / unchanged / moved (us) |\n"
              "|---|---|---|---|---|---|---|---|---|\n";
    for (size_t n : counts) {
        ParamLayer L(dev, n, floats);
        const bool movable = L.movable();
        // Correct first.
        L.forward_at(false);
        check(L.output_is(false), "the forward reads the registered parameters");
        if (movable) {
            const uint64_t before = L.session().stats().param_moves;
            L.forward_at(true);
            check(L.output_is(true), "the forward reads the moved parameters");
            L.forward_at(false);
            check(L.output_is(false), "the forward reads the parameters moved back");
            check(L.session().stats().param_moves - before == 2 * n, "param_moves counts every moved parameter");
        } else {
            check(L.try_move() == GRAPHED_STATUS_PARAM_MOVED, "a move the graphs cannot follow is refused");
        }
        const int batches = std::max(5, replays / per_batch / int(std::max<size_t>(1, n / 8)));
        std::vector<double> t_null, t_same, t_moved;
        uint64_t moved_calls = 0;
        const uint64_t moves_before = L.session().stats().param_moves;
        for (int round = 0; round < 3; ++round) {
            t_null.push_back(host_us(dev, [&] { L.forward_null(); }, per_batch, batches));
            t_same.push_back(host_us(dev, [&] { L.forward_unchanged(); }, per_batch, batches));
            if (movable)
                t_moved.push_back(host_us(
                    dev,
                    [&] {
                        L.forward_moved();
                        ++moved_calls;
                    },
                    per_batch, batches));
        }
        if (movable)
            check(L.session().stats().param_moves - moves_before == moved_calls * n,
                  "param_moves grows by N per moved replay");
        const double h_null = bench::median(t_null), h_same = bench::median(t_same);
        const double h_moved = movable ? bench::median(t_moved) : std::nan("");
        std::string device = "n/a (host backend)";
        if (tools.device_timing()) {
            const int launches = int(n) + 3;
            const double d_null = tools.median_ms([&] { L.forward_null(); }, [] {}, 20, samples, launches);
            const double d_same = tools.median_ms([&] { L.forward_unchanged(); }, [] {}, 20, samples, launches);
            device = fmt("%.2f", d_null * 1e3) + " / " + fmt("%.2f", d_same * 1e3) + " / ";
            device += movable ? fmt("%.2f", tools.median_ms([&] { L.forward_moved(); }, [] {}, 20, samples, launches) *
                                                1e3)
                              : std::string("n/a");
        }
        const uint32_t nodes = movable ? L.nodes() : 0;
        const std::string moved_cell = movable ? fmt("%.2f", h_moved) : "refused: " + L.why_fixed();
        report << "| " << n << " | " << (movable ? std::to_string(nodes) : std::string("n/a")) << " | "
               << fmt("%.2f", h_null) << " | " << fmt("%.2f", h_same) << " | " << moved_cell << " | "
               << fmt("%.2f", h_same - h_null) << " | "
               << (movable ? fmt("%.3f", (h_moved - h_same) / double(n)) : std::string("n/a")) << " | "
               << (movable && nodes ? fmt("%.3f", (h_moved - h_same) / double(nodes)) : std::string("n/a")) << " | "
               << device << " |\n";
        std::printf("param guard N=%zu: host NULL %.2f us, unchanged %.2f us, moved %s (%u nodes); device %s\n", n,
                    h_null, h_same, movable ? (fmt("%.2f", h_moved) + " us").c_str() : "refused", nodes,
                    device.c_str());
    }
}

}  // namespace

int main(int argc, char** argv) {
    std::string backend = "cuda", out, torch_json;
    bool quick = false, capture_only = false, param_guard = false, microbatches = false, buckets = false;
    std::vector<uint32_t> counts = {1, 4, 16, 64};  // --microbatches: the N of the table
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--backend" && i + 1 < argc) backend = argv[++i];
        else if (a == "--quick") quick = true;
        else if (a == "--capture-only") capture_only = true;
        else if (a == "--param-guard") param_guard = true;
        else if (a == "--microbatches") microbatches = true;
        else if (a == "--buckets") buckets = true;
        else if (a == "--out" && i + 1 < argc) out = argv[++i];
        else if (a == "--torch-json" && i + 1 < argc) torch_json = argv[++i];
        else if (a == "--counts" && i + 1 < argc) {
            counts.clear();
            std::stringstream list(argv[++i]);
            for (std::string n; std::getline(list, n, ',');) counts.push_back(uint32_t(std::stoul(n)));
        } else {
            std::fprintf(stderr, "usage: %s [--backend cuda|host] [--quick] [--capture-only] [--param-guard] [--microbatches] [--buckets] "
                         "[--counts N,N,...] [--out FILE] "
                         "[--torch-json FILE]\n",
                         argv[0]);
            return 2;
        }
    }
    std::string why;
    std::unique_ptr<kit::Device> dev, blas;
    // Event timing records on its device's stream: a table run on the
    // cuBLAS device is timed by tools of its own (its stream is not dev's).
    std::unique_ptr<bench::Tools> tools, btools;
    if (backend == "cuda") {
        dev = kit::make_cuda_device(&why);
        if (!dev) {
            std::fprintf(stderr, "no CUDA device: %s\n", why.c_str());
            return 2;
        }
        tools = bench::make_cuda_tools(*dev);
        blas = bench::make_blas_device(&why);
        if (blas) btools = bench::make_cuda_tools(*blas);
    } else {
        dev = kit::make_host_device();
        tools = bench::make_host_tools(*dev);
    }
    try {
        report << "Measured on " << tools->describe() << " with graphed " << graphed_version() << ".\n";
        if (buckets) {
            const std::vector<uint64_t> sizes = {32, 64, 96, 128, 160, 192, 224, 256};
            if (blas && !quick)
                failures += bench::bucket_table(*blas, *btools, report, 8, 1024, sizes, 200, 50);
            else
                failures += bench::bucket_table(*dev, *tools, report, 3, 32, {8, 16, 24, 32}, 13, 5);
        } else if (microbatches) {
            if (blas && !quick)
                failures += bench::microbatch_table(*blas, *btools, report, 24, 256, 64, counts, 50);
            else
                failures += bench::microbatch_table(*dev, *tools, report, 6, 32, 8, {1, 4}, 5);
        } else if (param_guard) {
            // The guard is host work, the same on both backends: the host
            // backend measures it too (its graphs refuse moves).
            if (!quick)
                param_guard_table(*dev, *tools, {1, 8, 64, 256}, 50, 10000, 500);
            else
                param_guard_table(*dev, *tools, {1, 8}, 20, 400, 20);
            failures += bench::microbatch_table(*dev, *tools, report, 6, 32, 8, {1, 4}, 5);
        } else if (capture_only) {
            capture_table(blas ? *blas : *dev, blas ? *btools : *tools, backend == "cuda" ? 24 : 6, backend == "cuda" ? 256 : 32,
                          backend == "cuda" ? 64 : 8, backend == "cuda" ? 5 : 3);
        } else if (backend == "cuda" && !quick) {
            const std::vector<Size> sizes = {{64, 16u << 10}, {64, 4u << 20}, {8, 256u << 20}};
            clone_table(*dev, *tools, sizes, 50);
            accumulate_table(*dev, *tools, sizes, 50);
            host_cost_table(*dev, *tools, 2000);
            if (blas) {
                mlp_table(*blas, *btools, {{1024, 32, GRAPHED_DTYPE_F32, 8}, {4096, 2048, GRAPHED_DTYPE_BF16, 8}}, 50);
                step_table(*blas, *btools, 24, 256, 64, 200, torch_json);
                memory_table(*blas, {8, 24}, 256, 64, torch_json);
            } else {
                report << "\n## 4. End to end\n\nNot run: " << why << "\n";
            }
            rebind_table(*dev, "the kit's CUDA kernels", true, 2000);
            if (blas) rebind_table(*blas, "cuBLAS GEMMs and the kit's kernels", false, 2000);
            if (blas) capture_table(*blas, *btools, 24, 256, 64, 5);
            param_guard_table(*dev, *tools, {1, 8, 64, 256}, 50, 10000, 500);
            if (blas) failures += bench::microbatch_table(*blas, *btools, report, 24, 256, 64, {1, 4, 16, 64}, 50);
            if (blas)
                failures += bench::bucket_table(*blas, *btools, report, 8, 1024,
                                                {32, 64, 96, 128, 160, 192, 224, 256}, 200, 50);
        } else {
            const std::vector<Size> sizes = {{64, 16u << 10}, {8, 256u << 10}};
            clone_table(*dev, *tools, sizes, 5);
            accumulate_table(*dev, *tools, sizes, 5);
            host_cost_table(*dev, *tools, 200);
            mlp_table(*dev, *tools, {{64, 8, GRAPHED_DTYPE_F32, 8}}, 5);
            step_table(*dev, *tools, 6, 32, 8, 5, torch_json);
            memory_table(*dev, {4}, 32, 8, torch_json);
            rebind_table(*dev, "host tasks", true, 200);
            capture_table(*dev, *tools, 6, 32, 8, 3);
            param_guard_table(*dev, *tools, {1, 8}, 20, 400, 20);
            failures += bench::microbatch_table(*dev, *tools, report, 6, 32, 8, {1, 4}, 5);
            failures += bench::bucket_table(*dev, *tools, report, 3, 32, {8, 16, 24, 32}, 13, 5);
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
