/*
 * graphed.hpp: a header-only C++17 layer over graphed.h.
 *
 * Everything here is inline code over the C API and nothing else: it adds no
 * symbol to link and includes only graphed.h and the standard library. It
 * turns statuses into exceptions (graphed::Error, carrying the status and the
 * library's message), owns handles with move-only RAII types (Session,
 * Buffer for a returned clone block, Lease for a strict-mode alias lease,
 * Ref for one returned output or grad), and starts every struct it builds
 * from its graphed_*_default() function, as the C API requires.
 *
 * Callbacks stay C functions. graphed_pass_fn, the allocator, log and hook
 * callbacks and host tasks are called from the library (Rust) through C
 * function pointers: a C++ exception must never leave one. Wrap a callback's
 * body in graphed::guard(), which turns an exception into a non-zero return
 * code (a graphed::Error into its status code), so that capture fails with
 * GRAPHED_STATUS_CALLBACK_FAILED naming it instead of the process ending.
 *
 * The raw C objects stay reachable (Session::get(), Ref::raw(), ...), so
 * C and C++ calls mix freely.
 */

#ifndef GRAPHED_HPP
#define GRAPHED_HPP

#include "graphed.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace graphed {

// ---- errors -------------------------------------------------------------------

/// The name of a status code as the header spells it ("GRAPHED_STATUS_OK").
inline const char* status_name(graphed_status status) noexcept {
    return graphed_status_name(static_cast<uint32_t>(status));
}

/// The message of the last failing graphed call on this thread.
inline std::string last_error_message() { return graphed_last_error_message(); }

/// A failed graphed call: its status and the library's message (which names
/// the function, the argument or object at fault and what to do next).
/// what() is "GRAPHED_STATUS_NAME: message".
class Error : public std::runtime_error {
  public:
    Error(graphed_status status, std::string message)
        : std::runtime_error(std::string(status_name(status)) + ": " + message),
          status_(status),
          message_(std::move(message)) {}

    graphed_status status() const noexcept { return status_; }
    /// The library's message, without the status name.
    const std::string& message() const noexcept { return message_; }

  private:
    graphed_status status_;
    std::string message_;
};

/// Throws graphed::Error with this thread's last error message unless
/// `status` is GRAPHED_STATUS_OK.
inline void check(graphed_status status) {
    if (status != GRAPHED_STATUS_OK) throw Error(status, graphed_last_error_message());
}

/// What graphed::guard returns for an exception that is not a graphed::Error.
constexpr int32_t kCallbackException = -1;

/// Runs a callback body `f` (returning an integer: 0 for success) and
/// returns its result; an exception becomes a non-zero code instead of
/// crossing into the library: a graphed::Error its status code, anything
/// else kCallbackException, and its what() goes with the failure
/// (graphed_callback_fail_message), so the capture error says it. Use it in
/// every callback written in C++:
///
///     static int32_t forward(const graphed_pass_ctx* ctx, void* self) {
///         return graphed::guard([&] { return static_cast<Layer*>(self)->forward(*ctx); });
///     }
template <class F>
int32_t guard(F&& f) noexcept {
    try {
        return static_cast<int32_t>(std::forward<F>(f)());
    } catch (const Error& e) {
        (void)graphed_callback_fail_message(e.what());
        return static_cast<int32_t>(e.status());
    } catch (const std::exception& e) {
        (void)graphed_callback_fail_message(e.what());
        return kCallbackException;
    } catch (...) {
        return kCallbackException;
    }
}

// ---- version and devices --------------------------------------------------------

/// The library's version ("MAJOR.MINOR.PATCH"); GRAPHED_VERSION_STRING is the header's.
inline const char* version() noexcept { return graphed_version(); }

/// The number of CUDA devices (throws NO_DRIVER / NO_DEVICE where there are none).
inline uint32_t device_count() {
    uint32_t n = 0;
    check(graphed_device_count(&n));
    return n;
}

/// The driver's CUDA version, 1000 * major + 10 * minor.
inline int32_t driver_version() {
    int32_t v = 0;
    check(graphed_driver_version(&v));
    return v;
}

/// Whether a backend (a graphed_backend value) can run here; if not, and
/// `why_not` is given, the reason ("GRAPHED_STATUS_NO_DRIVER: ...").
inline bool backend_available(uint32_t backend, std::string* why_not = nullptr) {
    graphed_status s = graphed_backend_available(backend);
    if (s == GRAPHED_STATUS_OK) return true;
    if (why_not) *why_not = std::string(status_name(s)) + ": " + graphed_last_error_message();
    return false;
}

// ---- descriptors ------------------------------------------------------------------

/// The size in bytes of one element of `dtype` (a graphed_dtype value;
/// graphed_dtype_size). Throws INVALID_ARGUMENT for an unknown code.
inline size_t dtype_size(uint32_t dtype) {
    size_t n = 0;
    check(graphed_dtype_size(dtype, &n));
    return n;
}

/// A session config from graphed_session_config_default(), on `backend`.
inline graphed_session_config session_config(uint32_t backend = GRAPHED_BACKEND_CUDA) {
    graphed_session_config c = graphed_session_config_default();
    c.backend = backend;
    return c;
}

/// A tensor descriptor from graphed_tensor_desc_default(): `bytes` of
/// `dtype`, with a grad buffer when `requires_grad`, and (inputs only)
/// `sample` data copied into the static input before warmup. Set `shape`
/// and `ndim` afterwards when the callable wants them.
inline graphed_tensor_desc tensor_desc(size_t bytes, uint32_t dtype = GRAPHED_DTYPE_F32, bool requires_grad = false,
                                       const void* sample = nullptr, uint32_t flags = GRAPHED_TENSOR_FLAGS_NONE) {
    graphed_tensor_desc t = graphed_tensor_desc_default();
    t.bytes = bytes;
    t.dtype = dtype;
    t.requires_grad = requires_grad ? 1u : 0u;
    t.sample = sample;
    t.flags = flags;
    return t;
}

