//! Host-backend exports for callbacks: enqueue a task on a host stream, and
//! synchronize (illegal under capture, as on a GPU).

use super::{boundary, graphed_status, graphed_stream};
use crate::backend::host;
use crate::backend::StreamRef;
use crate::error::Error;
use std::ffi::c_void;

/// A host task: `fn(user_data)`.
pub type graphed_host_task_fn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;

/// Enqueues `task(user_data)` on a host-backend stream (the ctx->stream of a
/// host session's callback; NULL runs it now). Outside capture it runs
/// immediately; under capture it is recorded and every replay runs it again
/// with the same `user_data`, which must therefore stay valid as long as
/// the session's graphs exist. Not for CUDA streams.
///
/// # Safety
/// `task` must be safe to call with `user_data` whenever the stream runs.
#[no_mangle]
pub unsafe extern "C" fn graphed_host_enqueue(
    stream: graphed_stream,
    task: graphed_host_task_fn,
    user_data: *mut c_void,
) -> graphed_status {
    boundary("graphed_host_enqueue", || {
        let f = task.ok_or(Error::NullPointer { what: "task" })?;
        host::enqueue_user(StreamRef(stream as usize), f, user_data)
    })
}

/// Waits for a host stream (NULL: every host stream). Host work runs as it
/// is enqueued, so this only enforces capture rules: called on a capturing
/// stream (or with NULL while any stream captures) it invalidates that
/// capture and returns GRAPHED_STATUS_CAPTURE_INVALIDATED, as a device
/// synchronize does under CUDA stream capture.
#[no_mangle]
pub extern "C" fn graphed_host_synchronize(stream: graphed_stream) -> graphed_status {
    boundary("graphed_host_synchronize", || {
        host::synchronize_user(StreamRef(stream as usize))
    })
}
