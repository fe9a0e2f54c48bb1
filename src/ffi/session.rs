//! Session exports: create/destroy, registration, capture, replay, grad
//! return, leases, queries; plus the scratch allocator and returned-buffer
//! exports that callbacks and callers use. Each function checks its
//! arguments, converts C structs into orchestration types and calls one
//! orchestration method. The C callbacks are adapted to the orchestration
//! traits here.

use super::types::*;
use super::{arg_out, arg_slice, boundary, graphed_status, read_sized};
use crate::backend::cuda::CudaBackend;
use crate::backend::host::HostBackend;
use crate::backend::{Backend, BackendKind, CaptureMode, DevPtr, StreamRef};
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::core::policy::{GradPolicy, ParamSpec};
use crate::error::{Error, PassKind, Result};
use crate::orchestrate::external::Provided;
use crate::orchestrate::scratch::Scratch;
use crate::orchestrate::{
    returned, CallableSpec, CloneAllocator, HookPoint, LogLevel, PassCallbacks, PassView,
    ReplayArgs, Returned, ScheduleSpec, Session, SessionOptions, TensorSpec,
};
use std::collections::HashSet;
use std::ffi::{c_void, CStr, CString};
use std::mem::size_of;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};

// Device pointers cross the ABI as `void*` and live inside as u64.
const _: () = assert!(size_of::<*const c_void>() == size_of::<DevPtr>());

/// Opaque session handle.
pub struct graphed_session {
    inner: Mutex<Session>,
}

fn sessions() -> MutexGuard<'static, HashSet<usize>> {
    static LIVE: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn busy() -> Error {
    Error::Busy(
        "the session is in use by another call: a callback called back into its own session, \
         or two threads used it at once"
            .into(),
    )
}

/// Runs `f` on a live, unlocked session.
fn with_session<T>(
    p: *mut graphed_session,
    f: impl FnOnce(&mut Session) -> Result<T>,
) -> Result<T> {
    if p.is_null() {
        return Err(Error::NullPointer { what: "session" });
    }
    if !sessions().contains(&(p as usize)) {
        return Err(Error::UseAfterDestroy(format!(
            "session 0x{:x} was destroyed (or never created)",
            p as usize
        )));
    }
    // SAFETY: registered pointers are live Box<graphed_session>es; they are
    // unregistered before they are freed.
    let s = unsafe { &*p };
    let mut guard = match s.inner.try_lock() {
        Ok(g) => g,
        Err(TryLockError::WouldBlock) => return Err(busy()),
        // A panic inside a previous call was caught at the boundary; the
        // session's invariants hold between statements, so carry on.
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
    };
    f(&mut guard)
}

fn ptrs<'a>(p: *const *const c_void, n: usize, what: &'static str) -> Result<&'a [DevPtr]> {
    // SAFETY: the caller passes `n` readable pointers; u64 and pointers have
    // the same size and alignment (asserted above).
    unsafe { arg_slice(p as *const DevPtr, n, what) }
}

// ---- defaults ---------------------------------------------------------------

/// The default session config: CUDA device 0, 3 warmup iterations, global
/// capture mode, clones on return, no strict leases, no callbacks.
#[no_mangle]
pub extern "C" fn graphed_session_config_default() -> graphed_session_config {
    graphed_session_config {
        struct_size: size_of::<graphed_session_config>(),
        backend: BackendKind::Cuda as u32,
        device: 0,
        warmup_iterations: 3,
        capture_mode: CaptureMode::Global as u32,
        clone_param_grads_on_return: true,
        strict_leases: false,
        clone_alloc: None,
        clone_free: None,
        allocator_ctx: std::ptr::null_mut(),
        log: None,
        log_ctx: std::ptr::null_mut(),
        log_level: LogLevel::Warn as u32,
        warmup_hook: None,
        warmup_hook_data: std::ptr::null_mut(),
        share_pool_with: std::ptr::null_mut(),
        schedule: std::ptr::null(),
        num_schedule_steps: 0,
        layers_per_chunk: std::ptr::null(),
        num_layers_per_chunk: 0,
        reuse_buffers: false,
    }
}

/// An empty callable descriptor with its struct_size set.
#[no_mangle]
pub extern "C" fn graphed_callable_desc_default() -> graphed_callable_desc {
    graphed_callable_desc {
        struct_size: size_of::<graphed_callable_desc>(),
        name: std::ptr::null(),
        num_inputs: 0,
        inputs: std::ptr::null(),
        num_params: 0,
        params: std::ptr::null(),
        num_outputs: 0,
        outputs: std::ptr::null(),
        forward: None,
        backward: None,
        wgrad: None,
        user_data: std::ptr::null_mut(),
        pre_hook: None,
        post_hook: None,
        hook_data: std::ptr::null_mut(),
    }
}

