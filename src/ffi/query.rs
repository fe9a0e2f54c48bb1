//! What a session can be asked: its memory and graph figures (the
//! library's accounting), the driver's memory figure, its static buffers,
//! its frozen policies and its buffer plan; and whether a backend can run
//! here at all.

use super::args::{
    arg_out, assert_header, check_out_array, check_struct, write_answer, write_struct, CStruct,
};
use super::boundary::boundary;
use super::enums::{graphed_backend, graphed_buffer_role, graphed_grad_policy};
use super::handles::graphed_session;
use super::session::session;
use super::status::graphed_status;
use crate::backend;
use crate::core::policy::GradPolicy;
use crate::error::Error;
use std::ffi::{c_char, c_void};
use std::mem::size_of;

/// The magic graphed_session_stats_default() sets.
pub const GRAPHED_SESSION_STATS_MAGIC: u32 = 0x6772_0006;

/// Memory and graph figures of a session (library accounting).
/// Initialise with graphed_session_stats_default() before asking.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_session_stats {
    /// sizeof(graphed_session_stats); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_SESSION_STATS_MAGIC; set by the _default() function.
    pub magic: u32,
    /// 1 once the session is captured.
    pub captured: u32,
    /// Bytes of static buffers (inputs, outputs, grads, slabs).
    pub static_bytes: u64,
    /// Bytes of the scratch arena this session's graphs use.
    pub scratch_bytes: u64,
    /// Bytes held by the (possibly shared) scratch pool.
    pub pool_bytes: u64,
    /// Bytes and blocks of returned clones not yet released.
    pub clone_bytes_outstanding: u64,
    pub clone_blocks_outstanding: u64,
    /// Bytes of released clone blocks kept for reuse by later replays.
    pub clone_bytes_cached: u64,
    /// Static bytes the same buffers would take without reuse.
    pub static_bytes_without_reuse: u64,
    /// The most static bytes live at one pass: no plan can use less.
    pub peak_live_bytes: u64,
    pub graph_count: u32,
    pub callables: u32,
    pub instances: u32,
    /// Strict leases currently held.
    pub leases_held: u32,
    /// Microbatches per callable (1 without a schedule).
    pub microbatches: u32,
    /// Inputs and grad-outputs rebound at replay
    /// (GRAPHED_TENSOR_FLAGS_REBIND), and those copied instead because
    /// capture could not verify a rebind (the plan dump says why).
    pub inputs_rebound: u32,
    pub inputs_rebind_refused: u32,
    /// Graph node updates that rebinding every rebound buffer once costs.
    pub rebind_nodes: u32,
    /// Graphs captured for clone slots and for steps (graph_count counts
    /// the graphs of single passes).
    pub slot_graphs: u32,
    pub step_graphs: u32,
    /// Host time of the capture, in nanoseconds: the whole
    /// graphed_session_capture call, then by phase (the phases do not
    /// overlap; the rest of the total is bookkeeping). Plan: layout,
    /// buffer plan, static allocation, samples copied in. Warmup: every
    /// warmup iteration. Capture: callbacks under stream capture.
    /// Instantiate and upload: of every graph. Slots and steps: the
    /// callbacks of clone-slot and step captures. Rebind plan and verify:
    /// finding where graphs take rebound buffers' addresses, and the
    /// replays that verify them.
    pub capture_ns: u64,
    pub capture_plan_ns: u64,
    pub capture_warmup_ns: u64,
    pub capture_record_ns: u64,
    pub capture_instantiate_ns: u64,
    pub capture_upload_ns: u64,
    pub capture_slots_ns: u64,
    pub capture_steps_ns: u64,
    pub capture_rebind_plan_ns: u64,
    pub capture_rebind_verify_ns: u64,
    /// Errors while the session released resources (a reset, a failed
    /// capture, clone blocks given back): each is also sent to the
    /// session's log; graphed_teardown_errors() has the process's count
    /// and the last one's text.
    pub teardown_errors: u64,
    /// Graph templates kept after capture: those rebinding plans need (the
    /// others are released once capture has verified the rebinds).
    pub templates_kept: u32,
    /// Parameters (over all instances) whose graphs can follow a move
    /// (GRAPHED_PARAM_FLAGS_REBIND, verified at capture), and those
    /// registered with that flag that capture refused (the plan dump says
    /// why).
    pub params_movable: u32,
    pub params_move_refused: u32,
    /// Parameter moves replays followed since capture (one per parameter
    /// per instance or step pointed at a new address).
    pub param_moves: u64,
    /// Passes (forward, backward, weight-grad) that chose their bucket on
    /// the device (graphed_replay_args.device_size) with a size above the
    /// largest bucket: none of the callable's bucket graphs ran for them,
    /// and their outputs and grads are zeros. Counted on the device, read
    /// here (no synchronisation on the replay path): counts the passes that
    /// have run (synchronise their stream first). 0 again after a reset.
    pub bucket_overflows: u64,
    /// COPY_INTO parameter grads (over all instances) whose pass writes
    /// them straight into the destination a replay gives
    /// (GRAPHED_PARAM_FLAGS_REBIND_GRAD, verified at capture), and those
    /// registered with that flag that capture refused: copied into the
    /// destination (the plan dump says why).
    pub grads_in_place: u32,
    pub grads_in_place_refused: u32,
}