/// A parameter descriptor from graphed_param_desc_default(): the caller's
/// device memory `data` of `bytes` of `dtype`, its grad policy (a
/// graphed_grad_policy value) and flags (graphed_param_flags bits).
inline graphed_param_desc param_desc(void* data, size_t bytes, uint32_t dtype = GRAPHED_DTYPE_F32,
                                     uint32_t policy = GRAPHED_GRAD_POLICY_DEFAULT,
                                     uint32_t flags = GRAPHED_PARAM_FLAGS_NONE, bool requires_grad = true) {
    graphed_param_desc p = graphed_param_desc_default();
    p.data = data;
    p.bytes = bytes;
    p.dtype = dtype;
    p.policy = policy;
    p.flags = flags;
    p.requires_grad = requires_grad ? 1u : 0u;
    return p;
}

/// A callable to register, owning its name and descriptor arrays (fill the
/// arrays with tensor_desc() and param_desc()). Registration copies
/// everything, so a Callable may change or go once it is registered.
struct Callable {
    std::string name;
    std::vector<graphed_tensor_desc> inputs;
    std::vector<graphed_param_desc> params;
    std::vector<graphed_tensor_desc> outputs;
    /// C functions: see the file comment and graphed::guard.
    graphed_pass_fn forward = nullptr;
    graphed_pass_fn backward = nullptr;
    graphed_pass_fn wgrad = nullptr;
    void* user_data = nullptr;
    graphed_pass_fn pre_hook = nullptr;
    graphed_pass_fn post_hook = nullptr;
    void* hook_data = nullptr;
    /// Sizes of the dynamic dimension, strictly ascending (empty: one
    /// shape); see graphed_callable_desc.bucket_sizes.
    std::vector<uint64_t> buckets;
    /// A grid of buckets: sizes of a second dynamic dimension (empty:
    /// none); see graphed_callable_desc.bucket_sizes2.
    std::vector<uint64_t> buckets2;

    /// The C descriptor (from graphed_callable_desc_default()). It points
    /// into this object: use it while this object lives unchanged.
    graphed_callable_desc desc() const {
        graphed_callable_desc d = graphed_callable_desc_default();
        d.name = name.empty() ? nullptr : name.c_str();
        d.num_inputs = inputs.size();
        d.inputs = inputs.empty() ? nullptr : inputs.data();
        d.num_params = params.size();
        d.params = params.empty() ? nullptr : params.data();
        d.num_outputs = outputs.size();
        d.outputs = outputs.empty() ? nullptr : outputs.data();
        d.forward = forward;
        d.backward = backward;
        d.wgrad = wgrad;
        d.user_data = user_data;
        d.pre_hook = pre_hook;
        d.post_hook = post_hook;
        d.hook_data = hook_data;
        d.num_buckets = buckets.size();
        d.bucket_sizes = buckets.empty() ? nullptr : buckets.data();
        d.num_buckets2 = buckets2.size();
        d.bucket_sizes2 = buckets2.empty() ? nullptr : buckets2.data();
        return d;
    }
};

/// A step's update stage (graphed_step_desc.update_check, update_apply,
/// update_data, scalar_bytes): the optimizer captured into the step's graph
/// after the last microbatch's backward, so that one replay runs the whole
/// iteration. `apply` updates the parameters from graphed_update_ctx.grads;
/// `check`, optional, writes *ctx->skip_flag (non-zero skips `apply` on
/// the device this replay); `scalar_bytes` sizes the step's device scalar
/// block (Session::step's `scalars`). C functions, like a Callable's: wrap
/// their bodies in graphed::guard.
struct StepUpdate {
    graphed_update_fn check = nullptr;
    graphed_update_fn apply = nullptr;
    void* data = nullptr;
    size_t scalar_bytes = 0;
};

/// A step's collective stage (graphed_step_desc.collective and what goes
/// with it): `record` enqueues the step's collectives on ctx->stream under
/// capture (never eagerly, never in a conditional node) and declares each
/// with graphed_collective_record; `at` is GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD
/// or GRAPHED_COLLECTIVE_AT_PER_CALLABLE; `exchange`, optional, all-gathers
/// the ranks' manifests at the end of the capture (a mismatch is
/// GRAPHED_STATUS_COLLECTIVE_MISMATCH), `rank` of `ranks`. Destroy the
/// session (or reset it) before the communicator its graphs use. C
/// functions: wrap their bodies in graphed::guard.
struct StepCollective {
    graphed_collective_fn record = nullptr;
    void* data = nullptr;
    uint32_t at = GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD;
    graphed_collective_exchange_fn exchange = nullptr;
    void* exchange_data = nullptr;
    uint32_t rank = 0;
    uint32_t ranks = 1;
};

/// What graphed_step_skipped answers: whether the step's last replay
/// skipped its update, and how many replays did since capture.
struct Skipped {
    bool last = false;
    uint64_t total = 0;
};

// ---- inside callbacks -------------------------------------------------------------

/// Scratch memory for the running callback (graphed_scratch_alloc on
/// ctx.scratch); throws graphed::Error. Callbacks only: hooks get no scratch.
inline void* scratch_alloc(const graphed_pass_ctx& ctx, size_t bytes) {
    void* p = nullptr;
    check(graphed_scratch_alloc(ctx.scratch, bytes, &p));
    return p;
}