/// Replay arguments for callable 0, microbatch 0, the default stream, no
/// data (replay on the static buffers) and no destinations.
#[no_mangle]
pub extern "C" fn graphed_replay_args_default() -> graphed_replay_args {
    graphed_replay_args {
        struct_size: size_of::<graphed_replay_args>(),
        callable: 0,
        microbatch: 0,
        stream: std::ptr::null_mut(),
        side_stream: std::ptr::null_mut(),
        data: std::ptr::null(),
        num_data: 0,
        param_dsts: std::ptr::null(),
        num_param_dsts: 0,
    }
}

// ---- C callbacks adapted to orchestration -------------------------------------

type PassFn = unsafe extern "C" fn(*const graphed_pass_ctx, *mut c_void) -> i32;

struct CCallbacks {
    forward: PassFn,
    backward: PassFn,
    wgrad: Option<PassFn>,
    user_data: *mut c_void,
    pre: Option<PassFn>,
    post: Option<PassFn>,
    hook_data: *mut c_void,
}

// SAFETY: the user data pointers are the caller's; the API contract is that
// callbacks may run on whichever thread calls graphed_session_capture.
unsafe impl Send for CCallbacks {}

fn call_pass(f: PassFn, v: &PassView, data: *mut c_void) -> std::result::Result<(), i32> {
    let ctx = graphed_pass_ctx {
        struct_size: size_of::<graphed_pass_ctx>(),
        callable: v.callable,
        microbatch: v.microbatch,
        pass: v.pass as u32,
        phase: v.phase as u32,
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
        scratch: v.scratch.handle() as *mut graphed_scratch,
        capture: v
            .provided
            .map_or(std::ptr::null_mut(), |p| p.handle() as *mut c_void),
    };
    // SAFETY: the caller registered `f` for this purpose; `ctx` and the
    // arrays it points to outlive the call.
    match unsafe { f(&ctx, data) } {
        0 => Ok(()),
        code => Err(code),
    }
}

impl PassCallbacks for CCallbacks {
    fn run(&self, v: &PassView) -> std::result::Result<(), i32> {
        let f = match v.pass {
            PassKind::Forward => self.forward,
            PassKind::Backward => self.backward,
            PassKind::Wgrad => self.wgrad.ok_or(-1)?,
        };
        call_pass(f, v, self.user_data)
    }

    fn has_wgrad(&self) -> bool {
        self.wgrad.is_some()
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

struct CAllocator {
    alloc: unsafe extern "C" fn(*mut c_void, usize, graphed_stream, *mut *mut c_void) -> i32,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, graphed_stream),
    ctx: *mut c_void,
}

// SAFETY: the API contract is that the allocator callbacks may be called
// from any thread that calls into the session or releases its buffers.
unsafe impl Send for CAllocator {}
// SAFETY: as above; the library never touches `ctx` itself.
unsafe impl Sync for CAllocator {}

impl CloneAllocator for CAllocator {
    fn alloc(&self, bytes: usize, stream: StreamRef) -> std::result::Result<DevPtr, i32> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the caller's allocator, with a valid out pointer.
        match unsafe { (self.alloc)(self.ctx, bytes, stream.0 as graphed_stream, &mut p) } {
            0 => Ok(p as DevPtr),
            code => Err(code),
        }
    }

    fn free(&self, ptr: DevPtr, bytes: usize, stream: StreamRef) {
        // SAFETY: frees what the matching alloc returned.
        unsafe {
            (self.free)(
                self.ctx,
                ptr as *mut c_void,
                bytes,
                stream.0 as graphed_stream,
            )
        }
    }
}

struct SendPtr(*mut c_void);
// SAFETY: the caller's log/hook context; the API contract allows calling
// its callbacks from any thread that uses the session.
unsafe impl Send for SendPtr {}

impl SendPtr {
    // A method, so that closures capture the whole (Send) wrapper.
    fn get(&self) -> *mut c_void {
        self.0
    }
}

