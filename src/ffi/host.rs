//! Host-backend exports for callbacks: enqueue a task or a named kernel
//! that may fault on a host stream, synchronize (illegal under capture, as
//! on a GPU; it reports a kernel's fault, as on a GPU), and the host
//! counterpart of any other operation CUDA refuses under capture.

use super::args::arg_str;
use super::boundary::boundary;
use super::callback::graphed_stream;
use super::status::graphed_status;
use crate::backend::{host, StreamRef};
use crate::error::Error;
use std::ffi::{c_char, c_void};
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

/// A host kernel: `fn(user_data)`, returning 0, or non-zero for a fault.
pub type graphed_host_kernel_fn = Option<unsafe extern "C" fn(user_data: *mut c_void) -> i32>;

/// A C host kernel and its argument, callable from any thread that replays.
struct CKernel {
    f: unsafe extern "C" fn(*mut c_void) -> i32,
    data: *mut c_void,
}

// SAFETY: as for CTask: the API contract is that a kernel may run on any
// thread that replays the session's graphs, with the same user_data.
unsafe impl Send for CKernel {}
// SAFETY: as above; the library never touches `data` itself.
unsafe impl Sync for CKernel {}

impl CKernel {
    fn run(&self) -> i32 {
        // SAFETY: per graphed_host_enqueue_kernel's contract.
        unsafe { (self.f)(self.data) }
    }
}

/// Enqueues the host kernel `kernel(user_data)` named `name` on a
/// host-backend stream, as graphed_host_enqueue does a task: it runs now
/// (NULL stream, or a stream not capturing) or is recorded and runs at
/// every replay. A non-zero return is a fault, as a CUDA kernel's: the
/// call that ran it still succeeds, and the stream's next synchronization
/// reports it, once, as GRAPHED_STATUS_CUDA_ERROR naming the kernel and
/// its return (graphed_host_synchronize on that stream, or on NULL for the
/// NULL stream's kernels, which run on the calling thread; a debug
/// replay's check, which names the callable, pass and graph). The name
/// (copied; NULL: unnamed) labels the kernel's node in
/// graphed_session_export_dot. Not for CUDA streams.
///
/// # Safety
/// `kernel` must be safe to call with `user_data` whenever the stream
/// runs; `name` NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn graphed_host_enqueue_kernel(
    stream: graphed_stream,
    name: *const c_char,
    kernel: graphed_host_kernel_fn,
    user_data: *mut c_void,
) -> graphed_status {
    boundary("graphed_host_enqueue_kernel", || {
        let f = kernel.ok_or(Error::NullPointer { what: "kernel" })?;
        // SAFETY: per this function's contract.
        let name = unsafe { arg_str(name, "name") }?.unwrap_or_default();
        let k = CKernel { f, data: user_data };
        host::enqueue_kernel(StreamRef(stream as usize), &name, Arc::new(move || k.run()))
    })
}

/// Waits for a host stream (NULL: every host stream). Host work runs as it
/// is enqueued, so this enforces capture rules: called on a capturing
/// stream (or with NULL while any stream captures) it invalidates that
/// capture and returns GRAPHED_STATUS_CAPTURE_INVALIDATED, as a device
/// synchronize does under CUDA stream capture. Otherwise it reports, once,
/// the first fault of a host kernel (graphed_host_enqueue_kernel) run on
/// the stream since the last report (NULL: run on the NULL stream by this
/// thread) as GRAPHED_STATUS_CUDA_ERROR.
#[no_mangle]
pub extern "C" fn graphed_host_synchronize(stream: graphed_stream) -> graphed_status {
    boundary("graphed_host_synchronize", || {
        host::synchronize(StreamRef(stream as usize))
    })
}

/// The host counterpart of an operation the CUDA driver does not allow
/// under stream capture (an allocation outside the graph's pool, work on
/// a stream the capture does not know, a CUDA library call that cannot be
/// captured), for tests of failed captures without a GPU. On a capturing
/// host stream (NULL: every capturing host stream, as work on the legacy
/// default stream under CUDA) it invalidates the capture, naming
/// `operation` (NULL: "an operation") as what broke it, and returns
/// GRAPHED_STATUS_CAPTURE_INVALIDATED, as CUDA fails the call; on a
/// stream that is not capturing it does nothing and returns OK.
///
/// # Safety
/// `operation` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn graphed_host_invalidate_capture(
    stream: graphed_stream,
    operation: *const c_char,
) -> graphed_status {
    boundary("graphed_host_invalidate_capture", || {
        // SAFETY: per this function's contract.
        let op = unsafe { arg_str(operation, "operation") }?;
        host::invalidate(
            StreamRef(stream as usize),
            op.as_deref().unwrap_or("an operation"),
        )
    })
}
