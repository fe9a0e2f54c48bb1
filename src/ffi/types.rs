//! The C structs and callback types of the session API. Enum-valued fields
//! the caller fills are `uint32_t` (validated, never undefined behaviour);
//! config structs start with `struct_size` and have a `_default()`
//! initialiser, and grow only at the end.

use std::ffi::{c_char, c_void};

use crate::core::schedule::ScheduleStep;
use crate::orchestrate::RefKind;

/// A stream: a `CUstream` (`cudaStream_t`) on the CUDA backend, a host
/// stream on the host backend. NULL is the default stream (the legacy
/// default stream on CUDA; immediate execution on the host).
pub type graphed_stream = *mut c_void;

/// A static input or output of a callable.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_tensor_desc {
    /// Size in bytes (non-zero, a multiple of the element size).
    pub bytes: usize,
    /// A graphed_dtype value.
    pub dtype: u32,
    /// Number of dimensions of `shape` (0: no shape, only bytes).
    pub ndim: u32,
    /// `ndim` dimensions; when given, their product times the element size
    /// must equal `bytes`. Copied at registration.
    pub shape: *const i64,
    /// Inputs: a grad-input buffer is made and backward writes it.
    /// Outputs: a grad-output buffer is made and backward reads it.
    pub requires_grad: bool,
    /// Inputs only: device pointer to `bytes` of sample data, copied into
    /// the static input before warmup (NULL: the static input starts
    /// zeroed). Read during graphed_session_capture only.
    pub sample: *const c_void,
    /// graphed_tensor_flags bits: GRAPHED_TENSOR_FLAGS_EXTERNAL makes the
    /// buffer the callable writes for this tensor (an output, or an input's
    /// grad) memory its callback provides at capture.
    pub flags: u32,
}

/// Flags of a graphed_tensor_desc (bit set).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_tensor_flags {
    None = 0,
    /// The library places no buffer for what the callable writes for this
    /// tensor (the output itself, or the grad of an input): the callback
    /// writes it wherever it likes and, during capture, hands its address to
    /// graphed_pass_set_buffer (it must stay valid while the session's
    /// graphs exist). Replays return that address. For frameworks that
    /// allocate outputs and grads themselves (PyTorch).
    External = 1,
}

/// A parameter of a callable. The library never writes `data`; it hands
/// the pointer to the callbacks.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_param_desc {
    /// Caller-owned device pointer to the parameter; must stay valid while
    /// the session's graphs exist (they bake it in).
    pub data: *mut c_void,
    pub bytes: usize,
    /// A graphed_dtype value.
    pub dtype: u32,
    /// graphed_param_flags bits (GRAPHED_PARAM_FLAGS_DELAYED_WGRAD,
    /// GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD).
    pub flags: u32,
    /// A graphed_grad_policy value: GRAPHED_GRAD_POLICY_DEFAULT lets capture
    /// decide (CLONE; ALIAS for delayed-wgrad parameters or when the
    /// session opts out of clones).
    pub policy: u32,
    /// Whether the parameter takes a gradient (a slot in the grad slab).
    pub requires_grad: bool,
}

/// Opaque: the scratch allocator a callback gets (graphed_scratch_alloc,
/// graphed_scratch_free). Valid only during the callback.
pub struct graphed_scratch {
    _private: [u8; 0],
}

