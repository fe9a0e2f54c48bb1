//! The C ABI. Every `extern "C"` function of the library lives in this
//! module tree and does only three things: check its arguments, call into the
//! orchestration layer inside the panic boundary, and turn the outcome into a
//! `graphed_status` plus the thread's last error message. No logic lives here.
//!
//! Shared machinery: the panic boundary (`boundary`), the thread-local
//! message, and the pointer helpers that turn C arguments into Rust
//! references with a clear error for NULL.

mod device;
mod host;
mod session;
mod status;
mod types;

pub use device::*;
pub use host::*;
pub use session::*;
pub use status::*;
pub use types::*;

use crate::error::{Error, Result};
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

/// The panic boundary: runs `f`, maps its error to a status and records the
/// message (prefixed with the exported function's name). A panic becomes
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

/// The panic boundary for functions that return a value instead of a status:
/// a panic yields `fallback`.
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

/// A shared reference from a C pointer, or `NullPointer` naming the argument.
///
/// # Safety
/// `p` must be NULL or point to a valid, initialised `T` that outlives `'a`
/// and is not mutated while the reference lives.
pub(crate) unsafe fn arg_ref<'a, T>(p: *const T, what: &'static str) -> Result<&'a T> {
    // SAFETY: the caller guarantees validity when non-NULL; NULL is rejected.
    unsafe { p.as_ref() }.ok_or(Error::NullPointer { what })
}

/// A slice from a C pointer and length. A length of zero gives an empty
/// slice whatever the pointer; a non-zero length with NULL is an error.
///
/// # Safety
/// When `len > 0`, `p` must point to `len` valid, initialised `T`s that
/// outlive `'a` and are not mutated while the slice lives.
pub(crate) unsafe fn arg_slice<'a, T>(
    p: *const T,
    len: usize,
    what: &'static str,
) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    // SAFETY: non-NULL, and the caller guarantees `len` valid elements.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// A checked output pointer: NULL is an error, and nothing is written here;
/// callers write through it only once the whole call has succeeded.
pub(crate) fn arg_out<T>(p: *mut T, what: &'static str) -> Result<*mut T> {
    if p.is_null() {
        Err(Error::NullPointer { what })
    } else {
        Ok(p)
    }
}

/// Checks the leading `struct_size` field of a config struct.
pub(crate) fn check_struct_size(what: &'static str, got: usize, min: usize) -> Result<()> {
    if got < min {
        Err(Error::StructSize { what, got, min })
    } else {
        Ok(())
    }
}

/// Reads a config struct that starts with its `size_t struct_size`, the way
/// NCCL reads its config: callers built against an older header pass a
/// smaller struct, and the fields they do not know keep `defaults`. A size
/// under `min` (the first released layout) is an error.
///
/// # Safety
/// `p` must be NULL or point to at least `struct_size` readable bytes whose
/// first field is a `size_t` holding that size.
pub(crate) unsafe fn read_sized<T: Copy>(
    p: *const T,
    what: &'static str,
    defaults: T,
    min: usize,
) -> Result<T> {
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    // SAFETY: non-NULL; every graphed config struct starts with a size_t.
    let size = unsafe { std::ptr::read_unaligned(p as *const usize) };
    check_struct_size(what, size, min)?;
    let mut out = defaults;
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: the caller guarantees `size` readable bytes at `p`; we copy at
    // most that many, and at most size_of::<T>() into `out`. T is Copy (plain
    // data), so any prefix of a valid caller struct over valid defaults is a
    // valid T for the #[repr(C)] config structs this is used with.
    unsafe { std::ptr::copy_nonoverlapping(p as *const u8, &mut out as *mut T as *mut u8, n) };
    Ok(out)
}