/// Frees scratch memory of the running callback.
inline void scratch_free(const graphed_pass_ctx& ctx, void* p) { check(graphed_scratch_free(ctx.scratch, p)); }

/// Hands over an external buffer during capture (graphed_pass_set_buffer on
/// ctx.capture, which is NULL outside capture: WRONG_STATE).
inline void set_buffer(const graphed_pass_ctx& ctx, graphed_buffer_role role, size_t index, void* p) {
    check(graphed_pass_set_buffer(ctx.capture, role, index, p));
}

// ---- what replays return ----------------------------------------------------------

/// One reference to a block of returned clones (the owner of CLONE grads),
/// released when this object goes. Move-only; share() adds a reference.
/// The release is ordered on the stream the clones were returned on, so
/// that stream must outlive this object (docs/lifetimes.md).
class Buffer {
  public:
    Buffer() = default;
    /// Takes over one reference the caller holds (NULL: an empty Buffer).
    static Buffer adopt(graphed_buffer* owner) noexcept { return Buffer(owner); }

    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    Buffer(Buffer&& o) noexcept : raw_(std::exchange(o.raw_, nullptr)) {}
    Buffer& operator=(Buffer&& o) noexcept {
        if (this != &o) {
            reset();
            raw_ = std::exchange(o.raw_, nullptr);
        }
        return *this;
    }
    ~Buffer() { reset(); }

    graphed_buffer* get() const noexcept { return raw_; }
    explicit operator bool() const noexcept { return raw_ != nullptr; }

    /// Another reference to the same block (graphed_buffer_retain).
    Buffer share() const {
        if (raw_) check(graphed_buffer_retain(raw_));
        return Buffer(raw_);
    }
    /// Releases the reference now, reporting a failure (empty afterwards).
    void release() { check(graphed_buffer_release(std::exchange(raw_, nullptr))); }
    /// Releases the reference now; a failure is ignored (as in the destructor).
    void reset() noexcept {
        if (raw_) (void)graphed_buffer_release(std::exchange(raw_, nullptr));
    }
    /// Gives the reference up to the caller, who releases it.
    graphed_buffer* detach() noexcept { return std::exchange(raw_, nullptr); }

  private:
    explicit Buffer(graphed_buffer* raw) noexcept : raw_(raw) {}
    graphed_buffer* raw_ = nullptr;
};

/// A strict-mode lease on an alias (graphed_ref.lease), released when this
/// object goes. graphed_lease_release never waits for calls in progress, so
/// a Lease may go on any thread at any time; after its session is destroyed
/// the release has nothing left to do.
class Lease {
  public:
    Lease() = default;
    /// Takes over `lease` (0: an empty Lease) of `session`.
    Lease(graphed_session* session, uint64_t lease) noexcept : session_(session), id_(lease) {}

    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lease(Lease&& o) noexcept : session_(o.session_), id_(std::exchange(o.id_, 0)) {}
    Lease& operator=(Lease&& o) noexcept {
        if (this != &o) {
            reset();
            session_ = o.session_;
            id_ = std::exchange(o.id_, 0);
        }
        return *this;
    }
    ~Lease() { reset(); }

    uint64_t id() const noexcept { return id_; }
    explicit operator bool() const noexcept { return id_ != 0; }

    /// Releases the lease now, reporting a failure (empty afterwards).
    void release() {
        if (id_) check(graphed_lease_release(session_, std::exchange(id_, 0)));
    }
    /// Releases the lease now; a failure is ignored (as in the destructor).
    void reset() noexcept {
        if (id_) (void)graphed_lease_release(session_, std::exchange(id_, 0));
    }
    /// Gives the lease up to the caller, who releases it.
    uint64_t detach() noexcept { return std::exchange(id_, 0); }

  private:
    graphed_session* session_ = nullptr;
    uint64_t id_ = 0;
};

/// One output or gradient a replay returned: where it is, what it is, and
/// what keeps it valid. A CLONE grad holds a reference to its clone block
/// and a strict-mode alias its lease; both go with the Ref. Move-only.
class Ref {
  public:
    Ref() : raw_() {}
    /// Takes over the owner reference and the lease of `r`, a ref that a
    /// replay of `session` returned.
    Ref(graphed_session* session, const graphed_ref& r) noexcept
        : raw_(r), owner_(Buffer::adopt(r.owner)), lease_(session, r.lease) {}

    Ref(const Ref&) = delete;
    Ref& operator=(const Ref&) = delete;
    Ref(Ref&&) noexcept = default;
    Ref& operator=(Ref&&) noexcept = default;
    ~Ref() = default;

    void* ptr() const noexcept { return raw_.ptr; }
    template <class T>
    T* as() const noexcept {
        return static_cast<T*>(raw_.ptr);
    }
    size_t bytes() const noexcept { return raw_.bytes; }
    /// How the bytes lie: rows() blocks of row_bytes() every pitch() bytes
    /// (one block for contiguous data; see graphed_ref.rows).
    size_t rows() const noexcept { return raw_.rows; }
    size_t row_bytes() const noexcept { return raw_.row_bytes; }
    size_t pitch() const noexcept { return raw_.pitch; }
    graphed_ref_kind kind() const noexcept { return static_cast<graphed_ref_kind>(raw_.kind); }
    /// The clone block this CLONE grad lives in (empty for other kinds).
    const Buffer& owner() const noexcept { return owner_; }
    /// The strict-mode lease of this alias (empty otherwise).
    const Lease& lease() const noexcept { return lease_; }
    Lease& lease() noexcept { return lease_; }
    /// The C ref as the replay wrote it (its owner and lease still belong to this Ref).
    const graphed_ref& raw() const noexcept { return raw_; }

