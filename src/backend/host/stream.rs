//! Host streams and their capture state: streams live in the handle table
//! (the ids callbacks see as their stream); work submitted to one runs now,
//! or is recorded while it captures; synchronizing under capture
//! invalidates the capture. A host kernel that fails leaves its error on
//! its stream (work on the NULL stream, which runs at once on the calling
//! thread: on that thread), and the stream's next synchronization reports
//! it, once, as a CUDA stream reports a kernel's asynchronous error.

use super::task::{run, HostKernel, HostTask, Task};
use crate::backend::StreamRef;
use crate::core::handle::{self, Kind};
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Default)]
struct StreamState {
    capture: Option<Vec<Task>>,
    invalidated: Option<String>,
    /// The first fault of work run on the stream, not yet reported.
    fault: Option<String>,
}

thread_local! {
    /// The first fault of work run at once (the NULL stream) on this
    /// thread, not yet reported.
    static NULL_STREAM_FAULT: std::cell::RefCell<Option<String>> =
        const { std::cell::RefCell::new(None) };
}

/// A host stream.
#[derive(Default)]
pub struct HostStream {
    state: Mutex<StreamState>,
}

impl HostStream {
    fn lock(&self) -> MutexGuard<'_, StreamState> {
        // Every update is a single assignment, so poison is moot.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn lookup(stream: StreamRef) -> Result<Arc<HostStream>> {
    handle::get::<HostStream>(Kind::HostStream, stream.0 as u64).map_err(|e| match e {
        Error::InvalidArgument(_) => Error::invalid(format!(
            "stream 0x{:x} is not a stream of the host backend (CUDA sessions pass CUstreams, \
             which the host functions cannot use)",
            stream.0
        )),
        other => other,
    })
}

/// Checks that `stream` is 0 or a live host stream, as the functions that
/// order work on it do, without touching it.
pub fn check_stream(stream: StreamRef) -> Result<()> {
    if stream.0 != 0 {
        lookup(stream)?;
    }
    Ok(())
}

/// Runs `task` on `stream`: now, or recorded when the stream is capturing.
/// A fault of the work it ran is kept for the stream's next
/// synchronization, not returned.
pub(super) fn submit(stream: StreamRef, task: Task) -> Result<()> {
    if stream.0 == 0 {
        return match run(&task) {
            Err(Error::DeviceFault(what)) => {
                NULL_STREAM_FAULT.with(|f| {
                    f.borrow_mut().get_or_insert(what);
                });
                Ok(())
            }
            r => r,
        };
    }
    let s = lookup(stream)?;
    {
        let mut st = s.lock();
        if let Some(list) = st.capture.as_mut() {
            list.push(task);
            return Ok(());
        }
    }
    // Run outside the lock: a user task may enqueue more work.
    match run(&task) {
        Err(Error::DeviceFault(what)) => {
            s.lock().fault.get_or_insert(what);
            Ok(())
        }
        r => r,
    }
}

/// Reports, once, the first fault of the work run on `stream` (0: on this
/// thread's NULL stream) since the last report. A stream that is not a
/// live host stream has none.
pub fn take_fault(stream: StreamRef) -> Result<()> {
    let fault = if stream.0 == 0 {
        NULL_STREAM_FAULT.with(|f| f.borrow_mut().take())
    } else {
        lookup(stream).ok().and_then(|s| s.lock().fault.take())
    };
    match fault {
        Some(what) => Err(Error::DeviceFault(format!(
            "{what} (a fault of work run on {}, reported at its synchronization)",
            stream_name(stream)
        ))),
        None => Ok(()),
    }
}

/// "host stream 0x..", or "the NULL stream (this thread's)".
fn stream_name(stream: StreamRef) -> String {
    match stream.0 {
        0 => "the NULL stream (run at once on this thread)".to_string(),
        s => format!("host stream 0x{s:x}"),
    }
}

/// User work on a host stream (0 = run now).
pub fn enqueue(stream: StreamRef, task: HostTask) -> Result<()> {
    submit(stream, Task::User(task))
}

/// A named host kernel on a host stream (0 = run now): a non-zero return is
/// a fault, which the stream's next synchronization reports.
pub fn enqueue_kernel(stream: StreamRef, name: &str, f: HostKernel) -> Result<()> {
    submit(
        stream,
        Task::Kernel {
            name: name.into(),
            f,
        },
    )
}

/// What every invalidated host capture says, as CUDA's
/// CUDA_ERROR_STREAM_CAPTURE_INVALIDATED does.
const NOT_ALLOWED: &str = "the capture was invalidated by an operation that is not allowed under \
     capture (a host synchronisation, an allocation outside the graph's pool, work on another stream)";

/// Marks the captures of `stream` (0: of every host stream, as an
/// operation of the legacy default stream does on CUDA) invalidated by
/// `operation`; returns the streams it invalidated, by name.
fn invalidate_captures(stream: StreamRef, operation: &dyn Fn() -> String) -> Result<Vec<String>> {
    let targets: Vec<(StreamRef, Arc<HostStream>)> = if stream.0 == 0 {
        handle::all_with_ids::<HostStream>(Kind::HostStream)
            .into_iter()
            .map(|(id, s)| (StreamRef(id as usize), s))
            .collect()
    } else {
        vec![(stream, lookup(stream)?)]
    };
    let mut hit = Vec::new();
    for (id, s) in targets {
        let mut st = s.lock();
        if st.capture.is_some() {
            hit.push(stream_name(id));
            st.invalidated.get_or_insert_with(operation);
        }
    }
    Ok(hit)
}

