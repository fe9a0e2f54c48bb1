// graphed for libtorch: replays. GraphedCallable checks a call's inputs
// against the samples, replays the forward graph (graphed::Session::forward)
// and wires the outputs into autograd through GraphedBackward, a node that
// replays the backward graph and returns grads per their frozen policies
// (the Refs graphed returns: CLONE, ALIAS or NONE). Also the delayed
// weight-gradient replay (backward_dw) and what a GraphedCallable reports
// (stats, plan, reset).
#include "internal.h"

#include <c10/cuda/CUDAGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace graphed_torch {

namespace {

// The device pointers of `dsts` (NULL for undefined ones); empty when all are.
std::vector<void*> pointers_of(const std::vector<at::Tensor>& dsts) {
    std::vector<void*> v(dsts.size(), nullptr);
    bool any = false;
    for (size_t j = 0; j < dsts.size(); ++j)
        if (dsts[j].defined()) {
            v[j] = dsts[j].data_ptr();
            any = true;
        }
    if (!any) v.clear();
    return v;
}

// The replay of (index, mb) on `stream` (and on `side`, joined by events,
// when not NULL), reading `data`.
graphed::Replay replay_of(size_t index, uint32_t mb, cudaStream_t stream, cudaStream_t side,
                          const std::vector<const void*>* data) {
    graphed::Replay r(static_cast<uint32_t>(index), mb);
    r.stream(stream).side_stream(side);
    if (data) r.data(*data);
    return r;
}

// "graphed callable 'name'" and, with several microbatches, which one.
std::string callable_text(const Shared& s, const Callable& c, uint32_t mb) {
    std::string o = "graphed callable '" + c.name + "'";
    if (s.microbatches > 1) o += " (microbatch " + std::to_string(mb) + ")";
    return o;
}

// Parameter j of `c` is not what its graphs read (another shape, dtype,
// device or layout, or none at all).
[[noreturn]] void param_changed(const Shared& s, const Callable& c, uint32_t mb, size_t j) {
    const at::Tensor& p = c.params[j];
    const std::string device = "cuda:" + std::to_string(s.device);
    throw ParamMoved(callable_text(s, c, mb) + ": parameter '" + c.param_name(j) + "' is " +
                     (p.defined() ? "now " + layout_text(p) : std::string("gone")) + "; its graphs read " +
                     layout_text(c.param_info[j].layout, device) +
                     " and cannot read it as it is (nothing was replayed). Give it back that shape, dtype, device "
                     "and layout (module.to(" +
                     device + "), .contiguous()), or reset() the graphs and make them again for the new one.");
}

// Which parameter graphed refused: the index its message names ("param j
// of ..."), else the first that moved from `from` (where the graphs read
// them; empty when unknown) to `to`.
size_t refused_param(const std::string& msg, const std::vector<const void*>& to, const std::vector<void*>& from) {
    const std::string key = "param ";
    for (size_t pos = msg.find(key); pos != std::string::npos; pos = msg.find(key, pos + 1)) {
        size_t k = pos + key.size(), j = 0;
        bool digits = false;
        for (; k < msg.size() && msg[k] >= '0' && msg[k] <= '9'; ++k, digits = true) j = j * 10 + size_t(msg[k] - '0');
        if (digits && j < to.size() && to[j]) return j;
    }
    for (size_t j = 0; j < to.size(); ++j)
        if (to[j] && (j >= from.size() || from[j] != to[j])) return j;
    return 0;
}

// graphed refused a forward given moved parameters (`to`): the same, as
// ParamMoved naming the parameter by its qualified name.
[[noreturn]] void param_refused(const Shared& s, const Callable& c, uint32_t mb, const std::vector<const void*>& to,
                                const graphed::Error& e) {
    // Where the graphs read them: best effort, the refusal stands either way.
    std::vector<void*> at;
    try {
        at = s.session->param_addresses(uint32_t(c.index), mb);
    } catch (const graphed::Error&) {
    }
    const size_t j = refused_param(e.message(), to, at);
    const void* from = j < at.size() ? at[j] : nullptr;
    std::string msg = callable_text(s, c, mb) + ": parameter '" + c.param_name(j) + "' moved from " + hex(from) +
                      " to " + hex(to[j]) +
                      ", and its graphs cannot follow it (nothing was replayed).\n  " + e.what() + "\n  ";
    if (!s.opts.rebind_params)
        msg += "The callables were made with rebind_params=False: their graphs read every parameter where it was at "
               "capture. Make them with rebind_params=True (the default) to follow parameters that move, or update "
               "parameters in place (load_state_dict without assign=True copies into them).";
    else
        msg += "session_plan() says, per parameter, whether its graphs can follow it and why not. A new address "
               "must be aligned at least as the captured one (up to 256 bytes; a tensor of its own is: PyTorch's "
               "allocator aligns to 512), or update the parameter in place instead.";
    throw ParamMoved(msg);
}


// With Options::accumulate_into: per parameter of `c`, the tensor its grad
// is added into (undefined where graphed returns it), found by `on`'s
// lookup and checked: a contiguous tensor of the parameter's shape and
// dtype on its device, as ACCUMULATE_INTO adds elementwise.
std::vector<at::Tensor> accumulate_dsts(const Shared& s, const Callable& c, uint32_t mb, const ReplayOn& on) {
    std::vector<at::Tensor> dsts(c.params.size());
    for (size_t j = 0; j < c.params.size(); ++j) {
        if (c.param_info[j].policy != GRAPHED_GRAD_POLICY_ACCUMULATE_INTO) continue;
        if (!on.accumulate_dst)
            throw std::logic_error("graphed: accumulate_param_grads_into is set but the call gave no destinations");
        const at::Tensor& p = c.params[j];
        at::Tensor d = on.accumulate_dst(p);
        // The message is built only for a refusal: this runs at every forward.
        auto where = [&] {
            return callable_text(s, c, mb) + ": parameter '" + c.param_name(j) + "'." + s.opts.accumulate_into;
        };
        if (!d.defined())
            throw std::invalid_argument(where() + " is None; graphed adds the parameter's grad into it "
                                                  "(accumulate_param_grads_into): give it a tensor first (zeros, "
                                                  "as Megatron allocates main_grad)");
        if (d.scalar_type() != p.scalar_type() || d.sizes() != p.sizes() || !d.is_cuda() ||
            d.device() != p.device() || !d.is_contiguous())
            throw std::invalid_argument(
                where() + " is " + layout_text(d) +
                "; graphed adds the grad elementwise into a contiguous tensor of the parameter's shape and dtype "
                "on its device (" +
                layout_text(p) + ")" +
                (d.scalar_type() != p.scalar_type() ? ": an accumulator of another dtype is not supported" : ""));
        dsts[j] = std::move(d);
    }
    return dsts;
}

// The backward of one replay, as an autograd node: it replays the backward
// graph and returns grads per the frozen policies. It holds the session
// while the autograd graph that may call it exists.
struct GraphedBackward : public torch::autograd::Node {
    std::shared_ptr<Shared> shared;
    size_t index = 0;
    uint32_t microbatch = 0;
    // With buckets: the forward's actual sizes, its bucket and the bucket's
    // sizes (none, 0 and none without).
    Sizes actual;
    size_t bucket = 0;
    Sizes bucket_sizes;
    std::optional<c10::cuda::CUDAStream> side;

