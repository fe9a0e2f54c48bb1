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
