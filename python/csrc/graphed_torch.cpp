// graphed for libtorch: see graphed_torch.h. Every call into graphed's C API
// is in this file.
#include "graphed_torch.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>

namespace graphed_torch {

namespace {

// ---- errors ---------------------------------------------------------------------------

std::string status_text(graphed_status s, const char* what) {
    return std::string(what) + ": " + graphed_status_name(s) + ": " + graphed_last_error_message();
}

void check(graphed_status s, const char* what) {
    if (s != GRAPHED_STATUS_OK) throw std::runtime_error(status_text(s, what));
}

void cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// ---- tensors ----------------------------------------------------------------------------

struct Meta {
    std::vector<int64_t> sizes;
    at::ScalarType dtype = at::kFloat;
    bool requires_grad = false;
    // Outputs keep the layout eager gave them (a transposed attention
    // output, channels_last), so that *_like and strided kernels see what
    // eager code sees; empty: contiguous. Always dense: numel elements.
    std::vector<int64_t> strides;
    size_t bytes() const {
        size_t n = 1;
        for (int64_t d : sizes) n *= size_t(d);
        return n * c10::elementSize(dtype);
    }
};

Meta meta_of(const at::Tensor& t) { return {t.sizes().vec(), t.scalar_type(), t.requires_grad()}; }

// An output's meta: its strides too when it is dense but not contiguous.
Meta layout_of(const at::Tensor& t) {
    Meta m = meta_of(t);
    if (!t.is_contiguous() && t.is_non_overlapping_and_dense()) m.strides = t.strides().vec();
    return m;
}

// `t` in the layout of `m` (itself when it already is, else a copy).
at::Tensor in_layout(const at::Tensor& t, const Meta& m) {
    if (m.strides.empty()) return t.contiguous();
    if (t.strides() == at::IntArrayRef(m.strides)) return t;
    return at::empty_strided(m.sizes, m.strides, t.options()).copy_(t);
}

// A tensor of layout `m` over memory graphed owns; `deleter` runs when it dies.
at::Tensor over(void* ptr, const Meta& m, const at::TensorOptions& options,
                std::function<void(void*)> deleter = [](void*) {}) {
    if (m.strides.empty()) return at::from_blob(ptr, m.sizes, std::move(deleter), options);
    return at::from_blob(ptr, m.sizes, m.strides, std::move(deleter), options);
}

// Plain string building: no iostreams in the extension (an ostringstream
// crashed inside operator<<(long) on the GPU machine's build, in this very
// error path).
std::string shape_text(at::IntArrayRef sizes) {
    std::string o = "[";
    for (size_t i = 0; i < sizes.size(); ++i) {
        if (i) o += ", ";
        o += std::to_string(sizes[i]);
    }
    return o + "]";
}

std::string describe(at::IntArrayRef sizes, at::ScalarType dtype, const std::string& device, bool requires_grad) {
    return "shape " + shape_text(sizes) + ", " + c10::toString(dtype) + ", " + device +
           ", requires_grad=" + (requires_grad ? "True" : "False");
}

std::string describe(const at::Tensor& t) {
    return describe(t.sizes(), t.scalar_type(), t.device().str(), t.requires_grad());
}

// graphed's dtype code; types graphed has no code for travel as bytes (U8,
// no shape): graphed only copies them.
uint32_t dtype_code(at::ScalarType t, bool* exact) {
    *exact = true;
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
        default: *exact = false; return GRAPHED_DTYPE_U8;
    }
}

at::TensorOptions options_of(at::ScalarType dtype, c10::DeviceIndex device) {
    return at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, device));
}

// ---- PyTorch's CUDA generators, made graph-safe ------------------------------------------
//
// Under stream capture, CUDAGeneratorImpl::philox_cuda_state hands kernels
// pointers to a seed and an offset in device memory (seed_extragraph_,
// offset_extragraph_) plus an offset inside the graph, and adds each op's
// increment to offset_intragraph_; it requires `capturing_`. torch's
// CUDAGraph sets this up around its own captures (capture_prologue) and, at
// each replay, writes the generator's current seed and offset to that memory
// and advances the offset by the graph's total (replay_prologue). graphed
// captures with its own stream capture, so the adapter does the same around
// graphed's captures and replays, with the public fields of
// CUDAGeneratorState (its methods are not exported from libtorch_cuda) and
// device memory of its own per captured pass. The generator keeps its state
// object in a private member; the explicit instantiation below is the
// standard-conforming way to name it.

template <typename Tag, typename Tag::type M>
struct Expose {
    friend typename Tag::type member(Tag) { return M; }
};
struct GeneratorStateMember {
    using type = c10::intrusive_ptr<at::CUDAGeneratorState> at::CUDAGeneratorImpl::*;
    friend type member(GeneratorStateMember);
};
template struct Expose<GeneratorStateMember, &at::CUDAGeneratorImpl::state_>;

c10::intrusive_ptr<at::CUDAGeneratorState> state_of(const at::Generator& g) {
    return g.get<at::CUDAGeneratorImpl>()->*member(GeneratorStateMember{});
}

struct RngStates {
    struct Entry {
        at::Generator generator;
        c10::intrusive_ptr<at::CUDAGeneratorState> state;
    };
    std::vector<Entry> entries;

    // What one captured pass draws: per state, the increment, and the device
    // memory its kernels read seed and offset from ([seed, offset] per state).
    struct PassDraws {
        at::Tensor device;
        std::vector<uint64_t> increments;
    };
    std::vector<PassDraws> passes;  // by pass key; empty device: draws nothing

    struct Saved {
        bool capturing;
        uint64_t intragraph;
        at::TensorBase seed, offset;
    };
    std::vector<Saved> saved;
    at::Tensor open_device;
    bool open = false;

    void add(const at::Generator& g, c10::DeviceIndex device) {
        if (!g.defined()) return;
        if (g.device().type() != at::kCUDA)
            throw std::invalid_argument("generators: " + g.device().str() + " is not a CUDA generator");
        // A generator made for "cuda" has no index: it is the current device's.
        const c10::DeviceIndex index = g.device().has_index() ? g.device().index() : c10::cuda::current_device();
        if (index != device)
            throw std::invalid_argument("generators: a generator of cuda:" + std::to_string(index) +
                                        " cannot draw inside graphs of cuda:" + std::to_string(device));
        auto s = state_of(g);
        for (const Entry& e : entries)
            if (e.state.get() == s.get()) return;
        entries.push_back({g, std::move(s)});
    }

    // Before a capture (outside it): every state draws from this pass's memory.
    void begin(c10::DeviceIndex device) {
        if (entries.empty() || open) return;
        open_device = at::empty({int64_t(2 * entries.size())}, options_of(at::kLong, device));
        saved.clear();
        for (size_t i = 0; i < entries.size(); ++i) {
            at::CUDAGeneratorState* s = entries[i].state.get();
            saved.push_back({s->capturing_, uint64_t(s->offset_intragraph_), s->seed_extragraph_, s->offset_extragraph_});
            s->seed_extragraph_ = open_device.narrow(0, int64_t(2 * i), 1);
            s->offset_extragraph_ = open_device.narrow(0, int64_t(2 * i + 1), 1);
            s->offset_intragraph_ = 0;
            s->capturing_ = true;
        }
        open = true;
    }

