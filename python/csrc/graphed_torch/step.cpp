// graphed for libtorch: a training step in one launch. make_graphed_step
// captures a chain of callables and its loss as usual (each one still
// callable on its own) and declares them as one graphed step over N
// microbatches, with the data inputs copied in from staging tensors and
// each microbatch's loss copied out. While the step's graph is captured
// (between the step's capture hooks: private pool routed, generators
// graph-safe), the callbacks carry the chain themselves: callable k+1
// reads callable k's outputs, callable k's backward the grads callable
// k+1 computed for them, the loss's backward is seeded with ones; the
// parameter grads go to the buffers graphed hands over, which graphed
// adds into each parameter's destination (ACCUMULATE_INTO). GraphedStep
// replays it: data copied into the staging, the generators advanced,
// one launch.
#include "internal.h"

#include <c10/cuda/CUDAGuard.h>
#include <algorithm>
#include <torch/autograd.h>

namespace graphed_torch {

namespace {

std::string data_name(const Shared& s, const StepState::Data& d) {
    const Callable& c = *s.callables[d.callable];
    return "callable '" + c.name + "': " + c.input_name(d.input);
}

// The step's capture hook: before its capture (when 0) the private pool
// and the generators are set up as around any captured pass; after it
// (when 1) they go back and what the step draws is recorded.
int32_t step_hook(uint32_t when, void* self) {
    auto* s = static_cast<Shared*>(self);
    StepState& st = *s->step;
    try {
        if (when == 0) {
            // The key after every captured pass's (the callables' passes
            // were captured before the step).
            st.rng_key = s->pass_keys_end();
            st.outs.assign(s->callables.size(), {});
            st.gins.assign(s->callables.size(), {});
            s->rng.begin(s->device);
            s->begin_routing();
            st.capturing = true;
        } else {
            st.capturing = false;
            st.stream.store(nullptr);
            s->end_routing();
            s->rng.end(st.rng_key);
            st.outs.clear();
            st.gins.clear();
            for (auto& c : s->callables)
                for (Instance& in : c->per_mb) in.tape = Tape();
        }
        return 0;
    } catch (const std::exception& e) {
        st.capturing = false;
        st.error = e.what();
        return 1;
    }
}

// Checks the chain: callable k+1's first inputs are callable k's outputs
// (shape, dtype, and a grad where the output takes one); the loss is one
// output of one element. Returns per callable how many inputs are chained.
std::vector<size_t> chain_of(const Shared& s) {
    std::vector<size_t> chained(s.callables.size(), 0);
    for (size_t k = 1; k < s.callables.size(); ++k) {
        const Callable& prev = *s.callables[k - 1];
        const Callable& c = *s.callables[k];
        if (c.sig.in.size() < prev.sig.out.size())
            throw std::invalid_argument("make_graphed_step: callable '" + c.name + "' takes " + std::to_string(c.sig.in.size()) +
                                        " inputs; its first inputs must be the " + std::to_string(prev.sig.out.size()) +
                                        " outputs of callable '" + prev.name + "'");
        for (size_t i = 0; i < prev.sig.out.size(); ++i) {
            const Meta &o = prev.sig.out[i], &x = c.sig.in[i];
            if (o.sizes != x.sizes || o.dtype != x.dtype || o.requires_grad != x.requires_grad)
                throw std::invalid_argument(
                    "make_graphed_step: callable '" + c.name + "': " + c.input_name(i) + " is " +
                    describe(x.sizes, x.dtype, "cuda:" + std::to_string(s.device), x.requires_grad) + " but output " +
                    std::to_string(i) + " of callable '" + prev.name + "', which feeds it, is " +
                    describe(o.sizes, o.dtype, "cuda:" + std::to_string(s.device), o.requires_grad));
        }
        chained[k] = prev.sig.out.size();
    }
    const Callable& loss = *s.callables.back();
    size_t numel = 1;
    for (int64_t d : loss.sig.out.empty() ? std::vector<int64_t>{0} : loss.sig.out[0].sizes) numel *= size_t(d);
    if (loss.sig.out.size() != 1 || numel != 1)
        throw std::invalid_argument("make_graphed_step: the last callable ('" + loss.name +
                                    "') is the loss: it must return one tensor of one element; it returns " +
                                    std::to_string(loss.sig.out.size()) + " outputs" +
                                    (loss.sig.out.empty() ? "" : ", the first of " + std::to_string(numel) + " elements"));
    if (!loss.sig.out[0].requires_grad)
        throw std::invalid_argument("make_graphed_step: the loss ('" + loss.name + "') does not require grad");
    return chained;
}

// A phase of the step's update under its capture (`check`: the check, else
// the apply): the caller's function on graphed's stream (current for
// PyTorch, its allocations routed to the private pool), given the grads
// where the step put them, the scalar block and the skip flag. A failure
// is reported as a callback's: the torch operator and the caller's line.
int32_t run_update(const graphed_update_ctx* ctx, Shared* s, bool check) {
    StepState& st = *s->step;
    OperatorWatch watch;
    try {
        const auto& fn = check ? st.opts.update_check : st.opts.update_apply;
        if (!fn) throw std::logic_error("make_graphed_step: the step's update has no function for this phase");
        auto raw = static_cast<cudaStream_t>(ctx->stream);
        st.stream.store(raw);
        c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(raw, s->device));
        StepUpdateView v;
        v.slot = ctx->slot;
        size_t j = 0;
        for (auto& c : s->callables)
            for (const ParamInfo& info : c->param_info) {
                const bool has = info.grad && j < ctx->num_params && ctx->grads && ctx->grads[j];
                v.grads.push_back(has ? over(ctx->grads[j], info.meta, options_of(info.meta.dtype, s->device))
                                      : at::Tensor());
                ++j;
            }
        if (ctx->scalars && ctx->scalar_bytes)
            v.scalars = over(ctx->scalars, Meta{{int64_t(ctx->scalar_bytes)}, at::kByte}, options_of(at::kByte, s->device));
        if (check && ctx->skip_flag) v.skip_flag = over(ctx->skip_flag, Meta{{1}, at::kInt}, options_of(at::kInt, s->device));
        at::AutoGradMode no_grad(false);
        fn(v);
        return 0;
    } catch (const std::exception& e) {
        st.error = e.what();
        const std::string said = watch.report(std::current_exception(), e.what());
        (void)graphed_callback_fail_message(said.c_str());
        return 1;
    }
}

int32_t update_check(const graphed_update_ctx* ctx, void* self) { return run_update(ctx, static_cast<Shared*>(self), true); }
int32_t update_apply(const graphed_update_ctx* ctx, void* self) { return run_update(ctx, static_cast<Shared*>(self), false); }

// Declares the step: staging for each data input, the losses' copy out,
// each parameter's destination.
void declare_step(Shared& s) {
    StepState& st = *s.step;
    const uint32_t n = st.opts.microbatches;
    st.chained = chain_of(s);
    std::vector<graphed_step_io> io;
    for (size_t k = 0; k < s.callables.size(); ++k) {
        const Callable& c = *s.callables[k];
        for (size_t i = st.chained[k]; i < c.sig.in.size(); ++i) {
            std::vector<int64_t> shape{int64_t(n)};
            shape.insert(shape.end(), c.sig.in[i].sizes.begin(), c.sig.in[i].sizes.end());
            at::Tensor staging = at::zeros(shape, options_of(c.sig.in[i].dtype, s.device));
            io.push_back(graphed::Session::step_io(uint32_t(k), GRAPHED_BUFFER_ROLE_INPUT, uint32_t(i), staging.data_ptr(),
                                                   c.sig.in[i].bytes()));
            st.data.push_back({k, i, std::move(staging)});
        }
    }
    const Callable& loss = *s.callables.back();
    st.losses = at::zeros({int64_t(n)}, options_of(loss.sig.out[0].dtype, s.device));
    io.push_back(graphed::Session::step_io(uint32_t(s.callables.size() - 1), GRAPHED_BUFFER_ROLE_OUTPUT, 0,
                                           st.losses.data_ptr(), loss.sig.out[0].bytes()));
    std::vector<void*> dsts;
    std::vector<uint32_t> callables;
    for (auto& c : s.callables) {
        callables.push_back(uint32_t(c->index));
        for (size_t j = 0; j < c->params.size(); ++j) {
            at::Tensor d;
            if (c->param_info[j].grad) {
                const at::Tensor& p = c->params[j];
                d = st.opts.destination(p);
                if (!d.defined() || !d.is_cuda() || d.device() != p.device() || d.scalar_type() != p.scalar_type() ||
                    d.sizes() != p.sizes() || !d.is_contiguous())
                    throw std::invalid_argument("make_graphed_step: callable '" + c->name + "': parameter '" +
                                                c->param_name(j) + "': its ." + s.opts.accumulate_into + " is " +
                                                (d.defined() ? describe(d) : std::string("None")) +
                                                "; the step adds its grad into a contiguous tensor of its shape, dtype "
                                                "and device");
            }
            dsts.push_back(d.defined() ? d.data_ptr() : nullptr);
            st.dsts.push_back(std::move(d));
        }
    }
    // Before any capture: the graph reads it, the capture may not allocate.
    if (st.opts.loop)
        st.loop_inc = at::zeros({int64_t(std::max<size_t>(s.rng.entries.size(), 1))}, options_of(at::kLong, s.device));
    cuda_check(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    graphed::StepUpdate update;
    if (st.opts.update_apply) {
        update.check = st.opts.update_check ? &update_check : nullptr;
        update.apply = &update_apply;
        update.data = &s;
        update.scalar_bytes = st.opts.scalar_bytes;
    } else if (st.opts.update_check || st.opts.scalar_bytes) {
        throw std::invalid_argument("make_graphed_step: an update check or scalar block needs an update (update_apply)");
    }
    st.index = s.session->add_step(callables, dsts, n, io,
                                   st.opts.loop ? GRAPHED_STEP_LOOP_WHILE : GRAPHED_STEP_LOOP_UNROLLED, step_hook, &s,
                                   update);
}

// Whether pass `key` draws random numbers (its own capture recorded draws).
bool draws(const Shared& s, size_t key) { return key < s.rng.passes.size() && s.rng.passes[key].device.defined(); }

// After capture: a looped step that draws learns what one microbatch draws
// (the body's increments), which each iteration adds to the offsets its
// kernels read (step_forward), so that every microbatch draws its own.
void check_captured(Shared& s) {
    StepState& st = *s.step;
    if (!st.opts.loop) return;
    if (draws(s, st.rng_key) != st.loop_offsets.defined())
        throw std::logic_error(std::string("make_graphed_step: the looped step's microbatch ") +
                               (st.loop_offsets.defined() ? "drew no random numbers where its passes' own captures did"
                                                          : "drew random numbers where its passes' own captures drew none"));
    if (!st.loop_offsets.defined()) return;
    const std::vector<uint64_t>& inc = s.rng.passes[st.rng_key].increments;
    std::vector<int64_t> host(inc.begin(), inc.end());
    st.loop_inc.copy_(at::tensor(host, at::kLong));
}

// A callback of `c` in the step's capture: `fn(s, st, k)` (k: the
// callable's place in the chain) runs on graphed's stream itself, current
// for PyTorch, its allocations routed to the private pool: no fork to the
// work stream and back, which a looped step's body (captured on a stream
// of its own, while the outer capture is open) may not hold. An exception
// fails the callback with its message.
int32_t in_step(const graphed_pass_ctx* ctx, Callable* c,
                const std::function<void(Shared& s, StepState& st, size_t k)>& fn) {
    Shared& s = *c->shared;
    return guarded(c, [&] {
        auto raw = static_cast<cudaStream_t>(ctx->stream);
        s.step->stream.store(raw);
        s.rng.enter(raw);
        c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(raw, s.device));
        fn(s, *s.step, c->index);
    });
}

}  // namespace

