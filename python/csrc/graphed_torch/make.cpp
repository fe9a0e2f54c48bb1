// graphed for libtorch: make_graphed_callables. Session setup (device, work
// stream, pool, generators, graphed's session config), discovery (the first
// warmup iteration, run here to learn the outputs and which inputs and
// parameters get grads), registration of each callable with graphed, and
// capture. What a session lets go of, and when, is teardown.cpp.
#include "internal.h"

#include <ATen/core/grad_mode.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

namespace graphed_torch {

namespace {

// Per sample input of `s`: the dimensions that follow its bucket sizes
// (dynamic_dims, dynamic_dims2; without dynamic_dims, the first for the
// inputs marked in dynamic_inputs).
std::vector<Dims> input_dims(const CallableSpec& s) {
    std::vector<Dims> dims(s.sample_inputs.size());
    for (size_t i = 0; i < dims.size(); ++i) {
        if (s.dynamic_dims.empty())
            dims[i].d1 = i < s.dynamic_inputs.size() && s.dynamic_inputs[i] ? 0 : -1;
        else if (i < s.dynamic_dims.size())
            dims[i].d1 = s.dynamic_dims[i];
        if (i < s.dynamic_dims2.size()) dims[i].d2 = s.dynamic_dims2[i];
    }
    return dims;
}

// Ascending sizes from 1.
void validate_sizes(const std::string& who, const std::vector<int64_t>& b, const char* what) {
    for (size_t k = 0; k < b.size(); ++k)
        if (b[k] < 1 || (k > 0 && b[k] <= b[k - 1]))
            throw std::invalid_argument(who + what + " must be 1 or more and strictly ascending");
}

// Buckets: ascending sizes from 1 (and a grid's second sizes), at least one
// dynamic input, each with the largest bucket as the size of the
// dimension that follows it.
void validate_buckets(const CallableSpec& s) {
    const std::string who = "callable '" + s.name + "': ";
    auto any_of = [](const std::vector<int64_t>& v) {
        return std::find_if(v.begin(), v.end(), [](int64_t d) { return d >= 0; }) != v.end();
    };
    if (s.bucket_sizes.empty()) {
        if (std::find(s.dynamic_inputs.begin(), s.dynamic_inputs.end(), true) != s.dynamic_inputs.end() ||
            any_of(s.dynamic_dims) || any_of(s.dynamic_dims2))
            throw std::invalid_argument(who + "dynamic inputs are marked, but it has no bucket_sizes");
        if (!s.bucket_sizes2.empty()) throw std::invalid_argument(who + "bucket_sizes2 without bucket_sizes");
        return;
    }
    const std::vector<int64_t>& b = s.bucket_sizes;
    const std::vector<int64_t>& b2 = s.bucket_sizes2;
    const size_t count = b.size() * std::max<size_t>(b2.size(), 1);
    if (count > GRAPHED_MAX_BUCKETS)
        throw std::invalid_argument(who + std::to_string(count) + " buckets; at most " +
                                    std::to_string(GRAPHED_MAX_BUCKETS));
    validate_sizes(who, b, "bucket sizes");
    validate_sizes(who, b2, "second bucket sizes");
    if (b.size() == 1 && b[0] == 1 && b2.empty())
        throw std::invalid_argument(who + "one bucket of size 1 is one shape: give no buckets");
    if (s.dynamic_dims.empty() && s.dynamic_inputs.size() != s.sample_inputs.size())
        throw std::invalid_argument(who + "dynamic_inputs has " + std::to_string(s.dynamic_inputs.size()) +
                                    " entries for " + std::to_string(s.sample_inputs.size()) + " inputs");
    for (const std::vector<int64_t>* v : {&s.dynamic_dims, &s.dynamic_dims2})
        if (!v->empty() && v->size() != s.sample_inputs.size())
            throw std::invalid_argument(who + "dynamic_dims has " + std::to_string(v->size()) + " entries for " +
                                        std::to_string(s.sample_inputs.size()) + " inputs");
    if (b2.empty() && any_of(s.dynamic_dims2))
        throw std::invalid_argument(who + "dynamic_dims2 without bucket_sizes2 (a grid)");
    const std::vector<Dims> dims = input_dims(s);
    bool any = false;
    for (size_t i = 0; i < s.sample_inputs.size(); ++i) {
        const Dims& d = dims[i];
        if (!d.any()) continue;
        any = true;
        const at::Tensor& x = s.sample_inputs[i];
        const std::string name = i < s.input_names.size() ? s.input_names[i] : "input " + std::to_string(i);
        if (d.d1 == d.d2)
            throw std::invalid_argument(who + name + " follows both bucket sizes on dimension " + std::to_string(d.d1));
        for (auto [dim, sizes] : {std::pair<int64_t, const std::vector<int64_t>*>{d.d1, &b}, {d.d2, &b2}}) {
            if (dim < 0) continue;
            if (dim >= x.dim() || x.size(dim) != sizes->back())
                throw std::invalid_argument(who + name + " is dynamic: its dimension " + std::to_string(dim) +
                                            " must be the largest bucket (" + std::to_string(sizes->back()) +
                                            "); it is " + describe(x));
        }
    }
    if (!any) throw std::invalid_argument(who + "it has buckets but no dynamic input");
}

void validate_specs(const std::vector<CallableSpec>& specs, c10::DeviceIndex device) {
    for (const CallableSpec& s : specs) {
        for (size_t i = 0; i < s.sample_inputs.size(); ++i) {
            const at::Tensor& x = s.sample_inputs[i];
            std::string who = "callable '" + s.name + "': " +
                              (i < s.input_names.size() ? s.input_names[i] : "input " + std::to_string(i));
            if (!x.defined()) throw std::invalid_argument(who + " is None");
            if (!x.is_cuda() || x.device().index() != device)
                throw std::invalid_argument(who + " is on " + x.device().str() + "; every sample must be on cuda:" +
                                            std::to_string(device));
        }
        for (const at::Tensor& p : s.params)
            if (!p.is_cuda() || p.device().index() != device)
                throw std::invalid_argument("callable '" + s.name + "': a parameter is on " + p.device().str() +
                                            ", not cuda:" + std::to_string(device));
        validate_buckets(s);
    }
}

// The first warmup iteration, run by the adapter in capture order on the
// samples: it learns each callable's outputs and which inputs and
// parameters get grads, before the callables are registered.
void discover(Shared& s, const std::vector<PassRef>& order) {
    std::vector<std::vector<Tape>> tapes(s.callables.size(), std::vector<Tape>(s.microbatches));
    std::vector<std::vector<std::vector<at::Tensor>>> gouts(s.callables.size(),
                                                            std::vector<std::vector<at::Tensor>>(s.microbatches));
    for (auto& c : s.callables) {
        c->sig.in_grad.assign(c->sig.in.size(), false);
        for (ParamInfo& p : c->param_info) p.grad = false;
    }
    c10::cuda::CUDAStreamGuard guard(s.route.work);
    for (const PassRef& p : order) {
        Callable* c = s.callables[p.callable].get();
        HookEvent e;
        e.pass = p.pass;
        e.microbatch = p.microbatch;
        if (p.pass == Pass::Forward) {
            std::vector<at::Tensor> ins;
            for (size_t i = 0; i < c->caller.samples.size(); ++i)
                ins.push_back(s.opts.training ? c->caller.samples[i].clone().requires_grad_(c->sig.in[i].requires_grad)
                                              : c->caller.samples[i].clone());
            e.inputs = &ins;
            c->call_hook(e);
            std::vector<at::Tensor> outs = c->run_forward(ins);
            if (!c->sig.outputs_known) {
                for (const at::Tensor& y : outs) c->sig.out.push_back(layout_of(y));
                c->sig.outputs_known = true;
            }
            e.before = false;
            e.outputs = &outs;
            c->call_hook(e);
            if (s.opts.training) tapes[p.callable][p.microbatch] = Tape{ins, outs};
            continue;
        }
        if (!s.opts.training) continue;
        auto& go = gouts[p.callable][p.microbatch];
        if (p.pass == Pass::Backward) {
            go.clear();
            for (const Meta& m : c->sig.out)
                go.push_back(m.requires_grad ? in_layout(at::zeros(m.sizes, options_of(m.dtype, s.device)), m) : at::Tensor());
        }
        e.grad_outputs = &go;
        c->call_hook(e);
        Tape& tape = tapes[p.callable][p.microbatch];
        const bool inputs = p.pass == Pass::Backward, params = p.pass == Pass::Wgrad || !c->wgrad;
        std::vector<at::Tensor> grads =
            c->run_backward(tape, go, inputs, params, (inputs && c->wgrad) || s.opts.retain_graph_in_backward, true);
        for (size_t i = 0; inputs && i < c->sig.in.size(); ++i) {
            if (grads[i].defined()) {
                c->sig.in_grad[i] = true;
            } else if (c->sig.in[i].requires_grad && !s.opts.allow_unused_input) {
                throw std::runtime_error("callable '" + c->name + "': " + c->input_name(i) +
                                         " requires grad but got no gradient in the first warmup iteration; pass "
                                         "allow_unused_input=True to accept that (its grad is then None)");
            }
        }
        for (size_t j = 0; params && j < c->params.size(); ++j)
            if (grads[c->sig.in.size() + j].defined()) c->param_info[j].grad = true;
        e.before = false;
        e.grads = &grads;
        c->call_hook(e);
    }
}

// Buckets: which outputs follow the bucket's sizes, and on which
// dimension, learnt by running the forward once more (no grad) per size on
// the samples' leading part at a smaller size of it (its smallest bucket,
// or with one bucket one less), the other size at its largest: a dimension
// of an output that changes with it must be that size.
void learn_dynamic_outputs(Shared& s, Callable& c) {
    c.sig.out_dyn.assign(c.sig.out.size(), false);
    c.sig.out_dims.assign(c.sig.out.size(), Dims());
    if (c.sig.buckets.empty()) return;
    for (int axis = 0; axis < (c.sig.buckets2.empty() ? 1 : 2); ++axis) {
        const std::vector<int64_t>& b = axis ? c.sig.buckets2 : c.sig.buckets;
        const int64_t largest = b.back(), probe = b.size() > 1 ? b.front() : largest - 1;
        if (probe < 1) continue;  // one bucket of size 1: nothing to learn
        std::vector<at::Tensor> ins;
        for (size_t i = 0; i < c.caller.samples.size(); ++i) {
            const int64_t d = axis ? c.sig.in_dims[i].d2 : c.sig.in_dims[i].d1;
            ins.push_back(d >= 0 ? c.caller.samples[i].narrow(d, 0, probe).clone() : c.caller.samples[i].clone());
        }
        std::vector<at::Tensor> outs;
        {
            c10::cuda::CUDAStreamGuard guard(s.route.work);
            at::AutoGradMode no_grad(false);
            outs = c.caller.forward(ins);
        }
        const std::string at_probe = std::to_string(probe) + (axis ? " as its second size" : c.sig.buckets2.empty() ? " rows" : " as its first size");
        if (outs.size() != c.sig.out.size())
            throw std::runtime_error("callable '" + c.name + "' returned " + std::to_string(outs.size()) + " outputs at " +
                                     at_probe + " and " + std::to_string(c.sig.out.size()) + " at " +
                                     std::to_string(largest));
        for (size_t i = 0; i < outs.size(); ++i) {
            Meta& m = c.sig.out[i];
            const at::IntArrayRef got = outs[i].sizes();
            if (got == at::IntArrayRef(m.sizes)) continue;
            int64_t follows = -1;
            bool ok = got.size() == m.sizes.size();
            for (size_t k = 0; ok && k < got.size(); ++k) {
                if (got[k] == m.sizes[k]) continue;
                ok = follows < 0 && m.sizes[k] == largest && got[k] == probe;
                follows = int64_t(k);
            }
            Dims& d = c.sig.out_dims[i];
            if (ok && (axis ? d.d1 : d.d2) == follows) ok = false;
            if (!ok)
                throw std::runtime_error("callable '" + c.name + "': output " + std::to_string(i) + " has shape " +
                                         describe(m.sizes, m.dtype, "cuda", m.requires_grad) + " at " +
                                         std::to_string(largest) + " and " + describe(outs[i]) + " at " + at_probe +
                                         ": with buckets, one dimension of an output is the bucket size, or none "
                                         "changes");
            (axis ? d.d2 : d.d1) = follows;
            c.sig.out_dyn[i] = true;
            m.strides.clear();  // contiguous in its bucket, whatever eager's layout
        }
    }
}

void register_callable(Shared& s, Callable& c) {
    const uint32_t m = s.microbatches;
    graphed::Callable d;
    // The shapes the descriptors point to, until registration copies them.
    std::vector<std::vector<int64_t>> shapes;
    shapes.reserve(c.sig.in.size() + c.sig.out.size());
    auto describe_tensor = [&](const Meta& meta, bool requires_grad, const void* sample, bool external, const Dims& dims) {
        bool exact = true;
        uint32_t code = dtype_code(meta.dtype, &exact);
        shapes.push_back(exact ? meta.sizes : std::vector<int64_t>{});
        // A dynamic tensor graphed knows as bytes: its shape, then the bytes
        // of an element.
        if (dims.any() && !exact) {
            shapes.back() = meta.sizes;
            shapes.back().push_back(int64_t(c10::elementSize(meta.dtype)));
        }
        graphed_tensor_desc t = graphed::tensor_desc(
            meta.bytes(), code, requires_grad, sample,
            (external ? GRAPHED_TENSOR_FLAGS_EXTERNAL : GRAPHED_TENSOR_FLAGS_NONE) | (dims.any() ? GRAPHED_TENSOR_FLAGS_DYNAMIC : 0u));
        t.ndim = uint32_t(shapes.back().size());
        t.shape = shapes.back().data();
        if (dims.any()) {
            t.dynamic_dim = dims.d1 >= 0 ? uint32_t(dims.d1) : GRAPHED_DIM_NONE;
            t.dynamic_dim2 = dims.d2 >= 0 ? uint32_t(dims.d2) : GRAPHED_DIM_NONE;
        }
        return t;
    };
    // Rebinding: inputs and incoming grads are read where they are, where
    // graphed verifies it (it copies the others, saying why). Not with a
    // delayed weight-grad pass, which reads them after the backward, when
    // autograd no longer keeps them. Nor with buckets, whose rows are
    // copied into each bucket's.
    const uint32_t rebind =
        s.opts.rebind_inputs && !c.wgrad && c.sig.buckets.empty() ? GRAPHED_TENSOR_FLAGS_REBIND : 0u;
    for (size_t i = 0; i < c.sig.in.size(); ++i) {
        d.inputs.push_back(describe_tensor(c.sig.in[i], c.sig.in_grad[i], c.caller.samples[i].data_ptr(), c.sig.in_grad[i], c.sig.in_dims[i]));
        d.inputs.back().flags |= rebind;
    }
    // Outputs that take a grad get one at backward.
    for (size_t o = 0; o < c.sig.out.size(); ++o) {
        const Meta& meta = c.sig.out[o];
        d.outputs.push_back(describe_tensor(meta, meta.requires_grad, nullptr, true, c.sig.out_dims[o]));
        if (meta.requires_grad) d.outputs.back().flags |= rebind;
    }
    d.buckets.assign(c.sig.buckets.begin(), c.sig.buckets.end());
    d.buckets2.assign(c.sig.buckets2.begin(), c.sig.buckets2.end());
    // Moving parameters: capture verifies, per parameter, that the graphs
    // can be pointed elsewhere; a call then follows a parameter it finds
    // at another address.
    const uint32_t movable = s.opts.rebind_params ? GRAPHED_PARAM_FLAGS_REBIND : 0u;
    for (size_t j = 0; j < c.params.size(); ++j) {
        const at::Tensor& p = c.params[j];
        bool exact = true;
        const bool grad = c.param_info[j].grad;
        // ACCUMULATE_INTO where asked (Options::accumulate_into), except
        // for parameters whose real grad is computed outside autograd
        // (DELAYED_WGRAD); else graphed decides (frozen at capture: see
        // ParamInfo::policy).
        const bool own_policy = grad && !(c.param_info[j].flags & GRAPHED_PARAM_FLAGS_DELAYED_WGRAD);
        const bool accumulate = own_policy && !s.opts.accumulate_into.empty();
        // Owned grads in fresh memory (Shared::fresh): written straight into
        // each replay's destination where capture verifies it.
        const bool fresh = own_policy && s.fresh;
        const uint32_t policy = accumulate ? (s.opts.copy_into ? uint32_t(GRAPHED_GRAD_POLICY_COPY_INTO)
                                                               : uint32_t(GRAPHED_GRAD_POLICY_ACCUMULATE_INTO))
                                : fresh    ? uint32_t(GRAPHED_GRAD_POLICY_COPY_INTO)
                                           : uint32_t(GRAPHED_GRAD_POLICY_DEFAULT);
        const uint32_t flags = c.param_info[j].flags | movable | (grad ? GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD : 0u) |
                               (fresh ? GRAPHED_PARAM_FLAGS_REBIND_GRAD : 0u);
        d.params.push_back(graphed::param_desc(p.data_ptr(), size_t(p.numel()) * size_t(p.element_size()),
                                               dtype_code(p.scalar_type(), &exact), policy, flags, grad));
        c.param_info[j].meta = Meta{p.sizes().vec(), p.scalar_type(), false};
        c.param_info[j].layout = meta_of(p);
        if (!p.is_contiguous()) c.param_info[j].layout.strides = p.strides().vec();
    }
    c.per_mb.assign(m, Instance());
    d.name = c.name;
    d.forward = forward_cb;
    d.backward = backward_cb;
    d.wgrad = c.wgrad ? wgrad_cb : nullptr;
    d.user_data = &c;
    d.pre_hook = pre_hook;
    d.post_hook = post_hook;
    d.hook_data = &c;
    s.session->add_callable(d);
}

// Which inputs capture verified as rebound (the others are copied).
void mark_rebound(Shared& s) {
    for (auto& c : s.callables)
        for (uint32_t m = 0; m < s.microbatches; ++m)
            c->per_mb[m].rebound = s.session->rebound(uint32_t(c->index), m, GRAPHED_BUFFER_ROLE_INPUT);
}

// graphed's session config for the options `o` of `s`.
// Whether a callback's error is a CUDA generator's refusal to draw under a
// capture it was not set up for (torch 2.11: "not in capture mode"; 2.12
// and later: no capture state, or no CUDAGraph, for the capture's id).
bool drew_unknown_generator(const std::string& error) {
    for (const char* text : {"not in capture mode", "could not find the CUDAGraph object", "capture state",
                             "capture_state"})
        if (error.find(text) != std::string::npos) return true;
    return false;
}

graphed_session_config config_of(Shared& s, const Options& o) {
    graphed_session_config cfg = graphed::session_config(GRAPHED_BACKEND_CUDA);
    cfg.device = s.device;
    cfg.warmup_iterations = uint32_t(std::max(o.num_warmup_iters - 1, 0));
    // Fresh grads are COPY_INTO by their own policy (register_callable).
    cfg.clone_param_grads_on_return = o.clone_param_grads_on_return ? 1u : 0u;
    cfg.strict_leases = o.strict_leases ? 1u : 0u;
    cfg.debug = o.debug ? 1u : 0u;
    // Warmup and capture on the work stream itself, so that the joins around
    // each callback are no-ops (the legacy default stream cannot capture:
    // then graphed's own stream, joined as before).
    if (s.route.work.stream() != nullptr) cfg.capture_stream = s.route.work.stream();
    // Clone slots capture the grad pass again without its hooks, so without
    // the private pool routed: off here (clones then copy out of the graph's
    // buffers, as with torch's allocator).
    cfg.clone_slots = 0;
    if (o.clones_from_torch_allocator) {
        cfg.clone_alloc = torch_alloc;
        cfg.clone_free = torch_free;
        cfg.allocator_ctx = &s;
    }
    cfg.warmup_hook = session_hook;
    cfg.warmup_hook_data = &s;
    if (!o.schedule.empty()) {
        cfg.schedule = o.schedule.data();
        cfg.num_schedule_steps = o.schedule.size();
        if (!o.layers_per_chunk.empty()) {
            cfg.layers_per_chunk = o.layers_per_chunk.data();
            cfg.num_layers_per_chunk = o.layers_per_chunk.size();
        }
    }
    cfg.reuse_buffers = o.reuse_buffers ? 1u : 0u;
    return cfg;
}

}  // namespace

std::shared_ptr<Shared> make_session(std::vector<CallableSpec> specs, const Options& o,
                                     const std::function<void(Shared&)>& declare,
                                     const std::function<void(Shared&)>& captured) {
    if (specs.empty()) throw std::invalid_argument("make_graphed_callables: no callables");
    auto shared = std::make_shared<Shared>();
    Shared& s = *shared;
    s.opts = o;
    s.device = c10::cuda::current_device();
    for (const CallableSpec& sp : specs)
        if (!sp.sample_inputs.empty() && sp.sample_inputs[0].defined() && sp.sample_inputs[0].is_cuda()) {
            s.device = sp.sample_inputs[0].device().index();
            break;
        }
    validate_specs(specs, s.device);
    c10::cuda::CUDAGuard device_guard(s.device);
    s.route.work = o.capture_stream ? *o.capture_stream : default_work_stream(s.device);
    if (s.route.work.device_index() != s.device)
        throw std::invalid_argument("capture_stream is on cuda:" + std::to_string(s.route.work.device_index()) +
                                    ", the samples on cuda:" + std::to_string(s.device));
    for (cudaEvent_t* e : {&s.route.ev_fork, &s.route.ev_join, &s.route.ev_replay})
        cuda_check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    s.route.pool = o.pool ? *o.pool : at::cuda::graph_pool_handle();
    s.rng.add(at::cuda::detail::getDefaultCUDAGenerator(s.device), s.device);
    for (const at::Generator& g : o.generators) s.rng.add(g, s.device);
    // Owned grads in fresh memory of PyTorch's allocator: where grads are
    // owned clones from it, in training, returned to autograd (not added
    // into an attribute, nor a step's), and the grad buffers are not let go
    // during capture (buffer reuse: cloned as they are consumed).
    s.fresh = o.lazy_clones && o.clone_param_grads_on_return && o.clones_from_torch_allocator && o.training &&
              o.accumulate_into.empty() && !declare && !o.reuse_buffers;
    s.session.emplace(config_of(s, o));

    const SchedulePlan plan = plan_schedule(specs.size(), o.schedule, o.layers_per_chunk);
    s.microbatches = plan.microbatches;
    if (o.reuse_buffers && !o.schedule.empty()) s.capture.releases = reuse_releases(specs.size(), o.schedule, o.layers_per_chunk);

    for (size_t i = 0; i < specs.size(); ++i) {
        CallableSpec& sp = specs[i];
        auto c = std::make_unique<Callable>();
        c->shared = &s;
        c->index = i;
        c->name = sp.name.empty() ? "callable_" + std::to_string(i) : sp.name;
        c->caller.forward = std::move(sp.forward);
        c->caller.hook = std::move(sp.hook);
        c->sig.input_names = std::move(sp.input_names);
        c->params = std::move(sp.params);
        c->param_info.resize(c->params.size());
        for (size_t j = 0; j < c->params.size(); ++j) {
            if (j < sp.param_names.size()) c->param_info[j].name = std::move(sp.param_names[j]);
            if (j < sp.param_flags.size()) c->param_info[j].flags = sp.param_flags[j];
        }
        c->caller.param_source = std::move(sp.param_source);
        for (const at::Tensor& x : sp.sample_inputs) {
            c->caller.samples.push_back(x.detach().contiguous());
            Meta m = meta_of(x);
            m.requires_grad = m.requires_grad && o.training;
            c->sig.in.push_back(m);
        }
        c->wgrad = plan.has_wgrad[i] != 0;
        c->sig.buckets = std::move(sp.bucket_sizes);
        c->sig.buckets2 = std::move(sp.bucket_sizes2);
        c->sig.in_dims = input_dims(sp);
        for (const Dims& d : c->sig.in_dims) c->sig.in_dyn.push_back(d.any());
        s.callables.push_back(std::move(c));
    }

    auto fail = [&](std::string msg) {
        bool rng = false;
        for (auto& c : s.callables)
            if (!c->error.empty()) {
                msg += "\n  callable '" + c->name + "': " + c->error;
                rng = rng || drew_unknown_generator(c->error);
            }
        if (rng)
            msg += "\n  (a callable draws random numbers from a CUDA generator graphed was not told about: pass it "
                   "in generators=, or register it with graphed.torch.register_generator, so that its numbers are "
                   "drawn afresh at every replay)";
        if (!s.capture.hook_error.empty()) msg += "\n  post_warmup_hook: " + s.capture.hook_error;
        if (s.step && !s.step->error.empty()) msg += "\n  the step's capture hook: " + s.step->error;
        // The reset returns the capture's memory; what it raised (CUDA
        // calls on a stream whose capture the failure invalidated) is told
        // after the failure itself, never instead of it.
        try {
            s.reset();
        } catch (const std::exception& e) {
            msg += "\n  then, releasing the session: " + std::string(e.what());
        }
        throw std::runtime_error(msg);
    };
    try {
        // Lazy initialisation stays out of the captures, as in torch.
        c10::cuda::device_synchronize();
        s.route.work.synchronize();
        {
            c10::cuda::CUDAStreamGuard guard(s.route.work);
            if (o.pre_warmup_hook) o.pre_warmup_hook();
        }
        discover(s, plan.order);
        for (auto& c : s.callables) learn_dynamic_outputs(s, *c);
        for (auto& c : s.callables) register_callable(s, *c);
        if (declare) declare(s);
    } catch (const std::exception& e) {
        fail(std::string("make_graphed_callables: ") + e.what());
    }
    std::string capture_error;
    try {
        s.session->capture();
    } catch (const std::exception& e) {
        capture_error = e.what();
    }
    // The routing and the generators' capture states are undone whatever
    // the capture did; an error undoing them after a failed capture is
    // told after the capture's own error, never instead of it.
    FirstError undo;
    undo.run([&] { s.end_routing(); });
    undo.run([&] { s.rng.abandon(); });
    if (!capture_error.empty())
        fail(undo.what.empty() ? capture_error : capture_error + "\n  then, undoing the capture: " + undo.what);
    if (!undo.what.empty()) fail("make_graphed_callables: undoing the capture: " + undo.what);
    for (auto& c : s.callables) {
        c->caller.samples.clear();
        for (Instance& in : c->per_mb) {
            if (!o.retain_graph_in_backward) in.tape = Tape();
            in.rebound.assign(c->sig.in.size(), false);
        }
    }
    if (o.rebind_inputs) mark_rebound(s);
    if (captured) {
        try {
            captured(s);
        } catch (const std::exception& e) {
            fail(e.what());  // the caller's message says whose
        }
    }
    s.drop_callbacks();
    enroll(shared);
    return shared;
}

std::vector<GraphedCallable> make_graphed_callables(std::vector<CallableSpec> specs, const Options& o) {
    std::shared_ptr<Shared> shared = make_session(std::move(specs), o, nullptr, nullptr);
    std::vector<GraphedCallable> out;
    for (size_t i = 0; i < shared->callables.size(); ++i) out.emplace_back(shared, i);
    return out;
}

}  // namespace graphed_torch
