//! Backends: the CUDA driver backend (the product) and the host emulation
//! (for tests and for users' CI). Orchestration sees the [`Backend`] trait
//! and the resource types that own what it makes ([`DeviceMemory`],
//! [`Stream`], [`Event`]); [`open`] picks the implementation; `accounting`
//! records what both hold, process-wide. Nothing here knows about C.

pub mod accounting;
pub mod cuda;
pub mod host;
pub mod journal;
pub mod teardown;

use crate::core::dot::Nodes;
use crate::core::dtype::DType;
use crate::error::Result;
use std::sync::Arc;

/// A device address (host address on the host backend).
pub type DevPtr = u64;

/// A raw stream handle: a `CUstream` on CUDA, a host stream on the host
/// backend; 0 is the default stream (the legacy NULL stream on CUDA,
/// immediate execution on the host).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StreamRef(pub usize);

/// A raw event handle (`CUevent`; unused on the host).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventRef(pub usize);

/// Which backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// CUDA through the driver API (the product).
    Cuda,
    /// Host emulation: "device" memory is host memory, a stream is a task
    /// queue, capture records tasks and replay re-runs them.
    Host,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Host => "host",
        }
    }
}

/// Capture mode of a stream capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureMode {
    /// Unsafe calls (allocations, synchronizations) from any thread during a
    /// capture invalidate it: PyTorch's default, and the safest.
    Global,
    /// Only unsafe calls from the capturing thread invalidate it.
    ThreadLocal,
    /// No checks: the caller promises nothing unsafe happens. (The host
    /// backend checks its own synchronize in every mode.)
    Relaxed,
}

/// A copy of `bytes` from `src + i * src_stride` to `dst + i * dst_stride`,
/// i the u32 at `index` when the copy runs (in a loop, the iteration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexedCopy {
    pub dst: DevPtr,
    pub dst_stride: usize,
    pub src: DevPtr,
    pub src_stride: usize,
    pub bytes: usize,
    pub index: DevPtr,
}

/// `rows` blocks of `width` bytes, block i at `dst + i * dst_pitch` (and,
/// for a copy, from `src + i * src_pitch`): a DYNAMIC tensor's data in a
/// bucket when it varies on a dimension other than the first
/// (`core::padded`). `src` is 0 for a zeroing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows2d {
    pub dst: DevPtr,
    pub dst_pitch: usize,
    pub src: DevPtr,
    pub src_pitch: usize,
    pub width: usize,
    pub rows: usize,
}

/// A choice on the device between bodies (see [`Backend::capture_switch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    /// A u64: the size to choose for.
    pub size: DevPtr,
    /// One u64 per body, ascending: the largest size each body takes.
    pub table: DevPtr,
    /// A u64 counting sizes no body takes.
    pub overflows: DevPtr,
}

/// The rows of a buffer past a size in device memory (see
/// [`Backend::zero_tail`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tail {
    pub dst: DevPtr,
    /// Bytes of one row.
    pub row: usize,
    /// A u64: the rows to keep.
    pub size: DevPtr,
    /// The buffer's bytes.
    pub bytes: usize,
    /// The most bytes the tail can take.
    pub most: usize,
}

/// One tensor of an accumulate: `count` elements at `dst` += `src`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccItem {
    pub dst: DevPtr,
    pub src: DevPtr,
    pub count: usize,
}

/// Host time making a graph ready took, after its capture ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Made {
    pub instantiate: std::time::Duration,
    pub upload: std::time::Duration,
}

/// An instantiated, uploaded graph. Dropping it destroys it.
pub trait Graph: Send {
    fn launch(&self, stream: StreamRef) -> Result<()>;

    /// The backend's own type (to take its template into another graph).
    fn as_any(&self) -> &dyn std::any::Any;

    /// How long instantiating and uploading it took.
    fn made(&self) -> Made {
        Made::default()
    }

    /// A plan to move the graph's references to `[base, base + bytes)`
    /// elsewhere: every place the graph takes such an address as a kernel
    /// argument or a copy or set operand. Needs the graph's template.
    fn rebinder(&self, base: DevPtr, bytes: usize) -> Result<RebindPlan>;

    /// Lets the captured template go once no new plan will be asked for
    /// (plans made before keep what they need); returns whether a plan
    /// still keeps it.
    fn release_template(&mut self) -> bool {
        false
    }