int32_t step_forward(const graphed_pass_ctx* ctx, Callable* c) {
    return in_step(ctx, c, [&](Shared& s, StepState& st, size_t k) {
        if (k == 0 && st.opts.loop && s.rng.open_device.defined()) {
            // The first op of a looped step's microbatch, when its passes draw
            // random numbers: the offsets move on by one microbatch's draws
            // (the prologue wrote them one microbatch back). Kept with the
            // step: the graph writes this memory at every replay.
            bool any = false;
            for (size_t key = 0; key < st.rng_key; ++key) any = any || draws(s, key);
            if (any) {
                st.loop_offsets = s.rng.open_device;
                st.loop_offsets.view({-1, 2}).select(1, 1).add_(st.loop_inc);
            }
        }
        std::vector<at::Tensor> ins = wrap_static(ctx->inputs, c->sig.in, s.device, true);
        for (size_t i = 0; i < st.chained[k]; ++i)
            ins[i] = st.outs[k - 1].at(i).detach().requires_grad_(c->sig.in[i].requires_grad);
        std::vector<at::Tensor> outs = c->run_forward(ins);
        if (k + 1 == s.callables.size()) {
            at::AutoGradMode no_grad(false);
            over(ctx->outputs[0], c->sig.out[0], options_of(c->sig.out[0].dtype, s.device)).copy_(outs[0]);
        }
        st.outs[k] = outs;
        c->per_mb[0].tape = Tape{std::move(ins), std::move(outs)};
    });
}

