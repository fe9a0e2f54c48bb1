//! The session config: the struct, its defaults, the caller's callbacks it
//! carries (clone allocator, log, warmup hook), and its conversion into the
//! orchestration layer's options.

use super::args::{arg_str, assert_header, CStruct};
use super::callback::graphed_stream;
use super::enums::{decode_bool, graphed_backend, graphed_capture_mode, graphed_log_level};
use super::handles::graphed_session;
use super::schedule::{graphed_schedule_step, read_schedule, ScheduleFields};
use crate::backend::{BackendKind, DevPtr, StreamRef};
use crate::error::{Error, Result};
use crate::orchestrate::{CloneAllocator, HookPoint, LogLevel, SessionOptions};
use std::ffi::{c_char, c_void, CString};
use std::mem::size_of;
use std::sync::Arc;

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

/// A session hook (before / after warmup): `when` is 0 before, 1 after.
/// Return 0; anything else aborts capture with GRAPHED_STATUS_CALLBACK_FAILED.
pub type graphed_session_hook_fn =
    Option<unsafe extern "C" fn(when: u32, user_data: *mut c_void) -> i32>;

/// The magic graphed_session_config_default() sets.
pub const GRAPHED_SESSION_CONFIG_MAGIC: u32 = 0x6772_0001;

/// Session configuration. Initialise with graphed_session_config_default(),
/// then set the fields you need.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_session_config {
    /// sizeof(graphed_session_config) as the caller was built; set by the
    /// _default() function.
    pub struct_size: usize,
    /// GRAPHED_SESSION_CONFIG_MAGIC; set by the _default() function.
    pub magic: u32,
    /// A graphed_backend value (default GRAPHED_BACKEND_CUDA).
    pub backend: u32,
    /// CUDA device ordinal (default 0).
    pub device: i32,
    /// Eager iterations before capture (default 3). At least 1 when
    /// callbacks use the scratch allocator.
    pub warmup_iterations: u32,
    /// A graphed_capture_mode value (default GRAPHED_CAPTURE_MODE_GLOBAL).
    pub capture_mode: u32,
    /// 1 (the default): parameter grads are returned as owned clones. 0:
    /// aliases of static buffers that the next backward overwrites.
    pub clone_param_grads_on_return: u32,
    /// 1: a replay that would overwrite a held alias fails (default 0).
    pub strict_leases: u32,
    /// 1: static buffers whose lifetimes do not overlap share memory (needs
    /// a schedule; default 0). Outputs are then valid only until their
    /// backward, and input grads until the next backward replay.
    pub reuse_buffers: u32,
    /// Names the session in messages (copied; NULL: "session").
    pub name: *const c_char,
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
    /// and device). Sessions sharing a pool are replayed one whole
    /// iteration at a time, in capture order (enforced).
    pub share_pool_with: *mut graphed_session,
    /// Optional pipeline schedule: `num_schedule_steps` steps of
    /// `schedule_step_size` bytes each (forward, backward or weight-grad of
    /// a chunk), in the order they run. Copied. NULL: one microbatch,
    /// forwards in registration order, then backwards in reverse.
    pub schedule: *const graphed_schedule_step,
    pub num_schedule_steps: usize,
    /// sizeof(graphed_schedule_step); set by the _default() function.
    pub schedule_step_size: usize,
    /// Optional number of layers (callables, in registration order) of each
    /// chunk; NULL: the callables split evenly over the chunks.
    pub layers_per_chunk: *const u32,
    pub num_layers_per_chunk: usize,
    /// Clone slots per callable (default 2, at most 16; 0 turns them off):
    /// the pass that writes parameter grads is also captured once per slot,
    /// writing its CLONE grads straight into that slot's block, so replays
    /// return owned grads without a copy while a slot is free (one is free
    /// again once the caller released its grads). With every slot held, a
    /// replay copies into another block. Needs no caller allocator and no
    /// external buffers in that pass (the weight-grad pass where there is
    /// one, else the backward: external parameter grads, or, from a
    /// backward, external input grads, leave the callable without clone
    /// slots; external input grads of a backward followed by a weight-grad
    /// pass do not); costs one block of the callable's
    /// CLONE bytes per slot. The slot captures run the pass callback again
    /// without the per-pass hooks: state a pre hook sets up for capture (a
    /// framework's private memory pool) is not there, so such a caller sets
    /// 0 or sets that state up for the whole of graphed_session_capture.
    pub clone_slots: u32,
    /// Optional: run warmup and capture on this stream of yours (a
    /// CUstream you created; CUDA only) instead of one the session makes,
    /// so that work your callbacks enqueue elsewhere on it (a framework's
    /// current stream) needs no join. NULL: the session's own. The default
    /// streams (CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) are
    /// GRAPHED_STATUS_INVALID_ARGUMENT at graphed_session_create.
    pub capture_stream: graphed_stream,
    /// 1: callables with buckets can also choose their bucket on the
    /// device, from a size in device memory (graphed_replay_args
    /// .device_size), without a host synchronisation: capture adds, per
    /// pass, a graph whose conditional SWITCH node runs the chosen
    /// bucket's graph. Needs a CUDA 12.8 driver: graphed_session_create
    /// says GRAPHED_STATUS_UNSUPPORTED, with the reason, where the driver
    /// has no SWITCH nodes. 0 (default): buckets are chosen on the host.
    pub bucket_choice_on_device: u32,
    /// Unused: the padding that ended the layout before `debug`
    /// (struct_size 184 on 64-bit), a field so that `debug` starts a
    /// larger layout. Ignored (a caller of that layout may leave anything
    /// there); leave it 0.
    pub reserved: u32,
    /// 1: debug mode (default 0). Every replay (forward, backward,
    /// weight-grad, step) synchronizes the caller's stream before it
    /// enqueues anything and right after its pass (its graph and the copies
    /// around it), and an error found there is returned
    /// (GRAPHED_STATUS_CUDA_ERROR for a driver's or a host kernel's error)
    /// with a message naming the session, the callable (name and index),
    /// microbatch, bucket, pass and graph (main, clone slot, the device's
    /// bucket choice) where it surfaced, or that it was pending from
    /// earlier work. Steps replay pass by pass where they can (not those
    /// with io copies or over microbatches: those are checked around their
    /// one graph). Slow: for finding a fault, not for training.
    /// GRAPHED_DEBUG=1 in the environment when the session is created
    /// turns it on too. Off, a replay tests this flag once, nothing more.
    pub debug: u32,
    // Ends in 4 bytes of padding on 64-bit: a u32 appended next fits in
    // them and would not change struct_size, so it comes with another
    // field, as `reserved` came with `debug`.
}

