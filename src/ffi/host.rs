//! Host-backend exports for callbacks: enqueue a task on a host stream, and
//! synchronize (illegal under capture, as on a GPU).

use super::boundary::boundary;
use super::callback::graphed_stream;
use super::status::graphed_status;
use crate::backend::{host, StreamRef};
use crate::error::Error;
use std::ffi::c_void;
use std::sync::Arc;

/// A host task: `fn(user_data)`.
pub type graphed_host_task_fn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;

/// A C task and its argument, callable from any thread that replays.
struct CTask {
    f: unsafe extern "C" fn(*mut c_void),
    data: *mut c_void,
}

// SAFETY: the API contract is that a task may run on any thread that
// replays the session's graphs, with the same user_data every time.
unsafe impl Send for CTask {}
// SAFETY: as above; the library never touches `data` itself.
unsafe impl Sync for CTask {}

impl CTask {
    // A method, so that closures capture the whole (Send + Sync) task.
    fn run(&self) {
        // SAFETY: per graphed_host_enqueue's contract, the task is safe to
        // call with its user_data whenever the stream runs.
        unsafe { (self.f)(self.data) }
    }
}

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
        let t = CTask { f, data: user_data };
        host::enqueue(StreamRef(stream as usize), Arc::new(move || t.run()))
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
        host::synchronize(StreamRef(stream as usize))
    })
}