int32_t step_backward(const graphed_pass_ctx* ctx, Callable* c) {
    return in_step(ctx, c, [&](Shared& s, StepState& st, size_t k) {
        const bool last = k + 1 == s.callables.size();
        std::vector<at::Tensor> gouts(c->sig.out.size());
        for (size_t i = 0; i < c->sig.out.size(); ++i) {
            const Meta& m = c->sig.out[i];
            if (!m.requires_grad) continue;
            at::Tensor g = last ? at::Tensor() : st.gins[k + 1].at(i);
            // The loss's seed: ones, or the loss scale (eager's
            // scaler.scale(loss).backward() seeds the loss with it).
            const at::Tensor& seed = st.opts.loss_seed;
            gouts[i] = g.defined() ? g
                       : last && seed.defined() ? seed.reshape(m.sizes).to(m.dtype)
                                              : in_layout((last ? at::ones(m.sizes, options_of(m.dtype, s.device))
                                                                : at::zeros(m.sizes, options_of(m.dtype, s.device))),
                                                          m);
        }
        std::vector<at::Tensor> grads = c->run_backward(c->per_mb[0].tape, gouts, k > 0, true, false, false);
        st.gins[k].assign(grads.begin(), grads.begin() + int64_t(c->sig.in.size()));
        at::AutoGradMode no_grad(false);
        for (size_t j = 0; j < c->params.size(); ++j)
            if (c->param_info[j].grad) {
                if (!ctx->param_grads || !ctx->param_grads[j])
                    throw std::runtime_error("graphed gave no buffer for parameter '" + c->param_name(j) +
                                             "'s grad in the step's capture");
                over(ctx->param_grads[j], c->param_info[j].meta, options_of(c->param_info[j].meta.dtype, s.device))
                    .copy_(grads[c->sig.in.size() + j]);
            }
    });
}