fn options(cfg: &graphed_session_config) -> Result<SessionOptions> {
    let allocator: Option<Arc<dyn CloneAllocator>> = match (cfg.clone_alloc, cfg.clone_free) {
        (Some(alloc), Some(free)) => Some(Arc::new(CAllocator {
            alloc,
            free,
            ctx: cfg.allocator_ctx,
        })),
        (None, None) => None,
        _ => {
            return Err(Error::invalid(
                "config.clone_alloc and config.clone_free must be given together",
            ))
        }
    };
    let log = cfg.log.map(|f| {
        let ctx = SendPtr(cfg.log_ctx);
        Box::new(move |level: LogLevel, msg: &str| {
            let text = CString::new(msg.replace('\0', " ")).unwrap_or_default();
            // SAFETY: the caller's log callback with its context and a
            // NUL-terminated message valid for the call.
            unsafe { f(ctx.get(), level as u32, text.as_ptr()) }
        }) as Box<dyn Fn(LogLevel, &str) + Send>
    });
    let warmup_hook = cfg.warmup_hook.map(|f| {
        let ctx = SendPtr(cfg.warmup_hook_data);
        Box::new(move |point: HookPoint| {
            // SAFETY: the caller's hook with its context.
            match unsafe { f(if point == HookPoint::Pre { 0 } else { 1 }, ctx.get()) } {
                0 => Ok(()),
                code => Err(code),
            }
        }) as Box<dyn Fn(HookPoint) -> std::result::Result<(), i32> + Send>
    });
    let schedule = if cfg.schedule.is_null() && cfg.num_schedule_steps == 0 {
        None
    } else {
        // SAFETY: the caller passes the stated number of steps.
        let steps = unsafe { arg_slice(cfg.schedule, cfg.num_schedule_steps, "config.schedule") }?;
        if steps.is_empty() {
            return Err(Error::InvalidSchedule(
                "config.schedule is given with num_schedule_steps = 0".into(),
            ));
        }
        let layers_per_chunk = if cfg.layers_per_chunk.is_null() {
            None
        } else {
            // SAFETY: the caller passes the stated number of entries.
            Some(
                unsafe {
                    arg_slice(
                        cfg.layers_per_chunk,
                        cfg.num_layers_per_chunk,
                        "config.layers_per_chunk",
                    )
                }?
                .to_vec(),
            )
        };
        Some(ScheduleSpec {
            steps: steps.to_vec(),
            layers_per_chunk,
        })
    };
    Ok(SessionOptions {
        schedule,
        reuse_buffers: cfg.reuse_buffers,
        warmup_iterations: cfg.warmup_iterations,
        clone_param_grads_on_return: cfg.clone_param_grads_on_return,
        strict_leases: cfg.strict_leases,
        capture_mode: CaptureMode::from_code(cfg.capture_mode)?,
        allocator,
        log,
        log_level: LogLevel::from_code(cfg.log_level)?,
        warmup_hook,
    })
}

// ---- lifecycle ----------------------------------------------------------------

/// Layout sizes of the first released versions of the config structs.
const CONFIG_MIN: usize = size_of::<graphed_session_config>();
const DESC_MIN: usize = size_of::<graphed_callable_desc>();
const ARGS_MIN: usize = size_of::<graphed_replay_args>();
const STATS_MIN: usize = size_of::<graphed_session_stats>();

/// Creates a session. On the CUDA backend this retains the device's
/// primary context (the one the CUDA runtime and PyTorch use).
/// Destroy it with graphed_session_destroy.
///
/// # Safety
/// `config` must be NULL or point to a graphed_session_config of at least
/// its struct_size bytes; `session_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_create(
    config: *const graphed_session_config,
    session_out: *mut *mut graphed_session,
) -> graphed_status {
    boundary("graphed_session_create", || {
        let out = arg_out(session_out, "session_out")?;
        // SAFETY: per this function's contract.
        let cfg = unsafe {
            read_sized(
                config,
                "config",
                graphed_session_config_default(),
                CONFIG_MIN,
            )
        }?;
        let kind = BackendKind::from_code(cfg.backend)?;
        let opts = options(&cfg)?;
        let pool = if cfg.share_pool_with.is_null() {
            None
        } else {
            Some(with_session(cfg.share_pool_with, |o| Ok(o.pool()))?)
        };
        let backend: Arc<dyn Backend> = match kind {
            BackendKind::Cuda => CudaBackend::for_device(cfg.device)?,
            BackendKind::Host => HostBackend::new(),
        };
        let session = Session::new(backend, pool, opts)?;
        let p = Box::into_raw(Box::new(graphed_session {
            inner: Mutex::new(session),
        }));
        sessions().insert(p as usize);
        // SAFETY: checked non-NULL; written only on success.
        unsafe { out.write(p) };
        Ok(())
    })
}