// SAFETY: repr(C), integers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_session_stats {
    const NAME: &'static str = "graphed_session_stats";
    const MAGIC: u32 = GRAPHED_SESSION_STATS_MAGIC;
    const MIN_SIZE: usize = 120;
    fn defaults() -> Self {
        graphed_session_stats_default()
    }
}
assert_header!(graphed_session_stats);

/// A zeroed stats struct with its size and magic set.
#[no_mangle]
pub extern "C" fn graphed_session_stats_default() -> graphed_session_stats {
    graphed_session_stats {
        struct_size: size_of::<graphed_session_stats>(),
        magic: GRAPHED_SESSION_STATS_MAGIC,
        captured: 0,
        static_bytes: 0,
        scratch_bytes: 0,
        pool_bytes: 0,
        clone_bytes_outstanding: 0,
        clone_blocks_outstanding: 0,
        clone_bytes_cached: 0,
        static_bytes_without_reuse: 0,
        peak_live_bytes: 0,
        graph_count: 0,
        callables: 0,
        instances: 0,
        leases_held: 0,
        microbatches: 0,
        inputs_rebound: 0,
        inputs_rebind_refused: 0,
        rebind_nodes: 0,
        slot_graphs: 0,
        step_graphs: 0,
        capture_ns: 0,
        capture_plan_ns: 0,
        capture_warmup_ns: 0,
        capture_record_ns: 0,
        capture_instantiate_ns: 0,
        capture_upload_ns: 0,
        capture_slots_ns: 0,
        capture_steps_ns: 0,
        capture_rebind_plan_ns: 0,
        capture_rebind_verify_ns: 0,
        teardown_errors: 0,
        templates_kept: 0,
        params_movable: 0,
        params_move_refused: 0,
        param_moves: 0,
        bucket_overflows: 0,
        grads_in_place: 0,
        grads_in_place_refused: 0,
    }
}

/// Writes the session's memory and graph figures (library accounting).
///
/// # Safety
/// `stats` must point to a graphed_session_stats initialised by
/// graphed_session_stats_default(), of at least its struct_size bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_stats_get(
    session: *mut graphed_session,
    stats: *mut graphed_session_stats,
) -> graphed_status {
    boundary("graphed_session_stats_get", || {
        let cell = self::session(session)?;
        let st = cell.lock()?.stats();
        let full = graphed_session_stats {
            captured: st.captured as u32,
            static_bytes: st.static_bytes,
            scratch_bytes: st.scratch_bytes,
            pool_bytes: st.pool_bytes,
            clone_bytes_outstanding: st.clone_bytes_outstanding,
            clone_blocks_outstanding: st.clone_blocks_outstanding,
            clone_bytes_cached: st.clone_bytes_cached,
            static_bytes_without_reuse: st.static_bytes_without_reuse,
            peak_live_bytes: st.peak_live_bytes,
            graph_count: st.graph_count,
            callables: st.callables,
            instances: st.instances,
            leases_held: st.leases_held,
            microbatches: st.microbatches,
            inputs_rebound: st.inputs_rebound,
            inputs_rebind_refused: st.inputs_rebind_refused,
            rebind_nodes: st.rebind_nodes,
            slot_graphs: st.slot_graphs,
            step_graphs: st.step_graphs,
            capture_ns: st.capture_times.total,
            capture_plan_ns: st.capture_times.plan,
            capture_warmup_ns: st.capture_times.warmup,
            capture_record_ns: st.capture_times.capture,
            capture_instantiate_ns: st.capture_times.instantiate,
            capture_upload_ns: st.capture_times.upload,
            capture_slots_ns: st.capture_times.slots,
            capture_steps_ns: st.capture_times.steps,
            capture_rebind_plan_ns: st.capture_times.rebind_plan,
            capture_rebind_verify_ns: st.capture_times.rebind_verify,
            teardown_errors: st.teardown_errors,
            templates_kept: st.capture_times.templates_kept as u32,
            params_movable: st.params_movable,
            params_move_refused: st.params_move_refused,
            param_moves: st.param_moves,
            bucket_overflows: st.bucket_overflows,
            grads_in_place: st.grads_in_place,
            grads_in_place_refused: st.grads_in_place_refused,
            ..graphed_session_stats_default()
        };
        // SAFETY: per this function's contract.
        unsafe { write_struct(stats, &full, "stats") }
    })
}