    // Puts the states back as they were before begin(); returns what each drew.
    std::vector<uint64_t> restore() {
        std::vector<uint64_t> drawn;
        for (size_t i = 0; i < entries.size(); ++i) {
            at::CUDAGeneratorState* s = entries[i].state.get();
            drawn.push_back(uint64_t(s->offset_intragraph_));
            s->capturing_ = saved[i].capturing;
            s->offset_intragraph_ = saved[i].intragraph;
            s->seed_extragraph_ = saved[i].seed;
            s->offset_extragraph_ = saved[i].offset;
        }
        open = false;
        return drawn;
    }

    // After the capture: records what the pass drew and restores the states.
    void end(size_t key) {
        if (!open) return;
        PassDraws d;
        d.increments = restore();
        bool draws = std::any_of(d.increments.begin(), d.increments.end(), [](uint64_t x) { return x != 0; });
        if (draws) {
            d.device = open_device;
            if (passes.size() <= key) passes.resize(key + 1);
            passes[key] = std::move(d);
        }
        open_device = at::Tensor();
    }

    // Before a replay of pass `key` on `stream`: the seed and offset each
    // state has now go to the pass's memory, and the states advance by what
    // the pass draws, so every replay draws fresh numbers, in the order eager
    // execution would.
    void prologue(size_t key, cudaStream_t stream) {
        if (key >= passes.size() || !passes[key].device.defined()) return;
        PassDraws& d = passes[key];
        cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
        cuda_check(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
        if (capturing != cudaStreamCaptureStatusNone)
            throw std::runtime_error(
                "graphed: a graph that draws random numbers cannot be replayed on a stream that is being captured "
                "(its generator state is written before each replay)");
        c10::SmallVector<int64_t, 8> host(2 * entries.size());
        for (size_t i = 0; i < entries.size(); ++i) {
            std::lock_guard<std::mutex> lock(entries[i].generator.mutex());
            at::CUDAGeneratorState* s = entries[i].state.get();
            host[2 * i] = int64_t(s->seed_);
            host[2 * i + 1] = int64_t(s->philox_offset_per_thread_);
            s->philox_offset_per_thread_ += d.increments[i];
        }
        // Pageable source: the driver stages it before returning.
        cuda_check(cudaMemcpyAsync(d.device.data_ptr(), host.data(), host.size() * sizeof(int64_t),
                                   cudaMemcpyHostToDevice, stream),
                   "cudaMemcpyAsync (generator state)");
    }

    // Restores every state left open by a failed capture.
    void abandon() {
        if (open) restore();
        open_device = at::Tensor();
    }
};

size_t pass_key(size_t instance, Pass p) { return instance * 3 + uint32_t(p); }

// One stream per device for every session's warmup and capture, so that
// libraries that cache per-stream state (cuBLAS workspaces) keep one.
c10::cuda::CUDAStream default_work_stream(c10::DeviceIndex device) {
    static std::mutex mu;
    static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
    std::lock_guard<std::mutex> lock(mu);
    auto it = streams.find(device);
    if (it == streams.end()) {
        // Its own stream (not one of PyTorch's pooled ones, which other code
        // may share), kept for the life of the process.
        c10::cuda::CUDAGuard guard(device);
        cudaStream_t raw = nullptr;
        cuda_check(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
        it = streams.emplace(device, c10::cuda::getStreamFromExternal(raw, device)).first;
    }
    return it->second;
}

}  // namespace

// ---- one callable -------------------------------------------------------------------------

// What forward left for backward, per microbatch.
struct Tape {
    std::vector<at::Tensor> inputs;   // the leaves forward received
    std::vector<at::Tensor> outputs;  // what it returned
};

struct Callable {
    Shared* shared = nullptr;
    size_t index = 0;
    std::string name;
    ForwardFn forward;
    Hook hook;
    std::vector<at::Tensor> samples;  // until capture ends
    std::vector<std::string> input_names, param_names;
    std::vector<Meta> in, out;
    std::vector<at::Tensor> params;
    std::vector<uint32_t> flags;
    std::vector<bool> in_grad;     // the input is registered as taking a grad
    std::vector<bool> param_grad;  // the parameter is registered as taking a grad
    bool wgrad = false;            // has a delayed weight-gradient pass
    bool outputs_known = false;
    std::vector<Tape> tapes;  // per microbatch
    // Per microbatch, per input: the graphs read it where it is (rebound).
    std::vector<std::vector<bool>> rebound;
    // External buffers handed to graphed, per microbatch.
    std::vector<std::vector<at::Tensor>> ext_out, ext_gin, ext_pgrad;
    // Between a pass's pre-hook, callback and post-hook.
    std::vector<at::Tensor> pass_inputs, pass_outputs, pass_gouts, pass_grads;
    std::string error;
    // Registration descriptors.
    std::vector<std::vector<int64_t>> shapes;
    std::vector<graphed_tensor_desc> tin, tout;
    std::vector<graphed_param_desc> pdesc;

    bool clone_slot(size_t j) const;
    std::string input_name(size_t i) const {
        return i < input_names.size() ? input_names[i] : "input " + std::to_string(i);
    }
    // "name (microbatch m): ", the start of every lease's description.
    std::string who(uint32_t mb) const { return name + " (microbatch " + std::to_string(mb) + "): "; }
    std::string param_name(size_t j) const {
        return j < param_names.size() ? param_names[j] : "parameter " + std::to_string(j);
    }
    std::vector<at::Tensor> run_forward(const std::vector<at::Tensor>& ins);
    std::vector<at::Tensor> run_backward(Tape& tape, const std::vector<at::Tensor>& gouts, bool inputs, bool params,
                                         bool retain, bool discover);
    void call_hook(const HookEvent& e) {
        if (hook) hook(e);
    }
};

// ---- the session ---------------------------------------------------------------------------

struct Shared {
    graphed_session* session = nullptr;
    c10::DeviceIndex device = 0;
    Options opts;
    uint32_t microbatches = 1;
    std::vector<std::unique_ptr<Callable>> callables;
    c10::cuda::CUDAStream work = c10::cuda::getDefaultCUDAStream();
    cudaEvent_t ev_fork = nullptr, ev_join = nullptr, ev_replay = nullptr;
    c10::MempoolId_t pool{0, 0};
    int pool_refs = 0;  // beginAllocateToPool calls, each released at reset
    bool routing = false;
    RngStates rng;
    std::vector<std::vector<Release>> releases;  // by capture position
    size_t capture_position = 0;
    std::string hook_error;
    bool is_reset = false;
    // Strict leases: releases that met a busy session, and what is held.
    std::mutex lease_mu;
    std::unordered_map<uint64_t, std::string> held;

    size_t instance(size_t callable, uint32_t mb) const { return callable * microbatches + mb; }

    void begin_routing() {
        c10::cuda::CUDACachingAllocator::beginAllocateToPool(
            device, pool, [s = work.stream()](cudaStream_t st) { return st == s; });
        ++pool_refs;
        routing = true;
    }
    void end_routing() {
        if (routing) {
            c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
            routing = false;
        }
    }

