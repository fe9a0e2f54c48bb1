// graphed for libtorch, inside: the types and functions the adapter's
// source files share. Private to the adapter (its API is graphed_torch.h);
// every call into graphed goes through graphed.hpp (graphed::Session,
// graphed::Ref, graphed::check), whose errors carry the library's message.
//
// The adapter's files, one concept each:
//   rng.cpp        PyTorch's CUDA generators, made graph-safe around captures and replays
//   streams.cpp    the work stream, the private pool routing, clones from PyTorch's allocator
//   tensors.cpp    tensor facts (Meta), tensors over static buffers and returned refs, fresh grads, leases
//   schedule.cpp   the pass order, shape and releases of buffer reuse (from graphed)
//   callbacks.cpp  graphed's callbacks and hooks: the forward and backward bodies
//   make.cpp       session setup, discovery, registration, capture
//   teardown.cpp   what a session lets go of (release of one callable, reset), the memory report
//   autograd.cpp   replays: GraphedCallable and its autograd node, GraphedBackward
//   step.cpp       a chain of callables with its loss as one step graph: its capture and replay
#pragma once

#include "graphed_torch.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <cuda_runtime_api.h>
#include <graphed.hpp>
#include <torch/headeronly/version.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// ---- the PyTorch versions built against ------------------------------------------------------
//
// The adapter builds on torch 2.11 through 2.15 (python/README.md). Where a
// part of libtorch it needs changed shape between them and no public API
// covers both, the code picks by version, with these names only:
//   GRAPHED_TORCH_CAPTURE_IDS  torch >= 2.12: a CUDA generator keeps the
//                              fields of each capture under that capture's id
//   GRAPHED_TORCH_INTRUSIVE_NODES  torch >= 2.13: autograd nodes are held by
//                              c10::intrusive_ptr (before: std::shared_ptr
//                              with torch::autograd::deleteNode)
#define GRAPHED_TORCH_AT_LEAST(major, minor) \
    (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
#if !GRAPHED_TORCH_AT_LEAST(2, 11)
#error "graphed.torch builds on torch 2.11 or newer (python/README.md)"
#endif
#define GRAPHED_TORCH_CAPTURE_IDS GRAPHED_TORCH_AT_LEAST(2, 12)
#define GRAPHED_TORCH_INTRUSIVE_NODES GRAPHED_TORCH_AT_LEAST(2, 13)

namespace graphed_torch {

inline void cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// ---- tensors (tensors.cpp) ---------------------------------------------------------------

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

Meta meta_of(const at::Tensor& t);
// An output's meta: its strides too when it is dense but not contiguous.
Meta layout_of(const at::Tensor& t);
// `t` in the layout of `m` (itself when it already is, else a copy).
at::Tensor in_layout(const at::Tensor& t, const Meta& m);
// A tensor of layout `m` over memory graphed owns; `deleter` runs when it dies.
at::Tensor over(void* ptr, const Meta& m, const at::TensorOptions& options,
                std::function<void(void*)> deleter = [](void*) {});
at::TensorOptions options_of(at::ScalarType dtype, c10::DeviceIndex device);
// "shape [2, 3], Float, cuda:0, requires_grad=False", for messages.
std::string describe(at::IntArrayRef sizes, at::ScalarType dtype, const std::string& device, bool requires_grad);
std::string describe(const at::Tensor& t);
// graphed's dtype code; types graphed has no code for travel as bytes (U8,
// no shape): graphed only copies them. `*exact` says which.
uint32_t dtype_code(at::ScalarType t, bool* exact);
// Tensors over the static buffers a callback receives (undefined where a
// pointer is NULL), requiring grad per `metas` when `with_grad`.
std::vector<at::Tensor> wrap_static(void* const* ptrs, const std::vector<Meta>& metas, c10::DeviceIndex device,
                                    bool with_grad);
// A tensor over one CLONE grad a replay returned (of a parameter of
// meta `m`); it holds the clone block's reference (taken from `r`) until
// it dies.
at::Tensor wrap_clone(graphed::Ref& r, const Meta& m, c10::DeviceIndex device);
// "0x7f3a...", as graphed writes addresses in its messages.
std::string hex(const void* p);
// "shape [2, 3], Float, cuda:0, contiguous" (or "strides [...]"), for messages.
std::string layout_text(const at::Tensor& t);
std::string layout_text(const Meta& m, const std::string& device);

// ---- PyTorch's CUDA generators, made graph-safe (rng.cpp) -------------------------------------

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

    // What begin() changed, put back by restore(). torch up to 2.11 keeps one
    // capture's fields in the state itself (saved here and set); torch 2.12
    // and later key a capture's fields by its capture id (`drawing`, entered
    // under that id once the capture has begun, then removed).
    struct Saved {
        bool capturing;
        uint64_t intragraph;
        at::TensorBase seed, offset;
    };
    std::vector<Saved> saved;
#if GRAPHED_TORCH_CAPTURE_IDS
    std::vector<c10::intrusive_ptr<at::CUDAGeneratorCaptureState>> drawing;
#endif
    unsigned long long capture_id = 0;
    bool entered = false;
    at::Tensor open_device;
    bool open = false;

    // Draws graph-safely from `g` too (a CUDA generator of `device`).
    void add(const at::Generator& g, c10::DeviceIndex device);
    // Before a capture (outside it): every state draws from this pass's memory.
    void begin(c10::DeviceIndex device);
    // Inside the capture on `stream`, before the pass's first op (where the
    // state is keyed by capture id, the id is known only now). Idempotent.
    void enter(cudaStream_t stream);
    // After the capture: records what pass `key` drew and restores the states.
    void end(size_t key);
    // Before a replay of pass `key` on `stream`: the generators' seeds and
    // offsets go to the pass's memory and the generators advance by what it
    // draws, so that every replay draws fresh numbers. A graph that runs
    // the captured pass `times` times in a loop whose every iteration first
    // moves the offsets in that memory on by one pass's draws (`looped`):
    // the offsets written are one pass's draws back, and the generators
    // advance by `times` passes' draws.
    void prologue(size_t key, cudaStream_t stream, uint32_t times = 1, bool looped = false);
    // Undoes the advance of prologue(key, ..., times) for a replay refused
    // before it enqueued anything (the state memory it wrote is read by
    // nothing).
    void unwind(size_t key, uint32_t times = 1);
    // Restores every state left open by a failed capture.
    void abandon();

  private:
    std::vector<uint64_t> restore();
};

// The key of one captured pass of one (callable, microbatch) instance.
inline size_t pass_key(size_t instance, Pass p) { return instance * 3 + uint32_t(p); }

// ---- streams and pools (streams.cpp) ---------------------------------------------------------

// One stream per device for every session's warmup and capture.
c10::cuda::CUDAStream default_work_stream(c10::DeviceIndex device);

// The blocks PyTorch's caching allocator hands out and frees on one device
// while a grad pass is captured. A grad whose memory none of them overlaps
// but its own allocation is the grad's alone during the pass: the pass's
// graph can be pointed elsewhere for it (GRAPHED_PARAM_FLAGS_REBIND_GRAD)
// without taking another tensor's references (a temporary the pool gave
// the same memory earlier in the pass) along.
struct Watched {
    uintptr_t addr;
    size_t size;
    bool alloc;  // handed out (else freed)
};
// Starts recording for `owner` on `device`; false when another capture
// records (then nothing is, and every grad counts as shared).
bool watch_allocations(const void* owner, c10::DeviceIndex device);
// Stops `owner`'s recording (if it is the one) and returns what it saw.
std::vector<Watched> watched_allocations(const void* owner);
// Whether [p, p + bytes) overlaps nothing in `seen` but its own allocation
// of exactly those bytes, handed out once while `seen` was recorded.
bool alone(const std::vector<Watched>& seen, const void* p, size_t bytes);
// graphed's clone allocator over PyTorch's caching allocator (ctx: the Shared).
int32_t torch_alloc(void* ctx, size_t bytes, graphed_stream, void** out);
void torch_free(void*, void* ptr, size_t, graphed_stream);

// ---- the schedule (schedule.cpp) -------------------------------------------------------------

// What make_graphed_callables needs of a schedule, from graphed: the passes
// in warmup and capture order, the microbatch count, which callables have a
// weight-grad pass (those graphed gives one), and the shape (empty without
// a schedule).
struct SchedulePlan {
    std::vector<PassRef> order;
    uint32_t microbatches = 1;
    std::vector<uint32_t> has_wgrad;  // per callable, 0 or 1
    graphed::ScheduleShape shape;
};
// Throws std::invalid_argument with graphed's message for a schedule that
// breaks one of its rules.
SchedulePlan plan_schedule(size_t num_callables, const std::vector<graphed_schedule_step>& schedule,
                           const std::vector<uint32_t>& layers_per_chunk);

// ---- one callable and the session -------------------------------------------------------------

// What forward left for backward, per microbatch.
struct Tape {
    std::vector<at::Tensor> inputs;   // the leaves forward received
    std::vector<at::Tensor> outputs;  // what it returned
};

// One parameter of a callable: what registration and capture fixed.
struct ParamInfo {
    std::string name;  // empty: "parameter j" in messages
    uint32_t flags = GRAPHED_PARAM_FLAGS_NONE;  // the caller's (DELAYED_WGRAD, ...)
    bool grad = false;                          // registered as taking a grad
    // Its grad's meta (shape and dtype, contiguous), and its own layout
    // (with strides when dense but not contiguous), which every call checks.
    Meta meta, layout;
    // The frozen graphed_grad_policy, as graphed's callbacks and hooks
    // receive it (graphed_pass_ctx.param_policies); DEFAULT until then.
    uint32_t policy = GRAPHED_GRAD_POLICY_DEFAULT;
};

// Buckets: the dimensions of a tensor that follow the bucket's first and
// second size (-1: none).
struct Dims {
    int64_t d1 = -1, d2 = -1;
    bool any() const { return d1 >= 0 || d2 >= 0; }
};

// Buckets: a bucket's sizes or a call's actual ones (the first and, for a
// grid, the second; 0 and 0 without buckets).
struct Sizes {
    int64_t n = 0, n2 = 0;
    bool any() const { return n > 0 || n2 > 0; }
};

// `m` with the dimensions `d` follow set to `at` (those at 0 left).
inline void resize_dims(Meta& m, const Dims& d, const Sizes& at) {
    if (d.d1 >= 0 && at.n > 0) m.sizes[size_t(d.d1)] = at.n;
    if (d.d2 >= 0 && at.n2 > 0) m.sizes[size_t(d.d2)] = at.n2;
}

// A callable's inputs and outputs, as the first warmup iteration found them.
struct Signature {
    std::vector<std::string> input_names;
    std::vector<Meta> in, out;
    std::vector<bool> in_grad;  // the input is registered as taking a grad
    bool outputs_known = false;
    // Buckets: the sizes (ascending; empty: one shape) and, for a grid,
    // the second sizes (empty: none); which inputs and outputs follow a
    // size (in_dyn, out_dyn) and on which dimensions (in_dims, out_dims;
    // their Meta holds the largest bucket's).
    std::vector<int64_t> buckets, buckets2;
    std::vector<bool> in_dyn, out_dyn;
    std::vector<Dims> in_dims, out_dims;
};

// What the caller gave for a callable: its functions and what they hold (a
// module's forward, its parameter dicts), and the samples until capture
// ends. Replays never call them; let go once capture is over.
struct Caller {
    ForwardFn forward;
    Hook hook;
    // Refreshes the parameters from where the caller keeps them.
    ParamSource param_source;
    std::vector<at::Tensor> samples;
};

// One (callable, microbatch) instance: what its passes keep between them.
struct Instance {
    Tape tape;  // what forward left for backward
    // Per bucket (one without buckets): graphed's number of the instance
    // (graphed_pass_ctx.instance), recorded as its passes are captured;
    // it keys the passes' random draws (pass_key).
    std::vector<uint32_t> ids;
    // With a delayed weight-grad pass: the memory of the parameters its
    // last forward read, kept until backward_dw, and (with
    // Options::accumulate_into) the destinations that forward found.
    std::vector<c10::Storage> wgrad_keep;
    std::vector<at::Tensor> wgrad_dsts;
    // Per input: the graphs read it where it is (rebound).
    std::vector<bool> rebound;
    // External buffers handed to graphed (every bucket's outputs and input
    // grads; the last bucket's parameter grads, the earlier buckets' in
    // `bucket_pgrad`), kept while the graphs write there.
    std::vector<at::Tensor> ext_out, ext_gin, ext_pgrad, bucket_pgrad;
    // With buckets: the one buffer per output, input grad and parameter
    // grad that every bucket's graphs write (bucket_home), of the largest
    // bucket's bytes; undefined where each bucket keeps its own.
    std::vector<at::Tensor> home_out, home_gin, home_pgrad;
};

// Between a pass's pre-hook, callback and post-hook.
struct PassState {
    std::vector<at::Tensor> inputs, outputs, gouts, grads;
    // With fresh grads, while its grad pass is captured: per parameter,
    // memory of its own (outside the private pool, made before the capture)
    // that a grad sharing memory with other blocks of the pass is copied
    // into, so that the memory graphed points elsewhere is the grad's alone.
    std::vector<at::Tensor> spare;
    bool watching = false;  // the allocator is watched for this pass
};

struct Callable {
    Shared* shared = nullptr;
    size_t index = 0;
    std::string name;
    Caller caller;
    Signature sig;
    // The parameters as the last call found them (the caller's
    // param_source refreshes them): the autograd node's inputs and
    // backward_dw's destinations.
    std::vector<at::Tensor> params;
    std::vector<ParamInfo> param_info;  // per parameter
    std::vector<Instance> per_mb;       // per microbatch
    bool wgrad = false;                 // has a delayed weight-gradient pass
    bool released = false;              // GraphedCallable::release: calls throw
    PassState pass;
    std::string error;

    std::string input_name(size_t i) const {
        return i < sig.input_names.size() ? sig.input_names[i] : "input " + std::to_string(i);
    }
    // "name (microbatch m): ", the start of every lease's description.
    std::string who(uint32_t mb) const { return name + " (microbatch " + std::to_string(mb) + "): "; }
    std::string param_name(size_t j) const {
        return j < param_info.size() && !param_info[j].name.empty() ? param_info[j].name
                                                                    : "parameter " + std::to_string(j);
    }
    // `metas` (in or out) with `at` as the dimensions the dynamic ones
    // follow (`dims`), contiguous, built in `buf`; `metas` itself, not
    // copied, without sizes (no buckets: the replays' usual path).
    static const std::vector<Meta>& sized(const std::vector<Meta>& metas, const std::vector<Dims>& dims, Sizes at,
                                          std::vector<Meta>& buf) {
        if (!at.any()) return metas;
        buf = metas;
        for (size_t i = 0; i < buf.size() && i < dims.size(); ++i)
            if (dims[i].any()) {
                resize_dims(buf[i], dims[i], at);
                buf[i].strides.clear();
            }
        return buf;
    }
    // What a replay of bucket `bucket` returns of `metas` for a call of
    // sizes `actual`: the dynamic ones of the actual sizes, lying in the
    // bucket's buffer as the bucket's contiguous tensor holds them (rows of
    // a pitch: graphed_ref.rows, pitch), so strided where another
    // dimension than the first is padded. `metas` itself without sizes.
    static const std::vector<Meta>& returned(const std::vector<Meta>& metas, const std::vector<Dims>& dims, Sizes actual,
                                             Sizes bucket, std::vector<Meta>& buf) {
        if (!actual.any()) return metas;
        buf = metas;
        for (size_t i = 0; i < buf.size() && i < dims.size(); ++i) {
            if (!dims[i].any()) continue;
            Meta& m = buf[i];
            resize_dims(m, dims[i], bucket);
            m.strides.assign(m.sizes.size(), 1);
            for (size_t k = m.sizes.size(); k-- > 1;) m.strides[k - 1] = m.strides[k] * m.sizes[k];
            resize_dims(m, dims[i], actual);
        }
        return buf;
    }
    // The forward and backward bodies (callbacks.cpp), shared by discovery
    // and graphed's callbacks; `bucket`: the bucket's sizes (none: no buckets).
    std::vector<at::Tensor> run_forward(const std::vector<at::Tensor>& ins, Sizes bucket = {});
    std::vector<at::Tensor> run_backward(Tape& tape, const std::vector<at::Tensor>& gouts, bool inputs, bool params,
                                         bool retain, bool discover);
    void call_hook(const HookEvent& e) {
        if (caller.hook) caller.hook(e);
    }
    // Lets go of what a pass's hooks and callback shared.
    void end_pass() {
        pass.inputs.clear();
        pass.outputs.clear();
        pass.gouts.clear();
        pass.grads.clear();
    }
    // Ends a watch of the allocator its grad pass started and lets go of
    // the spare memory not taken (post_hook; a failed pass).
    void end_watch() {
        if (pass.watching) watched_allocations(this);
        pass.watching = false;
        pass.spare.clear();
    }
    // Lets go of every tensor kept for its graphs and of the caller's
    // objects (a module's parameter dicts): at its release and at reset
    // (teardown.cpp).
    void let_go();
};

// A step (make_graphed_step): what its declaration, capture and replays share.
struct StepState {
    StepOptions opts;
    uint32_t index = 0;  // graphed's step index
    // Per callable: how many of its leading inputs are the previous
    // callable's outputs (0 for the first).
    std::vector<size_t> chained;
    // The data inputs, copied in per microbatch from `staging` ([N, *shape]).
    struct Data {
        size_t callable, input;
        at::Tensor staging;
    };
    std::vector<Data> data;
    at::Tensor losses;             // [N]: each microbatch's loss, copied out
    std::vector<at::Tensor> dsts;  // per parameter of the step, in order
    size_t rng_key = 0;            // the step's draws (RngStates::passes)
    // A looped step: per generator, what one microbatch draws (written
    // after capture), added at the start of each iteration to the offsets
    // in `loop_offsets` (the step's generator memory; defined only when its
    // passes draw), so that microbatch i draws where eager's i-th would.
    at::Tensor loop_inc, loop_offsets;
    cudaEvent_t done = nullptr;    // after the last replay (staging reusable)
    // Between the capture hook's before and after: the step's capture runs,
    // its callbacks on `stream` (graphed's; allocations there go to the
    // private pool).
    bool capturing = false;
    std::atomic<cudaStream_t> stream{nullptr};
    // During it: each callable's outputs and input grads of the microbatch
    // being captured (the chain).
    std::vector<std::vector<at::Tensor>> outs, gins;
    std::string error;  // of the capture hook
};

// The work stream callbacks run on, joined to graphed's, and the private
// pool its allocations go to while a pass is captured (streams.cpp).
struct Routing {
    c10::cuda::CUDAStream work = c10::cuda::getDefaultCUDAStream();
    cudaEvent_t ev_fork = nullptr, ev_join = nullptr, ev_replay = nullptr;
    c10::MempoolId_t pool{0, 0};
    int pool_refs = 0;     // beginAllocateToPool calls, each released at reset
    bool routing = false;  // allocations go to the pool now
};

// What capture walks through: buffer reuse's releases by capture position
// (graphed_pass_ctx.capture_position), and the post-warmup hook's error.
struct CaptureProgress {
    std::vector<std::vector<Release>> releases;
    std::string hook_error;
};

// Strict leases: what each lease still held is, for messages. Any thread
// (a tensor's deleter) may hold or forget one.
class StrictLeases {
  public:
    void hold(uint64_t id, std::string what);
    void forget(uint64_t id);
    // The descriptions still held that start with `prefix`, sorted.
    std::vector<std::string> alive(const std::string& prefix) const;

  private:
    mutable std::mutex mu_;
    std::unordered_map<uint64_t, std::string> held_;
};

struct Shared {
    std::optional<graphed::Session> session;  // empty once reset
    c10::DeviceIndex device = 0;
    Options opts;
    uint32_t microbatches = 1;
    std::vector<std::unique_ptr<Callable>> callables;
    Routing route;
    RngStates rng;
    CaptureProgress capture;
    std::unique_ptr<StepState> step;  // make_graphed_step only
    bool is_reset = false;
    StrictLeases leases;

    // Owned parameter grads in fresh memory (Options::lazy_clones;
    // tensors.cpp). Each grad graphed does not alias by its own policy
    // (Transformer Engine's delayed weight-grad ones) is registered
    // COPY_INTO with GRAPHED_PARAM_FLAGS_REBIND_GRAD, and every replay of
    // the pass that writes it gives graphed a tensor of PyTorch's caching
    // allocator, allocated then, as its destination: the graph writes the
    // grad straight into it where capture verified it can (graphed copies
    // it there where not), and autograd gets that tensor. No grad handed
    // out is memory a later replay writes, and none is ever moved.
    bool fresh = false;
    // The destinations of the grads of `c` that a replay of its grad pass
    // writes fresh (undefined for the others), allocated on the current
    // stream; empty when none is.
    std::vector<at::Tensor> fresh_grads(const Callable& c) const;
    // Before every replay of pass `key` on `stream`: the generators advanced.
    void before_replay(size_t key, cudaStream_t stream) { rng.prologue(key, stream); }
    // What autograd gets for the grad `r` of callable `c`'s parameter j
    // that a replay (microbatch `mb`) returned: none (no grad, or written
    // into its destination), the clone, or the alias.
    at::Tensor param_grad(const Callable& c, size_t j, uint32_t mb, graphed::Ref& r,
                          const std::shared_ptr<Shared>& self);

    // Every pass key of callable `index` (each microbatch, bucket and pass
    // it was captured in).
    template <class F>
    void for_each_pass_key(size_t index, F&& f) const {
        for (const Instance& in : callables[index]->per_mb)
            for (uint32_t id : in.ids)
                for (Pass p : {Pass::Forward, Pass::Backward, Pass::Wgrad}) f(pass_key(id, p));
    }
    // One past the largest pass key of the callables' captures.
    size_t pass_keys_end() const {
        size_t end = 0;
        for (const auto& c : callables)
            for (const Instance& in : c->per_mb)
                for (uint32_t id : in.ids) end = std::max(end, pass_key(id, Pass::Wgrad) + 1);
        return end;
    }

    // The private pool and the work stream (streams.cpp).
    void begin_routing();
    void end_routing();
    // Runs `fn` with the work stream current, joined to `ext` (graphed's
    // stream) before and after: under capture the work stream joins it.
    void on_work_stream(graphed_stream ext, const std::function<void()>& fn);

    // Runs a replay `fn(session)` of (callable, mb); under strict leases an
    // alias still held becomes AliasHeld naming the tensors still alive.
    template <class F>
    void replay(size_t callable, uint32_t mb, F&& fn) {
        try {
            fn(*session);
        } catch (const graphed::Error& e) {
            if (e.status() == GRAPHED_STATUS_ALIAS_HELD) alias_held(e, callable, mb);
            throw;
        }
    }
    [[noreturn]] void alias_held(const graphed::Error& e, size_t callable, uint32_t mb);
    // replay(), the generators' advance for pass `key` undone when graphed
    // refused the replay (it enqueued nothing); a CUDA error leaves them.
    template <class F>
    void replay_or_unwind(size_t key, size_t callable, uint32_t mb, F&& fn) {
        try {
            replay(callable, mb, std::forward<F>(fn));
        } catch (const AliasHeld&) {
            rng.unwind(key);
            throw;
        } catch (const graphed::Error& e) {
            if (e.status() != GRAPHED_STATUS_CUDA_ERROR) rng.unwind(key);
            throw;
        }
    }

    // A tensor over an ALIAS a replay returned; it keeps the session alive,
    // and under strict leases holds the lease (taken from `r`) until it dies.
    // `what()` describes it in messages (called only for a leased alias).
    template <class Describe>
    at::Tensor wrap_alias(graphed::Ref& r, const Meta& m, Describe&& what, const std::shared_ptr<Shared>& self) {
        if (!r.lease()) return over(r.ptr(), m, options_of(m.dtype, device), [self](void*) {});
        return wrap_leased(r, m, what(), self);
    }
    at::Tensor wrap_leased(graphed::Ref& r, const Meta& m, std::string what, const std::shared_ptr<Shared>& self);
    // graphed_lease_release never waits for the session and never gets
    // BUSY, so a tensor's deleter may call it on any thread.
    void drop_lease(graphed::Lease& lease);

    // With buffer reuse: lets go of what `r` names (schedule.cpp).
    void release(const Release& r);
    // Releases callable `index` (every microbatch of it): graphed's graphs
    // and static buffers only it uses, and what the adapter keeps for it;
    // the last one released resets the session (teardown.cpp).
    void release_callable(size_t index);
    // Throws for a call of `c` after its release or the session's reset.
    void check_live(const Callable& c) const;
    // What it holds, per callable (teardown.cpp).
    SessionMemory memory();
    // Destroys the session and lets go of everything it used (teardown.cpp).
    void reset();
    // Held by reset, release_callable and memory: a report on another thread
    // never reads what a reset or release is freeing.
    std::recursive_mutex teardown_mu;
    // Lets go of the caller's functions: each callable's forward and hook,
    // the warmup hooks, the step's destination. Replays never call them,
    // and what they hold (a module, whose forward attribute holds the
    // graphed callable; a parameter whose grad holds the session) would
    // otherwise be held from here, a cycle no garbage collector sees.
    // Called once capture is over, and by reset (teardown.cpp).
    void drop_callbacks();
    ~Shared();
};

// ---- what broke a callback (failure.cpp) -----------------------------------------------------

// While it lives, notes the torch operators an exception unwinds (on any
// thread; one watch at a time in the process: a watch made while another
// lives notes nothing); `report` names the innermost, where the caller's
// code issued it (set_failure_site) and the exception's first line.
class OperatorWatch {
  public:
    OperatorWatch();
    ~OperatorWatch();
    OperatorWatch(const OperatorWatch&) = delete;
    OperatorWatch& operator=(const OperatorWatch&) = delete;
    std::string report(const std::exception_ptr& e, const char* what) const;

  private:
    void* unwound_ = nullptr;
    uint64_t handle_ = 0;
};

// ---- graphed's callbacks (callbacks.cpp) -----------------------------------------------------

// `body` for a callback of `c`: an exception becomes a non-zero return, its
// message is kept for the capture error, and what broke it (the torch
// operator, the caller's line, the exception's first line) goes to graphed
// (graphed_callback_fail_message), which names it in the capture error.
int32_t guarded(Callable* c, const std::function<void()>& body);
int32_t pre_hook(const graphed_pass_ctx* ctx, void* self);
int32_t post_hook(const graphed_pass_ctx* ctx, void* self);
int32_t forward_cb(const graphed_pass_ctx* ctx, void* self);
int32_t backward_cb(const graphed_pass_ctx* ctx, void* self);
int32_t wgrad_cb(const graphed_pass_ctx* ctx, void* self);
int32_t session_hook(uint32_t when, void* self);

// ---- the step (step.cpp) ---------------------------------------------------------------------

// The forward and backward callbacks while the step's graph is captured
// (StepState::capturing): the chain carried from callable to callable.
int32_t step_forward(const graphed_pass_ctx* ctx, Callable* c);
int32_t step_backward(const graphed_pass_ctx* ctx, Callable* c);

// ---- session setup (make.cpp) ------------------------------------------------------------------

// Enters a session made and captured in the registry of live sessions
// (memory_report; teardown.cpp).
void enroll(const std::shared_ptr<Shared>& s);

// Sets up the session, discovers, registers and captures `specs`;
// `declare` runs between registration and capture (a step's declaration)
// and `captured` after a successful capture. Throws std::runtime_error
// with graphed's message and the callbacks' errors, the session reset.
std::shared_ptr<Shared> make_session(std::vector<CallableSpec> specs, const Options& o,
                                     const std::function<void(Shared&)>& declare,
                                     const std::function<void(Shared&)>& captured);

// The parameters of `c` where they are now, checked (check_params;
// autograd.cpp): `to` holds every parameter's address, for the replay of
// microbatch `mb` to give graphed, which points its graphs at those that
// moved; false when `c` has none. One the graphs cannot read as it is
// throws ParamMoved naming it.
bool params_now(const Shared& s, Callable& c, uint32_t mb, std::vector<const void*>& to);
// The parameters of `c` refreshed from the caller and checked against what
// its graphs read (shape, dtype, device, layout), their addresses aside:
// one that changed throws ParamMoved naming it.
void check_params(const Shared& s, Callable& c, uint32_t mb);

}  // namespace graphed_torch
