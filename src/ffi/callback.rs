//! What a forward, backward or weight-grad callback (or a per-callable
//! hook) receives, and the exports it may call while it runs: the scratch
//! allocator and, under capture, the external-buffer hand-over. The
//! in-callback handles are registered for the duration of one call only, so
//! a copy kept past it is reported as destroyed.

use super::args::arg_out;
use super::boundary::boundary;
use super::enums::{graphed_buffer_role, graphed_grad_policy, graphed_pass, graphed_phase};
use super::handles::{get, graphed_capture, graphed_scratch, ptr};
use super::status::graphed_status;
use crate::backend::DevPtr;
use crate::core::handle::{Kind, Scoped};
use crate::core::policy::GradPolicy;
use crate::error::Error;
use crate::orchestrate::external::Provided;
use crate::orchestrate::scratch::Scratch;
use crate::orchestrate::{HookPoint, PassCallbacks, PassView};
use std::ffi::c_void;
use std::mem::size_of;

/// A stream: a `CUstream` (`cudaStream_t`) on the CUDA backend, a host
/// stream on the host backend. NULL is the default stream (the legacy
/// default stream on CUDA; immediate execution on the host).
pub type graphed_stream = *mut c_void;

/// What a forward, backward or weight-grad callback (and a per-callable
/// hook) receives. Every array and pointer is valid during the call only;
/// the buffers they point to are the static buffers, valid while the
/// session is captured. Arrays hold NULL where a buffer does not exist.
#[repr(C)]
pub struct graphed_pass_ctx {
    /// sizeof(graphed_pass_ctx) as the library was built: fields past a
    /// caller's own sizeof are new to it.
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
    /// It is the session's capture stream (or config.capture_stream): the
    /// session's own goes with the session's graphs, at a reset, a failed
    /// capture or the session's destroy; a host stream kept past then is
    /// GRAPHED_STATUS_USE_AFTER_DESTROY wherever it is passed.
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
    /// for backward, and temporaries. Callbacks only (NULL for hooks).
    pub scratch: *mut graphed_scratch,
    /// For graphed_pass_set_buffer: set for callbacks under capture, NULL
    /// otherwise (warmup, hooks).
    pub capture: *mut graphed_capture,
    /// [num_params] the frozen graphed_grad_policy of each parameter
    /// (GRAPHED_GRAD_POLICY_DEFAULT for parameters without a gradient).
    pub param_policies: *const u32,
    /// Under the capture of a step over several microbatches
    /// (graphed_step_desc.microbatches): which microbatch this call
    /// records (0-based), of how many; 0 and 1 otherwise. Work that must
    /// differ per microbatch (random numbers) keys on it.
    pub step_microbatch: u32,
    pub step_microbatches: u32,
    /// Under the capture of a step that loops on the device
    /// (GRAPHED_STEP_LOOP_WHILE): device memory holding the running
    /// microbatch (a uint32_t, 0 to the replay's count - 1) while the body
    /// runs; kernels read it there (step_microbatch is 0 then). NULL
    /// otherwise.
    pub step_microbatch_index: *const u32,
    /// Callables with buckets: which bucket this call records (0-based),
    /// of how many, and its size (the first dimension of its DYNAMIC
    /// tensors); 0, 0 and 0 otherwise.
    pub bucket: u32,
    pub num_buckets: u32,
    pub bucket_size: u64,
    /// Callables with buckets: device memory holding the actual size of
    /// the replay (a uint64_t, at most bucket_size; rows past it are
    /// padding: zeroed inputs and grad-outputs, except a chained input's,
    /// which hold what its producer computed there), for kernels that
    /// must mask or average over the actual rows. It holds bucket_size
    /// during warmup. NULL otherwise.
    pub actual_size: *const u64,
    /// The position of this pass in the session's capture order (0-based):
    /// the order graphed_schedule_passes gives (and graphed_release.after
    /// counts in), bucket round by bucket round for callables with
    /// buckets (round b holds the passes of the callables with more than b
    /// buckets, in that order). The same in every warmup iteration (which
    /// runs the passes in that order), in the pass's own capture, and in
    /// the captures of its clone slots and of a step that repeat it.
    pub capture_position: u32,
    /// The instance this call records: (callable, microbatch, bucket)
    /// numbered callable by callable, microbatch by microbatch, bucket by
    /// bucket: first(c) + microbatch * buckets(c) + bucket, where
    /// buckets(c) is the callable's bucket count (1 without buckets) and
    /// first(c) the sum of microbatches * buckets(k) over the callables k
    /// before c. Dense (0 to graphed_session_stats.instances - 1), fixed
    /// for the session's captured life, and what
    /// graphed_session_instance_of answers after capture.
    pub instance: u32,
    /// Callables with a grid of buckets (graphed_callable_desc.
    /// bucket_sizes2): the bucket's second size (bucket_size is its first;
    /// the bucket is bucket_sizes[bucket / num_buckets2] x
    /// bucket_sizes2[bucket % num_buckets2]), and device memory holding
    /// the replay's actual second size (a uint64_t, as actual_size). 0 and
    /// NULL otherwise.
    pub bucket_size2: u64,
    pub actual_size2: *const u64,
}

