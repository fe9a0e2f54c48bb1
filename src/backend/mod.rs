//! Backends: the CUDA driver backend (the product) and the host emulation
//! (for tests and for users' CI). Orchestration sees only the [`Backend`]
//! trait: device memory, streams, events, capture, graphs.

pub mod cuda;
pub mod host;

use crate::core::dtype::DType;
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Which backend. C name: `graphed_backend`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// CUDA through the driver API (the product).
    Cuda = 0,
    /// Host emulation: "device" memory is host memory, a stream is a task
    /// queue, capture records tasks and replay re-runs them.
    Host = 1,
}

impl BackendKind {
    pub fn from_code(code: u32) -> Result<BackendKind> {
        match code {
            0 => Ok(BackendKind::Cuda),
            1 => Ok(BackendKind::Host),
            _ => Err(crate::error::Error::invalid(format!(
                "backend: {code} is not a graphed_backend value"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Host => "host",
        }
    }
}

/// Capture mode of a stream capture. C name: `graphed_capture_mode`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureMode {
    /// Unsafe calls (allocations, synchronizations) from any thread during a
    /// capture invalidate it: PyTorch's default, and the safest.
    Global = 0,
    /// Only unsafe calls from the capturing thread invalidate it.
    ThreadLocal = 1,
    /// No checks: the caller promises nothing unsafe happens. (The host
    /// backend checks its own synchronize in every mode.)
    Relaxed = 2,
}

impl CaptureMode {
    pub fn from_code(code: u32) -> crate::error::Result<CaptureMode> {
        Ok(match code {
            0 => CaptureMode::Global,
            1 => CaptureMode::ThreadLocal,
            2 => CaptureMode::Relaxed,
            _ => {
                return Err(crate::error::Error::invalid(format!(
                    "capture_mode: {code} is not a graphed_capture_mode value"
                )))
            }
        })
    }
}

/// One tensor of a batched accumulate: `count` elements at `dst` += `src`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccItem {
    pub dst: DevPtr,
    pub src: DevPtr,
    pub count: usize,
}

/// `accumulate` for each item in turn: the default `accumulate_batch`, and
/// a backend's fallback where its batched launch does not apply.
pub fn accumulate_each<B: Backend + ?Sized>(
    backend: &B,
    items: &[AccItem],
    dtype: DType,
    stream: StreamRef,
) -> Result<()> {
    for it in items {
        backend.accumulate(it.dst, it.src, it.count, dtype, stream)?;
    }
    Ok(())
}

/// An instantiated, uploaded graph. Dropping it destroys it.
pub trait Graph: Send {
    fn launch(&self, stream: StreamRef) -> Result<()>;
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

/// Bytes the library holds, by kind; shared by a session with the buffers
/// it hands out, so that the accounting outlives the session.
#[derive(Debug, Default)]
pub struct MemCounters {
    pub static_bytes: AtomicU64,
    pub scratch_bytes: AtomicU64,
    pub clone_bytes: AtomicU64,
    pub clone_blocks: AtomicU64,
}

impl MemCounters {
    pub fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn sub(c: &AtomicU64, n: usize) {
        c.fetch_sub(n as u64, Ordering::Relaxed);
    }

    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// What orchestration needs from a device. All stream work is asynchronous
/// in stream order; under capture it is recorded instead of run.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// The device ordinal (0 on the host).
    fn ordinal(&self) -> i32;
    /// Makes this backend's context current on the calling thread until the
    /// guard drops.
    fn bind(&self) -> Result<ContextGuard>;

    /// Device memory outside any stream (not legal under capture).
    fn alloc(&self, bytes: usize) -> Result<DevPtr>;
    /// Frees `alloc` memory; waits for the device first where needed.
    fn free(&self, ptr: DevPtr);
    /// Stream-ordered allocation from the backend's pool (clones).
    fn alloc_async(&self, bytes: usize, stream: StreamRef) -> Result<DevPtr>;
    fn free_async(&self, ptr: DevPtr, stream: StreamRef);

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize, stream: StreamRef) -> Result<()>;
    fn zero(&self, dst: DevPtr, bytes: usize, stream: StreamRef) -> Result<()>;
    /// `dst += src` for `count` elements of `dtype` (f32, f16, bf16).
    fn accumulate(
        &self,
        dst: DevPtr,
        src: DevPtr,
        count: usize,
        dtype: DType,
        stream: StreamRef,
    ) -> Result<()>;
    /// `accumulate` for several tensors of one dtype, in as few launches as
    /// the backend can.
    fn accumulate_batch(&self, items: &[AccItem], dtype: DType, stream: StreamRef) -> Result<()> {
        accumulate_each(self, items, dtype, stream)
    }
    /// Prepares what `accumulate` needs (loads kernels), outside capture.
    fn prepare_accumulate(&self) -> Result<()>;

    fn create_stream(&self) -> Result<StreamRef>;
    fn destroy_stream(&self, s: StreamRef);
    fn create_event(&self) -> Result<EventRef>;
    fn destroy_event(&self, e: EventRef);
    fn record_event(&self, e: EventRef, s: StreamRef) -> Result<()>;
    fn wait_event(&self, s: StreamRef, e: EventRef) -> Result<()>;
    fn synchronize(&self, s: StreamRef) -> Result<()>;
    fn synchronize_device(&self) -> Result<()>;

    fn begin_capture(&self, s: StreamRef, mode: CaptureMode) -> Result<()>;
    /// Ends the capture on `s`; a valid capture is instantiated and uploaded.
    fn end_capture(&self, s: StreamRef) -> Result<CaptureEnd>;

    /// (free, total) device memory as the driver reports it.
    fn mem_info(&self) -> Result<(usize, usize)>;
}