std::pair<std::vector<GraphedCallable>, GraphedStep> make_graphed_step(std::vector<CallableSpec> specs, const Options& o,
                                                                        const StepOptions& step) {
    if (o.accumulate_into.empty())
        throw std::invalid_argument("make_graphed_step: the step adds parameter grads into a destination: set "
                                    "Options::accumulate_into (\"grad\", \"main_grad\", ...)");
    if (!step.destination) throw std::invalid_argument("make_graphed_step: StepOptions::destination is not set");
    if (!o.schedule.empty()) throw std::invalid_argument("make_graphed_step: a step takes no pipeline schedule");
    if (!o.training) throw std::invalid_argument("make_graphed_step: a step trains (Options::training)");
    if (step.microbatches == 0 || step.microbatches > GRAPHED_STEP_MAX_MICROBATCHES)
        throw std::invalid_argument("make_graphed_step: microbatches is " + std::to_string(step.microbatches) +
                                    "; a step holds 1 to " + std::to_string(GRAPHED_STEP_MAX_MICROBATCHES));
    Options opts = o;
    // The step's io copies fill the data inputs' static buffers.
    opts.rebind_inputs = false;
    auto declare = [&step](Shared& s) {
        s.step = std::make_unique<StepState>();
        s.step->opts = step;
        declare_step(s);
    };
    std::shared_ptr<Shared> shared = make_session(std::move(specs), opts, declare, check_captured);
    std::vector<GraphedCallable> callables;
    for (size_t i = 0; i < shared->callables.size(); ++i) callables.emplace_back(shared, i);
    return {std::move(callables), GraphedStep(shared)};
}