    /// Drops the clone reference and the lease now, reporting a failure.
    /// The pointer is not to be used afterwards.
    void release() {
        owner_.release();
        lease_.release();
    }
    /// Gives the owner reference and the lease up to the caller, who
    /// releases them (graphed_buffer_release, graphed_lease_release).
    graphed_ref detach() noexcept {
        owner_.detach();
        lease_.detach();
        return raw_;
    }

  private:
    graphed_ref raw_;
    Buffer owner_;
    Lease lease_;
};

/// What a backward replay returns.
struct Grads {
    /// One per input: ALIAS, or NONE for inputs that take no grad.
    std::vector<Ref> inputs;
    /// One per parameter, per its frozen grad policy.
    std::vector<Ref> params;
};

/// Arguments of a replay, from graphed_replay_args_default(). Pointers to
/// arrays (data(ptrs, n), param_dsts()) are the caller's and must outlive
/// the replay call; a single data pointer (data(p)) is kept here.
class Replay {
  public:
    Replay() = default;
    explicit Replay(uint32_t callable, uint32_t microbatch = 0) {
        raw_.callable = callable;
        raw_.microbatch = microbatch;
    }

    Replay& callable(uint32_t c) {
        raw_.callable = c;
        return *this;
    }
    /// The actual size of the dynamic dimension (callables with buckets;
    /// graphed_replay_args.size).
    Replay& size(uint64_t n) {
        raw_.size = n;
        return *this;
    }
    /// The actual second size (callables with a grid of buckets;
    /// graphed_replay_args.size2).
    Replay& size2(uint64_t n) {
        raw_.size2 = n;
        return *this;
    }
    /// Device memory holding the actual size (a uint64_t): the bucket is
    /// chosen on the device (graphed_replay_args.device_size; sessions
    /// created with bucket_choice_on_device).
    Replay& device_size(const uint64_t* n) {
        raw_.device_size = n;
        return *this;
    }
    Replay& microbatch(uint32_t m) {
        raw_.microbatch = m;
        return *this;
    }
    Replay& stream(graphed_stream s) {
        raw_.stream = s;
        return *this;
    }
    /// Launch on `s` instead, synced with stream() by events (NULL: none).
    Replay& side_stream(graphed_stream s) {
        raw_.side_stream = s;
        return *this;
    }
    /// One new input (forward) or grad-output (backward).
    Replay& data(const void* p) {
        one_ = p;
        has_one_ = true;
        raw_.data = nullptr;
        raw_.num_data = 1;
        return *this;
    }
    /// One pointer per input or grad-output (the caller's array).
    Replay& data(const void* const* ptrs, size_t n) {
        has_one_ = false;
        raw_.data = ptrs;
        raw_.num_data = n;
        return *this;
    }
    Replay& data(const std::vector<const void*>& ptrs) { return data(ptrs.data(), ptrs.size()); }
    /// Replay on what the static buffers hold.
    Replay& no_data() { return data(nullptr, 0); }
    /// Destinations of COPY_INTO and ACCUMULATE_INTO grads, one per
    /// parameter (the caller's array).
    Replay& param_dsts(void* const* ptrs, size_t n) {
        raw_.param_dsts = ptrs;
        raw_.num_param_dsts = n;
        return *this;
    }
    Replay& param_dsts(const std::vector<void*>& ptrs) { return param_dsts(ptrs.data(), ptrs.size()); }
    /// The parameters' current addresses, one per parameter (the caller's
    /// array; NULL entries: where the graphs read them now). A forward
    /// follows moved parameters registered with GRAPHED_PARAM_FLAGS_REBIND;
    /// others are GRAPHED_STATUS_PARAM_MOVED.
    Replay& params(const void* const* ptrs, size_t n) {
        raw_.params = ptrs;
        raw_.num_params = n;
        return *this;
    }
    Replay& params(const std::vector<const void*>& ptrs) { return params(ptrs.data(), ptrs.size()); }

    uint32_t callable() const noexcept { return raw_.callable; }
    /// The C arguments; they may point into this object.
    graphed_replay_args args() const noexcept {
        graphed_replay_args a = raw_;
        if (has_one_) a.data = &one_;
        return a;
    }

  private:
    graphed_replay_args raw_ = graphed_replay_args_default();
    const void* one_ = nullptr;
    bool has_one_ = false;
};

// ---- schedules --------------------------------------------------------------------

/// Schedule steps from Transformer Engine's `_order` notation (c: forward of
/// chunk c, counted from 1; -c: its backward; -c - 0.5: its weight-grad).
inline std::vector<graphed_schedule_step> schedule_from_te_order(const std::vector<double>& order) {
    std::vector<graphed_schedule_step> steps(order.size());
    check(graphed_schedule_from_te_order(order.data(), order.size(), steps.data(), sizeof(graphed_schedule_step)));
    return steps;
}

/// The shape of a schedule (graphed_schedule_shape).
struct ScheduleShape {
    uint32_t chunks = 0;
    uint32_t microbatches = 0;
    /// Per chunk: its number of layers (callables) and its first callable.
    std::vector<uint32_t> chunk_layers;
    std::vector<uint32_t> chunk_first;
};