/// Writes the number of inputs, parameters and outputs of a registered
/// callable (the sizes of its replay arrays).
///
/// # Safety
/// The outputs must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_callable_arity(
    session: *mut graphed_session,
    callable: u32,
    num_inputs_out: *mut usize,
    num_params_out: *mut usize,
    num_outputs_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_callable_arity", || {
        let cell = self::session(session)?;
        let (i, p, o) = (
            arg_out(num_inputs_out, "num_inputs_out")?,
            arg_out(num_params_out, "num_params_out")?,
            arg_out(num_outputs_out, "num_outputs_out")?,
        );
        let (ni, np, no) = cell.lock()?.arity(callable)?;
        // SAFETY: all three checked non-NULL and aligned.
        unsafe {
            i.write(ni);
            p.write(np);
            o.write(no);
        }
        Ok(())
    })
}

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
        let cell = self::session(session)?;
        let role = graphed_buffer_role::decode(role, "role")?;
        let s = cell.lock()?;
        let b = s.buffers(callable, microbatch, role)?;
        if count != b.len() {
            return Err(Error::invalid(format!(
                "count is {count}; that role has {} buffers",
                b.len()
            )));
        }
        let stride = size_of::<*mut c_void>();
        check_out_array(ptrs, b.len(), stride, stride, "ptrs")?;
        for (i, &p) in b.iter().enumerate() {
            // SAFETY: checked: room for `count` aligned pointers.
            unsafe { ptrs.add(i).write(p as *mut c_void) };
        }
        Ok(())
    })
}

/// Writes the number of static buffers of one role (a graphed_buffer_role
/// value) of (callable, microbatch) of a captured session to
/// `*count_out`: the `count` graphed_session_buffers and
/// graphed_session_rebound take for that role.
///
/// # Safety
/// `count_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_buffer_count(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    role: u32,
    count_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_buffer_count", || {
        let cell = self::session(session)?;
        // SAFETY: per this function's contract.
        unsafe {
            write_answer(count_out, "count_out", || {
                let role = graphed_buffer_role::decode(role, "role")?;
                cell.lock()?.buffer_count(callable, microbatch, role)
            })
        }
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
        let cell = self::session(session)?;
        let s = cell.lock()?;
        let p = s.policies(callable)?;
        if count != p.len() {
            return Err(Error::invalid(format!(
                "count is {count}; the callable has {} parameters",
                p.len()
            )));
        }
        check_out_array(policies, p.len(), 4, 4, "policies")?;
        for (i, pol) in p.iter().enumerate() {
            let code = graphed_grad_policy::encode(pol.unwrap_or(GradPolicy::Default));
            // SAFETY: checked: room for `count` aligned values.
            unsafe { policies.add(i).write(code) };
        }
        Ok(())
    })
}

/// Writes, for each input (role GRAPHED_BUFFER_ROLE_INPUT) or each output's
/// grad-output (GRAPHED_BUFFER_ROLE_GRAD_OUTPUT) of (callable, microbatch),
/// 1 where replays rebind it (GRAPHED_TENSOR_FLAGS_REBIND, verified at
/// capture) and 0 where they copy it (not asked for, or refused: the plan
/// dump says why) to `rebound` (`count` = the number of inputs or outputs).
/// Other roles are never rebound: GRAPHED_STATUS_INVALID_ARGUMENT.
///
/// # Safety
/// `rebound` must have room for `count` values.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_rebound(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    role: u32,
    rebound: *mut u32,
    count: usize,
) -> graphed_status {
    boundary("graphed_session_rebound", || {
        let cell = self::session(session)?;
        let role = graphed_buffer_role::decode(role, "role")?;
        let on = cell.lock()?.rebound(callable, microbatch, role)?;
        write_flags(&on, rebound, count, "rebound", "that role has")
    })
}