    // Runs `fn` with the work stream current, joined to `ext` (graphed's
    // stream) before and after: under capture the work stream joins it.
    void on_work_stream(graphed_stream ext, const std::function<void()>& fn) {
        auto s = static_cast<cudaStream_t>(ext);
        cuda_check(cudaEventRecord(ev_fork, s), "cudaEventRecord");
        cuda_check(cudaStreamWaitEvent(work.stream(), ev_fork, 0), "cudaStreamWaitEvent");
        struct Join {
            Shared* sh;
            cudaStream_t s;
            ~Join() {
                if (cudaEventRecord(sh->ev_join, sh->work.stream()) == cudaSuccess) cudaStreamWaitEvent(s, sh->ev_join, 0);
            }
        } join{this, s};
        c10::cuda::CUDAStreamGuard guard(work);
        fn();
    }

    // graphed_lease_release never waits for the session and never gets
    // BUSY, so a tensor's deleter may call it on any thread.
    void release_lease(uint64_t lease) {
        std::lock_guard<std::mutex> lock(lease_mu);
        held.erase(lease);
        if (session) graphed_lease_release(session, lease);
    }
    [[noreturn]] void alias_held(graphed_status s, const char* what, size_t callable, uint32_t mb) {
        std::string msg = "graphed: " + status_text(s, what);
        std::lock_guard<std::mutex> lock(lease_mu);
        const std::string prefix = callables[callable]->who(mb);
        std::vector<std::string> alive;
        for (auto& [lease, name] : held)
            if (name.rfind(prefix, 0) == 0) alive.push_back(name);
        std::sort(alive.begin(), alive.end());
        if (!alive.empty()) {
            msg += "\nStill alive:";
            for (auto& n : alive) msg += "\n  " + n;
        }
        msg += "\nDrop them (del, or zero_grad(set_to_none=True)) or take a copy (.clone()) before the next replay.";
        throw AliasHeld(msg);
    }

    // A tensor over static memory; it keeps the session alive, and under strict
    // leases releases its lease when it dies.
    at::Tensor wrap_alias(void* ptr, const Meta& m, uint64_t lease, std::string what,
                          const std::shared_ptr<Shared>& self) {
        if (lease == 0) return over(ptr, m, options_of(m.dtype, device), [self](void*) {});
        {
            std::lock_guard<std::mutex> lock(lease_mu);
            held[lease] = std::move(what);
        }
        return over(ptr, m, options_of(m.dtype, device), [self, lease](void*) { self->release_lease(lease); });
    }