/// Destroys a session: waits for the device, destroys its graphs and frees
/// its static buffers and scratch (a pool shared with another session
/// lives on with it). Clones already returned stay valid until released.
/// NULL is a no-op; a destroyed session gives GRAPHED_STATUS_USE_AFTER_DESTROY.
///
/// # Safety
/// `session` must be NULL or a pointer from graphed_session_create.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_destroy(session: *mut graphed_session) -> graphed_status {
    boundary("graphed_session_destroy", || {
        if session.is_null() {
            return Ok(());
        }
        let mut live = sessions();
        if !live.contains(&(session as usize)) {
            return Err(Error::UseAfterDestroy(format!(
                "session 0x{:x} was already destroyed",
                session as usize
            )));
        }
        // SAFETY: registered, hence live.
        if let Err(TryLockError::WouldBlock) = unsafe { &*session }.inner.try_lock() {
            return Err(busy());
        }
        live.remove(&(session as usize));
        drop(live);
        // SAFETY: created by Box::into_raw in graphed_session_create and
        // removed from the registry exactly once.
        drop(unsafe { Box::from_raw(session) });
        Ok(())
    })
}

fn tensor(t: &graphed_tensor_desc, what: &str) -> Result<TensorSpec> {
    let shape: Vec<i64> = if t.ndim == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller passes `ndim` readable dimensions.
        unsafe { arg_slice(t.shape, t.ndim as usize, "shape") }?.to_vec()
    };
    Ok(TensorSpec {
        bytes: t.bytes,
        dtype: DType::from_code(t.dtype, &format!("{what}.dtype"))?,
        shape,
        requires_grad: t.requires_grad,
        sample: t.sample as DevPtr,
        external: match t.flags {
            0 => false,
            1 => true,
            f => {
                return Err(Error::invalid(format!(
                    "{what}.flags has unknown bits 0x{:x}",
                    f & !1
                )))
            }
        },
    })
}

/// Registers a callable before capture; writes its index to `*index_out`.
/// Everything in the descriptor is copied: changing it afterwards changes
/// nothing.
///
/// # Safety
/// `desc` must point to a graphed_callable_desc of at least its struct_size
/// bytes whose arrays hold the counts it states.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_add_callable(
    session: *mut graphed_session,
    desc: *const graphed_callable_desc,
    index_out: *mut u32,
) -> graphed_status {
    boundary("graphed_session_add_callable", || {
        let out = arg_out(index_out, "index_out")?;
        // SAFETY: per this function's contract.
        let d = unsafe { read_sized(desc, "desc", graphed_callable_desc_default(), DESC_MIN) }?;
        let name = if d.name.is_null() {
            None
        } else {
            // SAFETY: a non-NULL name is NUL-terminated per the contract.
            let s = unsafe { CStr::from_ptr(d.name) };
            Some(
                s.to_str()
                    .map_err(|_| Error::invalid("desc.name is not valid UTF-8"))?
                    .to_string(),
            )
        };
        // SAFETY (three slices): the arrays hold the stated counts.
        let inputs = unsafe { arg_slice(d.inputs, d.num_inputs, "desc.inputs") }?;
        let outputs = unsafe { arg_slice(d.outputs, d.num_outputs, "desc.outputs") }?;
        let params = unsafe { arg_slice(d.params, d.num_params, "desc.params") }?;
        let inputs: Result<Vec<TensorSpec>> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| tensor(t, &format!("desc.inputs[{i}]")))
            .collect();
        let outputs: Result<Vec<TensorSpec>> = outputs
            .iter()
            .enumerate()
            .map(|(i, t)| tensor(t, &format!("desc.outputs[{i}]")))
            .collect();
        let params = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                Ok(ParamSpec {
                    data: p.data as DevPtr,
                    bytes: p.bytes,
                    dtype: DType::from_code(p.dtype, &format!("desc.params[{i}].dtype"))?,
                    requires_grad: p.requires_grad,
                    flags: p.flags,
                    policy: GradPolicy::from_code(p.policy, &format!("desc.params[{i}].policy"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let callbacks = CCallbacks {
            forward: d.forward.ok_or(Error::NullPointer {
                what: "desc.forward",
            })?,
            backward: d.backward.ok_or(Error::NullPointer {
                what: "desc.backward",
            })?,
            wgrad: d.wgrad,
            user_data: d.user_data,
            pre: d.pre_hook,
            post: d.post_hook,
            hook_data: d.hook_data,
        };
        let index = with_session(session, |s| {
            let name = name.unwrap_or_else(|| format!("callable {}", s.callable_count()));
            let (inputs, outputs) = (inputs?, outputs?);
            s.add_callable(CallableSpec {
                name,
                inputs,
                params,
                outputs,
                callbacks: Box::new(callbacks),
            })
        })?;
        // SAFETY: checked non-NULL; written only on success.
        unsafe { out.write(index) };
        Ok(())
    })
}

/// Changes the graphed_param_flags of a registered parameter. Allowed only
/// before capture: capture freezes every parameter's grad policy, and a
/// later change gives GRAPHED_STATUS_WRONG_STATE.
///
/// # Safety
/// `session` must be NULL or a pointer from graphed_session_create.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_set_param_flags(
    session: *mut graphed_session,
    callable: u32,
    param: u32,
    flags: u32,
) -> graphed_status {
    boundary("graphed_session_set_param_flags", || {
        with_session(session, |s| s.set_param_flags(callable, param, flags))
    })
}

/// Warms up and captures every registered callable (see docs/design.md):
/// warmup iterations eagerly on a side stream, then one graph per pass,
/// instantiated and uploaded. On failure (a callback's non-zero return, an
/// illegal call under capture, a driver error) everything the attempt
/// made is released, the message names the callable and pass, and the
/// session can be captured again.
///
/// # Safety
/// `session` must be NULL or a pointer from graphed_session_create.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_capture(session: *mut graphed_session) -> graphed_status {
    boundary("graphed_session_capture", || {
        with_session(session, |s| s.capture())
    })
}

/// Releases the session's graphs, static buffers and scratch (waiting for
/// the device first). Every later replay or capture returns
/// GRAPHED_STATUS_SESSION_RESET; clones already returned stay valid.
///
/// # Safety
/// `session` must be NULL or a pointer from graphed_session_create.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_reset(session: *mut graphed_session) -> graphed_status {
    boundary("graphed_session_reset", || {
        with_session(session, |s| s.reset())
    })
}