/// The shape of `steps` for `num_callables` callables, split over the chunks
/// per `layers_per_chunk` (empty: evenly). Throws INVALID_SCHEDULE with the
/// rule a schedule breaks.
inline ScheduleShape schedule_shape(const std::vector<graphed_schedule_step>& steps, uint32_t num_callables,
                                    const std::vector<uint32_t>& layers_per_chunk = {}) {
    ScheduleShape s;
    const uint32_t* lpc = layers_per_chunk.empty() ? nullptr : layers_per_chunk.data();
    check(graphed_schedule_shape(steps.data(), steps.size(), sizeof(graphed_schedule_step), lpc,
                                 layers_per_chunk.size(), num_callables, &s.chunks, &s.microbatches, nullptr, nullptr,
                                 0));
    s.chunk_layers.resize(s.chunks);
    s.chunk_first.resize(s.chunks);
    check(graphed_schedule_shape(steps.data(), steps.size(), sizeof(graphed_schedule_step), lpc,
                                 layers_per_chunk.size(), num_callables, &s.chunks, &s.microbatches,
                                 s.chunk_layers.data(), s.chunk_first.data(), s.chunk_layers.size()));
    return s;
}

namespace detail {

/// A schedule helper's list (graphed_schedule_passes, _releases): its
/// length asked first, then the list.
template <class T>
using ScheduleListFn = graphed_status (*)(const graphed_schedule_step*, size_t, size_t, const uint32_t*, size_t,
                                          const uint32_t*, uint32_t, T*, size_t, size_t, size_t*);

template <class T>
std::vector<T> schedule_list(ScheduleListFn<T> fn, const std::vector<graphed_schedule_step>& steps,
                             uint32_t num_callables, const std::vector<uint32_t>& layers_per_chunk) {
    const graphed_schedule_step* st = steps.empty() ? nullptr : steps.data();
    const uint32_t* lpc = layers_per_chunk.empty() ? nullptr : layers_per_chunk.data();
    size_t count = 0;
    check(fn(st, steps.size(), sizeof(graphed_schedule_step), lpc, layers_per_chunk.size(), nullptr, num_callables,
             nullptr, 0, sizeof(T), &count));
    std::vector<T> out(count);
    check(fn(st, steps.size(), sizeof(graphed_schedule_step), lpc, layers_per_chunk.size(), nullptr, num_callables,
             out.data(), out.size(), sizeof(T), &count));
    return out;
}

}  // namespace detail

/// The passes of one iteration in warmup and capture order
/// (graphed_schedule_passes) for `num_callables` callables: `steps` (empty:
/// no schedule) expanded, the callables of chunks with weight-grad steps
/// getting a weight-grad pass. Throws INVALID_SCHEDULE with the rule a
/// schedule breaks.
inline std::vector<graphed_pass_ref> schedule_passes(const std::vector<graphed_schedule_step>& steps,
                                                     uint32_t num_callables,
                                                     const std::vector<uint32_t>& layers_per_chunk = {}) {
    return detail::schedule_list<graphed_pass_ref>(&graphed_schedule_passes, steps, num_callables, layers_per_chunk);
}

/// With buffer reuse: the outputs, input grads and copied-out parameter
/// grads each pass of schedule_passes() lets go of
/// (graphed_schedule_releases), ordered by pass.
inline std::vector<graphed_release> schedule_releases(const std::vector<graphed_schedule_step>& steps,
                                                      uint32_t num_callables,
                                                      const std::vector<uint32_t>& layers_per_chunk = {}) {
    return detail::schedule_list<graphed_release>(&graphed_schedule_releases, steps, num_callables,
                                                  layers_per_chunk);
}

/// What graphed holds in this process, over every session
/// (graphed_memory_stats_get).
inline graphed_memory_stats memory_stats() {
    graphed_memory_stats m = graphed_memory_stats_default();
    check(graphed_memory_stats_get(&m));
    return m;
}

// ---- sessions -----------------------------------------------------------------------

/// Free and total device memory as the driver reports them.
struct DeviceMemory {
    size_t free = 0;
    size_t total = 0;
};

/// The bucket a forward replay of a size runs, and its size (the first
/// dimension of its DYNAMIC tensors); 0 and 0 without buckets.
struct Bucket {
    uint32_t index = 0;
    uint64_t size = 0;
    /// A grid's second size (0 otherwise).
    uint64_t size2 = 0;
};

namespace detail {

/// Room for `n` C refs: on the stack for the usual few, else on the heap,
/// so that a replay into reused vectors allocates nothing.
class RefArray {
  public:
    explicit RefArray(size_t n) : n_(n) {
        if (n > kInline) heap_.resize(n);
    }
    graphed_ref* data() noexcept { return n_ > kInline ? heap_.data() : (n_ ? inline_ : nullptr); }

  private:
    static constexpr size_t kInline = 16;
    size_t n_;
    graphed_ref inline_[kInline];
    std::vector<graphed_ref> heap_;
};

inline void adopt_refs(graphed_session* s, graphed_ref* refs, size_t n, std::vector<Ref>& out) {
    out.clear();
    for (size_t i = 0; i < n; ++i) out.emplace_back(s, refs[i]);
}

}  // namespace detail

