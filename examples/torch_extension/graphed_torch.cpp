// graphed for libtorch: see graphed_torch.h.
#include "graphed_torch.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <stdexcept>

namespace graphed_torch {

namespace {

void check(graphed_status s, const char* what) {
    if (s != GRAPHED_STATUS_OK)
        throw std::runtime_error(std::string(what) + ": " + graphed_status_name(s) + ": " +
                                 graphed_last_error_message());
}

struct Meta {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
    bool requires_grad;
    size_t bytes() const {
        size_t n = 1;
        for (int64_t d : sizes) n *= size_t(d);
        return n * c10::elementSize(dtype);
    }
};

Meta meta_of(const at::Tensor& t) { return {t.sizes().vec(), t.scalar_type(), t.requires_grad()}; }

uint32_t dtype_code(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return GRAPHED_DTYPE_F32;
        case at::kHalf: return GRAPHED_DTYPE_F16;
        case at::kBFloat16: return GRAPHED_DTYPE_BF16;
        case at::kDouble: return GRAPHED_DTYPE_F64;
        case at::kChar: return GRAPHED_DTYPE_I8;
        case at::kByte: return GRAPHED_DTYPE_U8;
        case at::kInt: return GRAPHED_DTYPE_I32;
        case at::kLong: return GRAPHED_DTYPE_I64;
        case at::kBool: return GRAPHED_DTYPE_BOOL;
        default: throw std::runtime_error(std::string("graphed_torch: unsupported dtype ") + c10::toString(t));
    }
}

}  // namespace

// One callable's registration and capture-time state.
struct Callable {
    Shared* shared = nullptr;
    std::string name;
    ForwardFn forward;
    std::vector<at::Tensor> samples, params;
    std::vector<Meta> in, out;
    std::vector<uint32_t> flags;
    // Warmup and capture, per microbatch: the leaves over the static inputs
    // and the outputs whose autograd graph backward differentiates.
    std::vector<std::vector<at::Tensor>> fwd_inputs, fwd_outputs;
    // Tensors handed to graphed as external buffers: they live as long as
    // the graphs.
    std::vector<at::Tensor> keep;
    std::string error;
    // Registration descriptors.
    std::vector<std::vector<int64_t>> shapes;
    std::vector<graphed_tensor_desc> tin, tout;
    std::vector<graphed_param_desc> pdesc;
};

struct Shared {
    graphed_session* session = nullptr;
    c10::DeviceIndex device = 0;
    uint32_t microbatches = 1;
    c10::MempoolId_t pool{0, 0};
    bool routing = false;
    std::vector<std::unique_ptr<Callable>> callables;

    void end_routing() {
        if (routing) {
            c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
            routing = false;
        }
    }
    ~Shared() {
        end_routing();
        // Waits for the device, destroys the graphs; then the tensors the
        // graphs used may go, and the private pool with them.
        graphed_session_destroy(session);
        for (auto& c : callables) {
            c->keep.clear();
            c->fwd_inputs.clear();
            c->fwd_outputs.clear();
        }
        if (pool.first != 0 || pool.second != 0) c10::cuda::CUDACachingAllocator::releasePool(device, pool);
    }
};

namespace {

at::TensorOptions options(const Meta& m, c10::DeviceIndex device) {
    return at::TensorOptions().dtype(m.dtype).device(at::Device(at::kCUDA, device));
}

// A tensor over graphed memory that keeps the session alive while it exists.
at::Tensor wrap(void* ptr, const Meta& m, c10::DeviceIndex device, const std::shared_ptr<Shared>& keep) {
    return at::from_blob(ptr, m.sizes, [keep](void*) {}, options(m, device));
}

// A tensor over one CLONE grad: its deleter drops the block reference.
at::Tensor wrap_clone(const graphed_ref& r, const Meta& m, c10::DeviceIndex device) {
    graphed_buffer* owner = r.owner;
    return at::from_blob(r.ptr, m.sizes, [owner](void*) { graphed_buffer_release(owner); }, options(m, device));
}

// The arguments of one replay of (index, microbatch) on the current stream,
// copying `data` into the static buffers.
graphed_replay_args replay_args(const Shared& shared, size_t index, uint32_t microbatch,
                                const std::vector<const void*>& data) {
    graphed_replay_args a = graphed_replay_args_default();
    a.callable = static_cast<uint32_t>(index);
    a.microbatch = microbatch;
    a.stream = c10::cuda::getCurrentCUDAStream(shared.device).stream();
    a.data = data.data();
    a.num_data = data.size();
    return a;
}

int32_t run_guarded(Callable* c, const graphed_pass_ctx* ctx, const std::function<void()>& body) {
    try {
        c10::cuda::CUDAStreamGuard guard(
            c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(ctx->stream), c->shared->device));
        body();
        return 0;
    } catch (const std::exception& e) {
        c->error = e.what();
        return 1;
    }
}