    /// Its nodes and their dependencies, as recorded when its capture
    /// ended (so that they outlive the template), for the DOT export.
    fn nodes(&self) -> Nodes {
        Nodes::unknown("this graph does not list its nodes")
    }
}

/// What [`Graph::rebinder`] found for a range.
pub enum RebindPlan {
    /// The graph references the range; the plan moves every reference.
    Plan(Box<dyn Rebinder>),
    /// Nothing in the graph takes an address of the range: no plan needed.
    Unreferenced,
    /// The graph cannot tell or cannot update its references (opaque work,
    /// no parameter information); the text says why.
    Refused(String),
}

/// Moves a graph's references to one range (see [`Graph::rebinder`]).
pub trait Rebinder: Send {
    /// How many nodes (or tasks) a rebind updates.
    fn nodes(&self) -> usize;
    /// Points every reference at the same offset from `base` instead. Not
    /// while the graph is being launched on another thread.
    fn rebind(&mut self, base: DevPtr) -> Result<()>;
}

/// How a stream capture ended.
pub enum CaptureEnd {
    Graph(Box<dyn Graph>),
    /// Something illegal happened under capture; the text says what.
    Invalidated(String),
}

/// Restores the previously current context (CUDA) when dropped.
pub struct ContextGuard {
    restore: Option<(fn(usize), usize)>,
}

impl ContextGuard {
    pub fn none() -> ContextGuard {
        ContextGuard { restore: None }
    }

    pub fn restoring(f: fn(usize), previous: usize) -> ContextGuard {
        ContextGuard {
            restore: Some((f, previous)),
        }
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if let Some((f, prev)) = self.restore.take() {
            f(prev);
        }
    }
}