/// A session (graphed_session_create ... graphed_session_destroy). Move-only.
///
/// The replay methods size their arrays from the counts of the callables
/// registered through add_callable(); a callable registered on get() with
/// the C function cannot be replayed through this class.
///
/// The destructor destroys the session and cannot report a failure: a
/// session destroyed while another call uses it (GRAPHED_STATUS_BUSY) would
/// leak. Call destroy() where that can happen.
///
/// As with the C handle, one call at a time (a concurrent one gets
/// GRAPHED_STATUS_BUSY); the object adds no lock of its own, so
/// add_callable() must not run while another thread replays through it.
class Session {
  public:
    /// Creates a session (graphed_session_create); throws graphed::Error.
    explicit Session(const graphed_session_config& config) { check(graphed_session_create(&config, &raw_)); }

    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
    Session(Session&& o) noexcept
        : raw_(std::exchange(o.raw_, nullptr)), arity_(std::move(o.arity_)), steps_(std::move(o.steps_)) {}
    Session& operator=(Session&& o) noexcept {
        if (this != &o) {
            if (raw_) (void)graphed_session_destroy_when_idle(raw_);
            raw_ = std::exchange(o.raw_, nullptr);
            arity_ = std::move(o.arity_);
            steps_ = std::move(o.steps_);
        }
        return *this;
    }
    /// Destroys the session once no call uses it (a call in progress on
    /// another thread, or a callback of this session, finishes first).
    ~Session() {
        if (raw_) (void)graphed_session_destroy_when_idle(raw_);
    }

    graphed_session* get() const noexcept { return raw_; }
    explicit operator bool() const noexcept { return raw_ != nullptr; }

    /// Destroys the session now (empty afterwards); throws on failure (BUSY
    /// while another call uses it), leaving the session as it was.
    void destroy() {
        check(graphed_session_destroy(raw_));
        raw_ = nullptr;
        arity_.clear();
        steps_.clear();
    }

    /// Registers a callable before capture; returns its index.
    uint32_t add_callable(const graphed_callable_desc& desc) {
        uint32_t index = 0;
        check(graphed_session_add_callable(raw_, &desc, &index));
        if (arity_.size() <= index) arity_.resize(size_t(index) + 1);
        arity_[index] = Arity{desc.num_inputs, desc.num_params, desc.num_outputs, true};
        return index;
    }
    uint32_t add_callable(const Callable& c) { return add_callable(c.desc()); }

    /// Changes a parameter's graphed_param_flags before capture.
    void set_param_flags(uint32_t callable, uint32_t param, uint32_t flags) {
        check(graphed_session_set_param_flags(raw_, callable, param, flags));
    }

    void capture() { check(graphed_session_capture(raw_)); }
    void reset() { check(graphed_session_reset(raw_)); }

    /// Releases one callable of the captured session while the others keep
    /// replaying (graphed_session_release_callable): its graphs, those of
    /// the steps that include it, and the static memory only it uses are
    /// freed; its later replays throw GRAPHED_STATUS_CALLABLE_RELEASED.
    /// Releasing it again does nothing.
    void release_callable(uint32_t callable) { check(graphed_session_release_callable(raw_, callable)); }

    /// What one callable holds (graphed_session_callable_memory).
    graphed_callable_memory callable_memory(uint32_t callable) const {
        graphed_callable_memory m = graphed_callable_memory_default();
        check(graphed_session_callable_memory(raw_, callable, &m));
        return m;
    }

    /// Replays a forward graph; returns one ALIAS Ref per output.
    std::vector<Ref> forward(const Replay& r) {
        std::vector<Ref> out;
        forward(r, out);
        return out;
    }
    /// The same into `outputs` (its capacity reused: no allocation once it has grown).
    void forward(const Replay& r, std::vector<Ref>& outputs) {
        replay_into(&graphed_forward, r, arity(r.callable()).outputs, outputs);
    }

    /// Replays a backward graph; returns the input and parameter grads.
    Grads backward(const Replay& r) {
        Grads g;
        backward(r, g);
        return g;
    }
    void backward(const Replay& r, Grads& grads) {
        const Arity& k = arity(r.callable());
        detail::RefArray in(k.inputs), params(k.params);
        const graphed_replay_args a = r.args();
        check(graphed_backward(raw_, &a, in.data(), k.inputs, params.data(), k.params));
        detail::adopt_refs(raw_, in.data(), k.inputs, grads.inputs);
        detail::adopt_refs(raw_, params.data(), k.params, grads.params);
    }

    /// Replays a weight-grad graph; returns the parameter grads.
    std::vector<Ref> wgrad(const Replay& r) {
        std::vector<Ref> out;
        wgrad(r, out);
        return out;
    }
    void wgrad(const Replay& r, std::vector<Ref>& params) {
        replay_into(&graphed_backward_wgrad, r, arity(r.callable()).params, params);
    }

    graphed_session_stats stats() const {
        graphed_session_stats s = graphed_session_stats_default();
        check(graphed_session_stats_get(raw_, &s));
        return s;
    }

    /// The number of static buffers of one role of (callable, microbatch)
    /// (graphed_session_buffer_count).
    size_t buffer_count(uint32_t callable, uint32_t microbatch, graphed_buffer_role role) const {
        size_t n = 0;
        check(graphed_session_buffer_count(raw_, callable, microbatch, role, &n));
        return n;
    }

    /// The static buffers of one role of (callable, microbatch).
    std::vector<void*> buffers(uint32_t callable, uint32_t microbatch, graphed_buffer_role role) const {
        std::vector<void*> out(buffer_count(callable, microbatch, role));
        check(graphed_session_buffers(raw_, callable, microbatch, role, out.data(), out.size()));
        return out;
    }

    /// Per input (GRAPHED_BUFFER_ROLE_INPUT) or per output's grad-output
    /// (GRAPHED_BUFFER_ROLE_GRAD_OUTPUT): whether replays rebind it (true) or
    /// copy it (false) (graphed_session_rebound).
    std::vector<bool> rebound(uint32_t callable, uint32_t microbatch, graphed_buffer_role role) const {
        std::vector<uint32_t> codes(buffer_count(callable, microbatch, role));
        check(graphed_session_rebound(raw_, callable, microbatch, role, codes.data(), codes.size()));
        return std::vector<bool>(codes.begin(), codes.end());
    }

