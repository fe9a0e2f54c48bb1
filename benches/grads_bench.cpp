// The grad-return tables of graphed_bench (docs/benchmarks.md sections 1
// and 2): a callable whose backward writes N parameter grads, returned
// CLONE (from a clone slot, or copied into a recycled block) against ALIAS,
// a flat copy and a per-tensor clone; and returned ACCUMULATE_INTO against
// CLONE followed by one add per tensor. Checked first: the clones hold the
// grads, ACCUMULATE_INTO adds them exactly.
#include "grads_bench.hpp"

#include "common.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace bench {

using kit::Buffer;

namespace {

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

}  // namespace

int clone_table(kit::Device& dev, Tools& tools, std::ostream& report, const std::vector<GradSize>& sizes,
                int samples) {
    Checks check;
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
    for (GradSize sz : sizes) {
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
    return check.failed;
}

int accumulate_table(kit::Device& dev, Tools& tools, std::ostream& report, const std::vector<GradSize>& sizes,
                     int samples) {
    Checks check;
    report << "\n## 2. ACCUMULATE_INTO against CLONE followed by a separate add\n\n"
              "Backward replay with ACCUMULATE_INTO (one batched kernel adds every grad into the caller's "
              "buffers) against backward with CLONE followed by one add kernel per tensor; both minus the "
              "ALIAS replay. Goal: at most 0.6x (accumulating reads two tensors and writes one; clone + add "
              "moves five).\n\n"
              "| grads | total | ACCUMULATE_INTO (ms) | CLONE + add (ms) | ratio |\n|---|---|---|---|---|\n";
    for (GradSize sz : sizes) {
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
    return check.failed;
}

}  // namespace bench
