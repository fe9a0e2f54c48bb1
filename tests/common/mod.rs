//! Helpers the C ABI integration tests share.
#![allow(dead_code)]

pub mod momentum;
pub mod mul;

use graphed::ffi::*;
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

/// The calling thread's last error message.
pub fn msg() -> String {
    // SAFETY: graphed returns a NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(graphed_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts a call succeeded, showing its message otherwise.
#[track_caller]
pub fn ok(s: graphed_status) {
    assert_eq!(s, graphed_status::Ok, "{}", msg());
}

/// A ref for graphed to fill.
pub fn empty_ref() -> graphed_ref {
    graphed_ref {
        ptr: null_mut(),
        bytes: 0,
        kind: 0,
        owner: null_mut(),
        lease: 0,
        rows: 0,
        row_bytes: 0,
        pitch: 0,
    }
}

/// A callable of one input, one output and `params`, with these callbacks
/// (the arrays must outlive the descriptor's use).
pub fn layer_desc(
    input: &graphed_tensor_desc,
    output: &graphed_tensor_desc,
    params: &[graphed_param_desc],
    forward: graphed_pass_fn,
    backward: graphed_pass_fn,
) -> graphed_callable_desc {
    let mut d = graphed_callable_desc_default();
    d.num_inputs = 1;
    d.inputs = input;
    d.num_outputs = 1;
    d.outputs = output;
    d.num_params = params.len();
    d.params = params.as_ptr();
    d.forward = forward;
    d.backward = backward;
    d
}

/// A session's stats.
pub fn stats(s: *mut graphed_session) -> graphed_session_stats {
    let mut st = graphed_session_stats_default();
    // SAFETY: an initialised stats struct; an invalid session is refused.
    ok(unsafe { graphed_session_stats_get(s, &mut st) });
    st
}

/// A host-backend config with one warmup iteration, the defaults otherwise.
pub fn host_config() -> graphed_session_config {
    let mut c = graphed_session_config_default();
    c.backend = graphed_backend::Host as u32;
    c.warmup_iterations = 1;
    c
}

/// A new session from `cfg` (the call must succeed).
pub fn create(cfg: &graphed_session_config) -> *mut graphed_session {
    let mut s = null_mut();
    // SAFETY: a valid config and out pointer.
    ok(unsafe { graphed_session_create(cfg, &mut s) });
    s
}

/// The process's memory figures (the call must succeed).
pub fn memory_stats() -> graphed_memory_stats {
    let mut m = graphed_memory_stats_default();
    // SAFETY: an initialised struct.
    ok(unsafe { graphed_memory_stats_get(&mut m) });
    m
}

/// A replay of step 0 with `n` refs and the parameters at `params` (None:
/// a NULL array): the status and the refs.
pub fn step_replay(
    s: *mut graphed_session,
    n: usize,
    params: Option<&[*const c_void]>,
) -> (graphed_status, Vec<graphed_ref>) {
    let mut a = graphed_step_args_default();
    if let Some(p) = params {
        a.params = p.as_ptr();
        a.num_params = p.len();
    }
    step_replay_args(s, &a, n)
}

/// A replay of step 0 with `a` (its arrays valid) and `n` refs: the status
/// and the refs.
pub fn step_replay_args(
    s: *mut graphed_session,
    a: &graphed_step_args,
    n: usize,
) -> (graphed_status, Vec<graphed_ref>) {
    let mut refs = vec![empty_ref(); n];
    // SAFETY: args whose arrays are the caller's valid ones, room for n refs.
    let st = unsafe { graphed_step_replay(s, a, refs.as_mut_ptr(), n) };
    (st, refs)
}

/// A session destroyed when dropped (the destroy must succeed).
pub struct Session(pub *mut graphed_session);

impl Drop for Session {
    fn drop(&mut self) {
        ok(graphed_session_destroy(self.0));
    }
}

/// A step over `callables`, `mbs` microbatches run as `loop_mode`, with
/// `io` and `dsts` its param_dsts (each left NULL where empty); the arrays
/// must outlive the descriptor's use.
pub fn step_desc(
    callables: &[u32],
    mbs: usize,
    loop_mode: graphed_step_loop,
    io: &[graphed_step_io],
    dsts: &[*mut c_void],
) -> graphed_step_desc {
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = callables.len();
    d.microbatches = mbs as u32;
    d.loop_mode = loop_mode as u32;
    if !io.is_empty() {
        d.io = io.as_ptr();
        d.num_io = io.len();
    }
    if !dsts.is_empty() {
        d.param_dsts = dsts.as_ptr();
        d.num_param_dsts = dsts.len();
    }
    d
}

/// Adds the step `d` (its arrays valid) to `s`: the status.
pub fn add_step(s: *mut graphed_session, d: &graphed_step_desc) -> graphed_status {
    let mut step = 0;
    // SAFETY: a descriptor whose arrays are the caller's valid ones.
    unsafe { graphed_session_add_step(s, d, &mut step) }
}

/// A clone allocator of the caller's that refuses every block with `CODE`.
pub unsafe extern "C" fn refuse_alloc<const CODE: i32>(
    _: *mut c_void,
    _: usize,
    _: graphed_stream,
    _: *mut *mut c_void,
) -> i32 {
    CODE
}

/// A clone allocator's free that has nothing to free.
pub unsafe extern "C" fn free_nothing(_: *mut c_void, _: *mut c_void, _: usize, _: graphed_stream) {
}