// Before each capture (outside it): PyTorch allocations on the capture
// stream go to the session's private pool, as in at::cuda::CUDAGraph.
int32_t pre_hook(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    if (ctx->phase != GRAPHED_PHASE_CAPTURE) return 0;
    auto stream = static_cast<cudaStream_t>(ctx->stream);
    c10::cuda::CUDACachingAllocator::beginAllocateToPool(c->shared->device, c->shared->pool,
                                                         [stream](cudaStream_t s) { return s == stream; });
    c->shared->routing = true;
    return 0;
}

int32_t post_hook(const graphed_pass_ctx*, void* self) {
    static_cast<Callable*>(self)->shared->end_routing();
    return 0;
}

int32_t forward_cb(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    return run_guarded(c, ctx, [&] {
        at::AutoGradMode grad(true);
        std::vector<at::Tensor> ins;
        for (size_t i = 0; i < c->in.size(); ++i)
            ins.push_back(at::from_blob(ctx->inputs[i], c->in[i].sizes, options(c->in[i], c->shared->device))
                              .requires_grad_(c->in[i].requires_grad));
        std::vector<at::Tensor> outs = c->forward(ins);
        if (outs.size() != c->out.size())
            throw std::runtime_error("callable '" + c->name + "' returned " + std::to_string(outs.size()) +
                                     " outputs during capture, " + std::to_string(c->out.size()) + " before");
        for (size_t i = 0; i < outs.size(); ++i) {
            if (outs[i].sizes().vec() != c->out[i].sizes || outs[i].scalar_type() != c->out[i].dtype)
                throw std::runtime_error("callable '" + c->name + "': output " + std::to_string(i) +
                                         " changed shape or dtype between calls");
            outs[i] = outs[i].contiguous();
        }
        if (ctx->phase == GRAPHED_PHASE_CAPTURE) {
            for (size_t i = 0; i < outs.size(); ++i) {
                check(graphed_pass_set_buffer(ctx, GRAPHED_BUFFER_ROLE_OUTPUT, i, outs[i].data_ptr()),
                      "graphed_pass_set_buffer");
                c->keep.push_back(outs[i].detach());
            }
        }
        const size_t mb = ctx->microbatch;
        if (c->fwd_inputs.size() <= mb) {
            c->fwd_inputs.resize(mb + 1);
            c->fwd_outputs.resize(mb + 1);
        }
        c->fwd_inputs[mb] = std::move(ins);
        c->fwd_outputs[mb] = std::move(outs);
    });
}