at::Tensor GraphedStep::operator()(const std::vector<at::Tensor>& data, uint32_t n, const void* scalars,
                                   size_t scalar_bytes) const {
    Shared& s = *shared_;
    if (s.is_reset) throw std::runtime_error("graphed step: its session was reset");
    for (const auto& c : s.callables)
        if (c->released)
            throw std::runtime_error("graphed step: its callable '" + c->name +
                                     "' was released, and the step's graphs with it; make the step again");
    StepState& st = *s.step;
    const uint32_t max = st.opts.microbatches;
    if (n == 0) n = max;
    if (n > max || (!st.opts.loop && n != max))
        throw std::invalid_argument("graphed step: " + std::to_string(n) + " microbatches asked; the step " +
                                    (st.opts.loop ? "runs 1 to " : "runs exactly ") + std::to_string(max) +
                                    (st.opts.loop ? "" : " (make it with loop=True to vary the count)"));
    if (data.size() != st.data.size())
        throw std::invalid_argument("graphed step takes " + std::to_string(st.data.size()) + " data inputs, got " +
                                    std::to_string(data.size()));
    c10::cuda::CUDAGuard guard(s.device);
    // Every check before anything is enqueued.
    const bool flat = max == 1 && !st.opts.loop;
    for (size_t d = 0; d < data.size(); ++d) {
        const at::Tensor& x = data[d];
        const Meta& m = s.callables[st.data[d].callable]->sig.in[st.data[d].input];
        std::vector<int64_t> want{int64_t(n)};
        want.insert(want.end(), m.sizes.begin(), m.sizes.end());
        const bool shape_ok = x.defined() && (x.sizes() == at::IntArrayRef(want) || (flat && x.sizes() == at::IntArrayRef(m.sizes)));
        if (!shape_ok || x.scalar_type() != m.dtype || !x.is_cuda() || x.device().index() != s.device)
            throw std::invalid_argument("graphed step: " + data_name(s, st.data[d]) + " is " +
                                        (x.defined() ? describe(x) : std::string("None")) + "; the step takes " +
                                        describe(want, m.dtype, "cuda:" + std::to_string(s.device), false) +
                                        (flat ? " (or without the leading 1)" : "") + ": one block per microbatch");
    }
    // The parameters where they are now (each checked as a call checks it).
    std::vector<const void*> where;
    for (auto& c : s.callables) {
        check_params(s, *c, 0);
        for (const at::Tensor& p : c->params) where.push_back(p.data_ptr());
    }
    cudaStream_t cur = c10::cuda::getCurrentCUDAStream(s.device).stream();
    // The staging is read by the last replay, perhaps on another stream.
    cuda_check(cudaStreamWaitEvent(cur, st.done, 0), "cudaStreamWaitEvent");
    for (size_t d = 0; d < data.size(); ++d) {
        const at::Tensor& x = data[d];
        if (x.is_contiguous())  // one copy call (the usual case)
            cuda_check(cudaMemcpyAsync(st.data[d].staging.data_ptr(), x.data_ptr(), size_t(x.nbytes()),
                                       cudaMemcpyDeviceToDevice, cur),
                       "cudaMemcpyAsync (a step's data)");
        else
            st.data[d].staging.narrow(0, 0, n).view(x.sizes()).copy_(x, /*non_blocking=*/true);
    }
    // An unrolled step's draws are those of all its microbatches; a looped
    // one's of one, run n times.
    const uint32_t times = st.opts.loop ? n : 1;
    s.rng.prologue(st.rng_key, cur, times, st.opts.loop);
    std::vector<graphed::Ref> refs;
    try {
        s.session->step(st.index, cur, refs, where, st.opts.loop ? n : 0, scalars, scalar_bytes);
    } catch (const graphed::Error& e) {
        s.rng.unwind(st.rng_key, times);
        if (e.status() == GRAPHED_STATUS_PARAM_MOVED) throw ParamMoved("graphed step: " + std::string(e.what()));
        throw;
    }
    cuda_check(cudaEventRecord(st.done, cur), "cudaEventRecord");
    return st.losses.narrow(0, 0, n).clone();
}

StepSkipped GraphedStep::skipped() const {
    Shared& s = *shared_;
    if (s.is_reset || !s.step) throw std::runtime_error("graphed step: its session was reset");
    if (!s.step->opts.update_check)
        throw std::invalid_argument("graphed step: it has no update check (a grad scaler), so it never skips its update");
    graphed::Skipped k = s.session->skipped(s.step->index);
    return StepSkipped{k.last, k.total};
}

std::vector<at::Tensor> GraphedStep::destinations() const { return shared_->step ? shared_->step->dsts : std::vector<at::Tensor>{}; }

uint32_t GraphedStep::microbatches() const { return shared_->step ? shared_->step->opts.microbatches : 0; }

}  // namespace graphed_torch
