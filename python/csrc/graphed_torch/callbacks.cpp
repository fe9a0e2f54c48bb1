// graphed for libtorch: graphed's callbacks. The forward and backward
// bodies (libtorch ops on the work stream; shared with discovery), the
// forward, backward and weight-grad callbacks that run them during warmup
// and capture and hand their outputs and grads to graphed as external
// buffers, and the hooks around each pass (the user's hooks, graph-safe
// generators and the private pool around each capture, buffer reuse's
// releases after it).
#include "internal.h"

#include <c10/cuda/CUDAGuard.h>
#include <torch/autograd.h>

namespace graphed_torch {

// ---- forward and backward bodies, shared by discovery and the callbacks -----------------

std::vector<at::Tensor> Callable::run_forward(const std::vector<at::Tensor>& ins, Sizes bucket) {
    at::AutoGradMode mode(shared->opts.training);
    std::vector<at::Tensor> outs = caller.forward(ins);
    // The outputs this bucket must give (the first warmup iteration's, with
    // the bucket's sizes where they follow them).
    std::vector<Meta> buf;
    const std::vector<Meta>& want = sized(sig.out, sig.out_dims, bucket, buf);
    if (sig.outputs_known && outs.size() != sig.out.size())
        throw std::runtime_error("callable '" + name + "' returned " + std::to_string(outs.size()) + " outputs; it returned " +
                                 std::to_string(sig.out.size()) + " in the first warmup iteration");
    for (size_t i = 0; i < outs.size(); ++i) {
        if (!outs[i].defined()) throw std::runtime_error("callable '" + name + "': output " + std::to_string(i) + " is None");
        if (!outs[i].is_cuda() || outs[i].device().index() != shared->device)
            throw std::runtime_error("callable '" + name + "': output " + std::to_string(i) + " is on " +
                                     outs[i].device().str() + ", not cuda:" + std::to_string(shared->device));
        if (sig.outputs_known && (outs[i].sizes() != at::IntArrayRef(want[i].sizes) ||
                              outs[i].scalar_type() != want[i].dtype || outs[i].requires_grad() != want[i].requires_grad))
            throw std::runtime_error("callable '" + name + "': output " + std::to_string(i) + " is " + describe(outs[i]) +
                                     (bucket.any() ? "; in bucket " + std::to_string(bucket.n) +
                                                          (bucket.n2 ? " x " + std::to_string(bucket.n2) : std::string()) + " it must be "
                                                    : "; in the first warmup iteration it was ") +
                                     describe(want[i].sizes, want[i].dtype, outs[i].device().str(), want[i].requires_grad));
        // The first warmup iteration's layout (dense), later ones in it.
        if (sig.outputs_known)
            outs[i] = in_layout(outs[i], want[i]);
        else if (!outs[i].is_non_overlapping_and_dense())
            outs[i] = outs[i].contiguous();
    }
    return outs;
}

// Grads of the registered inputs (`inputs`) and parameters (`params`) from
// the tape; during discovery, of every input and parameter that requires
// grad. Returns one entry per input, then per parameter (undefined: none).
std::vector<at::Tensor> Callable::run_backward(Tape& tape, const std::vector<at::Tensor>& gouts, bool inputs,
                                               bool params_too, bool retain, bool discover) {
    std::vector<at::Tensor> result(sig.in.size() + params.size());
    std::vector<at::Tensor> roots, grads_in, wrt;
    std::vector<size_t> slot;
    for (size_t i = 0; i < sig.out.size(); ++i)
        if (sig.out[i].requires_grad) {
            roots.push_back(tape.outputs.at(i));
            grads_in.push_back(gouts.at(i));
        }
    if (inputs)
        for (size_t i = 0; i < sig.in.size(); ++i)
            if (discover ? sig.in[i].requires_grad : bool(sig.in_grad[i])) {
                wrt.push_back(tape.inputs.at(i));
                slot.push_back(i);
            }
    if (params_too)
        for (size_t j = 0; j < params.size(); ++j)
            if (discover ? params[j].requires_grad() : param_info[j].grad) {
                wrt.push_back(params[j]);
                slot.push_back(sig.in.size() + j);
            }
    if (roots.empty() || wrt.empty()) {
        if (!retain) tape = Tape();
        return result;
    }
    std::vector<at::Tensor> grads = torch::autograd::grad(roots, wrt, grads_in, retain, /*create_graph=*/false,
                                                          /*allow_unused=*/true);
    for (size_t k = 0; k < grads.size(); ++k) {
        size_t s = slot[k];
        if (grads[k].defined()) {
            result[s] = grads[k].contiguous();
        } else if (!discover) {
            std::string who = s < sig.in.size() ? "input '" + input_name(s) + "'" : "parameter '" + param_name(s - sig.in.size()) + "'";
            throw std::runtime_error("callable '" + name + "': " + who +
                                     " got no gradient in this pass, but got one in the first warmup iteration "
                                     "(the inputs and parameters that take grads must not change between iterations)");
        }
    }
    if (!retain) tape = Tape();
    return result;
}

// ---- graphed's callbacks ---------------------------------------------------------------------

int32_t guarded(Callable* c, const std::function<void()>& body) {
    OperatorWatch watch;
    try {
        body();
        return 0;
    } catch (const std::exception& e) {
        c->error = e.what();
        const std::string said = watch.report(std::current_exception(), e.what());
        (void)graphed_callback_fail_message(said.c_str());
        return 1;
    }
}

namespace {

// The hook event of the pass `ctx` describes, before or after it.
HookEvent hook_event(const graphed_pass_ctx* ctx, bool before) {
    HookEvent e;
    e.before = before;
    e.pass = Pass(ctx->pass);
    e.capture = ctx->phase == GRAPHED_PHASE_CAPTURE;
    e.microbatch = ctx->microbatch;
    return e;
}

// The sizes of the pass's bucket (none without buckets).
Sizes bucket_of(const graphed_pass_ctx* ctx) {
    return ctx->num_buckets ? Sizes{int64_t(ctx->bucket_size), int64_t(ctx->bucket_size2)} : Sizes{};
}

// Buckets at the memory of one shape: what a bucket's capture hands graphed
// as an external buffer (`t`, of that bucket's shape) goes into `home`, one
// buffer of `largest` shape that every bucket's graphs write, made by the
// first capture; the graph copies `t` there (one copy per pass), and `t`
// itself goes back to the private pool with the pass's other temporaries.
// Returns what to hand over. graphed reads a bucket's buffer as the
// bucket's contiguous tensor (its actual data rows of a pitch, the
// bucket's), so `t` goes to the home's first bytes as it is: for a tensor
// that follows the bucket on its first dimension these are its first rows
// (home.narrow(0, 0, n)); on another dimension, not home.narrow(d, 0, n),
// whose pitch is the largest bucket's. Where `largest` is empty the first
// capture's `t` is the home (parameter grads: every bucket's have one
// shape) and later ones are copied into it.
at::Tensor bucket_home(at::Tensor& home, const at::Tensor& t, const std::vector<int64_t>& largest) {
    if (!home.defined()) {
        if (largest.empty()) return home = t;
        home = at::empty(largest, t.options());
    }
    (largest.empty() ? home : home.view(-1).narrow(0, 0, t.numel()).view(t.sizes())).copy_(t);
    return home;
}

// Whether a bucketed callable's outputs and input grads share one buffer
// across its buckets: not under strict leases, which refuse a replay per
// bucket (docs/pytorch.md, "Shapes that change").
bool homes_io(const Shared& s, const graphed_pass_ctx* ctx) { return ctx->num_buckets > 1 && !s.opts.strict_leases; }

void set_buffer(const graphed_pass_ctx* ctx, graphed_buffer_role role, size_t index, const at::Tensor& t) {
    graphed::set_buffer(*ctx, role, index, t.data_ptr());
}

void backward_body(const graphed_pass_ctx* ctx, Callable* c, bool inputs, bool params) {
    Shared& s = *c->shared;
    const uint32_t mb = ctx->microbatch;
    const bool retain = (inputs && c->wgrad) || s.opts.retain_graph_in_backward;
    if (ctx->phase == GRAPHED_PHASE_CAPTURE) s.rng.enter(static_cast<cudaStream_t>(ctx->stream));
    s.on_work_stream(ctx->stream, [&] {
        c->pass.grads = c->run_backward(c->per_mb[mb].tape, c->pass.gouts, inputs, params, retain, false);
        if (ctx->phase != GRAPHED_PHASE_CAPTURE) return;
        Instance& inst = c->per_mb[mb];
        if (inputs)
            for (size_t i = 0; i < c->sig.in.size(); ++i)
                if (c->sig.in_grad[i]) {
                    at::Tensor g = c->pass.grads[i];
                    if (homes_io(s, ctx) && c->sig.in_dyn[i] && g.is_contiguous()) {
                        inst.home_gin.resize(c->sig.in.size());
                        g = bucket_home(inst.home_gin[i], g, c->sig.in[i].sizes);
                    }
                    set_buffer(ctx, GRAPHED_BUFFER_ROLE_GRAD_INPUT, i, g);
                    inst.ext_gin.push_back(g);
                }
        if (params) {
            // An earlier bucket's grads stay where its graphs write them.
            for (at::Tensor& g : c->per_mb[mb].ext_pgrad)
                if (g.defined()) c->per_mb[mb].bucket_pgrad.push_back(g);
            c->per_mb[mb].ext_pgrad.assign(c->params.size(), at::Tensor());
            // Fresh grads: which blocks of the pass each grad's memory shares.
            const bool watched = c->pass.watching;
            const std::vector<Watched> seen = watched ? watched_allocations(c) : std::vector<Watched>();
            c->pass.watching = false;
            for (size_t j = 0; j < c->params.size(); ++j)
                if (c->param_info[j].grad) {
                    at::Tensor g = c->pass.grads[c->sig.in.size() + j];
                    // With buckets, every bucket's graphs write one buffer
                    // per grad (the first capture's; alive since, it is the
                    // grad's alone in every later pass), except aliased
                    // grads, which a replay hands out.
                    const bool home = ctx->num_buckets > 1 && c->param_info[j].policy != GRAPHED_GRAD_POLICY_ALIAS;
                    inst.home_pgrad.resize(c->params.size());
                    const bool later = home && inst.home_pgrad[j].defined();
                    // Not the grad's alone: copied (in the graph) into memory
                    // that is, which graphed then points at each replay's
                    // destination.
                    const bool whole = g.storage_offset() == 0 && g.nbytes() == g.storage().nbytes();
                    if (!later && j < c->pass.spare.size() && c->pass.spare[j].defined() &&
                        !(watched && whole && alone(seen, g.data_ptr(), g.nbytes()))) {
                        c->pass.spare[j].copy_(g);
                        g = c->pass.spare[j];
                    }
                    if (home) g = bucket_home(inst.home_pgrad[j], g, {});
                    set_buffer(ctx, GRAPHED_BUFFER_ROLE_PARAM_GRADS, j, g);
                    inst.ext_pgrad[j] = g;
                }
        }
    });
}

}  // namespace

// Before each pass (outside capture): the user's hook, then, for a capture,
// graph-safe generators (entered under the capture's id by the pass's
// callback, where torch keys them so) and the private pool.
int32_t pre_hook(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    Shared& s = *c->shared;
    return guarded(c, [&] {
        if (ctx->param_policies)
            for (size_t j = 0; j < c->param_info.size() && j < ctx->num_params; ++j)
                c->param_info[j].policy = ctx->param_policies[j];
        const Pass pass = Pass(ctx->pass);
        const bool capture = ctx->phase == GRAPHED_PHASE_CAPTURE;
        if (!s.opts.training && pass != Pass::Forward) return;  // nothing runs
        HookEvent e = hook_event(ctx, true);
        const Sizes bucket = bucket_of(ctx);
        std::vector<Meta> buf;
        if (pass == Pass::Forward) {
            c->pass.inputs = wrap_static(ctx->inputs, Callable::sized(c->sig.in, c->sig.in_dims, bucket, buf), s.device, s.opts.training);
            e.inputs = &c->pass.inputs;
        } else {
            c->pass.gouts = wrap_static(ctx->grad_outputs, Callable::sized(c->sig.out, c->sig.out_dims, bucket, buf), s.device, false);
            e.grad_outputs = &c->pass.gouts;
        }
        if (c->caller.hook) s.on_work_stream(ctx->stream, [&] { c->call_hook(e); });
        // Fresh grads, the pass that writes them: memory of its own per grad
        // (made here, outside the private pool), and what the pool hands out
        // and frees during the pass recorded, to tell which grads share it.
        const bool grads = pass == (c->wgrad ? Pass::Wgrad : Pass::Backward);
        if (capture && grads && s.fresh) {
            c->pass.spare.assign(c->params.size(), at::Tensor());
            for (size_t j = 0; j < c->params.size(); ++j)
                if (c->param_info[j].grad && c->param_info[j].policy == GRAPHED_GRAD_POLICY_COPY_INTO) {
                    const Meta& m = c->param_info[j].meta;
                    c->pass.spare[j] = at::empty(m.sizes, options_of(m.dtype, s.device));
                }
            c->pass.watching = watch_allocations(c, s.device);
        }
        if (capture) {
            s.rng.begin(s.device);
            s.begin_routing();
        }
    });
}

// After each pass (outside capture): what the capture made stays in the pool,
// generators go back to eager use, buffers consumed are let go (reuse), then
// the user's hook.
int32_t post_hook(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    Shared& s = *c->shared;
    return guarded(c, [&] {
        const Pass pass = Pass(ctx->pass);
        const bool capture = ctx->phase == GRAPHED_PHASE_CAPTURE;
        if (!s.opts.training && pass != Pass::Forward) return;
        if (capture) {
            s.end_routing();
            // graphed's numbering of the instance and of the pass's place
            // in the capture order (the same for its clone slots' captures).
            std::vector<uint32_t>& ids = c->per_mb.at(ctx->microbatch).ids;
            if (ids.size() <= ctx->bucket) ids.resize(ctx->bucket + 1, ctx->instance);
            ids[ctx->bucket] = ctx->instance;
            s.rng.end(pass_key(ctx->instance, pass));
            if (s.opts.reuse_buffers && ctx->capture_position < s.capture.releases.size())
                for (const Release& r : s.capture.releases[ctx->capture_position]) s.release(r);
        }
        if (c->caller.hook) {
            HookEvent e = hook_event(ctx, false);
            if (pass == Pass::Forward) {
                e.inputs = &c->pass.inputs;
                e.outputs = &c->pass.outputs;
            } else {
                e.grad_outputs = &c->pass.gouts;
                e.grads = &c->pass.grads;
            }
            s.on_work_stream(ctx->stream, [&] { c->call_hook(e); });
        }
        // A watch its callback did not end (a failed pass) stops here.
        c->end_watch();
        c->end_pass();
    });
}

int32_t forward_cb(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    Shared& s = *c->shared;
    if (s.step && s.step->capturing) return step_forward(ctx, c);
    return guarded(c, [&] {
        const uint32_t mb = ctx->microbatch;
        if (ctx->phase == GRAPHED_PHASE_CAPTURE) s.rng.enter(static_cast<cudaStream_t>(ctx->stream));
        s.on_work_stream(ctx->stream, [&] {
            std::vector<at::Tensor> outs = c->run_forward(c->pass.inputs, bucket_of(ctx));
            if (ctx->phase == GRAPHED_PHASE_CAPTURE) {
                Instance& inst = c->per_mb[mb];
                for (size_t i = 0; i < outs.size(); ++i) {
                    at::Tensor y = outs[i].detach();
                    if (homes_io(s, ctx) && c->sig.out_dyn[i] && c->sig.out[i].strides.empty() && y.is_contiguous()) {
                        inst.home_out.resize(outs.size());
                        y = bucket_home(inst.home_out[i], y, c->sig.out[i].sizes);
                    }
                    set_buffer(ctx, GRAPHED_BUFFER_ROLE_OUTPUT, i, y);
                    inst.ext_out.push_back(y);
                }
            }
            // The tape is for the backward; in inference nothing reads it,
            // and the outputs go as soon as the pass ends.
            if (s.opts.training) c->per_mb[mb].tape = Tape{c->pass.inputs, outs};
            c->pass.outputs = std::move(outs);
        });
    });
}

int32_t backward_cb(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    if (!c->shared->opts.training) return 0;
    if (c->shared->step && c->shared->step->capturing) return step_backward(ctx, c);
    return guarded(c, [&] { backward_body(ctx, c, true, !c->wgrad); });
}

int32_t wgrad_cb(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    return guarded(c, [&] { backward_body(ctx, c, false, true); });
}

int32_t session_hook(uint32_t when, void* self) {
    auto* s = static_cast<Shared*>(self);
    if (when != 1 || !s->opts.post_warmup_hook) return 0;
    try {
        c10::cuda::CUDAStreamGuard guard(s->route.work);
        s->opts.post_warmup_hook();
        return 0;
    } catch (const std::exception& e) {
        s->capture.hook_error = e.what();
        return 1;
    }
}

}  // namespace graphed_torch