// ---- replay ---------------------------------------------------------------------

fn replay_args<'a>(a: &'a graphed_replay_args) -> Result<ReplayArgs<'a>> {
    let data = if a.data.is_null() {
        if a.num_data != 0 {
            return Err(Error::invalid(format!(
                "args.data is NULL but args.num_data is {}",
                a.num_data
            )));
        }
        None
    } else {
        Some(ptrs(a.data, a.num_data, "args.data")?)
    };
    let param_dsts = if a.param_dsts.is_null() {
        if a.num_param_dsts != 0 {
            return Err(Error::invalid(format!(
                "args.param_dsts is NULL but args.num_param_dsts is {}",
                a.num_param_dsts
            )));
        }
        None
    } else {
        Some(ptrs(
            a.param_dsts.cast(),
            a.num_param_dsts,
            "args.param_dsts",
        )?)
    };
    Ok(ReplayArgs {
        callable: a.callable,
        microbatch: a.microbatch,
        stream: StreamRef(a.stream as usize),
        side_stream: (!a.side_stream.is_null()).then_some(StreamRef(a.side_stream as usize)),
        data,
        param_dsts,
    })
}

fn check_out(out: *mut graphed_ref, n: usize, expected: usize, what: &'static str) -> Result<()> {
    if n != expected {
        return Err(Error::invalid(format!(
            "{what} has room for {n} refs; the callable has {expected}"
        )));
    }
    if expected > 0 && out.is_null() {
        return Err(Error::NullPointer { what });
    }
    Ok(())
}

fn write_refs(out: *mut graphed_ref, refs: &[Returned]) {
    for (i, r) in refs.iter().enumerate() {
        let c = graphed_ref {
            ptr: r.ptr as *mut c_void,
            bytes: r.bytes,
            kind: r.kind,
            owner: r.owner as *mut graphed_buffer,
            lease: r.lease,
        };
        // SAFETY: check_out verified the array is non-NULL with room for
        // exactly refs.len() entries.
        unsafe { out.add(i).write(c) };
    }
}

/// Replays the forward graph of (args->callable, args->microbatch) on
/// args->stream, after copying args->data into the static inputs. Writes
/// one GRAPHED_REF_KIND_ALIAS ref per output to `outputs`
/// (`num_outputs` must equal the callable's output count): the static
/// outputs, valid until the next forward replay of the same instance.
///
/// # Safety
/// `args` must point to a graphed_replay_args of at least its struct_size
/// bytes; `outputs` must have room for `num_outputs` refs.
#[no_mangle]
pub unsafe extern "C" fn graphed_forward(
    session: *mut graphed_session,
    args: *const graphed_replay_args,
    outputs: *mut graphed_ref,
    num_outputs: usize,
) -> graphed_status {
    boundary("graphed_forward", || {
        // SAFETY: per this function's contract.
        let a = unsafe { read_sized(args, "args", graphed_replay_args_default(), ARGS_MIN) }?;
        let ra = replay_args(&a)?;
        with_session(session, |s| {
            check_out(outputs, num_outputs, s.arity(a.callable)?.2, "outputs")?;
            write_refs(outputs, s.forward(&ra)?);
            Ok(())
        })
    })
}

