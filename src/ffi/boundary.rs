//! The panic boundary every export runs in, and the thread-local message
//! of the last failing call.

use super::status::graphed_status;
use crate::error::Result;
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's last error message.
pub(crate) fn set_last_error(msg: String) {
    // Interior NULs cannot cross into C; replace them rather than lose the text.
    let msg = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|m| *m.borrow_mut() = msg);
}

pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|m| m.borrow().as_ptr())
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-text payload".to_string()
    }
}

/// Runs `f`, maps its error to a status and records the message (prefixed
/// with the exported function's name). A panic becomes
/// `GRAPHED_STATUS_INTERNAL`; it never unwinds into C.
pub(crate) fn boundary(func: &'static str, f: impl FnOnce() -> Result<()>) -> graphed_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => graphed_status::Ok,
        Ok(Err(e)) => {
            let status = graphed_status::from(&e);
            set_last_error(format!("{func}: {e}"));
            status
        }
        Err(payload) => {
            set_last_error(format!(
                "{func}: internal error (a panic was caught at the C boundary): {}",
                panic_text(payload.as_ref())
            ));
            graphed_status::Internal
        }
    }
}

/// The panic boundary for functions that return a value instead of a
/// status: a panic yields `fallback`.
pub(crate) fn boundary_value<T>(func: &'static str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(payload) => {
            set_last_error(format!(
                "{func}: internal error (a panic was caught at the C boundary): {}",
                panic_text(payload.as_ref())
            ));
            fallback
        }
    }
}