/// What a forward, backward or weight-grad callback (and a per-callable
/// hook) receives. Every array and pointer is valid during the call only;
/// the buffers they point to are the static buffers, valid while the
/// session is captured. Arrays hold NULL where a buffer does not exist.
#[repr(C)]
pub struct graphed_pass_ctx {
    pub struct_size: usize,
    /// Index of the callable, as returned by graphed_session_add_callable.
    pub callable: u32,
    pub microbatch: u32,
    /// A graphed_pass value: which pass this call records.
    pub pass: u32,
    /// A graphed_phase value: WARMUP (runs now) or CAPTURE (recorded).
    pub phase: u32,
    /// The warmup iteration (0-based); the warmup count during capture.
    pub iteration: u32,
    /// Enqueue all work here: a CUstream on CUDA (never the legacy default
    /// stream), a host stream (graphed_host_enqueue) on the host backend.
    pub stream: graphed_stream,
    pub num_inputs: usize,
    /// Static inputs (read).
    pub inputs: *const *mut c_void,
    pub num_params: usize,
    /// The caller's parameter pointers, as registered.
    pub params: *const *mut c_void,
    pub num_outputs: usize,
    /// Static outputs: forward writes them; backward may read them.
    pub outputs: *const *mut c_void,
    /// [num_outputs] static grad-outputs: backward reads them.
    pub grad_outputs: *const *mut c_void,
    /// [num_inputs] static grad-inputs: backward writes them.
    pub grad_inputs: *const *mut c_void,
    /// [num_params] parameter-grad slots (one slab): backward writes them,
    /// or the weight-grad callback for callables that have one.
    pub param_grads: *const *mut c_void,
    /// One pointer-sized slot per (callable, microbatch), shared by its
    /// passes: forward may leave a pointer (e.g. to saved scratch) for
    /// backward.
    pub tape: *mut *mut c_void,
    /// Scratch memory from the session pool for tensors saved from forward
    /// for backward, and temporaries.
    pub scratch: *mut graphed_scratch,
    /// Used by graphed_pass_set_buffer (NULL outside capture).
    pub capture: *mut c_void,
}

/// A forward, backward or weight-grad callback, or a per-callable hook.
/// Return 0 on success; any other value aborts capture with
/// GRAPHED_STATUS_CALLBACK_FAILED and that value in the message.
pub type graphed_pass_fn =
    Option<unsafe extern "C" fn(ctx: *const graphed_pass_ctx, user_data: *mut c_void) -> i32>;

/// A session hook (before / after warmup): `when` is 0 before, 1 after.
pub type graphed_session_hook_fn =
    Option<unsafe extern "C" fn(when: u32, user_data: *mut c_void) -> i32>;

/// Allocates `bytes` of device memory for returned clones, ordered on
/// `stream`; writes the pointer to `*ptr_out` and returns 0.
pub type graphed_alloc_fn = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        bytes: usize,
        stream: graphed_stream,
        ptr_out: *mut *mut c_void,
    ) -> i32,
>;

/// Frees memory from the matching graphed_alloc_fn, ordered on `stream`.
pub type graphed_free_fn = Option<
    unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, bytes: usize, stream: graphed_stream),
>;

/// Receives log messages (`level` is a graphed_log_level value).
pub type graphed_log_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, level: u32, message: *const c_char)>;

/// A callable to register. Initialise with graphed_callable_desc_default().
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_callable_desc {
    pub struct_size: usize,
    /// Name used in messages (copied; NULL: "callable N").
    pub name: *const c_char,
    pub num_inputs: usize,
    pub inputs: *const graphed_tensor_desc,
    pub num_params: usize,
    pub params: *const graphed_param_desc,
    pub num_outputs: usize,
    pub outputs: *const graphed_tensor_desc,
    /// Required.
    pub forward: graphed_pass_fn,
    /// Required.
    pub backward: graphed_pass_fn,
    /// Optional delayed weight-gradient callback: when set, backward
    /// computes only input grads, this callback fills the parameter-grad
    /// slots, it is captured as its own graph, and
    /// graphed_backward_wgrad replays it and returns the parameter grads.
    pub wgrad: graphed_pass_fn,
    /// Passed to forward, backward and wgrad.
    pub user_data: *mut c_void,
    /// Optional hooks around every callback call, outside capture.
    pub pre_hook: graphed_pass_fn,
    pub post_hook: graphed_pass_fn,
    pub hook_data: *mut c_void,
}