/// Replays the backward graph of (args->callable, args->microbatch) after
/// copying args->data into the static grad-outputs. Writes one ref per
/// input to `input_grads` (ALIAS, valid until the next backward replay of
/// the instance; NONE for inputs without requires_grad) and one per
/// parameter to `param_grads`, each per its frozen policy: CLONE (an owned
/// copy: release `owner` with graphed_buffer_release), ALIAS, COPY_INTO or
/// ACCUMULATE_INTO (into args->param_dsts[i]), NONE (no grad, or a callable
/// with a weight-grad callback, whose grads graphed_backward_wgrad returns).
///
/// # Safety
/// As graphed_forward; the arrays must have room for the stated counts.
#[no_mangle]
pub unsafe extern "C" fn graphed_backward(
    session: *mut graphed_session,
    args: *const graphed_replay_args,
    input_grads: *mut graphed_ref,
    num_input_grads: usize,
    param_grads: *mut graphed_ref,
    num_param_grads: usize,
) -> graphed_status {
    boundary("graphed_backward", || {
        // SAFETY: per this function's contract.
        let a = unsafe { read_sized(args, "args", graphed_replay_args_default(), ARGS_MIN) }?;
        let ra = replay_args(&a)?;
        with_session(session, |s| {
            let (ni, np, _) = s.arity(a.callable)?;
            check_out(input_grads, num_input_grads, ni, "input_grads")?;
            check_out(param_grads, num_param_grads, np, "param_grads")?;
            let (gi, gp) = s.backward(&ra)?;
            write_refs(input_grads, gi);
            write_refs(param_grads, gp);
            Ok(())
        })
    })
}

/// Replays the weight-grad graph of a callable registered with a wgrad
/// callback, and writes its parameter grads (per policy) to `param_grads`.
///
/// # Safety
/// As graphed_backward.
#[no_mangle]
pub unsafe extern "C" fn graphed_backward_wgrad(
    session: *mut graphed_session,
    args: *const graphed_replay_args,
    param_grads: *mut graphed_ref,
    num_param_grads: usize,
) -> graphed_status {
    boundary("graphed_backward_wgrad", || {
        // SAFETY: per this function's contract.
        let a = unsafe { read_sized(args, "args", graphed_replay_args_default(), ARGS_MIN) }?;
        let ra = replay_args(&a)?;
        with_session(session, |s| {
            check_out(
                param_grads,
                num_param_grads,
                s.arity(a.callable)?.1,
                "param_grads",
            )?;
            write_refs(param_grads, s.wgrad(&ra)?);
            Ok(())
        })
    })
}

/// Releases a strict-mode lease (the `lease` of an ALIAS ref): the alias
/// is no longer used, so the replay that overwrites it may run.
///
/// # Safety
/// `session` must be NULL or a pointer from graphed_session_create.
#[no_mangle]
pub unsafe extern "C" fn graphed_lease_release(
    session: *mut graphed_session,
    lease: u64,
) -> graphed_status {
    boundary("graphed_lease_release", || {
        with_session(session, |s| s.release_lease(lease))
    })
}

// ---- queries ----------------------------------------------------------------------

/// Writes the static buffers of one role (a graphed_buffer_role value) of
/// (callable, microbatch) to `ptrs` (`count` must equal the number of
/// inputs, outputs or parameters; NULL where a buffer does not exist).
/// Passing a static input back as replay data skips its copy.
///
/// # Safety
/// `ptrs` must have room for `count` pointers.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_buffers(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    role: u32,
    ptrs: *mut *mut c_void,
    count: usize,
) -> graphed_status {
    boundary("graphed_session_buffers", || {
        let role = Role::from_code(role)?;
        with_session(session, |s| {
            let b = s.buffers(callable, microbatch, role)?;
            if count != b.len() {
                return Err(Error::invalid(format!(
                    "count is {count}; that role has {} buffers",
                    b.len()
                )));
            }
            if b.is_empty() {
                return Ok(());
            }
            let out = arg_out(ptrs, "ptrs")?;
            for (i, &p) in b.iter().enumerate() {
                // SAFETY: non-NULL with room for `count` entries.
                unsafe { out.add(i).write(p as *mut c_void) };
            }
            Ok(())
        })
    })
}