    // Inputs the graphs read in place (rebound), kept until the backward,
    // with their version counters at the forward.
    std::vector<std::pair<at::Tensor, uint32_t>> held;
    // The memory of the parameters the forward read, which the backward
    // reads too, kept until then (as autograd's saved tensors keep theirs):
    // a parameter moved or freed in between does not change what it reads.
    std::vector<c10::Storage> params_held;
    // With Options::accumulate_into: where each parameter's grad is added
    // (undefined: returned to autograd), as the forward found them.
    std::vector<at::Tensor> dsts;

    std::string name() const override { return "GraphedBackward"; }

    void release_variables() override {
        held.clear();
        params_held.clear();
        dsts.clear();
    }

    torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
        Shared& s = *shared;
        if (s.is_reset) throw std::runtime_error("graphed: backward of a callable whose session was reset");
        Callable* c = s.callables[index].get();
        s.check_live(*c);
        for (size_t i = 0; i < held.size(); ++i)
            if (held[i].first.defined() && held[i].first._version() != held[i].second)
                throw std::runtime_error(
                    "graphed callable '" + c->name + "': " + c->input_name(i) +
                    " was modified in place after the forward; its graphs read it where it is (rebind_inputs=True), "
                    "so its backward would use the new values. Modify a copy, or pass rebind_inputs=False to copy "
                    "inputs into the graph's own buffers.");
        std::vector<at::Tensor> contiguous;
        std::vector<const void*> data;
        contiguous.reserve(c->sig.out.size());
        std::vector<Meta> buf;
        // Contiguous at the actual sizes: graphed copies them into the bucket.
        const std::vector<Meta>& outs = Callable::sized(c->sig.out, c->sig.out_dims, actual, buf);
        size_t k = 0;
        for (size_t i = 0; i < c->sig.out.size(); ++i) {
            if (!c->sig.out[i].requires_grad) {
                data.push_back(nullptr);
                continue;
            }
            const at::Tensor& g = grads[k++];
            // In the output's layout: the graph reads its grad that way.
            const Meta& m = outs[i];
            contiguous.push_back(in_layout(g.defined() ? g : at::zeros(m.sizes, options_of(m.dtype, s.device)), m));
            data.push_back(contiguous.back().data_ptr());
        }
        cudaStream_t cur = c10::cuda::getCurrentCUDAStream(s.device).stream();
        cudaStream_t side_stream = side && side->stream() != cur ? side->stream() : nullptr;
        // Owned grads: the backward writes them into fresh memory (not with a
        // weight-grad pass, whose replay returns them), made before the
        // generators advance.
        std::vector<at::Tensor> fresh;
        if (!c->wgrad) fresh = s.fresh_grads(*c);
        const size_t key = pass_key(c->per_mb[microbatch].ids.at(bucket), Pass::Backward);
        s.before_replay(key, cur);
        graphed::Replay r = replay_of(index, microbatch, cur, side_stream, &data);
        // graphed refuses it when the callable's last forward ran other sizes.
        if (actual.n) r.size(uint64_t(actual.n));
        if (actual.n2) r.size2(uint64_t(actual.n2));
        const std::vector<void*> dst_ptrs = pointers_of(fresh.empty() ? dsts : fresh);
        if (!dst_ptrs.empty()) r.param_dsts(dst_ptrs);
        graphed::Grads g;
        s.replay_or_unwind(key, index, microbatch, [&](graphed::Session& session) { session.backward(r, g); });
        torch::autograd::variable_list result;
        result.reserve(g.inputs.size() + g.params.size());
        std::vector<Meta> in_buf;
        const std::vector<Meta>& ins = Callable::returned(c->sig.in, c->sig.in_dims, actual, bucket_sizes, in_buf);
        for (size_t i = 0; i < g.inputs.size(); ++i)
            result.push_back(g.inputs[i].kind() == GRAPHED_REF_KIND_NONE
                                 ? at::Tensor()
                                 : s.wrap_alias(
                                       g.inputs[i], ins[i],
                                       [&] { return c->who(microbatch) + "the grad of " + c->input_name(i); }, shared));
        for (size_t j = 0; j < g.params.size(); ++j)
            result.push_back(j < fresh.size() && fresh[j].defined()
                                 ? std::move(fresh[j])
                                 : s.param_grad(*c, j, microbatch, g.params[j], shared));
        return result;
    }
};