/// What orchestration needs from a device. All stream work is asynchronous
/// in stream order; under capture it is recorded instead of run. The
/// create/destroy pairs are used through the owning types below.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// The device ordinal (0 on the host).
    fn ordinal(&self) -> i32;
    /// Makes this backend's context current on the calling thread until the
    /// guard drops.
    fn bind(&self) -> Result<ContextGuard>;

    /// Device memory outside any stream (not legal under capture).
    fn alloc(&self, bytes: usize) -> Result<DevPtr>;
    /// Frees `alloc` memory (the caller has waited for work that uses it).
    fn free(&self, ptr: DevPtr) -> Result<()>;
    /// Stream-ordered allocation from the backend's pool (clones).
    fn alloc_async(&self, bytes: usize, stream: StreamRef) -> Result<DevPtr>;
    fn free_async(&self, ptr: DevPtr, stream: StreamRef) -> Result<()>;

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize, stream: StreamRef) -> Result<()>;
    fn zero(&self, dst: DevPtr, bytes: usize, stream: StreamRef) -> Result<()>;
    /// Copies `r.rows` blocks of `r.width` bytes from `r.src` (pitch
    /// `r.src_pitch`) to `r.dst` (pitch `r.dst_pitch`); the pitches are at
    /// least the width, and the regions do not overlap.
    fn copy_2d(&self, r: Rows2d, stream: StreamRef) -> Result<()>;
    /// Zeroes `r.rows` blocks of `r.width` bytes at `r.dst` (pitch
    /// `r.dst_pitch`, at least the width; `r.src` is ignored).
    fn zero_2d(&self, r: Rows2d, stream: StreamRef) -> Result<()>;
    /// Sets `count` elements of `elem` bytes (1, 2 or 4) at `dst` to the
    /// low `elem` bytes of `pattern`.
    fn fill(
        &self,
        dst: DevPtr,
        pattern: u32,
        elem: usize,
        count: usize,
        stream: StreamRef,
    ) -> Result<()>;
    /// Whether graphs can loop (conditional WHILE nodes): None, or why not.
    fn loops(&self) -> Option<String>;
    /// Records, into the capture running on `stream`, a loop whose body
    /// `body` records into the stream it is given: the body runs, the u32
    /// at `state` (the index) is incremented, and the body runs again
    /// while the index is below the u32 at `state + 4` (the count); it
    /// always runs once, unless `skip` (flag, counter) is given and the u32
    /// at flag is not 0 when the graph runs: then the body does not run
    /// and the u64 at counter is incremented (as `capture_unless` does,
    /// without nesting the loop inside a condition: CUDA refuses the child
    /// graph that would hold it). The capture goes on after the loop. Work
    /// in the body is limited to kernels, copies and sets (no events, no
    /// forks).
    fn capture_loop(
        &self,
        stream: StreamRef,
        state: DevPtr,
        skip: Option<(DevPtr, DevPtr)>,
        mode: CaptureMode,
        body: &mut dyn FnMut(StreamRef) -> Result<()>,
    ) -> Result<()>;
    /// Records, into the capture running on `stream`, work that runs only
    /// when the u32 at `flag` is 0 when the graph runs: the body `body`
    /// records into the stream it is given (kernels, copies and sets only,
    /// as a loop's). When the flag is not 0, the body does not run and the
    /// u64 at `counter` is incremented. Needs what `loops` needs
    /// (conditional nodes that kernels set). The capture goes on after it.
    fn capture_unless(
        &self,
        stream: StreamRef,
        flag: DevPtr,
        counter: DevPtr,
        mode: CaptureMode,
        body: &mut dyn FnMut(StreamRef) -> Result<()>,
    ) -> Result<()>;
    /// Enqueues a copy of `src` (host memory, read before this returns)
    /// to device memory at `dst`, in stream order on `stream` (not
    /// capturing).
    fn upload_async(&self, dst: DevPtr, src: &[u8], stream: StreamRef) -> Result<()>;
    /// Waits for the work before the last record of `event`, and reports
    /// an error that work met.
    fn event_synchronize(&self, event: EventRef) -> Result<()>;
    /// Whether graphs can choose one of several bodies on the device
    /// (conditional SWITCH nodes): None, or why not.
    fn switches(&self) -> Option<String>;
    /// Records, into the capture running on `stream`, a choice made on the
    /// device when the graph runs: body i, a copy of `bodies[i]`'s work,
    /// runs for the first i whose `choice.table[i]` (u64 device memory)
    /// is at least the u64 at `choice.size`; when none is, no body runs,
    /// the u64 at `choice.overflows` is incremented and the ranges of
    /// `zeros` (address, bytes: what the bodies write) are zeroed instead.
    /// The capture goes on after the choice. The bodies are graphs of this
    /// backend whose templates are kept.
    fn capture_switch(
        &self,
        stream: StreamRef,
        choice: Choice,
        bodies: &[&dyn Graph],
        zeros: &[(DevPtr, usize)],
    ) -> Result<()>;
    /// Zeroes `[dst + min(n * row, bytes), dst + bytes)`, n the u64 at
    /// `size` when the work runs; at most `most` bytes are zeroed (it sizes
    /// the work; a larger tail is zeroed whole, only slower).
    fn zero_tail(&self, tail: Tail, stream: StreamRef) -> Result<()>;
    /// A copy whose addresses depend on an index read when it runs.
    fn copy_indexed(&self, c: IndexedCopy, stream: StreamRef) -> Result<()>;
    /// `dst += src` for every item, elements of `dtype` (f32, f16, bf16), in
    /// as few launches as the backend can. Destinations are aligned to the
    /// element size (checked by the caller).
    fn accumulate(&self, items: &[AccItem], dtype: DType, stream: StreamRef) -> Result<()>;
    /// Sets the `u32` at `flag` to a non-zero value when the `bytes` bytes
    /// at `a` and at `b` differ; leaves it alone when they are equal.
    fn differ(
        &self,
        a: DevPtr,
        b: DevPtr,
        bytes: usize,
        flag: DevPtr,
        stream: StreamRef,
    ) -> Result<()>;
    /// Loads what `accumulate` and `differ` need, outside capture.
    fn prepare_kernels(&self) -> Result<()>;

    fn create_stream(&self) -> Result<StreamRef>;
    fn destroy_stream(&self, s: StreamRef) -> Result<()>;
    fn create_event(&self) -> Result<EventRef>;
    fn destroy_event(&self, e: EventRef) -> Result<()>;
    /// Records `event` at the current end of `stream`.
    fn record(&self, event: EventRef, stream: StreamRef) -> Result<()>;
    /// Makes later work on `stream` wait for the last record of `event`.
    fn wait(&self, stream: StreamRef, event: EventRef) -> Result<()>;
    /// Makes later work on `to` wait for the work enqueued on `from` so far,
    /// through `event`.
    fn join(&self, from: StreamRef, to: StreamRef, event: EventRef) -> Result<()> {
        self.record(event, from)?;
        self.wait(to, event)
    }
    /// Waits for the work enqueued on `s`, and reports an error that work
    /// met (CUDA: a kernel's asynchronous or sticky error; host: a host
    /// kernel's fault).
    fn synchronize(&self, s: StreamRef) -> Result<()>;
    /// Waits for all work of the device (of every stream).
    fn synchronize_all(&self) -> Result<()>;

    fn begin_capture(&self, s: StreamRef, mode: CaptureMode) -> Result<()>;
    /// Ends the capture on `s`; a valid capture is instantiated and uploaded.
    fn end_capture(&self, s: StreamRef) -> Result<CaptureEnd>;
    /// Whether `s` is capturing a graph now (anyone's capture).
    fn is_capturing(&self, s: StreamRef) -> Result<bool>;
    /// Whether the capture on `s` was invalidated (something uncapturable
    /// was enqueued): ending it can only fail.
    fn capture_invalidated(&self, s: StreamRef) -> Result<bool>;

    /// (free, total) device memory as the driver reports it.
    fn mem_info(&self) -> Result<(usize, usize)>;

    /// Copies between host memory and device memory, outside capture.
    /// `download` returns once the data is on the host; `upload` may
    /// return before it has landed on the device (CUDA's pageable copies),
    /// so work on other streams that reads it waits for the device first.
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()>;
    fn download(&self, dst: &mut [u8], src: DevPtr) -> Result<()>;
}