    void release(const Release& r);
    void reset();
    ~Shared() {
        try {
            reset();
        } catch (...) {
        }
        if (ev_fork) cudaEventDestroy(ev_fork);
        if (ev_join) cudaEventDestroy(ev_join);
        if (ev_replay) cudaEventDestroy(ev_replay);
    }
};

bool Callable::clone_slot(size_t j) const {
    return shared->opts.clone_param_grads_on_return && !(flags[j] & GRAPHED_PARAM_FLAGS_DELAYED_WGRAD);
}

void Shared::release(const Release& r) {
    Callable& c = *callables.at(r.callable);
    switch (r.role) {
        case GRAPHED_BUFFER_ROLE_OUTPUT: c.ext_out[r.microbatch].clear(); break;
        case GRAPHED_BUFFER_ROLE_GRAD_INPUT: c.ext_gin[r.microbatch].clear(); break;
        default:
            for (size_t j = 0; j < c.ext_pgrad[r.microbatch].size(); ++j)
                if (c.clone_slot(j)) c.ext_pgrad[r.microbatch][j] = at::Tensor();
    }
}

void Shared::reset() {
    if (is_reset) return;
    is_reset = true;
    end_routing();
    rng.abandon();
    {
        std::lock_guard<std::mutex> lock(lease_mu);
        // Waits for the device and destroys the graphs; then the tensors they
        // used may go, and the private pool with them.
        graphed_session_destroy(session);
        session = nullptr;
    }
    for (auto& c : callables) {
        c->tapes.clear();
        c->ext_out.clear();
        c->ext_gin.clear();
        c->ext_pgrad.clear();
        c->pass_inputs.clear();
        c->pass_outputs.clear();
        c->pass_gouts.clear();
        c->pass_grads.clear();
        c->samples.clear();
    }
    rng.passes.clear();
    for (; pool_refs > 0; --pool_refs) c10::cuda::CUDACachingAllocator::releasePool(device, pool);
}

// ---- forward and backward bodies, shared by discovery and the callbacks -----------------

std::vector<at::Tensor> Callable::run_forward(const std::vector<at::Tensor>& ins) {
    at::AutoGradMode mode(shared->opts.training);
    std::vector<at::Tensor> outs = forward(ins);
    if (outputs_known && outs.size() != out.size())
        throw std::runtime_error("callable '" + name + "' returned " + std::to_string(outs.size()) + " outputs; it returned " +
                                 std::to_string(out.size()) + " in the first warmup iteration");
    for (size_t i = 0; i < outs.size(); ++i) {
        if (!outs[i].defined()) throw std::runtime_error("callable '" + name + "': output " + std::to_string(i) + " is None");
        if (!outs[i].is_cuda() || outs[i].device().index() != shared->device)
            throw std::runtime_error("callable '" + name + "': output " + std::to_string(i) + " is on " +
                                     outs[i].device().str() + ", not cuda:" + std::to_string(shared->device));
        if (outputs_known && (outs[i].sizes() != at::IntArrayRef(out[i].sizes) || outs[i].scalar_type() != out[i].dtype ||
                              outs[i].requires_grad() != out[i].requires_grad))
            throw std::runtime_error("callable '" + name + "': output " + std::to_string(i) + " is " + describe(outs[i]) +
                                     "; in the first warmup iteration it was " +
                                     describe(out[i].sizes, out[i].dtype, outs[i].device().str(), out[i].requires_grad));
        // The first warmup iteration's layout (dense), later ones in it.
        if (outputs_known)
            outs[i] = in_layout(outs[i], out[i]);
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
    std::vector<at::Tensor> result(in.size() + params.size());
    std::vector<at::Tensor> roots, grads_in, wrt;
    std::vector<size_t> slot;
    for (size_t i = 0; i < out.size(); ++i)
        if (out[i].requires_grad) {
            roots.push_back(tape.outputs.at(i));
            grads_in.push_back(gouts.at(i));
        }
    if (inputs)
        for (size_t i = 0; i < in.size(); ++i)
            if (discover ? in[i].requires_grad : bool(in_grad[i])) {
                wrt.push_back(tape.inputs.at(i));
                slot.push_back(i);
            }
    if (params_too)
        for (size_t j = 0; j < params.size(); ++j)
            if (discover ? params[j].requires_grad() : bool(param_grad[j])) {
                wrt.push_back(params[j]);
                slot.push_back(in.size() + j);
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
            std::string who = s < in.size() ? "input '" + input_name(s) + "'" : "parameter '" + param_name(s - in.size()) + "'";
            throw std::runtime_error("callable '" + name + "': " + who +
                                     " got no gradient in this pass, but got one in the first warmup iteration "
                                     "(the inputs and parameters that take grads must not change between iterations)");
        }
    }
    if (!retain) tape = Tape();
    return result;
}

namespace {

// ---- graphed's callbacks ---------------------------------------------------------------------

int32_t guarded(Callable* c, const std::function<void()>& body) {
    try {
        body();
        return 0;
    } catch (const std::exception& e) {
        c->error = e.what();
        return 1;
    }
}

std::vector<at::Tensor> wrap_static(void* const* ptrs, const std::vector<Meta>& metas, c10::DeviceIndex device,
                                    bool with_grad) {
    std::vector<at::Tensor> v;
    v.reserve(metas.size());
    for (size_t i = 0; i < metas.size(); ++i) {
        if (!ptrs || !ptrs[i]) {  // no such buffer (the grad of an output without grad)
            v.emplace_back();
            continue;
        }
        at::Tensor t = over(ptrs[i], metas[i], options_of(metas[i].dtype, device));
        v.push_back(with_grad ? t.requires_grad_(metas[i].requires_grad) : t);
    }
    return v;
}

// The hook event of the pass `ctx` describes, before or after it.
HookEvent hook_event(const graphed_pass_ctx* ctx, bool before) {
    HookEvent e;
    e.before = before;
    e.pass = Pass(ctx->pass);
    e.capture = ctx->phase == GRAPHED_PHASE_CAPTURE;
    e.microbatch = ctx->microbatch;
    return e;
}

// Before each pass (outside capture): the user's hook, then, for a capture,
// graph-safe generators and the private pool.
int32_t pre_hook(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    Shared& s = *c->shared;
    return guarded(c, [&] {
        const Pass pass = Pass(ctx->pass);
        const bool capture = ctx->phase == GRAPHED_PHASE_CAPTURE;
        if (!s.opts.training && pass != Pass::Forward) return;  // nothing runs
        HookEvent e = hook_event(ctx, true);
        if (pass == Pass::Forward) {
            c->pass_inputs = wrap_static(ctx->inputs, c->in, s.device, s.opts.training);
            e.inputs = &c->pass_inputs;
        } else {
            c->pass_gouts = wrap_static(ctx->grad_outputs, c->out, s.device, false);
            e.grad_outputs = &c->pass_gouts;
        }
        if (c->hook) s.on_work_stream(ctx->stream, [&] { c->call_hook(e); });
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
            s.rng.end(pass_key(s.instance(c->index, ctx->microbatch), pass));
            if (s.opts.reuse_buffers && s.capture_position < s.releases.size())
                for (const Release& r : s.releases[s.capture_position]) s.release(r);
            ++s.capture_position;
        }
        if (c->hook) {
            HookEvent e = hook_event(ctx, false);
            if (pass == Pass::Forward) {
                e.inputs = &c->pass_inputs;
                e.outputs = &c->pass_outputs;
            } else {
                e.grad_outputs = &c->pass_gouts;
                e.grads = &c->pass_grads;
            }
            s.on_work_stream(ctx->stream, [&] { c->call_hook(e); });
        }
        c->pass_inputs.clear();
        c->pass_outputs.clear();
        c->pass_gouts.clear();
        c->pass_grads.clear();
    });
}

void set_buffer(const graphed_pass_ctx* ctx, uint32_t role, size_t index, const at::Tensor& t) {
    check(graphed_pass_set_buffer(ctx->capture, role, index, t.data_ptr()), "graphed_pass_set_buffer");
}

int32_t forward_cb(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    Shared& s = *c->shared;
    return guarded(c, [&] {
        const uint32_t mb = ctx->microbatch;
        s.on_work_stream(ctx->stream, [&] {
            std::vector<at::Tensor> outs = c->run_forward(c->pass_inputs);
            if (ctx->phase == GRAPHED_PHASE_CAPTURE) {
                for (size_t i = 0; i < outs.size(); ++i) {
                    set_buffer(ctx, GRAPHED_BUFFER_ROLE_OUTPUT, i, outs[i]);
                    c->ext_out[mb].push_back(outs[i].detach());
                }
            }
            c->tapes[mb] = Tape{c->pass_inputs, outs};
            c->pass_outputs = std::move(outs);
        });
    });
}

void backward_body(const graphed_pass_ctx* ctx, Callable* c, bool inputs, bool params) {
    Shared& s = *c->shared;
    const uint32_t mb = ctx->microbatch;
    const bool retain = (inputs && c->wgrad) || s.opts.retain_graph_in_backward;
    s.on_work_stream(ctx->stream, [&] {
        c->pass_grads = c->run_backward(c->tapes[mb], c->pass_gouts, inputs, params, retain, false);
        if (ctx->phase != GRAPHED_PHASE_CAPTURE) return;
        if (inputs)
            for (size_t i = 0; i < c->in.size(); ++i)
                if (c->in_grad[i]) {
                    set_buffer(ctx, GRAPHED_BUFFER_ROLE_GRAD_INPUT, i, c->pass_grads[i]);
                    c->ext_gin[mb].push_back(c->pass_grads[i]);
                }
        if (params) {
            c->ext_pgrad[mb].assign(c->params.size(), at::Tensor());
            for (size_t j = 0; j < c->params.size(); ++j)
                if (c->param_grad[j]) {
                    const at::Tensor& g = c->pass_grads[c->in.size() + j];
                    set_buffer(ctx, GRAPHED_BUFFER_ROLE_PARAM_GRADS, j, g);
                    c->ext_pgrad[mb][j] = g;
                }
        }
    });
}

int32_t backward_cb(const graphed_pass_ctx* ctx, void* self) {
    auto* c = static_cast<Callable*>(self);
    if (!c->shared->opts.training) return 0;
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
        c10::cuda::CUDAStreamGuard guard(s->work);
        s->opts.post_warmup_hook();
        return 0;
    } catch (const std::exception& e) {
        s->hook_error = e.what();
        return 1;
    }
}

int32_t torch_alloc(void* ctx, size_t bytes, graphed_stream, void** out) {
    try {
        // On the caller's current stream, where the grads are used: graphed
        // may write them on a side stream, which the caller's stream joins.
        // (Called during replays only, while the session lives.)
        const c10::DeviceIndex device = static_cast<Shared*>(ctx)->device;
        *out = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes,
                                                                      c10::cuda::getCurrentCUDAStream(device).stream());
        return *out ? 0 : 1;
    } catch (...) {
        return 1;
    }
}

void torch_free(void*, void* ptr, size_t, graphed_stream) { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }

// A tensor over one CLONE grad: its deleter drops the block reference.
at::Tensor wrap_clone(const graphed_ref& r, const at::Tensor& param, c10::DeviceIndex device) {
    graphed_buffer* owner = r.owner;
    return at::from_blob(r.ptr, param.sizes(), [owner](void*) { graphed_buffer_release(owner); },
                         options_of(param.scalar_type(), device));
}

graphed_replay_args replay_args(size_t index, uint32_t mb, cudaStream_t stream, cudaStream_t side,
                                const std::vector<const void*>* data) {
    graphed_replay_args a = graphed_replay_args_default();
    a.callable = static_cast<uint32_t>(index);
    a.microbatch = mb;
    a.stream = stream;
    a.side_stream = side;
    if (data) {
        a.data = data->data();
        a.num_data = data->size();
    }
    return a;
}

