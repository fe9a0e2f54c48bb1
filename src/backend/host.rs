//! The host backend: an emulation of the CUDA model for machines without a
//! GPU. "Device" memory is host memory; a stream is a task queue that runs
//! each task as it is enqueued, unless the stream is capturing, in which
//! case the task is recorded; a graph is the recorded list, and launching it
//! runs the tasks again on the same addresses. Static-buffer semantics are
//! the same as on a GPU, so the aliasing hazard and its fix show on a CPU.
//!
//! Streams are registered in the handle table (the ids callbacks see as
//! their stream). User work is enqueued with [`enqueue`]; [`synchronize`]
//! under capture invalidates the capture, as a device synchronize does
//! under CUDA's global capture mode.

use super::{
    AccItem, Backend, BackendKind, CaptureEnd, CaptureMode, ContextGuard, DevPtr, EventRef, Graph,
    RebindPlan, Rebinder, StreamRef,
};
use crate::core::dtype::{accumulate_host, DType};
use crate::core::handle::{self, Kind};
use crate::core::ALIGN;
use crate::error::{Error, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

thread_local! {
    /// Frees on this thread that report a failure (after freeing): tests
    /// inject them to see teardown errors reported.
    static FAILING_FREES: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Makes the next `n` frees of host-backend memory on this thread report a
/// failure (the memory is still freed): for tests of teardown reporting.
#[doc(hidden)]
pub fn inject_free_failures(n: u32) {
    FAILING_FREES.with(|f| f.set(n));
}

fn injected_free_failure() -> Result<()> {
    let hit = FAILING_FREES.with(|f| {
        let n = f.get();
        f.set(n.saturating_sub(1));
        n > 0
    });
    if hit {
        return Err(Error::Internal("an injected failure of a host free".into()));
    }
    Ok(())
}

/// User work on a host stream.
pub type HostTask = Arc<dyn Fn() + Send + Sync>;

/// One unit of stream work. Addresses are stored as integers: they are
/// device addresses in the CUDA sense, only dereferenced when the task runs.
#[derive(Clone)]
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
    /// Sets the u32 at `flag` to 1 when the two ranges differ.
    Differ {
        a: usize,
        b: usize,
        bytes: usize,
        flag: usize,
    },
    User(HostTask),
}

fn run(task: &Task) -> Result<()> {
    match *task {
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
        Task::Differ { a, b, bytes, flag } => unsafe {
            let (x, y) = (
                std::slice::from_raw_parts(a as *const u8, bytes),
                std::slice::from_raw_parts(b as *const u8, bytes),
            );
            if x != y {
                *(flag as *mut u32) = 1;
            }
        },
        Task::User(ref f) => f(),
    }
    Ok(())
}

#[derive(Default)]
struct StreamState {
    capture: Option<Vec<Task>>,
    invalidated: Option<String>,
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
fn submit(stream: StreamRef, task: Task) -> Result<()> {
    if stream.0 == 0 {
        return run(&task);
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
    run(&task)
}

/// User work on a host stream (0 = run now).
pub fn enqueue(stream: StreamRef, task: HostTask) -> Result<()> {
    submit(stream, Task::User(task))
}

/// Waits for a host stream (0 = the whole device). Host work has already
/// run, so this only checks capture: synchronizing a capturing stream, or
/// the device while any stream captures, is illegal and invalidates those
/// captures, as under CUDA's global capture mode.
pub fn synchronize(stream: StreamRef) -> Result<()> {
    let targets: Vec<Arc<HostStream>> = if stream.0 == 0 {
        handle::all::<HostStream>(Kind::HostStream)
    } else {
        vec![lookup(stream)?]
    };
    let mut hit = false;
    for s in targets {
        let mut st = s.lock();
        if st.capture.is_some() {
            hit = true;
            st.invalidated.get_or_insert_with(|| {
                "the stream was synchronized while it was capturing \
                 (the host counterpart of a device synchronize under stream capture)"
                    .to_string()
            });
        }
    }
    if hit {
        Err(Error::IllegalUnderCapture(
            "synchronizing is not allowed while a stream is capturing; the capture is invalidated"
                .into(),
        ))
    } else {
        Ok(())
    }
}

struct HostGraph {
    tasks: Arc<Mutex<Vec<Task>>>,
}

impl HostGraph {
    fn tasks(&self) -> MutexGuard<'_, Vec<Task>> {
        // Rebinds replace whole addresses; a task list is never half written.
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Graph for HostGraph {
    fn launch(&self, stream: StreamRef) -> Result<()> {
        // One task at a time, outside the lock: a user task may launch work.
        let n = self.tasks().len();
        for i in 0..n {
            let t = self.tasks()[i].clone();
            submit(stream, t)?;
        }
        Ok(())
    }

    fn rebinder(&self, base: DevPtr, bytes: usize) -> Result<RebindPlan> {
        let (lo, hi) = (base as usize, base as usize + bytes);
        let inside = |a: usize| a >= lo && a < hi;
        let mut refs = Vec::new();
        for (i, t) in self.tasks().iter().enumerate() {
            match *t {
                Task::User(_) => {
                    return Ok(RebindPlan::Refused(
                        "the graph runs host tasks whose data is opaque: where they \
                         read the input cannot be seen"
                            .into(),
                    ))
                }
                Task::Copy { dst, src, .. } | Task::Accumulate { dst, src, .. } => {
                    for (field, a) in [(0, dst), (1, src)] {
                        if inside(a) {
                            refs.push((i, field, a - lo));
                        }
                    }
                }
                Task::Zero { dst, .. } => {
                    if inside(dst) {
                        refs.push((i, 0, dst - lo));
                    }
                }
                Task::Differ { a, b, .. } => {
                    for (field, p) in [(0, a), (1, b)] {
                        if inside(p) {
                            refs.push((i, field, p - lo));
                        }
                    }
                }
            }
        }
        if refs.is_empty() {
            return Ok(RebindPlan::Unreferenced);
        }
        Ok(RebindPlan::Plan(Box::new(HostRebinder {
            tasks: self.tasks.clone(),
            refs,
        })))
    }
}

/// (task, which address: 0 dst / 1 src, offset from the base).
struct HostRebinder {
    tasks: Arc<Mutex<Vec<Task>>>,
    refs: Vec<(usize, u8, usize)>,
}

impl Rebinder for HostRebinder {
    fn nodes(&self) -> usize {
        self.refs.len()
    }

    fn rebind(&mut self, base: DevPtr) -> Result<()> {
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        for &(i, field, off) in &self.refs {
            let a = base as usize + off;
            match (&mut tasks[i], field) {
                (Task::Copy { dst, .. }, 0)
                | (Task::Accumulate { dst, .. }, 0)
                | (Task::Zero { dst, .. }, _) => *dst = a,
                (Task::Copy { src, .. }, _) | (Task::Accumulate { src, .. }, _) => *src = a,
                (Task::Differ { a: x, .. }, 0) => *x = a,
                (Task::Differ { b: y, .. }, _) => *y = a,
                (Task::User(_), _) => {}
            }
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

    fn free(&self, ptr: DevPtr) -> Result<()> {
        let layout = self.allocs().remove(&ptr).ok_or_else(|| {
            Error::invalid(format!(
                "0x{ptr:x} is not memory of this host backend (freed twice?)"
            ))
        })?;
        // SAFETY: allocated by alloc_zeroed with this layout, removed once.
        unsafe { dealloc(ptr as *mut u8, layout) };
        injected_free_failure()
    }

    fn alloc_async(&self, bytes: usize, _stream: StreamRef) -> Result<DevPtr> {
        self.alloc(bytes)
    }

    fn free_async(&self, ptr: DevPtr, _stream: StreamRef) -> Result<()> {
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

    fn accumulate(&self, items: &[AccItem], dtype: DType, stream: StreamRef) -> Result<()> {
        if !dtype.accumulable() {
            return Err(Error::invalid(format!(
                "cannot accumulate {}",
                dtype.name()
            )));
        }
        for it in items {
            submit(
                stream,
                Task::Accumulate {
                    dst: it.dst as usize,
                    src: it.src as usize,
                    count: it.count,
                    dtype,
                },
            )?;
        }
        Ok(())
    }

    fn differ(
        &self,
        a: DevPtr,
        b: DevPtr,
        bytes: usize,
        flag: DevPtr,
        stream: StreamRef,
    ) -> Result<()> {
        submit(
            stream,
            Task::Differ {
                a: a as usize,
                b: b as usize,
                bytes,
                flag: flag as usize,
            },
        )
    }

    fn prepare_kernels(&self) -> Result<()> {
        Ok(())
    }

    fn create_stream(&self) -> Result<StreamRef> {
        let id = handle::insert(Kind::HostStream, Arc::new(HostStream::default()), 1);
        Ok(StreamRef(id as usize))
    }

    fn destroy_stream(&self, s: StreamRef) -> Result<()> {
        match handle::remove(s.0 as u64) {
            Some(_) => Ok(()),
            None => Err(Error::invalid(format!(
                "stream 0x{:x} is not a live host stream",
                s.0
            ))),
        }
    }

    // Host work runs as it is enqueued: events and waits have nothing to order.
    fn create_event(&self) -> Result<EventRef> {
        Ok(EventRef(0))
    }

    fn destroy_event(&self, _e: EventRef) -> Result<()> {
        Ok(())
    }

    fn record(&self, _event: EventRef, _stream: StreamRef) -> Result<()> {
        Ok(())
    }

    fn wait(&self, _stream: StreamRef, _event: EventRef) -> Result<()> {
        Ok(())
    }

    fn synchronize(&self, _s: StreamRef) -> Result<()> {
        Ok(())
    }

    fn synchronize_all(&self) -> Result<()> {
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
            None => CaptureEnd::Graph(Box::new(HostGraph {
                tasks: Arc::new(Mutex::new(tasks)),
            })),
        })
    }

    fn is_capturing(&self, s: StreamRef) -> Result<bool> {
        if s.0 == 0 {
            return Ok(false);
        }
        Ok(lookup(s)?.lock().capture.is_some())
    }

    fn capture_invalidated(&self, s: StreamRef) -> Result<bool> {
        if s.0 == 0 {
            return Ok(false);
        }
        Ok(lookup(s)?.lock().invalidated.is_some())
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        Err(Error::Unsupported(
            "the host backend has no device memory figure".into(),
        ))
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        // SAFETY: `dst` is host memory of at least src.len() bytes (a buffer
        // of this backend, per the caller).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        // SAFETY: as above, for `src`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn counter_task(c: &Arc<AtomicU32>) -> HostTask {
        let c = c.clone();
        Arc::new(move || {
            c.fetch_add(1, Ordering::Relaxed);
        })
    }

    #[test]
    fn capture_records_and_replay_reruns_on_the_same_addresses() {
        let b = HostBackend::new();
        let s = b.create_stream().unwrap();
        let src = b.alloc(16).unwrap();
        let dst = b.alloc(16).unwrap();
        let counter = Arc::new(AtomicU32::new(0));
        b.begin_capture(s, CaptureMode::Global).unwrap();
        assert!(b.is_capturing(s).unwrap());
        enqueue(s, counter_task(&counter)).unwrap();
        b.copy(dst, src, 16, s).unwrap();
        assert_eq!(
            counter.load(Ordering::Relaxed),
            0,
            "nothing runs under capture"
        );
        let g = match b.end_capture(s).unwrap() {
            CaptureEnd::Graph(g) => g,
            CaptureEnd::Invalidated(why) => panic!("invalidated: {why}"),
        };
        assert!(!b.is_capturing(s).unwrap());
        // SAFETY: src is a live 16-byte allocation of this backend.
        unsafe { *(src as *mut u32) = 42 };
        g.launch(StreamRef(0)).unwrap();
        g.launch(s).unwrap();
        assert_eq!(counter.load(Ordering::Relaxed), 2);
        // SAFETY: dst is a live 16-byte allocation.
        assert_eq!(unsafe { *(dst as *const u32) }, 42);
        b.destroy_stream(s).unwrap();
    }

    #[test]
    fn copies_are_rebound_and_opaque_tasks_are_refused() {
        let b = HostBackend::new();
        let s = b.create_stream().unwrap();
        let (x, y, z) = (
            b.alloc(16).unwrap(),
            b.alloc(16).unwrap(),
            b.alloc(16).unwrap(),
        );
        b.upload(x, &[1; 16]).unwrap();
        b.upload(y, &[2; 16]).unwrap();
        b.begin_capture(s, CaptureMode::Global).unwrap();
        b.copy(z, x + 8, 8, s).unwrap();
        let CaptureEnd::Graph(g) = b.end_capture(s).unwrap() else {
            panic!("invalidated")
        };
        let RebindPlan::Plan(mut r) = g.rebinder(x, 16).unwrap() else {
            panic!("the copy reads x + 8")
        };
        assert_eq!(r.nodes(), 1);
        r.rebind(y).unwrap();
        g.launch(s).unwrap();
        let mut out = [0u8; 16];
        b.download(&mut out, z).unwrap();
        assert_eq!(&out[..8], &[2; 8], "the copy reads y + 8 now");
        assert!(
            matches!(g.rebinder(z + 64, 16).unwrap(), RebindPlan::Unreferenced),
            "nothing references that range"
        );
        b.begin_capture(s, CaptureMode::Global).unwrap();
        enqueue(s, Arc::new(|| {})).unwrap();
        let CaptureEnd::Graph(g) = b.end_capture(s).unwrap() else {
            panic!("invalidated")
        };
        let RebindPlan::Refused(why) = g.rebinder(x, 16).unwrap() else {
            panic!("a host task is opaque")
        };
        assert!(why.contains("opaque"), "{why}");
        b.destroy_stream(s).unwrap();
    }

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