    /// Per parameter of (callable, microbatch): whether a forward given
    /// another address for it points the graphs there (true) or is refused
    /// with GRAPHED_STATUS_PARAM_MOVED (false) (graphed_session_params_movable).
    std::vector<bool> params_movable(uint32_t callable, uint32_t microbatch = 0) const {
        std::vector<uint32_t> codes(arity(callable).params);
        check(graphed_session_params_movable(raw_, callable, microbatch, codes.data(), codes.size()));
        return std::vector<bool>(codes.begin(), codes.end());
    }

    /// Which bucket a forward replay of `callable` given `size` rows runs
    /// (graphed_session_bucket_of; before capture too).
    Bucket bucket_of(uint32_t callable, uint64_t size) const {
        Bucket b;
        check(graphed_session_bucket_of(raw_, callable, size, &b.index, &b.size));
        return b;
    }

    /// Which bucket of a grid a forward replay of `callable` given `size`
    /// and `size2` runs (graphed_session_bucket_of2; before capture too).
    Bucket bucket_of(uint32_t callable, uint64_t size, uint64_t size2) const {
        Bucket b;
        check(graphed_session_bucket_of2(raw_, callable, size, size2, &b.index, &b.size, &b.size2));
        return b;
    }

    /// The instance number of (callable, microbatch, bucket) of a captured
    /// session: graphed_pass_ctx.instance in its callbacks
    /// (graphed_session_instance_of).
    uint32_t instance_of(uint32_t callable, uint32_t microbatch = 0, uint32_t bucket = 0) const {
        uint32_t n = 0;
        check(graphed_session_instance_of(raw_, callable, microbatch, bucket, &n));
        return n;
    }

    /// Where the graphs of (callable, microbatch) read each parameter now
    /// (graphed_session_param_addresses).
    std::vector<void*> param_addresses(uint32_t callable, uint32_t microbatch = 0) const {
        std::vector<void*> out(arity(callable).params);
        check(graphed_session_param_addresses(raw_, callable, microbatch, out.data(), out.size()));
        return out;
    }

    /// The frozen grad policy of each parameter of a captured callable.
    std::vector<graphed_grad_policy> param_policies(uint32_t callable) const {
        std::vector<uint32_t> codes(arity(callable).params);
        check(graphed_session_param_policies(raw_, callable, codes.data(), codes.size()));
        std::vector<graphed_grad_policy> out;
        out.reserve(codes.size());
        for (uint32_t c : codes) out.push_back(static_cast<graphed_grad_policy>(c));
        return out;
    }

    /// Declares a step before capture (graphed_session_add_step): the
    /// callables, in registration order, and one destination per parameter
    /// of theirs for COPY_INTO / ACCUMULATE_INTO grads (empty: none needed).
    /// A step over `microbatches` microbatches in one graph, with `io`
    /// copies of each microbatch's data in and out (see graphed_step_desc).
    /// `loop_mode` GRAPHED_STEP_LOOP_WHILE holds one microbatch in a
    /// conditional WHILE node, and a replay names how many to run.
    /// `capture_hook` (with `capture_hook_data`) runs before (0) and after
    /// (1) each capture of the step's graph (graphed_step_desc.capture_hook).
    /// `update`: the optimizer the step's graph runs after the backward
    /// passes (see StepUpdate; none by default). `collective`: the
    /// collectives it records before the update (see StepCollective).
    uint32_t add_step(const std::vector<uint32_t>& callables, const std::vector<void*>& param_dsts = {},
                      uint32_t microbatches = 1, const std::vector<graphed_step_io>& io = {},
                      uint32_t loop_mode = GRAPHED_STEP_LOOP_UNROLLED, graphed_session_hook_fn capture_hook = nullptr,
                      void* capture_hook_data = nullptr, const StepUpdate& update = {},
                      const StepCollective& collective = {}) {
        graphed_step_desc d = graphed_step_desc_default();
        d.callables = callables.data();
        d.num_callables = callables.size();
        d.param_dsts = param_dsts.empty() ? nullptr : param_dsts.data();
        d.num_param_dsts = param_dsts.size();
        d.microbatches = microbatches;
        d.io = io.empty() ? nullptr : io.data();
        d.num_io = io.size();
        d.loop_mode = loop_mode;
        d.capture_hook = capture_hook;
        d.capture_hook_data = capture_hook_data;
        d.update_check = update.check;
        d.update_apply = update.apply;
        d.update_data = update.data;
        d.scalar_bytes = update.scalar_bytes;
        d.collective = collective.record;
        d.collective_data = collective.data;
        d.collective_at = collective.at;
        d.collective_exchange = collective.exchange;
        d.collective_exchange_data = collective.exchange_data;
        d.collective_rank = collective.rank;
        d.collective_ranks = collective.ranks;
        uint32_t index = 0;
        check(graphed_session_add_step(raw_, &d, &index));
        step_params(index);
        return index;
    }

    /// One io entry of a step (graphed_step_io): `role`'s buffer `index` of
    /// `callable`, microbatch i at `ptr + i * stride`.
    static graphed_step_io step_io(uint32_t callable, uint32_t role, uint32_t index, void* ptr, size_t stride) {
        graphed_step_io e = graphed_step_io_default();
        e.callable = callable;
        e.role = role;
        e.index = index;
        e.ptr = ptr;
        e.stride = stride;
        return e;
    }