// The backward of one replay, as an autograd node: it replays the backward
// graph and returns grads per the frozen policies. It holds the session
// while the autograd graph that may call it exists.
struct GraphedBackward : public torch::autograd::Node {
    std::shared_ptr<Shared> shared;
    size_t index = 0;
    uint32_t microbatch = 0;
    std::optional<c10::cuda::CUDAStream> side;

    // Inputs the graphs read in place (rebound), kept until the backward,
    // with their version counters at the forward.
    std::vector<std::pair<at::Tensor, uint32_t>> held;

    std::string name() const override { return "GraphedBackward"; }

    void release_variables() override { held.clear(); }

    torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
        Shared& s = *shared;
        if (s.is_reset) throw std::runtime_error("graphed: backward of a callable whose session was reset");
        Callable* c = s.callables[index].get();
        for (size_t i = 0; i < held.size(); ++i)
            if (held[i].first.defined() && held[i].first._version() != held[i].second)
                throw std::runtime_error(
                    "graphed callable '" + c->name + "': " + c->input_name(i) +
                    " was modified in place after the forward; its graphs read it where it is (rebind_inputs=True), "
                    "so its backward would use the new values. Modify a copy, or pass rebind_inputs=False to copy "
                    "inputs into the graph's own buffers.");
        std::vector<at::Tensor> contiguous;
        std::vector<const void*> data;
        contiguous.reserve(c->out.size());
        size_t k = 0;
        for (size_t i = 0; i < c->out.size(); ++i) {
            if (!c->out[i].requires_grad) {
                data.push_back(nullptr);
                continue;
            }
            const at::Tensor& g = grads[k++];
            // In the output's layout: the graph reads its grad that way.
            const Meta& m = c->out[i];
            contiguous.push_back(in_layout(g.defined() ? g : at::zeros(m.sizes, options_of(m.dtype, s.device)), m));
            data.push_back(contiguous.back().data_ptr());
        }
        cudaStream_t cur = c10::cuda::getCurrentCUDAStream(s.device).stream();
        cudaStream_t side_stream = side && side->stream() != cur ? side->stream() : nullptr;
        s.rng.prologue(pass_key(s.instance(index, microbatch), Pass::Backward), cur);
        graphed_replay_args a = replay_args(index, microbatch, cur, side_stream, &data);
        std::vector<graphed_ref> gin(c->in.size()), gp(c->params.size());
        graphed_status st = graphed_backward(s.session, &a, gin.data(), gin.size(), gp.data(), gp.size());
        if (st == GRAPHED_STATUS_ALIAS_HELD) s.alias_held(st, "graphed_backward", index, microbatch);
        check(st, "graphed_backward");
        torch::autograd::variable_list result;
        result.reserve(gin.size() + gp.size());
        for (size_t i = 0; i < gin.size(); ++i)
            result.push_back(gin[i].kind == GRAPHED_REF_KIND_NONE
                                 ? at::Tensor()
                                 : s.wrap_alias(gin[i].ptr, c->in[i], gin[i].lease,
                                                gin[i].lease ? c->who(microbatch) + "the grad of " + c->input_name(i)
                                                             : std::string(),
                                                shared));
        for (size_t j = 0; j < gp.size(); ++j) {
            switch (gp[j].kind) {
                case GRAPHED_REF_KIND_CLONE: result.push_back(wrap_clone(gp[j], c->params[j], s.device)); break;
                case GRAPHED_REF_KIND_NONE: result.push_back(at::Tensor()); break;
                default:
                    result.push_back(s.wrap_alias(gp[j].ptr, meta_of(c->params[j]), gp[j].lease,
                                                  gp[j].lease ? c->who(microbatch) + c->param_name(j) + ".grad"
                                                              : std::string(),
                                                  shared));
            }
        }
        return result;
    }
};

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
        c->in_grad.assign(c->in.size(), false);
        c->param_grad.assign(c->params.size(), false);
    }
    c10::cuda::CUDAStreamGuard guard(s.work);
    for (const PassRef& p : order) {
        Callable* c = s.callables[p.callable].get();
        HookEvent e;
        e.pass = p.pass;
        e.microbatch = p.microbatch;
        if (p.pass == Pass::Forward) {
            std::vector<at::Tensor> ins;
            for (size_t i = 0; i < c->samples.size(); ++i)
                ins.push_back(s.opts.training ? c->samples[i].clone().requires_grad_(c->in[i].requires_grad)
                                              : c->samples[i].clone());
            e.inputs = &ins;
            c->call_hook(e);
            std::vector<at::Tensor> outs = c->run_forward(ins);
            if (!c->outputs_known) {
                for (const at::Tensor& y : outs) c->out.push_back(layout_of(y));
                c->outputs_known = true;
            }
            e.before = false;
            e.outputs = &outs;
            c->call_hook(e);
            tapes[p.callable][p.microbatch] = Tape{ins, outs};
            continue;
        }
        if (!s.opts.training) continue;
        auto& go = gouts[p.callable][p.microbatch];
        if (p.pass == Pass::Backward) {
            go.clear();
            for (const Meta& m : c->out)
                go.push_back(m.requires_grad ? in_layout(at::zeros(m.sizes, options_of(m.dtype, s.device)), m) : at::Tensor());
        }
        e.grad_outputs = &go;
        c->call_hook(e);
        Tape& tape = tapes[p.callable][p.microbatch];
        const bool inputs = p.pass == Pass::Backward, params = p.pass == Pass::Wgrad || !c->wgrad;
        std::vector<at::Tensor> grads =
            c->run_backward(tape, go, inputs, params, (inputs && c->wgrad) || s.opts.retain_graph_in_backward, true);
        for (size_t i = 0; inputs && i < c->in.size(); ++i) {
            if (grads[i].defined()) {
                c->in_grad[i] = true;
            } else if (c->in[i].requires_grad && !s.opts.allow_unused_input) {
                throw std::runtime_error("callable '" + c->name + "': " + c->input_name(i) +
                                         " requires grad but got no gradient in the first warmup iteration; pass "
                                         "allow_unused_input=True to accept that (its grad is then None)");
            }
        }
        for (size_t j = 0; params && j < c->params.size(); ++j)
            if (grads[c->in.size() + j].defined()) c->param_grad[j] = true;
        e.before = false;
        e.grads = &grads;
        c->call_hook(e);
    }
}

