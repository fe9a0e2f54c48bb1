//! Handles as C sees them: opaque pointers whose values are ids from the
//! handle table (`core::handle`), never addresses. A lookup pins the object
//! for the call; a NULL handle, a destroyed one and a forged one each get
//! their own status.

use crate::core::handle::{self, Kind};
use crate::error::{Error, Result};
use std::any::Any;
use std::sync::Arc;

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