/// A forward, backward or weight-grad callback, or a per-callable hook.
/// Return 0 on success; any other value aborts capture with
/// GRAPHED_STATUS_CALLBACK_FAILED and that value in the message.
pub type graphed_pass_fn =
    Option<unsafe extern "C" fn(ctx: *const graphed_pass_ctx, user_data: *mut c_void) -> i32>;

pub(crate) type PassFn = unsafe extern "C" fn(*const graphed_pass_ctx, *mut c_void) -> i32;

/// The callbacks of one callable, as registered.
pub(crate) struct CCallbacks {
    pub forward: PassFn,
    pub backward: PassFn,
    pub wgrad: Option<PassFn>,
    pub user_data: *mut c_void,
    pub pre: Option<PassFn>,
    pub post: Option<PassFn>,
    pub hook_data: *mut c_void,
}

// SAFETY: the user data pointers are the caller's; the API contract is that
// callbacks may run on whichever thread calls graphed_session_capture.
unsafe impl Send for CCallbacks {}

thread_local! {
    /// What the running callback said about its failure.
    static FAILURE: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Attaches a message to the failure of the running callback (or hook) on
/// this thread: call it just before returning non-zero, and the capture
/// error carries the message after the code (C++: an exception's what()).
/// The text is copied. Outside a callback it is kept until the next
/// callback on this thread starts, and then dropped.
///
/// # Safety
/// `message` must be NULL (clears it) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn graphed_callback_fail_message(
    message: *const std::ffi::c_char,
) -> graphed_status {
    boundary("graphed_callback_fail_message", || {
        let text = if message.is_null() {
            None
        } else {
            // SAFETY: NUL-terminated per the contract.
            Some(
                unsafe { std::ffi::CStr::from_ptr(message) }
                    .to_string_lossy()
                    .into_owned(),
            )
        };
        FAILURE.with(|f| *f.borrow_mut() = text);
        Ok(())
    })
}

/// Forgets what an earlier callback on this thread said about its failure
/// (before a callback starts).
pub(super) fn clear_failure() {
    FAILURE.with(|m| m.borrow_mut().take());
}

/// What the callback that just failed on this thread said about it ("":
/// nothing), in the form capture errors append it.
pub(super) fn take_failure() -> String {
    FAILURE
        .with(|m| m.borrow_mut().take())
        .map_or(String::new(), |m| format!(": {m}"))
}

/// Calls `f` with the context of `v`; the in-callback handles live for the
/// call only.
fn call_pass(f: PassFn, v: &PassView, data: *mut c_void) -> std::result::Result<(), i32> {
    FAILURE.with(|m| m.borrow_mut().take());
    let policies: Vec<u32> = v
        .param_policies
        .iter()
        .map(|p| graphed_grad_policy::encode(p.unwrap_or(GradPolicy::Default)))
        .collect();
    let scratch = v.scratch.map(|s| Scoped::new(Kind::Scratch, s.clone()));
    let capture = v.provided.map(|p| Scoped::new(Kind::Capture, p.clone()));
    let ctx = graphed_pass_ctx {
        struct_size: size_of::<graphed_pass_ctx>(),
        callable: v.callable,
        microbatch: v.microbatch,
        pass: graphed_pass::encode(v.pass),
        phase: graphed_phase::encode(v.phase),
        iteration: v.iteration,
        stream: v.stream.0 as graphed_stream,
        num_inputs: v.inputs.len(),
        inputs: v.inputs.as_ptr().cast(),
        num_params: v.params.len(),
        params: v.params.as_ptr().cast(),
        num_outputs: v.outputs.len(),
        outputs: v.outputs.as_ptr().cast(),
        grad_outputs: v.grad_outputs.as_ptr().cast(),
        grad_inputs: v.grad_inputs.as_ptr().cast(),
        param_grads: v.param_grads.as_ptr().cast(),
        tape: v.tape,
        scratch: scratch
            .as_ref()
            .map_or(std::ptr::null_mut(), |h| ptr(h.id())),
        capture: capture
            .as_ref()
            .map_or(std::ptr::null_mut(), |h| ptr(h.id())),
        param_policies: policies.as_ptr(),
        step_microbatch: v.step_microbatch,
        step_microbatches: v.step_microbatches,
        step_microbatch_index: v.step_index as *const u32,
        bucket: v.bucket,
        num_buckets: v.buckets,
        bucket_size: v.bucket_size,
        actual_size: v.actual_size as *const u64,
        capture_position: v.position,
        instance: v.instance,
        bucket_size2: v.bucket_size2,
        actual_size2: v.actual_size2 as *const u64,
    };
    // SAFETY: the caller registered `f` for this purpose; `ctx` and the
    // arrays it points to outlive the call.
    let code = unsafe { f(&ctx, data) };
    drop((scratch, capture));
    match code {
        0 => Ok(()),
        code => Err(code),
    }
}

