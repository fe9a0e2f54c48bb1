//! Helpers the C ABI integration tests share.
#![allow(dead_code)]

use graphed::ffi::*;
use std::ffi::CStr;
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