// The sizes of a call of bucketed `c`: the dimensions of its dynamic inputs
// that follow the bucket's sizes, the same for all, 1 to the largest
// bucket (else std::invalid_argument saying which and why).
Sizes call_sizes(const Callable& c, const std::vector<at::Tensor>& inputs) {
    Sizes got{-1, c.sig.buckets2.empty() ? 0 : -1};
    size_t from[2] = {0, 0};
    auto take = [&](size_t i, int64_t d, int64_t& n, size_t& first, const char* which) {
        if (d < 0) return;
        const at::Tensor& x = inputs[i];
        if (!x.defined() || x.dim() != int64_t(c.sig.in[i].sizes.size()))
            throw std::invalid_argument("graphed callable '" + c.name + "': " + c.input_name(i) + " is " +
                                        (x.defined() ? describe(x) : std::string("None")) + "; its dimension " +
                                        std::to_string(d) + " is the call's" + which + " size (it was captured with " +
                                        describe(c.sig.in[i].sizes, c.sig.in[i].dtype, x.defined() ? x.device().str() : "cuda",
                                                 c.sig.in[i].requires_grad) + ")");
        const int64_t v = x.size(d);
        if (n < 0) {
            n = v;
            first = i;
        } else if (v != n) {
            throw std::invalid_argument("graphed callable '" + c.name + "': " + c.input_name(i) + " has " +
                                        std::to_string(v) + (d ? " on dimension " + std::to_string(d) : std::string(" rows")) +
                                        " and " + c.input_name(first) + " " + std::to_string(n) +
                                        "; its dynamic inputs give the call's size together");
        }
    };
    for (size_t i = 0; i < inputs.size() && i < c.sig.in_dims.size(); ++i) {
        take(i, c.sig.in_dims[i].d1, got.n, from[0], c.sig.buckets2.empty() ? "" : " first");
        take(i, c.sig.in_dims[i].d2, got.n2, from[1], " second");
    }
    auto check = [&](int64_t n, const std::vector<int64_t>& b, const char* what) {
        if (n < 1 || n > b.back())
            throw std::invalid_argument("graphed callable '" + c.name + "': a call of " + std::to_string(n) + " " + what +
                                        "; its buckets hold 1 to " + std::to_string(b.back()) + " (nothing was replayed)");
    };
    check(got.n, c.sig.buckets, c.sig.buckets2.empty() ? "rows" : "as its first size");
    if (!c.sig.buckets2.empty()) check(got.n2, c.sig.buckets2, "as its second size");
    return got;
}

