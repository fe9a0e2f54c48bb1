// graphed for libtorch, inside: the data model of one callable (its
// parameters, instances per microbatch, signature, the caller, the pass in
// progress) and of the session the callables of one make share (routing,
// capture progress, strict leases, steps). Private to the adapter;
// included through internal.h.
#pragma once

#include "tools.h"

namespace graphed_torch {

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

}  // namespace graphed_torch