int32_t backward_cb(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    return run_guarded(c, ctx, [&] {
        const size_t mb = ctx->microbatch;
        std::vector<at::Tensor> outs, gouts, wrt;
        for (size_t i = 0; i < c->out.size(); ++i) {
            if (!c->out[i].requires_grad) continue;
            outs.push_back(c->fwd_outputs.at(mb)[i]);
            gouts.push_back(at::from_blob(ctx->grad_outputs[i], c->out[i].sizes, options(c->out[i], c->shared->device)));
        }
        std::vector<size_t> in_idx, p_idx;
        for (size_t i = 0; i < c->in.size(); ++i)
            if (c->in[i].requires_grad) {
                wrt.push_back(c->fwd_inputs.at(mb)[i]);
                in_idx.push_back(i);
            }
        for (size_t j = 0; j < c->params.size(); ++j)
            if (c->params[j].requires_grad()) {
                wrt.push_back(c->params[j]);
                p_idx.push_back(j);
            }
        std::vector<at::Tensor> grads = torch::autograd::grad(outs, wrt, gouts, /*retain_graph=*/false,
                                                              /*create_graph=*/false, /*allow_unused=*/true);
        for (size_t k = 0; k < grads.size(); ++k)
            grads[k] = grads[k].defined() ? grads[k].contiguous() : at::zeros_like(wrt[k]);
        if (ctx->phase == GRAPHED_PHASE_CAPTURE) {
            for (size_t k = 0; k < grads.size(); ++k) {
                bool input = k < in_idx.size();
                check(graphed_pass_set_buffer(ctx, input ? GRAPHED_BUFFER_ROLE_GRAD_INPUT : GRAPHED_BUFFER_ROLE_PARAM_GRADS,
                                              input ? in_idx[k] : p_idx[k - in_idx.size()], grads[k].data_ptr()),
                      "graphed_pass_set_buffer");
                c->keep.push_back(grads[k]);
            }
        }
        c->fwd_outputs[mb].clear();
        c->fwd_inputs[mb].clear();
    });
}

int32_t torch_alloc(void*, size_t bytes, graphed_stream stream, void** out) {
    try {
        *out = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
        return *out ? 0 : 1;
    } catch (...) {
        return 1;
    }
}

void torch_free(void*, void* ptr, size_t, graphed_stream) { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }

// The backward of one replay, as an autograd node: it replays the backward
// graph and returns grads per the frozen policies. It holds the session
// while the autograd graph that may call it exists.
struct GraphedBackward : public torch::autograd::Node {
    std::shared_ptr<Shared> shared;
    size_t index = 0;
    uint32_t microbatch = 0;

    std::string name() const override { return "GraphedBackward"; }

    torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
        Callable* c = shared->callables[index].get();
        // One incoming grad per output that requires grad (those alone got
        // this node as their grad_fn), in output order.
        std::vector<at::Tensor> contiguous;
        std::vector<const void*> data;
        size_t k = 0;
        for (size_t i = 0; i < c->out.size(); ++i) {
            if (!c->out[i].requires_grad) {
                data.push_back(nullptr);
                continue;
            }
            const at::Tensor& g = grads[k++];
            contiguous.push_back(g.defined() ? g.contiguous()
                                             : at::zeros(c->out[i].sizes, options(c->out[i], shared->device)));
            data.push_back(contiguous.back().data_ptr());
        }
        graphed_replay_args a = replay_args(*shared, index, microbatch, data);
        std::vector<graphed_ref> gin(c->in.size()), gp(c->params.size());
        check(graphed_backward(shared->session, &a, gin.data(), gin.size(), gp.data(), gp.size()), "graphed_backward");
        torch::autograd::variable_list result;
        for (size_t i = 0; i < gin.size(); ++i)
            result.push_back(gin[i].kind == GRAPHED_REF_KIND_NONE ? at::Tensor()
                                                                  : wrap(gin[i].ptr, c->in[i], shared->device, shared));
        for (size_t j = 0; j < gp.size(); ++j) {
            Meta m = meta_of(c->params[j]);
            switch (gp[j].kind) {
                case GRAPHED_REF_KIND_CLONE: result.push_back(wrap_clone(gp[j], m, shared->device)); break;
                case GRAPHED_REF_KIND_NONE: result.push_back(at::Tensor()); break;
                default: result.push_back(wrap(gp[j].ptr, m, shared->device, shared));
            }
        }
        return result;
    }
};

}  // namespace