// Whether `x` has the shape of `m` in every dimension but those `d` follows.
bool same_but(const at::Tensor& x, const Meta& m, const Dims& d) {
    if (x.dim() != int64_t(m.sizes.size())) return false;
    for (int64_t k = 0; k < x.dim(); ++k)
        if (k != d.d1 && k != d.d2 && x.size(k) != m.sizes[size_t(k)]) return false;
    return true;
}

}  // namespace

// Declared in internal.h (also the step's replay uses it).
void check_params(const Shared& s, Callable& c, uint32_t mb) {
    if (c.caller.param_source) c.caller.param_source(c.params);
    for (size_t j = 0; j < c.params.size(); ++j) {
        const at::Tensor& p = c.params[j];
        const Meta& m = c.param_info[j].layout;
        if (!p.defined() || !p.is_cuda() || p.device().index() != s.device || p.scalar_type() != m.dtype ||
            p.sizes() != at::IntArrayRef(m.sizes) ||
            !(m.strides.empty() ? p.is_contiguous() : p.strides() == at::IntArrayRef(m.strides)))
            param_changed(s, c, mb, j);
    }
}

bool params_now(const Shared& s, Callable& c, uint32_t mb, std::vector<const void*>& to) {
    if (c.params.empty()) return false;
    check_params(s, c, mb);
    // Every parameter's address: graphed compares each with where its
    // graphs read it and points them only at those that moved.
    to.resize(c.params.size());
    for (size_t j = 0; j < c.params.size(); ++j) to[j] = c.params[j].data_ptr();
    return true;
}

