//! The host backend: an emulation of the CUDA model for machines without a
//! GPU. "Device" memory is host memory; a stream is a task queue that runs
//! each task as it is enqueued, unless the stream is capturing, in which
//! case the task is recorded; a graph is the recorded list, and launching it
//! runs the tasks again on the same addresses. Static-buffer semantics are
//! the same as on a GPU, so the aliasing hazard and its fix show on a CPU.
//!
//! User callbacks enqueue work with `graphed_host_enqueue`; a synchronize
//! under capture (`graphed_host_synchronize`) invalidates the capture, as a
//! device synchronize does under CUDA's global capture mode.

use super::{
    Backend, BackendKind, CaptureEnd, CaptureMode, ContextGuard, DevPtr, EventRef, Graph, StreamRef,
};
use crate::core::dtype::{accumulate_host, DType};
use crate::core::ALIGN;
use crate::error::{Error, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// A user task: `f(data)`.
pub type HostTaskFn = unsafe extern "C" fn(*mut c_void);

/// One unit of stream work. Addresses are stored as integers: they are
/// device addresses in the CUDA sense, only dereferenced when the task runs.
#[derive(Clone, Copy)]
enum Task {
    Copy {
        dst: usize,
        src: usize,
        bytes: usize,
    },
    Zero {
        dst: usize,
        bytes: usize,
    },
    Accumulate {
        dst: usize,
        src: usize,
        count: usize,
        dtype: DType,
    },
    User {
        f: HostTaskFn,
        data: usize,
    },
}

fn run(task: Task) -> Result<()> {
    match task {
        // SAFETY (all arms): the addresses were handed to the backend as
        // device pointers of at least `bytes` bytes (library-owned static
        // buffers, or caller buffers under the API contract), and the host
        // backend's device memory is host memory.
        Task::Copy { dst, src, bytes } => {
            if dst != src && bytes > 0 {
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) }
            }
        }
        Task::Zero { dst, bytes } => unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) },
        Task::Accumulate {
            dst,
            src,
            count,
            dtype,
        } => unsafe { accumulate_host(dst as *mut u8, src as *const u8, count, dtype)? },
        Task::User { f, data } => unsafe { f(data as *mut c_void) },
    }
    Ok(())
}

#[derive(Default)]
struct StreamState {
    capture: Option<Vec<Task>>,
    invalidated: Option<String>,
}

/// A host stream. Created by the backend; C code sees its address.
#[derive(Default)]
pub struct HostStream {
    state: Mutex<StreamState>,
}