void register_callable(Shared& s, Callable& c) {
    const uint32_t m = s.microbatches;
    c.tapes.assign(m, Tape());
    c.ext_out.assign(m, {});
    c.ext_gin.assign(m, {});
    c.ext_pgrad.assign(m, {});
    c.shapes.reserve(c.in.size() + c.out.size());
    auto describe_tensor = [&](const Meta& meta, bool requires_grad, const void* sample, bool external) {
        bool exact = true;
        uint32_t code = dtype_code(meta.dtype, &exact);
        c.shapes.push_back(exact ? meta.sizes : std::vector<int64_t>{});
        graphed_tensor_desc t = graphed_tensor_desc_default();
        t.bytes = meta.bytes();
        t.dtype = code;
        t.ndim = uint32_t(c.shapes.back().size());
        t.shape = c.shapes.back().data();
        t.requires_grad = requires_grad ? 1u : 0u;
        t.sample = sample;
        t.flags = uint32_t(external ? GRAPHED_TENSOR_FLAGS_EXTERNAL : GRAPHED_TENSOR_FLAGS_NONE);
        return t;
    };
    // Rebinding: inputs and incoming grads are read where they are. Not with
    // a delayed weight-grad pass, which reads them after the backward, when
    // autograd no longer keeps them.
    const uint32_t rebind = s.opts.rebind_inputs && !c.wgrad ? GRAPHED_TENSOR_FLAGS_REBIND : 0u;
    for (size_t i = 0; i < c.in.size(); ++i) {
        c.tin.push_back(describe_tensor(c.in[i], c.in_grad[i], c.samples[i].data_ptr(), c.in_grad[i]));
        if (at::isFloatingType(c.in[i].dtype)) c.tin.back().flags |= rebind;
    }
    for (const Meta& meta : c.out) {
        c.tout.push_back(describe_tensor(meta, meta.requires_grad, nullptr, true));
        if (meta.requires_grad && at::isFloatingType(meta.dtype)) c.tout.back().flags |= rebind;
    }
    for (size_t j = 0; j < c.params.size(); ++j) {
        const at::Tensor& p = c.params[j];
        bool exact = true;
        uint32_t code = dtype_code(p.scalar_type(), &exact);
        const bool grad = c.param_grad[j];
        uint32_t flags = c.flags[j] | (grad ? GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD : 0u);
        graphed_param_desc pd = graphed_param_desc_default();
        pd.data = p.data_ptr();
        pd.bytes = size_t(p.numel()) * size_t(p.element_size());
        pd.dtype = code;
        pd.flags = flags;
        pd.policy = GRAPHED_GRAD_POLICY_DEFAULT;
        pd.requires_grad = grad ? 1u : 0u;
        c.pdesc.push_back(pd);
    }
    graphed_callable_desc d = graphed_callable_desc_default();
    d.name = c.name.c_str();
    d.num_inputs = c.tin.size();
    d.inputs = c.tin.data();
    d.num_outputs = c.tout.size();
    d.outputs = c.tout.data();
    d.num_params = c.pdesc.size();
    d.params = c.pdesc.data();
    d.forward = forward_cb;
    d.backward = backward_cb;
    d.wgrad = c.wgrad ? wgrad_cb : nullptr;
    d.user_data = &c;
    d.pre_hook = pre_hook;
    d.post_hook = post_hook;
    d.hook_data = &c;
    uint32_t index = 0;
    check(graphed_session_add_callable(s.session, &d, &index), "graphed_session_add_callable");
}

std::vector<uint32_t> resolve_layers(size_t num_callables, const std::vector<graphed_schedule_step>& schedule,
                                     const std::vector<uint32_t>& layers_per_chunk) {
    uint32_t chunks = 0;
    for (const auto& st : schedule) chunks = std::max(chunks, st.chunk + 1);
    if (!layers_per_chunk.empty()) {
        if (layers_per_chunk.size() != chunks)
            throw std::invalid_argument("layers_per_chunk has " + std::to_string(layers_per_chunk.size()) +
                                        " entries; the schedule has " + std::to_string(chunks) + " chunks");
        size_t total = 0;
        for (uint32_t l : layers_per_chunk) {
            if (l == 0) throw std::invalid_argument("layers_per_chunk: every chunk needs at least one layer");
            total += l;
        }
        if (total != num_callables)
            throw std::invalid_argument("the chunks hold " + std::to_string(total) + " layers in all but there are " +
                                        std::to_string(num_callables) + " callables; there must be one callable per layer");
        return layers_per_chunk;
    }
    if (chunks == 0 || num_callables % chunks != 0)
        throw std::invalid_argument(std::to_string(num_callables) + " callables cannot be split evenly into " +
                                    std::to_string(chunks) + " chunks; give layers_per_chunk");
    return std::vector<uint32_t>(chunks, uint32_t(num_callables / chunks));
}

}  // namespace

// ---- schedules -------------------------------------------------------------------------------

std::vector<PassRef> pass_order(size_t n, const std::vector<graphed_schedule_step>& schedule,
                                const std::vector<uint32_t>& layers_per_chunk) {
    std::vector<PassRef> order;
    if (schedule.empty()) {
        for (size_t i = 0; i < n; ++i) order.push_back({uint32_t(i), 0, Pass::Forward});
        for (size_t i = n; i-- > 0;) order.push_back({uint32_t(i), 0, Pass::Backward});
        return order;
    }
    std::vector<uint32_t> layers = resolve_layers(n, schedule, layers_per_chunk);
    std::vector<uint32_t> prefix(layers.size(), 0);
    for (size_t c = 1; c < layers.size(); ++c) prefix[c] = prefix[c - 1] + layers[c - 1];
    std::vector<std::vector<uint32_t>> seen(3, std::vector<uint32_t>(layers.size(), 0));
    for (const auto& st : schedule) {
        if (st.pass > GRAPHED_PASS_WGRAD) throw std::invalid_argument("schedule: unknown pass " + std::to_string(st.pass));
        const uint32_t mb = seen[st.pass][st.chunk]++;
        const uint32_t L = layers[st.chunk];
        for (uint32_t k = 0; k < L; ++k) {
            uint32_t l = st.pass == GRAPHED_PASS_FORWARD ? k : L - 1 - k;
            order.push_back({prefix[st.chunk] + l, mb, Pass(st.pass)});
        }
    }
    return order;
}

std::vector<std::vector<Release>> reuse_releases(size_t n, const std::vector<graphed_schedule_step>& schedule,
                                                 const std::vector<uint32_t>& layers_per_chunk) {
    if (schedule.empty()) throw std::invalid_argument("buffer reuse needs a schedule");
    const std::vector<PassRef> order = pass_order(n, schedule, layers_per_chunk);
    const std::vector<uint32_t> layers = resolve_layers(n, schedule, layers_per_chunk);
    std::vector<uint32_t> chunk_of, layer_of;
    for (uint32_t c = 0; c < layers.size(); ++c)
        for (uint32_t l = 0; l < layers[c]; ++l) {
            chunk_of.push_back(c);
            layer_of.push_back(l);
        }
    std::vector<bool> has_wgrad(chunk_of.size(), false);
    for (const PassRef& p : order)
        if (p.pass == Pass::Wgrad) has_wgrad.at(p.callable) = true;
    std::vector<std::vector<Release>> out(order.size());
    // The input grad of a chunk's first layer is taken by the previous
    // chunk's backward of the same microbatch: it is let go no earlier than
    // that backward's capture.
    auto consumer = [&](size_t from, const PassRef& p) -> size_t {
        uint32_t c = chunk_of.at(p.callable);
        if (c == 0) return 0;
        for (size_t k = from + 1; k < order.size(); ++k)
            if (order[k].pass == Pass::Backward && chunk_of.at(order[k].callable) == c - 1 &&
                order[k].microbatch == p.microbatch)
                return k;
        return order.size();
    };
    std::optional<PassRef> prev_in_step, prev_step_first;
    std::optional<size_t> prev_step_first_at;
    for (size_t k = 0; k < order.size(); ++k) {
        const PassRef& p = order[k];
        if (p.pass == Pass::Wgrad) {
            out[k].push_back({p.callable, p.microbatch, GRAPHED_BUFFER_ROLE_PARAM_GRADS});
            continue;
        }
        if (p.pass != Pass::Backward) continue;
        out[k].push_back({p.callable, p.microbatch, GRAPHED_BUFFER_ROLE_OUTPUT});
        if (!has_wgrad[p.callable]) out[k].push_back({p.callable, p.microbatch, GRAPHED_BUFFER_ROLE_PARAM_GRADS});
        const uint32_t l = layer_of.at(p.callable), L = layers.at(chunk_of.at(p.callable));
        if (l == L - 1) prev_in_step.reset();
        if (prev_in_step) out[k].push_back({prev_in_step->callable, prev_in_step->microbatch, GRAPHED_BUFFER_ROLE_GRAD_INPUT});
        prev_in_step = p;
        if (l == 0) {
            if (prev_step_first) {
                size_t at = std::max(k, consumer(*prev_step_first_at, *prev_step_first));
                if (at < order.size())
                    out[at].push_back({prev_step_first->callable, prev_step_first->microbatch, GRAPHED_BUFFER_ROLE_GRAD_INPUT});
            }
            prev_step_first = p;
            prev_step_first_at = k;
        }
    }
    return out;
}