// SAFETY: repr(C), integers and pointers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_session_config {
    const NAME: &'static str = "graphed_session_config";
    const MAGIC: u32 = GRAPHED_SESSION_CONFIG_MAGIC;
    const MIN_SIZE: usize = 176;
    fn defaults() -> Self {
        graphed_session_config_default()
    }
}
assert_header!(graphed_session_config);

/// The default session config: CUDA device 0, 3 warmup iterations, global
/// capture mode, clones on return, no strict leases, no callbacks.
#[no_mangle]
pub extern "C" fn graphed_session_config_default() -> graphed_session_config {
    graphed_session_config {
        struct_size: size_of::<graphed_session_config>(),
        magic: GRAPHED_SESSION_CONFIG_MAGIC,
        backend: graphed_backend::Cuda as u32,
        device: 0,
        warmup_iterations: 3,
        capture_mode: graphed_capture_mode::Global as u32,
        clone_param_grads_on_return: 1,
        strict_leases: 0,
        reuse_buffers: 0,
        name: std::ptr::null(),
        clone_alloc: None,
        clone_free: None,
        allocator_ctx: std::ptr::null_mut(),
        log: None,
        log_ctx: std::ptr::null_mut(),
        log_level: graphed_log_level::Warn as u32,
        warmup_hook: None,
        warmup_hook_data: std::ptr::null_mut(),
        share_pool_with: std::ptr::null_mut(),
        schedule: std::ptr::null(),
        num_schedule_steps: 0,
        schedule_step_size: size_of::<graphed_schedule_step>(),
        layers_per_chunk: std::ptr::null(),
        num_layers_per_chunk: 0,
        clone_slots: 2,
        capture_stream: std::ptr::null_mut(),
        bucket_choice_on_device: 0,
        reserved: 0,
        debug: 0,
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

/// The caller's context pointer for a callback.
pub(super) struct SendPtr(pub(super) *mut c_void);
// SAFETY: the caller's log/hook context; the API contract allows calling
// its callbacks from any thread that uses the session.
unsafe impl Send for SendPtr {}
// SAFETY: as for Send; the library never reads or writes through it, it
// only hands it back to the caller's callback.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    // A method, so that closures capture the whole (Send) wrapper.
    pub(super) fn get(&self) -> *mut c_void {
        self.0
    }
}

/// A caller's hook (`graphed_session_hook_fn`, the session's warmup hook
/// or a step's capture hook) with its context, as the orchestration calls
/// it: `when` 0 before, 1 after; a non-zero return is its failure. None
/// where unset.
pub(super) fn hook_of(
    f: graphed_session_hook_fn,
    data: *mut c_void,
) -> Option<impl Fn(HookPoint) -> std::result::Result<(), i32> + Send + Sync> {
    let f = f?;
    let ctx = SendPtr(data);
    Some(move |point: HookPoint| {
        // SAFETY: the caller's hook with its own context, per the
        // contract of the field that holds it.
        match unsafe { f(if point == HookPoint::Pre { 0 } else { 1 }, ctx.get()) } {
            0 => Ok(()),
            code => Err(code),
        }
    })
}

/// What `graphed_session_create` needs from a config, checked.
pub(crate) struct Config {
    pub backend: BackendKind,
    pub device: i32,
    pub share_pool_with: *mut graphed_session,
    pub options: SessionOptions,
}

/// The caller's capture stream: NULL (the session's own) or a stream the
/// caller made. CUDA's default streams are refused by name: callbacks
/// never receive one, and CUDA cannot capture the legacy one.
fn capture_stream(s: graphed_stream) -> Result<Option<StreamRef>> {
    let name = match s as usize {
        0 => return Ok(None),
        1 => "CU_STREAM_LEGACY (0x1), the legacy default stream",
        2 => "CU_STREAM_PER_THREAD (0x2), the per-thread default stream",
        raw => return Ok(Some(StreamRef(raw))),
    };
    Err(Error::invalid(format!(
        "config.capture_stream is {name}: warmup and capture run on a stream of their own, never on a \
         default stream; pass a stream you created, or NULL for one the session makes"
    )))
}

/// Checks a config and converts it into session options.
pub(crate) fn convert(cfg: &graphed_session_config) -> Result<Config> {
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
            unsafe { f(ctx.get(), graphed_log_level::encode(level), text.as_ptr()) }
        }) as Box<dyn Fn(LogLevel, &str) + Send>
    });
    let warmup_hook = hook_of(cfg.warmup_hook, cfg.warmup_hook_data)
        .map(|h| Box::new(h) as Box<dyn Fn(HookPoint) -> std::result::Result<(), i32> + Send>);
    // SAFETY: the caller passes the stated numbers of steps (of the stated
    // size) and layer counts.
    let schedule = unsafe {
        read_schedule(
            cfg.schedule,
            cfg.num_schedule_steps,
            cfg.schedule_step_size,
            cfg.layers_per_chunk,
            cfg.num_layers_per_chunk,
            &ScheduleFields::CONFIG,
        )
    }?;
    // SAFETY: a non-NULL name is NUL-terminated per the contract.
    let name = unsafe { arg_str(cfg.name, "config.name") }?.unwrap_or_else(|| "session".into());
    Ok(Config {
        backend: graphed_backend::decode(cfg.backend, "config.backend")?,
        device: cfg.device,
        share_pool_with: cfg.share_pool_with,
        options: SessionOptions {
            name,
            schedule,
            reuse_buffers: decode_bool(cfg.reuse_buffers, "config.reuse_buffers")?,
            warmup_iterations: cfg.warmup_iterations,
            clone_param_grads_on_return: decode_bool(
                cfg.clone_param_grads_on_return,
                "config.clone_param_grads_on_return",
            )?,
            strict_leases: decode_bool(cfg.strict_leases, "config.strict_leases")?,
            capture_mode: graphed_capture_mode::decode(cfg.capture_mode, "config.capture_mode")?,
            allocator,
            log,
            log_level: graphed_log_level::decode(cfg.log_level, "config.log_level")?,
            warmup_hook,
            capture_stream: capture_stream(cfg.capture_stream)?,
            device_buckets: decode_bool(
                cfg.bucket_choice_on_device,
                "config.bucket_choice_on_device",
            )?,
            debug: decode_bool(cfg.debug, "config.debug")?,
            clone_slots: match cfg.clone_slots {
                n @ 0..=16 => n,
                n => {
                    return Err(Error::invalid(format!(
                        "config.clone_slots is {n}; at most 16"
                    )))
                }
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CaptureMode;

    #[test]
    fn the_first_released_layout_is_todays() {
        // MIN_SIZE is a literal that must never change: when a field is
        // appended, size_of grows and this test moves to `>`.
        assert_eq!(graphed_session_config::MIN_SIZE, 176);
        assert!(size_of::<graphed_session_config>() > graphed_session_config::MIN_SIZE);
    }

    #[test]
    fn debug_starts_a_layout_of_its_own() {
        // The layout before `debug` was 184 bytes on 64-bit, ending in the
        // padding that `reserved` now names: a caller of that layout
        // passes 184 and gets debug off, whatever its padding held.
        assert_eq!(std::mem::offset_of!(graphed_session_config, debug), 184);
        let mut old = graphed_session_config_default();
        old.struct_size = 184;
        old.reserved = 7;
        old.debug = 1;
        // SAFETY: a full config, of which 184 bytes are read.
        let got = unsafe { super::super::args::read_struct(&old, "config") }.unwrap();
        assert_eq!((got.reserved, got.debug), (7, 0));
        assert!(!convert(&got).unwrap().options.debug);
        old.struct_size = size_of::<graphed_session_config>();
        // SAFETY: as above, whole.
        let got = unsafe { super::super::args::read_struct(&old, "config") }.unwrap();
        assert!(convert(&got).unwrap().options.debug);
        old.debug = 2;
        let e = convert(&old).err().unwrap();
        assert!(e.to_string().contains("config.debug is 2"), "{e}");
    }

    #[test]
    fn defaults_convert() {
        let c = convert(&graphed_session_config_default()).unwrap();
        assert_eq!(c.backend, BackendKind::Cuda);
        assert!(c.options.clone_param_grads_on_return);
        assert_eq!(c.options.capture_mode, CaptureMode::Global);
        let mut bad = graphed_session_config_default();
        bad.strict_leases = 2;
        let e = convert(&bad).err().unwrap();
        assert!(e.to_string().contains("config.strict_leases is 2"), "{e}");
    }
}