impl HostStream {
    fn lock(&self) -> MutexGuard<'_, StreamState> {
        // A panic while the lock was held cannot leave the state half
        // written (every update is a single assignment), so poison is moot.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Live host streams by address, so that a pointer from C is checked before
/// it is used.
fn streams() -> MutexGuard<'static, HashMap<usize, Arc<HostStream>>> {
    static STREAMS: OnceLock<Mutex<HashMap<usize, Arc<HostStream>>>> = OnceLock::new();
    STREAMS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn lookup(stream: StreamRef) -> Result<Arc<HostStream>> {
    streams().get(&stream.0).cloned().ok_or_else(|| {
        Error::invalid(format!(
            "stream 0x{:x} is not a stream of the host backend (CUDA sessions pass CUstreams, \
             which the host functions cannot use)",
            stream.0
        ))
    })
}

/// Runs `task` on `stream`: now, or recorded when the stream is capturing.
fn submit(stream: StreamRef, task: Task) -> Result<()> {
    if stream.0 == 0 {
        return run(task);
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
    run(task)
}

/// `graphed_host_enqueue`: a user task on a host stream (0 = run now).
pub fn enqueue_user(stream: StreamRef, f: HostTaskFn, data: *mut c_void) -> Result<()> {
    submit(
        stream,
        Task::User {
            f,
            data: data as usize,
        },
    )
}

/// `graphed_host_synchronize`: waits for a stream (0 = the whole device).
/// Host work has already run, so this only checks capture: synchronizing a
/// capturing stream, or the device while any stream captures, is illegal
/// and invalidates those captures, as under CUDA's global capture mode.
pub fn synchronize_user(stream: StreamRef) -> Result<()> {
    let targets: Vec<Arc<HostStream>> = if stream.0 == 0 {
        streams().values().cloned().collect()
    } else {
        vec![lookup(stream)?]
    };
    let mut hit = false;
    for s in targets {
        let mut st = s.lock();
        if st.capture.is_some() {
            hit = true;
            st.invalidated.get_or_insert_with(|| {
                "graphed_host_synchronize was called while the stream was capturing \
                 (the host counterpart of a device synchronize under stream capture)"
                    .to_string()
            });
        }
    }
    if hit {
        Err(Error::IllegalUnderCapture(
            "graphed_host_synchronize is not allowed while a stream is capturing; the capture is invalidated".into(),
        ))
    } else {
        Ok(())
    }
}

struct HostGraph {
    tasks: Vec<Task>,
}

impl Graph for HostGraph {
    fn launch(&self, stream: StreamRef) -> Result<()> {
        for &t in &self.tasks {
            submit(stream, t)?;
        }
        Ok(())
    }
}

/// The host backend. One per session; allocations are tracked so that a
/// free of an unknown address is caught.
#[derive(Default)]
pub struct HostBackend {
    allocs: Mutex<HashMap<DevPtr, Layout>>,
}

impl HostBackend {
    pub fn new() -> Arc<HostBackend> {
        Arc::new(HostBackend::default())
    }

    fn allocs(&self) -> MutexGuard<'_, HashMap<DevPtr, Layout>> {
        self.allocs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for HostBackend {
    fn drop(&mut self) {
        for (ptr, layout) in self.allocs().drain() {
            // SAFETY: every entry was allocated by alloc_zeroed with this layout.
            unsafe { dealloc(ptr as *mut u8, layout) };
        }
    }
}

impl Backend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn ordinal(&self) -> i32 {
        0
    }

    fn bind(&self) -> Result<ContextGuard> {
        Ok(ContextGuard::none())
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN).map_err(|_| {
            Error::OutOfMemory(format!("{bytes} bytes is not a valid host allocation size"))
        })?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        if p.is_null() {
            return Err(Error::OutOfMemory(format!(
                "host allocation of {bytes} bytes failed"
            )));
        }
        self.allocs().insert(p as DevPtr, layout);
        Ok(p as DevPtr)
    }

    fn free(&self, ptr: DevPtr) {
        if let Some(layout) = self.allocs().remove(&ptr) {
            // SAFETY: allocated by alloc_zeroed with this layout, removed once.
            unsafe { dealloc(ptr as *mut u8, layout) };
        }
    }

    fn alloc_async(&self, bytes: usize, _stream: StreamRef) -> Result<DevPtr> {
        self.alloc(bytes)
    }

    fn free_async(&self, ptr: DevPtr, _stream: StreamRef) {
        self.free(ptr)
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize, stream: StreamRef) -> Result<()> {
        submit(
            stream,
            Task::Copy {
                dst: dst as usize,
                src: src as usize,
                bytes,
            },
        )
    }

    fn zero(&self, dst: DevPtr, bytes: usize, stream: StreamRef) -> Result<()> {
        submit(
            stream,
            Task::Zero {
                dst: dst as usize,
                bytes,
            },
        )
    }

    fn accumulate(
        &self,
        dst: DevPtr,
        src: DevPtr,
        count: usize,
        dtype: DType,
        stream: StreamRef,
    ) -> Result<()> {
        if !dtype.accumulable() {
            return Err(Error::invalid(format!(
                "cannot accumulate {}",
                dtype.name()
            )));
        }
        submit(
            stream,
            Task::Accumulate {
                dst: dst as usize,
                src: src as usize,
                count,
                dtype,
            },
        )
    }

    fn prepare_accumulate(&self) -> Result<()> {
        Ok(())
    }

    fn create_stream(&self) -> Result<StreamRef> {
        let s = Arc::new(HostStream::default());
        let key = Arc::as_ptr(&s) as usize;
        streams().insert(key, s);
        Ok(StreamRef(key))
    }

    fn destroy_stream(&self, s: StreamRef) {
        streams().remove(&s.0);
    }

    fn create_event(&self) -> Result<EventRef> {
        Ok(EventRef(0))
    }

    fn destroy_event(&self, _e: EventRef) {}

    fn record_event(&self, _e: EventRef, _s: StreamRef) -> Result<()> {
        Ok(())
    }

    fn wait_event(&self, _s: StreamRef, _e: EventRef) -> Result<()> {
        Ok(())
    }

    fn synchronize(&self, _s: StreamRef) -> Result<()> {
        Ok(())
    }

    fn synchronize_device(&self) -> Result<()> {
        Ok(())
    }

    fn begin_capture(&self, s: StreamRef, _mode: CaptureMode) -> Result<()> {
        let stream = lookup(s)?;
        let mut st = stream.lock();
        if st.capture.is_some() {
            return Err(Error::state("the host stream is already capturing"));
        }
        *st = StreamState {
            capture: Some(Vec::new()),
            invalidated: None,
        };
        Ok(())
    }

    fn end_capture(&self, s: StreamRef) -> Result<CaptureEnd> {
        let stream = lookup(s)?;
        let mut st = stream.lock();
        let Some(tasks) = st.capture.take() else {
            return Err(Error::state("the host stream is not capturing"));
        };
        Ok(match st.invalidated.take() {
            Some(why) => CaptureEnd::Invalidated(why),
            None => CaptureEnd::Graph(Box::new(HostGraph { tasks })),
        })
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        Err(Error::Unsupported(
            "the host backend has no device memory figure".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    unsafe extern "C" fn bump(data: *mut c_void) {
        // SAFETY: the tests pass a pointer to a live u32.
        unsafe { *(data as *mut u32) += 1 };
    }

    #[test]
    fn capture_records_and_replay_reruns_on_the_same_addresses() {
        let b = HostBackend::new();
        let s = b.create_stream().unwrap();
        let src = b.alloc(16).unwrap();
        let dst = b.alloc(16).unwrap();
        let mut counter = 0u32;
        b.begin_capture(s, CaptureMode::Global).unwrap();
        enqueue_user(s, bump, &mut counter as *mut u32 as *mut c_void).unwrap();
        b.copy(dst, src, 16, s).unwrap();
        assert_eq!(counter, 0, "nothing runs under capture");
        let g = match b.end_capture(s).unwrap() {
            CaptureEnd::Graph(g) => g,
            CaptureEnd::Invalidated(why) => panic!("invalidated: {why}"),
        };
        // SAFETY: src is a live 16-byte allocation of this backend.
        unsafe { *(src as *mut u32) = 42 };
        g.launch(StreamRef(0)).unwrap();
        g.launch(s).unwrap();
        assert_eq!(counter, 2);
        // SAFETY: dst is a live 16-byte allocation.
        assert_eq!(unsafe { *(dst as *const u32) }, 42);
        b.destroy_stream(s);
    }

    #[test]
    fn synchronize_under_capture_invalidates_it() {
        let b = HostBackend::new();
        let s = b.create_stream().unwrap();
        synchronize_user(s).unwrap();
        b.begin_capture(s, CaptureMode::Global).unwrap();
        assert!(matches!(
            // This stream, not the whole device: tests run on parallel threads.
            synchronize_user(s),
            Err(Error::IllegalUnderCapture(_))
        ));
        assert!(matches!(
            b.end_capture(s).unwrap(),
            CaptureEnd::Invalidated(_)
        ));
        // The stream is usable again.
        b.begin_capture(s, CaptureMode::Global).unwrap();
        assert!(matches!(b.end_capture(s).unwrap(), CaptureEnd::Graph(_)));
        b.destroy_stream(s);
    }

    #[test]
    fn unknown_streams_are_rejected() {
        let mut x = 0u32;
        let r = enqueue_user(StreamRef(0xdead0), bump, &mut x as *mut u32 as *mut c_void);
        assert!(matches!(r, Err(Error::InvalidArgument(_))));
        assert_eq!(x, 0);
    }
}