impl PassCallbacks for CCallbacks {
    fn run(&self, v: &PassView) -> std::result::Result<(), i32> {
        let f = match v.pass {
            crate::core::PassKind::Forward => self.forward,
            crate::core::PassKind::Backward => self.backward,
            crate::core::PassKind::Wgrad => self.wgrad.ok_or(-1)?,
        };
        call_pass(f, v, self.user_data)
    }

    fn has_wgrad(&self) -> bool {
        self.wgrad.is_some()
    }

    fn failure_message(&self) -> Option<String> {
        FAILURE.with(|m| m.borrow_mut().take())
    }

    fn hook(&self, point: HookPoint, v: &PassView) -> std::result::Result<(), i32> {
        match if point == HookPoint::Pre {
            self.pre
        } else {
            self.post
        } {
            Some(f) => call_pass(f, v, self.hook_data),
            None => Ok(()),
        }
    }
}

/// Allocates `bytes` of scratch device memory from the session pool for
/// the callback that received `scratch`. Memory saved for backward is
/// freed by backward (graphed_scratch_free); memory freed in one pass is
/// reused by later passes in capture order. Requests must be the same in
/// every warmup iteration and in capture. More than 2^48 bytes is
/// GRAPHED_STATUS_OUT_OF_MEMORY.
///
/// # Safety
/// `ptr_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_scratch_alloc(
    scratch: *mut graphed_scratch,
    bytes: usize,
    ptr_out: *mut *mut c_void,
) -> graphed_status {
    boundary("graphed_scratch_alloc", || {
        let out = arg_out(ptr_out, "ptr_out")?;
        let s = get::<Scratch, _>(scratch, Kind::Scratch, "scratch")?;
        let p = s.alloc(bytes)?;
        // SAFETY: checked non-NULL; written only on success.
        unsafe { out.write(p as *mut c_void) };
        Ok(())
    })
}

/// Frees a scratch allocation (see graphed_scratch_alloc).
#[no_mangle]
pub extern "C" fn graphed_scratch_free(
    scratch: *mut graphed_scratch,
    ptr: *mut c_void,
) -> graphed_status {
    boundary("graphed_scratch_free", || {
        get::<Scratch, _>(scratch, Kind::Scratch, "scratch")?.free(ptr as DevPtr)
    })
}

/// Provides, during capture, the memory of an external buffer of the
/// running pass: `capture` is the callback's ctx->capture, `role` a
/// graphed_buffer_role (OUTPUT from forward; GRAD_INPUT or PARAM_GRADS from
/// backward, or PARAM_GRADS from the weight-grad callback), `index` the
/// output, input or parameter. The memory must hold the buffer's bytes and
/// stay valid, at that address, while the session's graphs exist; replays
/// return it. Every external buffer of a pass must be provided, or capture
/// fails naming it. Outside capture (ctx->capture NULL):
/// GRAPHED_STATUS_WRONG_STATE; also in the capture of a step
/// (graphed_session_add_step), where each external buffer is already
/// where the pass's own capture provided it (ctx->outputs,
/// ctx->grad_inputs, ctx->param_grads) and the callback writes there.
#[no_mangle]
pub extern "C" fn graphed_pass_set_buffer(
    capture: *mut graphed_capture,
    role: u32,
    index: usize,
    ptr: *mut c_void,
) -> graphed_status {
    boundary("graphed_pass_set_buffer", || {
        if capture.is_null() {
            return Err(Error::state(
                "buffers can only be provided during capture (ctx->capture is NULL in warmup and in hooks), \
                 from the callback of the pass that writes them",
            ));
        }
        let role = graphed_buffer_role::decode(role, "role")?;
        get::<Provided, _>(capture, Kind::Capture, "capture")?.set(role, index, ptr as DevPtr)
    })
}