/// Writes, for each parameter of (callable, microbatch), 1 where a forward
/// replay given another address for it points the graphs there
/// (GRAPHED_PARAM_FLAGS_REBIND, verified at capture) and 0 where it is
/// refused with GRAPHED_STATUS_PARAM_MOVED (not asked for, or refused: the
/// plan dump says why) to `movable` (`count` = its parameter count).
///
/// # Safety
/// `movable` must have room for `count` values.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_params_movable(
    session: *mut graphed_session,
    callable: u32,
    microbatch: u32,
    movable: *mut u32,
    count: usize,
) -> graphed_status {
    boundary("graphed_session_params_movable", || {
        let cell = self::session(session)?;
        let on = cell.lock()?.params_movable(callable, microbatch)?;
        write_flags(
            &on,
            movable,
            count,
            "movable",
            "the callable's parameters number",
        )
    })
}

/// Writes `on` as 0/1 values to the caller's array of `count` values.
fn write_flags(
    on: &[bool],
    out: *mut u32,
    count: usize,
    what: &'static str,
    of: &str,
) -> crate::error::Result<()> {
    if count != on.len() {
        return Err(Error::invalid(format!(
            "count is {count}; {of} {}",
            on.len()
        )));
    }
    check_out_array(out, on.len(), 4, 4, what)?;
    for (i, &r) in on.iter().enumerate() {
        // SAFETY: checked: room for `count` aligned values.
        unsafe { out.add(i).write(r as u32) };
    }
    Ok(())
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
    buffer: *mut c_char,
    capacity: usize,
    length_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_plan_dump", || {
        let cell = self::session(session)?;
        let len_out = arg_out(length_out, "length_out")?;
        let text = cell.lock()?.plan_dump()?;
        // SAFETY: per this function's contract.
        unsafe { write_text(&text, buffer, capacity, len_out) }
    })
}

/// Writes `text` into `buffer` (`capacity` bytes, NUL-terminated, truncated
/// if short; nothing when NULL) and its full length to `len_out`.
///
/// # Safety
/// `buffer` is NULL or has room for `capacity` bytes; `len_out` is
/// writable (checked non-NULL).
unsafe fn write_text(
    text: &str,
    buffer: *mut c_char,
    capacity: usize,
    len_out: *mut usize,
) -> crate::error::Result<()> {
    if !buffer.is_null() && capacity > 0 {
        check_out_array(buffer, capacity, 1, 1, "buffer")?;
        let n = text.len().min(capacity - 1);
        // SAFETY: the caller's buffer has `capacity` bytes; we write n + 1 <= capacity.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buffer as *mut u8, n);
            buffer.add(n).write(0);
        }
    }
    // SAFETY: the caller's promise.
    unsafe { len_out.write(text.len()) };
    Ok(())
}

/// How many errors the process's teardowns met (a free, a destroy or a
/// synchronize that failed while a session, a graph or a buffer was
/// released), and the last one's text into `buffer` (`capacity` bytes,
/// NUL-terminated, truncated if short; its full length to `*length_out`,
/// 0 when there was none). Teardown never fails its caller: such errors
/// are counted here, in each session's stats (teardown_errors) and sent
/// to the session's log. Pass a NULL buffer to ask for the length.
///
/// # Safety
/// `count_out` and `length_out` must be writable; `buffer` must be NULL or
/// have room for `capacity` bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_teardown_errors(
    count_out: *mut u64,
    buffer: *mut c_char,
    capacity: usize,
    length_out: *mut usize,
) -> graphed_status {
    boundary("graphed_teardown_errors", || {
        let count = arg_out(count_out, "count_out")?;
        let len_out = arg_out(length_out, "length_out")?;
        let (n, last) = crate::backend::teardown::last();
        // SAFETY: per this function's contract.
        unsafe { write_text(last.as_deref().unwrap_or(""), buffer, capacity, len_out)? };
        // SAFETY: checked non-NULL.
        unsafe { count.write(n) };
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
        let cell = self::session(session)?;
        let f = arg_out(free_out, "free_out")?;
        let t = arg_out(total_out, "total_out")?;
        let (free, total) = cell.lock()?.device_memory()?;
        // SAFETY: both checked non-NULL.
        unsafe {
            f.write(free);
            t.write(total);
        }
        Ok(())
    })
}

