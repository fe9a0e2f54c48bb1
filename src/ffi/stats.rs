//! What a session reports of itself: its memory and graph figures, its
//! rebinding and capture-time figures, its teardown errors
//! (graphed_session_stats, the library's accounting).

use super::args::{assert_header, write_struct, CStruct};
use super::boundary::boundary;
use super::handles::graphed_session;
use super::session::session;
use super::status::graphed_status;
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