// ---- make ------------------------------------------------------------------------------------

// graphed's plan of a captured session, as text.
std::string plan_text(graphed_session* session) {
    size_t n = 0;
    check(graphed_session_plan_dump(session, nullptr, 0, &n), "graphed_session_plan_dump");
    std::string text(n + 1, '\0');
    check(graphed_session_plan_dump(session, text.data(), text.size(), &n), "graphed_session_plan_dump");
    text.resize(std::min(n, text.size() - 1));
    return text;
}

// Which inputs capture verified as rebound (the others are copied).
void mark_rebound(Shared& s) {
    for (auto& c : s.callables)
        for (uint32_t m = 0; m < s.microbatches; ++m) {
            std::vector<uint32_t> on(c->in.size());
            check(graphed_session_rebound(s.session, uint32_t(c->index), m, GRAPHED_BUFFER_ROLE_INPUT, on.data(),
                                          on.size()),
                  "graphed_session_rebound");
            c->rebound[m].assign(on.begin(), on.end());
        }
}

std::vector<GraphedCallable> make_graphed_callables(std::vector<CallableSpec> specs, const Options& o) {
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
    s.work = o.capture_stream ? *o.capture_stream : default_work_stream(s.device);
    if (s.work.device_index() != s.device)
        throw std::invalid_argument("capture_stream is on cuda:" + std::to_string(s.work.device_index()) +
                                    ", the samples on cuda:" + std::to_string(s.device));
    for (cudaEvent_t* e : {&s.ev_fork, &s.ev_join, &s.ev_replay})
        cuda_check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    s.pool = o.pool ? *o.pool : at::cuda::graph_pool_handle();
    s.rng.add(at::cuda::detail::getDefaultCUDAGenerator(s.device), s.device);
    for (const at::Generator& g : o.generators) s.rng.add(g, s.device);

    graphed_session_config cfg = graphed_session_config_default();
    cfg.backend = GRAPHED_BACKEND_CUDA;
    cfg.device = s.device;
    cfg.warmup_iterations = uint32_t(std::max(o.num_warmup_iters - 1, 0));
    cfg.clone_param_grads_on_return = o.clone_param_grads_on_return ? 1u : 0u;
    cfg.strict_leases = o.strict_leases ? 1u : 0u;
    // Warmup and capture on the work stream itself, so that the joins around
    // each callback are no-ops (the legacy default stream cannot capture:
    // then graphed's own stream, joined as before).
    if (s.work.stream() != nullptr) cfg.capture_stream = s.work.stream();
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
    check(graphed_session_create(&cfg, &s.session), "graphed_session_create");

    const std::vector<PassRef> order = pass_order(specs.size(), o.schedule, o.layers_per_chunk);
    uint32_t mbs = 1;
    for (const PassRef& p : order) mbs = std::max(mbs, p.microbatch + 1);
    s.microbatches = mbs;
    if (o.reuse_buffers && !o.schedule.empty())
        s.releases = reuse_releases(specs.size(), o.schedule, o.layers_per_chunk);

    for (size_t i = 0; i < specs.size(); ++i) {
        CallableSpec& sp = specs[i];
        auto c = std::make_unique<Callable>();
        c->shared = &s;
        c->index = i;
        c->name = sp.name.empty() ? "callable_" + std::to_string(i) : sp.name;
        c->forward = std::move(sp.forward);
        c->hook = std::move(sp.hook);
        c->input_names = std::move(sp.input_names);
        c->param_names = std::move(sp.param_names);
        c->params = std::move(sp.params);
        c->flags = std::move(sp.param_flags);
        c->flags.resize(c->params.size(), GRAPHED_PARAM_FLAGS_NONE);
        for (const at::Tensor& x : sp.sample_inputs) {
            c->samples.push_back(x.detach().contiguous());
            Meta m = meta_of(x);
            m.requires_grad = m.requires_grad && o.training;
            c->in.push_back(m);
        }
        for (const PassRef& p : order)
            if (p.callable == i && p.pass == Pass::Wgrad) c->wgrad = true;
        s.callables.push_back(std::move(c));
    }

    auto fail = [&](std::string msg) {
        bool rng = false;
        for (auto& c : s.callables)
            if (!c->error.empty()) {
                msg += "\n  callable '" + c->name + "': " + c->error;
                rng = rng || c->error.find("not in capture mode") != std::string::npos;
            }
        if (rng)
            msg += "\n  (a callable draws random numbers from a CUDA generator graphed was not told about: pass it "
                   "in generators=, or register it with graphed.torch.register_generator, so that its numbers are "
                   "drawn afresh at every replay)";
        if (!s.hook_error.empty()) msg += "\n  post_warmup_hook: " + s.hook_error;
        s.reset();
        throw std::runtime_error(msg);
    };
    try {
        // Lazy initialisation stays out of the captures, as in torch.
        c10::cuda::device_synchronize();
        s.work.synchronize();
        {
            c10::cuda::CUDAStreamGuard guard(s.work);
            if (o.pre_warmup_hook) o.pre_warmup_hook();
        }
        discover(s, order);
        for (auto& c : s.callables) register_callable(s, *c);
    } catch (const std::exception& e) {
        fail(std::string("make_graphed_callables: ") + e.what());
    }
    graphed_status st = graphed_session_capture(s.session);
    s.end_routing();
    s.rng.abandon();
    if (st != GRAPHED_STATUS_OK) fail(status_text(st, "graphed_session_capture"));
    for (auto& c : s.callables) {
        c->samples.clear();
        if (!o.retain_graph_in_backward)
            for (Tape& t : c->tapes) t = Tape();
        c->rebound.assign(s.microbatches, std::vector<bool>(c->in.size(), false));
    }
    if (o.rebind_inputs) mark_rebound(s);
    std::vector<GraphedCallable> out;
    for (size_t i = 0; i < s.callables.size(); ++i) out.emplace_back(shared, i);
    return out;
}

// ---- replay ----------------------------------------------------------------------------------