std::vector<at::Tensor> GraphedCallable::operator()(const std::vector<at::Tensor>& inputs) const {
    Callable* c = shared_->callables[index_].get();
    if (inputs.size() != c->in.size())
        throw std::runtime_error("graphed callable '" + c->name + "' takes " + std::to_string(c->in.size()) +
                                 " inputs, got " + std::to_string(inputs.size()));
    std::vector<at::Tensor> contiguous;
    std::vector<const void*> data;
    for (size_t i = 0; i < inputs.size(); ++i) {
        const Meta& m = c->in[i];
        if (inputs[i].sizes().vec() != m.sizes || inputs[i].scalar_type() != m.dtype)
            throw std::runtime_error("graphed callable '" + c->name + "': input " + std::to_string(i) +
                                     " does not match the sample's shape and dtype");
        contiguous.push_back(inputs[i].contiguous());
        data.push_back(contiguous.back().data_ptr());
    }
    graphed_replay_args a = replay_args(*shared_, index_, microbatch_, data);
    std::vector<graphed_ref> out(c->out.size());
    check(graphed_forward(shared_->session, &a, out.data(), out.size()), "graphed_forward");
    std::vector<at::Tensor> result;
    for (size_t i = 0; i < out.size(); ++i) result.push_back(wrap(out[i].ptr, c->out[i], shared_->device, shared_));

    // Autograd: the outputs' grad_fn is a GraphedBackward node whose next
    // edges are the inputs and the parameters, as a custom Function's would.
    bool needs_grad = false;
    for (const at::Tensor& t : inputs) needs_grad = needs_grad || t.requires_grad();
    for (const at::Tensor& p : c->params) needs_grad = needs_grad || p.requires_grad();
    if (at::GradMode::is_enabled() && needs_grad) {
        auto node = std::shared_ptr<GraphedBackward>(new GraphedBackward(), torch::autograd::deleteNode);
        node->shared = shared_;
        node->index = index_;
        node->microbatch = microbatch_;
        node->set_next_edges(torch::autograd::collect_next_edges(inputs, c->params));
        for (size_t i = 0; i < result.size(); ++i)
            if (c->out[i].requires_grad) torch::autograd::set_history(result[i], node);
    }
    return result;
}

const std::vector<at::Tensor>& GraphedCallable::params() const { return shared_->callables[index_]->params; }

GraphedCallable GraphedCallable::for_microbatch(uint32_t microbatch) const {
    if (microbatch >= shared_->microbatches)
        throw std::runtime_error("graphed callable '" + shared_->callables[index_]->name + "' has " +
                                 std::to_string(shared_->microbatches) + " microbatch(es), not " +
                                 std::to_string(microbatch + 1));
    return GraphedCallable(shared_, index_, microbatch);
}

uint32_t GraphedCallable::microbatches() const { return shared_->microbatches; }

graphed_session_stats GraphedCallable::stats() const {
    graphed_session_stats st = graphed_session_stats_default();
    check(graphed_session_stats_get(shared_->session, &st), "graphed_session_stats_get");
    return st;
}

