// The moved-parameters table of graphed_bench (docs/benchmarks.md section
// 10): the guard (the parameters' current addresses given to every
// replay, unchanged) and the rebind (every parameter moved at every
// replay, between two sets of buffers) against replays given no
// addresses, host and device time. Checked first: the output follows the
// addresses the graphs were pointed at, and param_moves counts every move;
// where the graphs cannot follow, the move is refused.
#include "param_guard_bench.hpp"

#include "common.hpp"
#include "layers.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace bench {

using kit::Buffer;

namespace {

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

}  // namespace

int param_guard_table(kit::Device& dev, Tools& tools, std::ostream& report, const std::vector<size_t>& counts,
                      int per_batch, int replays, int samples) {
    Checks check;
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
    return check.failed;
}

}  // namespace bench
