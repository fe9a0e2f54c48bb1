//! Handles as C sees them: the opaque handle types, pointers whose values
//! are ids from the handle table (`core::handle`), never addresses. A
//! lookup pins the object for the call; a NULL handle, a destroyed one and
//! a forged one each get their own status.

use crate::core::handle::{self, Kind};
use crate::error::{Error, Result};
use std::any::Any;
use std::sync::Arc;

/// Opaque session handle.
pub struct graphed_session {
    _private: [u8; 0],
}

/// Opaque: a block of returned clones (graphed_ref.owner).
pub struct graphed_buffer {
    _private: [u8; 0],
}

/// Opaque: the scratch allocator a callback gets (graphed_scratch_alloc,
/// graphed_scratch_free). Valid only during that call.
pub struct graphed_scratch {
    _private: [u8; 0],
}

/// Opaque: where a callback under capture hands over its external buffers
/// (graphed_pass_set_buffer). Valid only during that call.
pub struct graphed_capture {
    _private: [u8; 0],
}

/// The id a handle pointer carries.
pub(crate) fn id<T>(p: *mut T) -> u64 {
    p as usize as u64
}

/// The handle pointer for an id.
pub(crate) fn ptr<T>(id: u64) -> *mut T {
    id as usize as *mut T
}

/// The object behind a non-NULL handle of `kind`, pinned while the `Arc`
/// lives.
pub(crate) fn get<T: Any + Send + Sync, H>(
    p: *mut H,
    kind: Kind,
    what: &'static str,
) -> Result<Arc<T>> {
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    handle::get::<T>(kind, id(p))
}