/// Session configuration. Initialise with graphed_session_config_default().
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_session_config {
    pub struct_size: usize,
    /// A graphed_backend value (default GRAPHED_BACKEND_CUDA).
    pub backend: u32,
    /// CUDA device ordinal (default 0).
    pub device: i32,
    /// Eager iterations before capture (default 3). At least 1 when
    /// callbacks use the scratch allocator.
    pub warmup_iterations: u32,
    /// A graphed_capture_mode value (default GRAPHED_CAPTURE_MODE_GLOBAL).
    pub capture_mode: u32,
    /// Return parameter grads as owned clones (default true). False makes
    /// them aliases of static buffers that the next backward overwrites.
    pub clone_param_grads_on_return: bool,
    /// Report a replay that would overwrite a held alias (default false).
    pub strict_leases: bool,
    /// Optional allocator for returned clones (both or neither).
    pub clone_alloc: graphed_alloc_fn,
    pub clone_free: graphed_free_fn,
    pub allocator_ctx: *mut c_void,
    /// Optional log callback, and the most verbose level it receives
    /// (a graphed_log_level value, default GRAPHED_LOG_LEVEL_WARN).
    pub log: graphed_log_fn,
    pub log_ctx: *mut c_void,
    pub log_level: u32,
    /// Optional hook before (when = 0) and after (when = 1) warmup.
    pub warmup_hook: graphed_session_hook_fn,
    pub warmup_hook_data: *mut c_void,
    /// Optional: share the scratch pool of this other session (same backend
    /// and device). Graphs sharing a pool must be replayed in capture order.
    pub share_pool_with: *mut super::graphed_session,
    /// Optional pipeline schedule: `num_schedule_steps` steps (forward,
    /// backward or weight-grad of a chunk), in the order they run. Copied.
    /// NULL: one microbatch, forwards in registration order, then backwards
    /// in reverse.
    pub schedule: *const ScheduleStep,
    pub num_schedule_steps: usize,
    /// Optional number of layers (callables, in registration order) of each
    /// chunk; NULL: the callables split evenly over the chunks.
    pub layers_per_chunk: *const u32,
    pub num_layers_per_chunk: usize,
    /// Share memory between static buffers whose lifetimes do not overlap
    /// (needs a schedule; default false). Outputs are then valid only until
    /// their backward, and input grads until the next backward replay.
    pub reuse_buffers: bool,
}

/// Arguments of a replay call. Initialise with graphed_replay_args_default().
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_replay_args {
    pub struct_size: usize,
    pub callable: u32,
    /// 0 unless the session has a pipeline schedule.
    pub microbatch: u32,
    /// The caller's stream; the replay is ordered on it.
    pub stream: graphed_stream,
    /// Optional: launch there instead, synced with `stream` by events.
    pub side_stream: graphed_stream,
    /// New data to copy into the static inputs (forward) or grad-outputs
    /// (backward), one device pointer per input/output; an entry equal to
    /// the static buffer is not copied. NULL array: replay on what the
    /// static buffers hold.
    pub data: *const *const c_void,
    pub num_data: usize,
    /// Destinations of COPY_INTO and ACCUMULATE_INTO parameter slots, one
    /// per parameter (NULL entries for other slots); NULL array when the
    /// callable has no such slot.
    pub param_dsts: *const *mut c_void,
    pub num_param_dsts: usize,
}

/// Opaque: an owned block of returned clones. Each CLONE grad carries one
/// reference; release each with graphed_buffer_release.
pub struct graphed_buffer {
    _private: [u8; 0],
}

/// One output or gradient handed back by a replay.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_ref {
    /// Device pointer (NULL when kind is GRAPHED_REF_KIND_NONE).
    pub ptr: *mut c_void,
    pub bytes: usize,
    pub kind: RefKind,
    /// CLONE: one reference to the block holding the clone; release it
    /// with graphed_buffer_release. NULL otherwise.
    pub owner: *mut graphed_buffer,
    /// ALIAS under strict leases: release with graphed_lease_release when
    /// done with the alias. 0 otherwise.
    pub lease: u64,
}

/// Memory and graph figures of a session (library accounting).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_session_stats {
    pub struct_size: usize,
    /// Bytes of static buffers (inputs, outputs, grads, slabs).
    pub static_bytes: u64,
    /// Bytes of the scratch arena this session's graphs use.
    pub scratch_bytes: u64,
    /// Bytes held by the (possibly shared) scratch pool.
    pub pool_bytes: u64,
    /// Bytes and blocks of returned clones not yet released.
    pub clone_bytes_outstanding: u64,
    pub clone_blocks_outstanding: u64,
    pub graph_count: u32,
    pub callables: u32,
    pub instances: u32,
    /// Strict leases currently held.
    pub leases_held: u32,
    pub captured: bool,
    /// Static bytes the same buffers would take without reuse.
    pub static_bytes_without_reuse: u64,
    /// The most static bytes live at one pass: no plan can use less.
    pub peak_live_bytes: u64,
    /// Microbatches per callable (1 without a schedule).
    pub microbatches: u32,
}