std::vector<at::Tensor> GraphedCallable::operator()(const std::vector<at::Tensor>& inputs, const ReplayOn& on) const {
    Shared& s = *shared_;
    Callable* c = s.callables[index_].get();
    if (s.is_reset) throw std::runtime_error("graphed callable '" + c->name + "': its session was reset");
    if (inputs.size() != c->in.size())
        throw std::invalid_argument("graphed callable '" + c->name + "' takes " + std::to_string(c->in.size()) +
                                    " tensor inputs, got " + std::to_string(inputs.size()));
    // requires_grad matters when a backward may follow.
    const bool grad_mode = s.opts.training && at::GradMode::is_enabled();
    // What the graphs read: each input, or its contiguous copy.
    c10::SmallVector<at::Tensor, 8> read;
    std::vector<const void*> data(inputs.size());
    bool needs_grad = false;
    for (size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor& x = inputs[i];
        const Meta& m = c->in[i];
        if (!x.defined()) throw std::invalid_argument("graphed callable '" + c->name + "': " + c->input_name(i) + " is None");
        const bool rg = x.requires_grad();
        if (x.sizes() != at::IntArrayRef(m.sizes) || x.scalar_type() != m.dtype || !x.is_cuda() ||
            x.device().index() != s.device || (grad_mode && rg != m.requires_grad))
            throw std::invalid_argument("graphed callable '" + c->name + "': " + c->input_name(i) + " is " + describe(x) +
                                        "; it was captured with " +
                                        describe(m.sizes, m.dtype, "cuda:" + std::to_string(s.device),
                                                 grad_mode ? m.requires_grad : rg));
        needs_grad = needs_grad || rg;
        read.push_back(x.is_contiguous() ? x : x.contiguous());
        data[i] = read.back().data_ptr();
    }
    cudaStream_t cur = c10::cuda::getCurrentCUDAStream(s.device).stream();
    cudaStream_t launch = cur, side = nullptr;
    const bool other = on.stream && on.stream->stream() != cur;
    if (other && on.join_event) {
        cuda_check(cudaEventRecord(s.ev_replay, cur), "cudaEventRecord");
        cuda_check(cudaStreamWaitEvent(on.stream->stream(), s.ev_replay, 0), "cudaStreamWaitEvent");
        launch = on.stream->stream();
    } else if (other) {
        side = on.stream->stream();
    }
    s.rng.prologue(pass_key(s.instance(index_, microbatch_), Pass::Forward), launch);
    graphed_replay_args a = replay_args(index_, microbatch_, launch, side, &data);
    c10::SmallVector<graphed_ref, 4> refs(c->out.size());
    graphed_status st = graphed_forward(s.session, &a, refs.data(), refs.size());
    if (st == GRAPHED_STATUS_ALIAS_HELD) s.alias_held(st, "graphed_forward", index_, microbatch_);
    check(st, "graphed_forward");
    if (launch != cur) cuda_check(cudaStreamWaitEvent(cur, on.join_event, 0), "cudaStreamWaitEvent (cuda_graph_event)");
    std::vector<at::Tensor> result;
    result.reserve(refs.size());
    for (size_t i = 0; i < refs.size(); ++i)
        result.push_back(s.wrap_alias(refs[i].ptr, c->out[i], refs[i].lease,
                                      refs[i].lease ? c->who(microbatch_) + "output " + std::to_string(i) : std::string(),
                                      shared_));

    // Autograd: the outputs' grad_fn is a GraphedBackward node whose next
    // edges are the inputs and the parameters, as a custom Function's would.
    for (const at::Tensor& p : c->params) needs_grad = needs_grad || p.requires_grad();
    if (grad_mode && needs_grad) {
        auto node = std::shared_ptr<GraphedBackward>(new GraphedBackward(), torch::autograd::deleteNode);
        node->shared = shared_;
        node->index = index_;
        node->microbatch = microbatch_;
        if (other) node->side = on.stream;
        // Rebound inputs are read by the backward where they are: kept
        // alive until then, with their versions (as autograd's saved
        // tensors are).
        if (s.opts.rebind_inputs) {
            const std::vector<bool>& rebound = c->rebound[microbatch_];
            for (size_t i = 0; i < read.size(); ++i)
                node->held.emplace_back(rebound[i] ? read[i] : at::Tensor(), rebound[i] ? read[i]._version() : 0u);
        }
        node->set_next_edges(torch::autograd::collect_next_edges(inputs, c->params));
        for (size_t i = 0; i < result.size(); ++i)
            if (c->out[i].requires_grad) torch::autograd::set_history(result[i], node);
    }
    return result;
}

void GraphedCallable::backward_dw() const {
    Shared& s = *shared_;
    Callable* c = s.callables[index_].get();
    if (!c->wgrad) return;
    if (s.is_reset) throw std::runtime_error("graphed callable '" + c->name + "': its session was reset");
    cudaStream_t cur = c10::cuda::getCurrentCUDAStream(s.device).stream();
    s.rng.prologue(pass_key(s.instance(index_, microbatch_), Pass::Wgrad), cur);
    graphed_replay_args a = replay_args(index_, microbatch_, cur, nullptr, nullptr);
    std::vector<graphed_ref> gp(c->params.size());
    graphed_status st = graphed_backward_wgrad(s.session, &a, gp.data(), gp.size());
    if (st == GRAPHED_STATUS_ALIAS_HELD) s.alias_held(st, "graphed_backward_wgrad", index_, microbatch_);
    check(st, "graphed_backward_wgrad");
    // Accumulated into param.grad as AccumulateGrad would.
    at::NoGradGuard no_grad;
    for (size_t j = 0; j < gp.size(); ++j) {
        if (gp[j].kind == GRAPHED_REF_KIND_NONE) continue;
        at::Tensor g = gp[j].kind == GRAPHED_REF_KIND_CLONE
                           ? wrap_clone(gp[j], c->params[j], s.device)
                           : s.wrap_alias(gp[j].ptr, meta_of(c->params[j]), gp[j].lease,
                                          gp[j].lease ? c->who(microbatch_) + c->param_name(j) + ".grad" : std::string(),
                                          shared_);
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

const std::vector<at::Tensor>& GraphedCallable::params() const { return shared_->callables[index_]->params; }

std::string GraphedCallable::input_name(size_t i) const { return shared_->callables[index_]->input_name(i); }

GraphedCallable GraphedCallable::for_microbatch(uint32_t microbatch) const {
    if (microbatch >= shared_->microbatches)
        throw std::out_of_range("graphed callable '" + shared_->callables[index_]->name + "' has " +
                                std::to_string(shared_->microbatches) + " microbatch(es), not " +
                                std::to_string(microbatch + 1));
    return GraphedCallable(shared_, index_, microbatch);
}

uint32_t GraphedCallable::microbatches() const { return shared_->microbatches; }

graphed_session_stats GraphedCallable::stats() const {
    graphed_session_stats st = graphed_session_stats_default();
    if (shared_->is_reset) return st;
    check(graphed_session_stats_get(shared_->session, &st), "graphed_session_stats_get");
    return st;
}

std::string GraphedCallable::plan() const { return shared_->is_reset ? std::string() : plan_text(shared_->session); }

std::string library_version() { return graphed_version(); }
std::string header_version() { return GRAPHED_VERSION_STRING; }

}  // namespace graphed_torch