std::vector<at::Tensor> GraphedCallable::operator()(const std::vector<at::Tensor>& inputs, const ReplayOn& on) const {
    Shared& s = *shared_;
    Callable* c = s.callables[index_].get();
    s.check_live(*c);
    if (inputs.size() != c->sig.in.size())
        throw std::invalid_argument("graphed callable '" + c->name + "' takes " + std::to_string(c->sig.in.size()) +
                                    " tensor inputs, got " + std::to_string(inputs.size()));
    // requires_grad matters when a backward may follow: an input that needs
    // a grad its sample did not is refused (the graphs compute none); one
    // that needs none where its sample did is accepted, its grad computed
    // and dropped (autograd has no edge for it), as torch and Transformer
    // Engine do.
    const bool grad_mode = s.opts.training && at::GradMode::is_enabled();
    // What the graphs read: each input, or its contiguous copy.
    c10::SmallVector<at::Tensor, 8> read;
    std::vector<const void*> data(inputs.size());
    bool needs_grad = false;
    // With buckets: the call's sizes (of the dimensions its dynamic inputs
    // follow), and the bucket graphed runs for them.
    const Sizes actual = c->sig.buckets.empty() ? Sizes{} : call_sizes(*c, inputs);
    size_t bucket = 0;
    Sizes bucket_sizes;
    if (actual.any()) {
        const graphed::Bucket b = c->sig.buckets2.empty()
                                      ? s.session->bucket_of(uint32_t(index_), uint64_t(actual.n))
                                      : s.session->bucket_of(uint32_t(index_), uint64_t(actual.n), uint64_t(actual.n2));
        bucket = b.index;
        bucket_sizes = Sizes{int64_t(b.size), int64_t(b.size2)};
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor& x = inputs[i];
        const Meta& m = c->sig.in[i];
        if (!x.defined()) throw std::invalid_argument("graphed callable '" + c->name + "': " + c->input_name(i) + " is None");
        const bool rg = x.requires_grad();
        const bool dyn = actual.any() && c->sig.in_dyn[i];
        if ((dyn ? !same_but(x, m, c->sig.in_dims[i]) : x.sizes() != at::IntArrayRef(m.sizes)) ||
            x.scalar_type() != m.dtype || !x.is_cuda() ||
            x.device().index() != s.device || (grad_mode && rg && !m.requires_grad))
            throw std::invalid_argument("graphed callable '" + c->name + "': " + c->input_name(i) + " is " + describe(x) +
                                        "; it was captured with " +
                                        describe(m.sizes, m.dtype, "cuda:" + std::to_string(s.device),
                                                 grad_mode ? m.requires_grad : rg));
        needs_grad = needs_grad || rg;
        read.push_back(x.is_contiguous() ? x : x.contiguous());
        data[i] = read.back().data_ptr();
    }
    // The parameters: unchanged, the replay is given none (NULL); moved,
    // their new addresses, which graphed follows or refuses.
    std::vector<const void*> moved_to;
    const bool moved = params_now(s, *c, microbatch_, moved_to);
    // Where accumulated grads go, looked up before anything is enqueued.
    std::vector<at::Tensor> dsts;
    if (grad_mode && !s.opts.accumulate_into.empty()) dsts = accumulate_dsts(s, *c, microbatch_, on);
    cudaStream_t cur = c10::cuda::getCurrentCUDAStream(s.device).stream();
    cudaStream_t launch = cur, side = nullptr;
    const bool other = on.stream && on.stream->stream() != cur;
    if (other && on.join_event) {
        cuda_check(cudaEventRecord(s.route.ev_replay, cur), "cudaEventRecord");
        cuda_check(cudaStreamWaitEvent(on.stream->stream(), s.route.ev_replay, 0), "cudaStreamWaitEvent");
        launch = on.stream->stream();
    } else if (other) {
        side = on.stream->stream();
    }
    const size_t key = pass_key(c->per_mb[microbatch_].ids.at(bucket), Pass::Forward);
    s.before_replay(key, launch);
    graphed::Replay r = replay_of(index_, microbatch_, launch, side, &data);
    if (moved) r.params(moved_to);
    if (actual.n) r.size(uint64_t(actual.n));
    if (actual.n2) r.size2(uint64_t(actual.n2));
    std::vector<graphed::Ref> refs;
    try {
        s.replay(index_, microbatch_, [&](graphed::Session& session) { session.forward(r, refs); });
    } catch (const graphed::Error& e) {
        if (e.status() != GRAPHED_STATUS_PARAM_MOVED) throw;
        // Nothing was enqueued: the generators go back to where they were.
        s.rng.unwind(key);
        param_refused(s, *c, microbatch_, moved_to, e);
    }
    if (launch != cur) cuda_check(cudaStreamWaitEvent(cur, on.join_event, 0), "cudaStreamWaitEvent (cuda_graph_event)");
    std::vector<at::Tensor> result;
    result.reserve(refs.size());
    std::vector<Meta> buf;
    // Outputs of the actual sizes, where the bucket's buffer holds them.
    const std::vector<Meta>& outs = Callable::returned(c->sig.out, c->sig.out_dims, actual, bucket_sizes, buf);
    for (size_t i = 0; i < refs.size(); ++i)
        result.push_back(s.wrap_alias(
            refs[i], outs[i], [&] { return c->who(microbatch_) + "output " + std::to_string(i); }, shared_));

    // Autograd: the outputs' grad_fn is a GraphedBackward node whose next
    // edges are the inputs and the parameters, as a custom Function's would.
    for (const at::Tensor& p : c->params) needs_grad = needs_grad || p.requires_grad();
    if (grad_mode && needs_grad) {
#if GRAPHED_TORCH_INTRUSIVE_NODES
        auto node = c10::make_intrusive<GraphedBackward>();
#else
        auto node = std::shared_ptr<GraphedBackward>(new GraphedBackward(), torch::autograd::deleteNode);
#endif
        node->shared = shared_;
        node->index = index_;
        node->microbatch = microbatch_;
        node->actual = actual;
        node->bucket = bucket;
        node->bucket_sizes = bucket_sizes;
        if (other) node->side = on.stream;
        // Rebound inputs are read by the backward where they are: kept
        // alive until then, with their versions (as autograd's saved
        // tensors are).
        if (s.opts.rebind_inputs) {
            const std::vector<bool>& rebound = c->per_mb[microbatch_].rebound;
            for (size_t i = 0; i < read.size(); ++i)
                node->held.emplace_back(rebound[i] ? read[i] : at::Tensor(), rebound[i] ? read[i]._version() : 0u);
        }
        // The parameters' memory, until the backward (and the weight-grad
        // pass) has read it.
        node->params_held.reserve(c->params.size());
        for (const at::Tensor& p : c->params) node->params_held.push_back(p.storage());
        if (c->wgrad) {
            c->per_mb[microbatch_].wgrad_keep = node->params_held;
            c->per_mb[microbatch_].wgrad_dsts = dsts;
        }
        node->dsts = std::move(dsts);
        // The current parameters (params_now refreshed them): a parameter
        // replaced since capture gets its grad, not the one registered.
        node->set_next_edges(torch::autograd::collect_next_edges(inputs, c->params));
        for (size_t i = 0; i < result.size(); ++i)
            if (c->sig.out[i].requires_grad) torch::autograd::set_history(result[i], node);
    }
    return result;
}