/// Writes the frozen graphed_grad_policy of each parameter of a captured
/// callable to `policies` (`count` = its parameter count;
/// GRAPHED_GRAD_POLICY_DEFAULT for parameters without a gradient).
///
/// # Safety
/// `policies` must have room for `count` values.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_param_policies(
    session: *mut graphed_session,
    callable: u32,
    policies: *mut u32,
    count: usize,
) -> graphed_status {
    boundary("graphed_session_param_policies", || {
        with_session(session, |s| {
            let p = s.policies(callable)?;
            if count != p.len() {
                return Err(Error::invalid(format!(
                    "count is {count}; the callable has {} parameters",
                    p.len()
                )));
            }
            if p.is_empty() {
                return Ok(());
            }
            let out = arg_out(policies, "policies")?;
            for (i, pol) in p.iter().enumerate() {
                // SAFETY: non-NULL with room for `count` entries.
                unsafe { out.add(i).write(pol.unwrap_or(GradPolicy::Default) as u32) };
            }
            Ok(())
        })
    })
}

/// Writes the session's memory and graph figures (library accounting).
/// Set stats->struct_size first (graphed_session_stats_default()).
///
/// # Safety
/// `stats` must point to a graphed_session_stats of at least its
/// struct_size bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_stats_get(
    session: *mut graphed_session,
    stats: *mut graphed_session_stats,
) -> graphed_status {
    boundary("graphed_session_stats_get", || {
        // SAFETY: per this function's contract.
        let have =
            unsafe { read_sized(stats, "stats", graphed_session_stats_default(), STATS_MIN) }?;
        let st = with_session(session, |s| Ok(s.stats()))?;
        let full = graphed_session_stats {
            struct_size: have.struct_size,
            static_bytes: st.static_bytes,
            scratch_bytes: st.scratch_bytes,
            pool_bytes: st.pool_bytes,
            clone_bytes_outstanding: st.clone_bytes_outstanding,
            clone_blocks_outstanding: st.clone_blocks_outstanding,
            graph_count: st.graph_count,
            callables: st.callables,
            instances: st.instances,
            leases_held: st.leases_held,
            captured: st.captured,
            static_bytes_without_reuse: st.static_bytes_without_reuse,
            peak_live_bytes: st.peak_live_bytes,
            microbatches: st.microbatches,
        };
        let n = have.struct_size.min(size_of::<graphed_session_stats>());
        // SAFETY: the caller's struct has struct_size writable bytes; we
        // write at most that many, from a full struct.
        unsafe {
            std::ptr::copy_nonoverlapping(&full as *const _ as *const u8, stats as *mut u8, n)
        };
        Ok(())
    })
}

/// A zeroed stats struct with its struct_size set.
#[no_mangle]
pub extern "C" fn graphed_session_stats_default() -> graphed_session_stats {
    graphed_session_stats {
        struct_size: size_of::<graphed_session_stats>(),
        static_bytes: 0,
        scratch_bytes: 0,
        pool_bytes: 0,
        clone_bytes_outstanding: 0,
        clone_blocks_outstanding: 0,
        graph_count: 0,
        callables: 0,
        instances: 0,
        leases_held: 0,
        captured: false,
        static_bytes_without_reuse: 0,
        peak_live_bytes: 0,
        microbatches: 0,
    }
}

/// Writes the static-buffer plan of a captured session as text (one line
/// per buffer: callable, microbatch, role, size, offset, memory slot,
/// lifetime in capture-order pass positions) into `buffer` (`capacity`
/// bytes, NUL-terminated, truncated if short) and its full length (without
/// the NUL) to `*length_out`. Pass a NULL buffer to ask for the length.
///
/// # Safety
/// `buffer` must be NULL or have room for `capacity` bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_plan_dump(
    session: *mut graphed_session,
    buffer: *mut std::ffi::c_char,
    capacity: usize,
    length_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_plan_dump", || {
        let len_out = arg_out(length_out, "length_out")?;
        let text = with_session(session, |s| s.plan_dump())?;
        if !buffer.is_null() && capacity > 0 {
            let n = text.len().min(capacity - 1);
            // SAFETY: the caller's buffer has `capacity` bytes; we write n + 1 <= capacity.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buffer as *mut u8, n);
                buffer.add(n).write(0);
            }
        }
        // SAFETY: checked non-NULL.
        unsafe { len_out.write(text.len()) };
        Ok(())
    })
}

/// The driver's figure for the session's device: free and total bytes
/// (cuMemGetInfo). GRAPHED_STATUS_UNSUPPORTED on the host backend.
///
/// # Safety
/// `free_out` and `total_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_device_memory(
    session: *mut graphed_session,
    free_out: *mut usize,
    total_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_device_memory", || {
        let f = arg_out(free_out, "free_out")?;
        let t = arg_out(total_out, "total_out")?;
        let (free, total) = with_session(session, |s| s.device_memory())?;
        // SAFETY: both checked non-NULL.
        unsafe {
            f.write(free);
            t.write(total);
        }
        Ok(())
    })
}