/// The backend of `kind` on device `device` (ignored on the host). CUDA
/// backends are shared by the sessions of one device.
pub fn open(kind: BackendKind, device: i32) -> Result<Arc<dyn Backend>> {
    Ok(match kind {
        BackendKind::Cuda => cuda::CudaBackend::for_device(device)?,
        BackendKind::Host => host::HostBackend::new(),
    })
}

/// `Ok` when a backend of `kind` can run on this machine, else why not
/// (no driver, no device).
pub fn available(kind: BackendKind) -> Result<()> {
    match kind {
        BackendKind::Host => Ok(()),
        BackendKind::Cuda => cuda::driver::device_count().map(|_| ()),
    }
}

/// Number of CUDA devices (`NoDriver` / `NoDevice` when there are none).
pub fn cuda_device_count() -> Result<u32> {
    cuda::driver::device_count()
}

/// The CUDA driver's version, as 1000 * major + 10 * minor.
pub fn cuda_driver_version() -> Result<i32> {
    cuda::driver::driver_version()
}

/// Device memory from [`Backend::alloc`], freed when dropped (after
/// waiting for the device: replays may still use it).
pub struct DeviceMemory {
    backend: Arc<dyn Backend>,
    ptr: DevPtr,
    bytes: usize,
}

impl DeviceMemory {
    pub fn new(backend: &Arc<dyn Backend>, bytes: usize) -> Result<DeviceMemory> {
        Ok(DeviceMemory {
            ptr: backend.alloc(bytes)?,
            bytes,
            backend: backend.clone(),
        })
    }

    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let _ctx = self.backend.bind();
        teardown::check(
            "waiting for the device before freeing memory",
            self.backend.synchronize_all(),
        );
        teardown::check("freeing device memory", self.backend.free(self.ptr));
    }
}

/// A stream made by a backend, destroyed when dropped; or a caller's
/// stream, borrowed and left alone.
pub struct Stream {
    backend: Arc<dyn Backend>,
    raw: StreamRef,
    owned: bool,
}

impl Stream {
    pub fn new(backend: &Arc<dyn Backend>) -> Result<Stream> {
        Ok(Stream {
            raw: backend.create_stream()?,
            backend: backend.clone(),
            owned: true,
        })
    }

    /// The caller's stream, used but never destroyed.
    pub fn borrowed(backend: &Arc<dyn Backend>, raw: StreamRef) -> Stream {
        Stream {
            raw,
            backend: backend.clone(),
            owned: false,
        }
    }

    pub fn raw(&self) -> StreamRef {
        self.raw
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _ctx = self.backend.bind();
        teardown::check(
            "waiting for a stream before destroying it",
            self.backend.synchronize(self.raw),
        );
        teardown::check("destroying a stream", self.backend.destroy_stream(self.raw));
    }
}

/// An event made by a backend, destroyed when dropped.
pub struct Event {
    backend: Arc<dyn Backend>,
    raw: EventRef,
}

impl Event {
    pub fn new(backend: &Arc<dyn Backend>) -> Result<Event> {
        Ok(Event {
            raw: backend.create_event()?,
            backend: backend.clone(),
        })
    }

    pub fn raw(&self) -> EventRef {
        self.raw
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ctx = self.backend.bind();
        teardown::check("destroying an event", self.backend.destroy_event(self.raw));
    }
}