void GraphedCallable::backward_dw() const {
    Shared& s = *shared_;
    Callable* c = s.callables[index_].get();
    if (!c->wgrad) return;
    s.check_live(*c);
    cudaStream_t cur = c10::cuda::getCurrentCUDAStream(s.device).stream();
    std::vector<at::Tensor> fresh = s.fresh_grads(*c);
    const size_t key = pass_key(c->per_mb[microbatch_].ids.at(0), Pass::Wgrad);
    s.before_replay(key, cur);
    graphed::Replay r = replay_of(index_, microbatch_, cur, nullptr, nullptr);
    const std::vector<void*> dst_ptrs = pointers_of(fresh.empty() ? c->per_mb[microbatch_].wgrad_dsts : fresh);
    if (!dst_ptrs.empty()) r.param_dsts(dst_ptrs);
    std::vector<graphed::Ref> gp;
    s.replay_or_unwind(key, index_, microbatch_, [&](graphed::Session& session) { session.wgrad(r, gp); });
    // Enqueued: the caching allocator orders a later reuse of this memory
    // after it on the stream.
    c->per_mb[microbatch_].wgrad_keep.clear();
    c->per_mb[microbatch_].wgrad_dsts.clear();
    // Accumulated into param.grad as AccumulateGrad would.
    at::NoGradGuard no_grad;
    for (size_t j = 0; j < gp.size(); ++j) {
        at::Tensor g = j < fresh.size() && fresh[j].defined() ? std::move(fresh[j])
                                                              : s.param_grad(*c, j, microbatch_, gp[j], shared_);
        if (!g.defined()) continue;
        at::Tensor& grad = c->params[j].mutable_grad();
        if (grad.defined())
            grad.add_(g);
        else
            grad = g;
    }
}