/// GRAPHED_STATUS_OK when a backend (a graphed_backend value) can run
/// here; otherwise the reason (GRAPHED_STATUS_NO_DRIVER, _NO_DEVICE).
#[no_mangle]
pub extern "C" fn graphed_backend_available(backend: u32) -> graphed_status {
    boundary(
        "graphed_backend_available",
        || match BackendKind::from_code(backend)? {
            BackendKind::Host => Ok(()),
            BackendKind::Cuda => crate::backend::cuda::driver::device_count().map(|_| ()),
        },
    )
}

// ---- returned buffers and scratch --------------------------------------------------

/// Drops one reference to a block of returned clones; the last one frees
/// it, ordered after the work already enqueued on the stream the clones
/// were returned on (that stream must still exist; synchronize other
/// streams that used the clones with it first, as with PyTorch's
/// record_stream). NULL is a no-op.
///
/// # Safety
/// `buffer` must be NULL or an `owner` from a graphed_ref.
#[no_mangle]
pub unsafe extern "C" fn graphed_buffer_release(buffer: *mut graphed_buffer) -> graphed_status {
    boundary("graphed_buffer_release", || {
        if buffer.is_null() {
            Ok(())
        } else {
            returned::release(buffer as usize)
        }
    })
}

/// Adds one reference to a block of returned clones.
///
/// # Safety
/// `buffer` must be an `owner` from a graphed_ref that is still referenced.
#[no_mangle]
pub unsafe extern "C" fn graphed_buffer_retain(buffer: *mut graphed_buffer) -> graphed_status {
    boundary("graphed_buffer_retain", || {
        if buffer.is_null() {
            return Err(Error::NullPointer { what: "buffer" });
        }
        returned::retain(buffer as usize)
    })
}

/// Allocates `bytes` of scratch device memory from the session pool for
/// the callback that received `scratch`. Memory saved for backward is
/// freed by backward (graphed_scratch_free); memory freed in one pass is
/// reused by later passes in capture order. Requests must be the same in
/// every warmup iteration and in capture.
///
/// # Safety
/// `scratch` must be the ctx->scratch of the running callback.
#[no_mangle]
pub unsafe extern "C" fn graphed_scratch_alloc(
    scratch: *mut graphed_scratch,
    bytes: usize,
    ptr_out: *mut *mut c_void,
) -> graphed_status {
    boundary("graphed_scratch_alloc", || {
        let out = arg_out(ptr_out, "ptr_out")?;
        if scratch.is_null() {
            return Err(Error::NullPointer { what: "scratch" });
        }
        let p = Scratch::with_handle(scratch as usize, |s| s.alloc(bytes))?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(p as *mut c_void) };
        Ok(())
    })
}

/// Provides, during capture, the memory of an external buffer of the running
/// pass: `role` is a graphed_buffer_role (OUTPUT from forward; GRAD_INPUT or
/// PARAM_GRADS from backward, or PARAM_GRADS from the weight-grad callback),
/// `index` the output, input or parameter. The memory must hold the
/// buffer's bytes and stay valid, at that address, while the session's
/// graphs exist; replays return it. Every external buffer of a pass must be
/// provided, or capture fails naming it.
///
/// # Safety
/// `ctx` must be the context of the running callback.
#[no_mangle]
pub unsafe extern "C" fn graphed_pass_set_buffer(
    ctx: *const graphed_pass_ctx,
    role: u32,
    index: usize,
    ptr: *mut c_void,
) -> graphed_status {
    boundary("graphed_pass_set_buffer", || {
        // SAFETY: per this function's contract.
        let c = unsafe { super::arg_ref(ctx, "ctx") }?;
        let role = Role::from_code(role)?;
        Provided::with_handle(c.capture as usize, |p| p.set(role, index, ptr as DevPtr))
    })
}

/// Frees a scratch allocation (see graphed_scratch_alloc).
///
/// # Safety
/// `scratch` must be the ctx->scratch of the running callback.
#[no_mangle]
pub unsafe extern "C" fn graphed_scratch_free(
    scratch: *mut graphed_scratch,
    ptr: *mut c_void,
) -> graphed_status {
    boundary("graphed_scratch_free", || {
        if scratch.is_null() {
            return Err(Error::NullPointer { what: "scratch" });
        }
        Scratch::with_handle(scratch as usize, |s| s.free(ptr as DevPtr))
    })
}