/// Waits for a host stream (0 = the whole device). Host work has already
/// run, so this checks capture: synchronizing a capturing stream, or
/// the device while any stream captures, is illegal and invalidates those
/// captures, as under CUDA's global capture mode; then it reports the
/// stream's fault, if any (`take_fault`; 0: this thread's NULL stream).
pub fn synchronize(stream: StreamRef) -> Result<()> {
    let op = || {
        format!(
            "graphed_host_synchronize({}), a host synchronisation, while the stream was capturing",
            stream_name(stream)
        )
    };
    let hit = invalidate_captures(stream, &op)?;
    if hit.is_empty() {
        return take_fault(stream);
    }
    Err(Error::IllegalUnderCapture(format!(
        "synchronizing is not allowed while a stream is capturing; the capture on {} is invalidated",
        hit.join(", ")
    )))
}

/// The host counterpart of an operation CUDA does not allow under capture
/// (`operation` names it): the captures of `stream` (0: every capturing
/// host stream) are invalidated naming it, and the call is refused as
/// CUDA refuses it; on a stream that is not capturing it does nothing.
pub fn invalidate(stream: StreamRef, operation: &str) -> Result<()> {
    let op = || format!("{operation}, not allowed under capture");
    let hit = invalidate_captures(stream, &op)?;
    if hit.is_empty() {
        return Ok(());
    }
    Err(Error::IllegalUnderCapture(format!(
        "{operation} is not allowed while a stream is capturing; the capture on {} is invalidated",
        hit.join(", ")
    )))
}

pub(super) fn create() -> StreamRef {
    let id = handle::insert(Kind::HostStream, Arc::new(HostStream::default()), 1);
    StreamRef(id as usize)
}

pub(super) fn destroy(s: StreamRef) -> Result<()> {
    match handle::remove(s.0 as u64) {
        Some(_) => Ok(()),
        None => Err(Error::invalid(format!(
            "stream 0x{:x} is not a live host stream",
            s.0
        ))),
    }
}

pub(super) fn begin_capture(s: StreamRef) -> Result<()> {
    let stream = lookup(s)?;
    let mut st = stream.lock();
    if st.capture.is_some() {
        return Err(Error::state("the host stream is already capturing"));
    }
    st.capture = Some(Vec::new());
    st.invalidated = None;
    Ok(())
}

/// Ends the capture on `s`: the recorded tasks, or (`Err`) why the capture
/// was invalidated.
pub(super) fn end_capture(s: StreamRef) -> Result<std::result::Result<Vec<Task>, String>> {
    let stream = lookup(s)?;
    let mut st = stream.lock();
    let Some(tasks) = st.capture.take() else {
        return Err(Error::state("the host stream is not capturing"));
    };
    Ok(match st.invalidated.take() {
        Some(op) => Err(format!("{NOT_ALLOWED}; the host backend saw {op}")),
        None => Ok(tasks),
    })
}

pub(super) fn is_capturing(s: StreamRef) -> Result<bool> {
    if s.0 == 0 {
        return Ok(false);
    }
    Ok(lookup(s)?.lock().capture.is_some())
}

pub(super) fn capture_invalidated(s: StreamRef) -> Result<bool> {
    if s.0 == 0 {
        return Ok(false);
    }
    Ok(lookup(s)?.lock().invalidated.is_some())
}

#[cfg(test)]
mod tests {
    use super::super::task::counter_task;
    use super::*;
    use crate::backend::host::HostBackend;
    use crate::backend::{Backend, CaptureEnd, CaptureMode};
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn synchronize_under_capture_invalidates_it() {
        let b = HostBackend::new();
        let s = b.create_stream().unwrap();
        synchronize(s).unwrap();
        b.begin_capture(s, CaptureMode::Global).unwrap();
        assert!(matches!(
            // This stream, not the whole device: tests run on parallel threads.
            synchronize(s),
            Err(Error::IllegalUnderCapture(_))
        ));
        assert!(matches!(
            b.end_capture(s).unwrap(),
            CaptureEnd::Invalidated(_)
        ));
        // The stream is usable again.
        b.begin_capture(s, CaptureMode::Global).unwrap();
        assert!(matches!(b.end_capture(s).unwrap(), CaptureEnd::Graph(_)));
        b.destroy_stream(s).unwrap();
    }

    #[test]
    fn unknown_and_destroyed_streams_are_rejected() {
        let counter = Arc::new(AtomicU32::new(0));
        let r = enqueue(StreamRef(0xdead0), counter_task(&counter));
        assert!(matches!(r, Err(Error::InvalidArgument(_))));
        let b = HostBackend::new();
        let s = b.create_stream().unwrap();
        b.destroy_stream(s).unwrap();
        let r = enqueue(s, counter_task(&counter));
        assert!(matches!(r, Err(Error::UseAfterDestroy(_))), "{r:?}");
        assert_eq!(counter.load(Ordering::Relaxed), 0);
    }
}