bool GraphedCallable::has_backward_dw() const { return shared_->callables[index_]->wgrad; }

void GraphedCallable::reset() const {
    c10::cuda::CUDAGuard guard(shared_->device);
    shared_->reset();
}

bool GraphedCallable::is_reset() const { return shared_->is_reset; }

void GraphedCallable::release() const { shared_->release_callable(index_); }

bool GraphedCallable::is_released() const { return shared_->is_reset || shared_->callables[index_]->released; }

const std::vector<at::Tensor>& GraphedCallable::params() const { return shared_->callables[index_]->params; }

const std::string& GraphedCallable::accumulate_into() const { return shared_->opts.accumulate_into; }

std::vector<bool> GraphedCallable::params_movable() const {
    if (shared_->is_reset) return std::vector<bool>(params().size(), false);
    return shared_->session->params_movable(uint32_t(index_), microbatch_);
}

std::string GraphedCallable::input_name(size_t i) const { return shared_->callables[index_]->input_name(i); }

const std::vector<int64_t>& GraphedCallable::bucket_sizes() const { return shared_->callables[index_]->sig.buckets; }
const std::vector<int64_t>& GraphedCallable::bucket_sizes2() const { return shared_->callables[index_]->sig.buckets2; }

GraphedCallable GraphedCallable::for_microbatch(uint32_t microbatch) const {
    if (microbatch >= shared_->microbatches)
        throw std::out_of_range("graphed callable '" + shared_->callables[index_]->name + "' has " +
                                std::to_string(shared_->microbatches) + " microbatch(es), not " +
                                std::to_string(microbatch + 1));
    return GraphedCallable(shared_, index_, microbatch);
}

uint32_t GraphedCallable::microbatches() const { return shared_->microbatches; }

graphed_session_stats GraphedCallable::stats() const {
    if (shared_->is_reset) return graphed_session_stats_default();
    return shared_->session->stats();
}

bool GraphedCallable::lazy_clones() const { return shared_->fresh; }

std::string GraphedCallable::plan() const { return shared_->is_reset ? std::string() : shared_->session->plan_dump(); }
std::string GraphedCallable::export_dot() const {
    return shared_->is_reset ? std::string() : shared_->session->export_dot();
}

std::string library_version() { return graphed::version(); }
std::string header_version() { return GRAPHED_VERSION_STRING; }

}  // namespace graphed_torch