/// The magic graphed_memory_stats_default() sets.
pub const GRAPHED_MEMORY_STATS_MAGIC: u32 = 0x6772_0012;

/// What graphed holds in this process, over every session and backend
/// (graphed's own accounting). Initialise with graphed_memory_stats_default()
/// before asking.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_memory_stats {
    /// sizeof(graphed_memory_stats); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_MEMORY_STATS_MAGIC; set by the _default() function.
    pub magic: u32,
    /// Sessions created and not yet destroyed (a session destroyed with
    /// graphed_session_destroy_when_idle counts until the call in progress
    /// on it returns).
    pub sessions: u32,
    /// Bytes of device memory graphed allocated and still holds (host
    /// memory on the host backend): static buffers, scratch arenas, clone
    /// blocks handed out and not yet released or kept for reuse,
    /// verification workspaces, loop state of steps. Memory from a
    /// session's clone_alloc is the caller's and not counted. 0 once every
    /// session is destroyed and every returned clone block released.
    pub device_bytes: u64,
    /// How many allocations those bytes are.
    pub allocations: u64,
    /// Graph executables alive (instantiated and not yet destroyed).
    pub graphs: u64,
}

// SAFETY: repr(C), integers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_memory_stats {
    const NAME: &'static str = "graphed_memory_stats";
    const MAGIC: u32 = GRAPHED_MEMORY_STATS_MAGIC;
    const MIN_SIZE: usize = 40;
    fn defaults() -> Self {
        graphed_memory_stats_default()
    }
}
assert_header!(graphed_memory_stats);

/// A zeroed graphed_memory_stats with its size and magic set.
#[no_mangle]
pub extern "C" fn graphed_memory_stats_default() -> graphed_memory_stats {
    graphed_memory_stats {
        struct_size: size_of::<graphed_memory_stats>(),
        magic: GRAPHED_MEMORY_STATS_MAGIC,
        sessions: 0,
        device_bytes: 0,
        allocations: 0,
        graphs: 0,
    }
}

/// Writes what graphed holds in this process (every session, every
/// backend): device bytes and allocations it made and has not freed, live
/// sessions, live graph executables. Needs no session; never BUSY.
/// GRAPHED_STATUS_NULL_POINTER for a NULL `out`, BAD_STRUCT for one not
/// initialised by graphed_memory_stats_default().
///
/// # Safety
/// `out` must be NULL or point to a graphed_memory_stats initialised by
/// graphed_memory_stats_default(), of at least its struct_size bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_memory_stats_get(
    out: *mut graphed_memory_stats,
) -> graphed_status {
    boundary("graphed_memory_stats_get", || {
        let h = crate::backend::accounting::held();
        let full = graphed_memory_stats {
            sessions: u32::try_from(h.sessions).unwrap_or(u32::MAX),
            device_bytes: h.bytes,
            allocations: h.allocations,
            graphs: h.graphs,
            ..graphed_memory_stats_default()
        };
        // SAFETY: per this function's contract.
        unsafe { write_struct(out, &full, "out") }
    })
}

/// The magic graphed_callable_memory_default() sets.
pub const GRAPHED_CALLABLE_MEMORY_MAGIC: u32 = 0x6772_0013;