    /// Replays a step on `stream`; `params` gets one Ref per parameter of
    /// its callables, in order (its capacity reused). `at`, when not empty,
    /// holds the parameters' current addresses (graphed_step_args.params).
    /// `microbatches`: how many this replay runs (0: all). `scalars` (with
    /// `scalar_bytes`, the whole block): new values of the step's scalar
    /// block, copied in before its graph runs (NULL: it keeps its values).
    void step(uint32_t step, graphed_stream stream, std::vector<Ref>& params,
              const std::vector<const void*>& at = {}, uint32_t microbatches = 0, const void* scalars = nullptr,
              size_t scalar_bytes = 0) {
        const size_t n = step_params(step);
        graphed_step_args a = graphed_step_args_default();
        a.step = step;
        a.stream = stream;
        a.params = at.empty() ? nullptr : at.data();
        a.num_params = at.size();
        a.microbatches = microbatches;
        a.scalars = scalars;
        a.scalar_bytes = scalar_bytes;
        detail::RefArray refs(n);
        check(graphed_step_replay(raw_, &a, refs.data(), n));
        detail::adopt_refs(raw_, refs.data(), n, params);
    }

    /// A step replay given new scalars: `scalars` is the whole block, as a
    /// trivially copyable struct (its sizeof the step's scalar_bytes).
    template <class Scalars>
    void step_with(uint32_t step, graphed_stream stream, std::vector<Ref>& params, const Scalars& scalars,
                   uint32_t microbatches = 0) {
        static_assert(std::is_trivially_copyable<Scalars>::value, "scalars are copied as bytes");
        this->step(step, stream, params, {}, microbatches, &scalars, sizeof(Scalars));
    }

    /// The collectives `step`'s graph records, in order
    /// (graphed_step_collectives).
    std::vector<graphed_collective_entry> collectives(uint32_t step) const {
        size_t n = 0;
        check(graphed_step_collectives(raw_, step, nullptr, 0, sizeof(graphed_collective_entry), &n));
        std::vector<graphed_collective_entry> out(n);
        check(graphed_step_collectives(raw_, step, out.data(), n, sizeof(graphed_collective_entry), &n));
        out.resize(n);
        return out;
    }

    /// Whether the last replay of `step` skipped its update, and how many
    /// did (graphed_step_skipped: waits for that replay to finish).
    Skipped skipped(uint32_t step) const {
        uint32_t last = 0;
        Skipped out;
        check(graphed_step_skipped(raw_, step, &last, &out.total));
        out.last = last != 0;
        return out;
    }

    /// The static-buffer plan as text (graphed_session_plan_dump).
    std::string plan_dump() const {
        size_t len = 0;
        check(graphed_session_plan_dump(raw_, nullptr, 0, &len));
        std::string text(len + 1, '\0');
        check(graphed_session_plan_dump(raw_, &text[0], text.size(), &len));
        text.resize(len < text.size() ? len : text.size() - 1);
        return text;
    }

    /// The captured graphs as Graphviz DOT text
    /// (graphed_session_export_dot): one cluster per graph, labelled with
    /// its callable, pass, microbatch and bucket (or step) and which graph
    /// it is; each node with its kind and kernel name.
    std::string export_dot() const {
        size_t len = 0;
        check(graphed_session_export_dot(raw_, nullptr, 0, &len));
        std::string text(len + 1, '\0');
        check(graphed_session_export_dot(raw_, &text[0], text.size(), &len));
        text.resize(len < text.size() ? len : text.size() - 1);
        return text;
    }

    /// The driver's free and total memory (UNSUPPORTED on the host backend).
    DeviceMemory device_memory() const {
        DeviceMemory m;
        check(graphed_session_device_memory(raw_, &m.free, &m.total));
        return m;
    }

  private:
    using ReplayFn = graphed_status (*)(graphed_session*, const graphed_replay_args*, graphed_ref*, size_t);

    // A replay that returns one array of `n` refs.
    void replay_into(ReplayFn fn, const Replay& r, size_t n, std::vector<Ref>& out) {
        detail::RefArray refs(n);
        const graphed_replay_args a = r.args();
        check(fn(raw_, &a, refs.data(), n));
        detail::adopt_refs(raw_, refs.data(), n, out);
    }

    struct Arity {
        size_t inputs = 0, params = 0, outputs = 0;
        bool known = false;
    };

    // The counts of a callable: remembered from add_callable, else asked of
    // the library once.
    const Arity& arity(uint32_t callable) const {
        if (callable >= arity_.size() || !arity_[callable].known) {
            Arity k;
            check(graphed_session_callable_arity(raw_, callable, &k.inputs, &k.params, &k.outputs));
            k.known = true;
            if (arity_.size() <= callable) arity_.resize(size_t(callable) + 1);
            arity_[callable] = k;
        }
        return arity_[callable];
    }

    // The refs a step's replay writes (graphed_step_param_count):
    // remembered from add_step, else asked of the library once.
    size_t step_params(uint32_t step) const {
        if (step >= steps_.size() || !steps_[step].known) {
            Count c;
            check(graphed_step_param_count(raw_, step, &c.n));
            c.known = true;
            if (steps_.size() <= step) steps_.resize(size_t(step) + 1);
            steps_[step] = c;
        }
        return steps_[step].n;
    }

    struct Count {
        size_t n = 0;
        bool known = false;
    };

    graphed_session* raw_ = nullptr;
    mutable std::vector<Arity> arity_;
    mutable std::vector<Count> steps_;
};

static_assert(!std::is_copy_constructible<Session>::value && std::is_nothrow_move_constructible<Session>::value,
              "Session is move-only");
static_assert(!std::is_copy_constructible<Ref>::value && std::is_nothrow_move_constructible<Ref>::value,
              "Ref is move-only");

}  // namespace graphed

#endif  // GRAPHED_HPP
