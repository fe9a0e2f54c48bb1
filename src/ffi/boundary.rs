//! The panic boundary every export runs in, and what a failing call leaves
//! on its thread: the message, read with graphed_last_error_message, and
//! its status, named by graphed_status_name.

use super::status::{self, graphed_status, UNKNOWN_STATUS};
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
            let msg = format!("{func}: {e}");
            crate::backend::journal::note(|| msg.clone());
            set_last_error(msg);
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

/// The name of a status code as written in this header
/// ("GRAPHED_STATUS_OK", ...). Takes a plain integer so that any value is
/// safe to pass: an unknown code gives "GRAPHED_STATUS_UNKNOWN". The string
/// is static; never free it.
#[no_mangle]
pub extern "C" fn graphed_status_name(code: u32) -> *const c_char {
    boundary_value(
        "graphed_status_name",
        UNKNOWN_STATUS.as_ptr().cast(),
        || status::name(code).as_ptr().cast(),
    )
}

/// The message of the most recent call on this thread that did not return
/// GRAPHED_STATUS_OK: it names the function, the argument or object at
/// fault, and what was expected. Empty if no call on this thread has failed.
/// Valid until the next failing graphed call on this thread; never free it.
#[no_mangle]
pub extern "C" fn graphed_last_error_message() -> *const c_char {
    boundary_value("graphed_last_error_message", c"".as_ptr(), || {
        LAST_ERROR.with(|m| m.borrow().as_ptr())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn status_names_are_the_tables() {
        for code in [0, 19, 20, 21, 1000, u32::MAX] {
            // SAFETY: graphed_status_name returns a static NUL-terminated string.
            let got = unsafe { CStr::from_ptr(graphed_status_name(code)) };
            assert_eq!(got.to_bytes_with_nul(), status::name(code).as_bytes());
        }
    }

    #[test]
    fn a_failing_call_leaves_its_message() {
        let st = boundary("graphed_test_export", || {
            Err(crate::Error::invalid("x is 2"))
        });
        assert_eq!(st, graphed_status::InvalidArgument);
        // SAFETY: a NUL-terminated thread-local string.
        let m = unsafe { CStr::from_ptr(graphed_last_error_message()) };
        assert_eq!(m.to_str().unwrap(), "graphed_test_export: x is 2");
    }
}