/// What one callable of a captured session holds (graphed's accounting).
/// Initialise with graphed_callable_memory_default() before asking.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_callable_memory {
    /// sizeof(graphed_callable_memory); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_CALLABLE_MEMORY_MAGIC; set by the _default() function.
    pub magic: u32,
    /// 1 once released by graphed_session_release_callable.
    pub released: u32,
    /// Bytes of its own static allocation: the static buffers of its
    /// instances that no other callable uses (not chained to another
    /// callable, sharing no memory with another's buffers through
    /// reuse_buffers). Freed by its release; 0 after.
    pub own_static_bytes: u64,
    /// Bytes of the static buffers it uses in the allocation callables
    /// share: buffers chained between it and another callable, and memory
    /// reuse_buffers gives to its buffers and another callable's (not the
    /// small block of bucket sizes that callables with buckets also keep
    /// there). That allocation is freed when the last callable using it is
    /// released; 0 once this one is released.
    pub shared_static_bytes: u64,
    /// Graph executables of its instances: every pass of every microbatch
    /// and bucket, clone slots, the graphs choosing its bucket on the
    /// device. 0 once released.
    pub graphs: u32,
    /// Graph executables of the steps that include it, which its release
    /// destroys too (they are counted for each of their callables).
    pub step_graphs: u32,
    /// Bytes of its returned clone blocks from graphed's memory not yet
    /// released with graphed_buffer_release (blocks from the session's
    /// clone_alloc are the caller's memory and not counted). Blocks stay
    /// valid after the release of their callable.
    pub clone_bytes_outstanding: u64,
    /// Bytes of its released clone blocks kept for reuse by its later
    /// replays (clone slots included); freed by its release.
    pub clone_bytes_cached: u64,
}

// SAFETY: repr(C), integers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_callable_memory {
    const NAME: &'static str = "graphed_callable_memory";
    const MAGIC: u32 = GRAPHED_CALLABLE_MEMORY_MAGIC;
    const MIN_SIZE: usize = 56;
    fn defaults() -> Self {
        graphed_callable_memory_default()
    }
}
assert_header!(graphed_callable_memory);

/// A zeroed graphed_callable_memory with its size and magic set.
#[no_mangle]
pub extern "C" fn graphed_callable_memory_default() -> graphed_callable_memory {
    graphed_callable_memory {
        struct_size: size_of::<graphed_callable_memory>(),
        magic: GRAPHED_CALLABLE_MEMORY_MAGIC,
        released: 0,
        own_static_bytes: 0,
        shared_static_bytes: 0,
        graphs: 0,
        step_graphs: 0,
        clone_bytes_outstanding: 0,
        clone_bytes_cached: 0,
    }
}

/// Writes what callable `callable` of a captured session holds (released
/// callables included: released = 1, their static bytes and graphs 0,
/// their clone blocks still outstanding counted). Checks, in order: a NULL
/// or stale session, a NULL `out`, a struct not initialised by
/// graphed_callable_memory_default() (BAD_STRUCT), BUSY, a session not
/// captured (WRONG_STATE) or reset (SESSION_RESET), a callable that does
/// not exist (INVALID_ARGUMENT).
///
/// # Safety
/// `out` must be NULL or point to a graphed_callable_memory initialised by
/// graphed_callable_memory_default(), of at least its struct_size bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_callable_memory(
    session: *mut graphed_session,
    callable: u32,
    out: *mut graphed_callable_memory,
) -> graphed_status {
    boundary("graphed_session_callable_memory", || {
        let cell = self::session(session)?;
        // The struct before the session's lock and state.
        // SAFETY: per this function's contract.
        unsafe { check_struct(out, "out") }?;
        let mut full = graphed_callable_memory_default();
        let m = cell.lock()?.callable_memory(callable)?;
        full.released = m.released as u32;
        full.own_static_bytes = m.own_static_bytes;
        full.shared_static_bytes = m.shared_static_bytes;
        full.graphs = m.graphs;
        full.step_graphs = m.step_graphs;
        full.clone_bytes_outstanding = m.clone_bytes_outstanding;
        full.clone_bytes_cached = m.clone_bytes_cached;
        // SAFETY: per this function's contract.
        unsafe { write_struct(out, &full, "out") }
    })
}

/// GRAPHED_STATUS_OK when a backend (a graphed_backend value) can run
/// here; otherwise the reason (GRAPHED_STATUS_NO_DRIVER, _NO_DEVICE).
#[no_mangle]
pub extern "C" fn graphed_backend_available(backend: u32) -> graphed_status {
    boundary("graphed_backend_available", || {
        backend::available(graphed_backend::decode(backend, "backend")?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_released_layout_is_a_prefix_of_todays() {
        // Fields added since are appended: a caller built against the
        // first layout passes a struct_size that ends where it ended.
        assert_eq!(
            std::mem::offset_of!(graphed_session_stats, capture_ns),
            graphed_session_stats::MIN_SIZE
        );
        assert!(size_of::<graphed_session_stats>() > graphed_session_stats::MIN_SIZE);
    }
}