std::vector<GraphedCallable> make_graphed_callables(std::vector<CallableSpec> specs, const Options& o) {
    if (specs.empty()) throw std::runtime_error("make_graphed_callables: no callables");
    auto shared = std::make_shared<Shared>();
    shared->device = specs[0].sample_inputs.empty() ? c10::cuda::current_device()
                                                    : specs[0].sample_inputs[0].device().index();
    c10::cuda::CUDAGuard device_guard(shared->device);
    shared->pool = at::cuda::graph_pool_handle();

    graphed_session_config cfg = graphed_session_config_default();
    cfg.backend = GRAPHED_BACKEND_CUDA;
    cfg.device = shared->device;
    cfg.warmup_iterations = static_cast<uint32_t>(o.num_warmup_iters);
    cfg.clone_param_grads_on_return = o.clone_param_grads_on_return;
    if (o.clones_from_torch_allocator) {
        cfg.clone_alloc = torch_alloc;
        cfg.clone_free = torch_free;
    }
    if (!o.schedule.empty()) {
        cfg.schedule = o.schedule.data();
        cfg.num_schedule_steps = o.schedule.size();
        if (!o.layers_per_chunk.empty()) {
            cfg.layers_per_chunk = o.layers_per_chunk.data();
            cfg.num_layers_per_chunk = o.layers_per_chunk.size();
        }
    }
    cfg.reuse_buffers = o.reuse_buffers;
    check(graphed_session_create(&cfg, &shared->session), "graphed_session_create");

    for (CallableSpec& s : specs) {
        auto c = std::make_unique<Callable>();
        c->shared = shared.get();
        c->name = s.name;
        c->forward = std::move(s.forward);
        c->params = s.params;
        for (const at::Tensor& x : s.sample_inputs) {
            if (!x.is_cuda()) throw std::runtime_error("make_graphed_callables: sample inputs must be CUDA tensors");
            c->samples.push_back(x.detach().contiguous());
            c->in.push_back(meta_of(x));
        }
        c->flags = s.param_flags;
        c->flags.resize(c->params.size(), GRAPHED_PARAM_FLAGS_NONE);
        // The outputs' shapes and dtypes, from one eager call.
        {
            std::vector<at::Tensor> probe;
            for (size_t i = 0; i < c->samples.size(); ++i)
                probe.push_back(c->samples[i].clone().requires_grad_(c->in[i].requires_grad));
            for (const at::Tensor& y : c->forward(probe)) c->out.push_back(meta_of(y));
        }
        c->shapes.reserve(c->in.size() + c->out.size());
        auto describe = [&](const Meta& m, const void* sample, bool external) {
            c->shapes.push_back(m.sizes);
            return graphed_tensor_desc{m.bytes(), dtype_code(m.dtype), uint32_t(m.sizes.size()), c->shapes.back().data(),
                                       m.requires_grad, sample,
                                       uint32_t(external ? GRAPHED_TENSOR_FLAGS_EXTERNAL : GRAPHED_TENSOR_FLAGS_NONE)};
        };
        for (size_t i = 0; i < c->in.size(); ++i)
            c->tin.push_back(describe(c->in[i], c->samples[i].data_ptr(), c->in[i].requires_grad));
        for (const Meta& m : c->out) c->tout.push_back(describe(m, nullptr, true));
        for (size_t j = 0; j < c->params.size(); ++j) {
            const at::Tensor& p = c->params[j];
            uint32_t flags = c->flags[j] | (p.requires_grad() ? GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD : 0u);
            c->pdesc.push_back({p.data_ptr(), size_t(p.numel()) * size_t(p.element_size()), dtype_code(p.scalar_type()), flags,
                                GRAPHED_GRAD_POLICY_DEFAULT, p.requires_grad()});
        }
        graphed_callable_desc d = graphed_callable_desc_default();
        d.name = c->name.c_str();
        d.num_inputs = c->tin.size();
        d.inputs = c->tin.data();
        d.num_outputs = c->tout.size();
        d.outputs = c->tout.data();
        d.num_params = c->pdesc.size();
        d.params = c->pdesc.data();
        d.forward = forward_cb;
        d.backward = backward_cb;
        d.user_data = c.get();
        d.pre_hook = pre_hook;
        d.post_hook = post_hook;
        d.hook_data = c.get();
        uint32_t index = 0;
        check(graphed_session_add_callable(shared->session, &d, &index), "graphed_session_add_callable");
        shared->callables.push_back(std::move(c));
    }
    graphed_status st = graphed_session_capture(shared->session);
    shared->end_routing();
    if (st != GRAPHED_STATUS_OK) {
        std::string msg = std::string("graphed_session_capture: ") + graphed_status_name(st) + ": " +
                          graphed_last_error_message();
        for (auto& c : shared->callables)
            if (!c->error.empty()) msg += "\n  callable '" + c->name + "': " + c->error;
        throw std::runtime_error(msg);
    }
    for (auto& c : shared->callables) c->samples.clear();
    graphed_session_stats stats = graphed_session_stats_default();
    check(graphed_session_stats_get(shared->session, &stats), "graphed_session_stats_get");
    shared->microbatches = stats.microbatches;
    std::vector<GraphedCallable> out;
    for (size_t i = 0; i < shared->callables.size(); ++i) out.emplace_back(shared, i);
    return out;
}

}  // namespace graphed_torch
