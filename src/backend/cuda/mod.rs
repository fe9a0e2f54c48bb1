//! The CUDA backend: the driver API through cudarc's `sys` layer, with raw
//! device pointers and streams (never cudarc's tracked slices, whose events
//! would invalidate a capture). One backend per device, shared by the
//! sessions on it (`device`: its primary context, the one the CUDA runtime
//! and PyTorch use, and a memory pool for returned clones). Here: memory,
//! copies, streams, events and capture as the `Backend` trait asks;
//! graphed's kernels are in `kernels`, captured graphs in `graph` (what
//! they hold in `describe`), their rebinding in `rebind`, loops inside graphs (conditional WHILE nodes) in
//! `loops`.

mod describe;
mod device;
pub mod driver;
mod graph;
mod kernels;
mod loops;
mod rebind;

use super::{
    accounting, AccItem, Backend, BackendKind, CaptureEnd, CaptureMode, Choice, ContextGuard,
    DevPtr, EventRef, Graph, IndexedCopy, Rows2d, StreamRef, Tail,
};
use crate::core::dtype::DType;
use crate::error::Result;
use cudarc::driver::sys;
use device::Inner;
use driver::{check, driver_version};
use graph::capture_status;
use std::collections::HashMap;
use std::ptr::null_mut;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The CUDA backend of one device.
pub struct CudaBackend {
    inner: Arc<Inner>,
}

fn registry() -> std::sync::MutexGuard<'static, HashMap<i32, Weak<CudaBackend>>> {
    static REG: OnceLock<Mutex<HashMap<i32, Weak<CudaBackend>>>> = OnceLock::new();
    REG.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

impl CudaBackend {
    /// The backend of device `ordinal`, shared with other sessions on it.
    pub fn for_device(ordinal: i32) -> Result<Arc<CudaBackend>> {
        let mut reg = registry();
        if let Some(b) = reg.get(&ordinal).and_then(Weak::upgrade) {
            return Ok(b);
        }
        let b = Arc::new(CudaBackend {
            inner: Arc::new(device::open(ordinal)?),
        });
        reg.insert(ordinal, Arc::downgrade(&b));
        Ok(b)
    }
}

/// The largest pitch the 2d copies and zeroings are given (the devices'
/// CU_DEVICE_ATTRIBUTE_MAX_PITCH); beyond it they go row by row.
const MAX_PITCH: usize = i32::MAX as usize;

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn ordinal(&self) -> i32 {
        self.inner.ordinal
    }

    fn bind(&self) -> Result<ContextGuard> {
        self.inner.bind()
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointer; context bound by the caller.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut p, bytes.max(1))
        })?;
        accounting::allocated(BackendKind::Cuda, p, bytes);
        Ok(p)
    }

    fn free(&self, ptr: DevPtr) -> Result<()> {
        // SAFETY: ptr came from alloc and is freed once.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })?;
        accounting::freed(BackendKind::Cuda, ptr);
        Ok(())
    }

    fn alloc_async(&self, bytes: usize, stream: StreamRef) -> Result<DevPtr> {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointer, our pool, the caller's stream.
        let r = unsafe {
            sys::cuMemAllocFromPoolAsync(
                &mut p,
                bytes.max(1),
                self.inner.pool,
                stream.0 as sys::CUstream,
            )
        };
        check("cuMemAllocFromPoolAsync", r)?;
        accounting::allocated(BackendKind::Cuda, p, bytes);
        Ok(p)
    }

    fn free_async(&self, ptr: DevPtr, stream: StreamRef) -> Result<()> {
        // SAFETY: ptr came from alloc_async and is freed once, in stream order.
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr, stream.0 as sys::CUstream)
        })?;
        // Back in the clone pool (which keeps it reserved for reuse): no
        // longer graphed's allocation.
        accounting::freed(BackendKind::Cuda, ptr);
        Ok(())
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize, stream: StreamRef) -> Result<()> {
        if bytes == 0 || dst == src {
            return Ok(());
        }
        // SAFETY: both ranges are device memory of at least `bytes` (library
        // buffers or caller buffers under the API contract).
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.0 as sys::CUstream)
        })
    }

    fn fill(
        &self,
        dst: DevPtr,
        pattern: u32,
        elem: usize,
        count: usize,
        stream: StreamRef,
    ) -> Result<()> {
        let s = stream.0 as sys::CUstream;
        match elem {
            // SAFETY: dst holds `count` elements of `elem` bytes of device memory.
            4 => check("cuMemsetD32Async", unsafe {
                sys::cuMemsetD32Async(dst, pattern, count, s)
            }),
            // SAFETY: as above.
            2 => check("cuMemsetD16Async", unsafe {
                sys::cuMemsetD16Async(dst, pattern as u16, count, s)
            }),
            // SAFETY: as above.
            1 => check("cuMemsetD8Async", unsafe {
                sys::cuMemsetD8Async(dst, pattern as u8, count, s)
            }),
            _ => Err(crate::error::Error::Internal(format!(
                "fill with {elem}-byte elements"
            ))),
        }
    }

    fn loops(&self) -> Option<String> {
        match self.inner.loops() {
            Ok(_) => None,
            Err(e) => Some(e.to_string()),
        }
    }

    fn capture_loop(
        &self,
        stream: StreamRef,
        state: DevPtr,
        skip: Option<(DevPtr, DevPtr)>,
        mode: CaptureMode,
        body: &mut dyn FnMut(StreamRef) -> Result<()>,
    ) -> Result<()> {
        let _ctx = self.inner.bind()?;
        self.inner
            .loops()?
            .capture(self.inner.ctx, stream, (state, skip), mode, body)
    }

    fn capture_unless(
        &self,
        stream: StreamRef,
        flag: DevPtr,
        counter: DevPtr,
        mode: CaptureMode,
        body: &mut dyn FnMut(StreamRef) -> Result<()>,
    ) -> Result<()> {
        let _ctx = self.inner.bind()?;
        self.inner
            .loops()?
            .capture_unless(self.inner.ctx, stream, flag, counter, mode, body)
    }

    fn upload_async(&self, dst: DevPtr, src: &[u8], stream: StreamRef) -> Result<()> {
        let _ctx = self.inner.bind()?;
        // SAFETY: `dst` is device memory of at least src.len() bytes. From
        // pageable memory the driver stages `src` before it returns, so the
        // slice need not outlive the call.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst,
                src.as_ptr().cast(),
                src.len(),
                stream.0 as sys::CUstream,
            )
        })
    }

    fn event_synchronize(&self, event: EventRef) -> Result<()> {
        let _ctx = self.inner.bind()?;
        // SAFETY: a live event.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(event.0 as sys::CUevent)
        })
    }

    fn switches(&self) -> Option<String> {
        let v = match driver_version() {
            Ok(v) => v,
            Err(e) => return Some(e.to_string()),
        };
        if v < loops::NEEDS_SWITCH {
            return Some(loops::switch_unsupported(v).to_string());
        }
        self.loops()
    }

    fn capture_switch(
        &self,
        stream: StreamRef,
        choice: Choice,
        bodies: &[&dyn Graph],
        zeros: &[(DevPtr, usize)],
    ) -> Result<()> {
        let _ctx = self.inner.bind()?;
        let templates = bodies
            .iter()
            .map(|g| {
                let g = g.as_any().downcast_ref::<graph::CudaGraph>();
                g.and_then(graph::CudaGraph::template).ok_or_else(|| {
                    crate::error::Error::Internal("a SWITCH body without its CUDA template".into())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.inner
            .loops()?
            .capture_switch(self.inner.ctx, stream, choice, &templates, zeros)
    }

    fn zero_tail(&self, t: Tail, stream: StreamRef) -> Result<()> {
        kernels::zero_tail(self.inner.on()?, t, stream)
    }

    fn copy_indexed(&self, c: IndexedCopy, stream: StreamRef) -> Result<()> {
        let l = self.inner.loops()?;
        l.copy_indexed(
            self.inner.sm_count(),
            c.dst,
            c.dst_stride,
            c.src,
            c.src_stride,
            c.bytes,
            c.index,
            stream,
        )
    }

    fn copy_2d(&self, r: Rows2d, stream: StreamRef) -> Result<()> {
        if r.rows == 0 || r.width == 0 {
            return Ok(());
        }
        let s = stream.0 as sys::CUstream;
        if r.dst_pitch.max(r.src_pitch) > MAX_PITCH {
            for i in 0..r.rows {
                let (d, f) = (
                    r.dst + (i * r.dst_pitch) as DevPtr,
                    r.src + (i * r.src_pitch) as DevPtr,
                );
                self.copy(d, f, r.width, stream)?;
            }
            return Ok(());
        }
        // Every field set: the struct holds enums with no zero value.
        let c = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: r.src,
            srcArray: std::ptr::null_mut(),
            srcPitch: r.src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: r.dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: r.dst_pitch,
            WidthInBytes: r.width,
            Height: r.rows,
        };
        // SAFETY: both regions are device memory holding `rows` blocks of
        // `width` bytes at their pitches (library buffers, or caller
        // buffers under the API contract).
        check("cuMemcpy2DAsync", unsafe { sys::cuMemcpy2DAsync_v2(&c, s) })
    }

    fn zero_2d(&self, r: Rows2d, stream: StreamRef) -> Result<()> {
        if r.rows == 0 || r.width == 0 {
            return Ok(());
        }
        let s = stream.0 as sys::CUstream;
        if r.dst_pitch > MAX_PITCH {
            for i in 0..r.rows {
                self.zero(r.dst + (i * r.dst_pitch) as DevPtr, r.width, stream)?;
            }
            return Ok(());
        }
        if (r.dst as usize | r.dst_pitch | r.width) % 4 == 0 {
            // SAFETY: `rows` blocks of `width` bytes of device memory at
            // `dst`, every `dst_pitch` bytes, 4-byte aligned.
            return check("cuMemsetD2D32Async", unsafe {
                sys::cuMemsetD2D32Async(r.dst, r.dst_pitch, 0, r.width / 4, r.rows, s)
            });
        }
        // SAFETY: as above, by bytes.
        check("cuMemsetD2D8Async", unsafe {
            sys::cuMemsetD2D8Async(r.dst, r.dst_pitch, 0, r.width, r.rows, s)
        })
    }

    fn zero(&self, dst: DevPtr, bytes: usize, stream: StreamRef) -> Result<()> {
        // SAFETY: dst holds at least `bytes` of device memory.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst, 0, bytes, stream.0 as sys::CUstream)
        })
    }

    fn accumulate(&self, items: &[AccItem], dtype: DType, stream: StreamRef) -> Result<()> {
        kernels::accumulate(self.inner.on()?, items, dtype, stream)
    }

    fn differ(
        &self,
        a: DevPtr,
        b: DevPtr,
        bytes: usize,
        flag: DevPtr,
        stream: StreamRef,
    ) -> Result<()> {
        kernels::differ(self.inner.on()?, a, b, bytes, flag, stream)
    }

    fn prepare_kernels(&self) -> Result<()> {
        self.inner.on().map(|_| ())
    }

    fn create_stream(&self) -> Result<StreamRef> {
        let mut s: sys::CUstream = null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out pointer; context bound by the caller.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, flags)
        })?;
        Ok(StreamRef(s as usize))
    }

    fn destroy_stream(&self, s: StreamRef) -> Result<()> {
        // SAFETY: created by create_stream, destroyed once.
        check("cuStreamDestroy", unsafe {
            sys::cuStreamDestroy_v2(s.0 as sys::CUstream)
        })
    }

    fn create_event(&self) -> Result<EventRef> {
        let mut e: sys::CUevent = null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, flags)
        })?;
        Ok(EventRef(e as usize))
    }

    fn destroy_event(&self, e: EventRef) -> Result<()> {
        // SAFETY: created by create_event, destroyed once.
        check("cuEventDestroy", unsafe {
            sys::cuEventDestroy_v2(e.0 as sys::CUevent)
        })
    }

    fn record(&self, event: EventRef, stream: StreamRef) -> Result<()> {
        // SAFETY: live event and stream.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(event.0 as sys::CUevent, stream.0 as sys::CUstream)
        })
    }

    fn wait(&self, stream: StreamRef, event: EventRef) -> Result<()> {
        // SAFETY: live event and stream.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream.0 as sys::CUstream, event.0 as sys::CUevent, 0)
        })
    }

    fn synchronize(&self, s: StreamRef) -> Result<()> {
        // SAFETY: live stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s.0 as sys::CUstream)
        })
    }

    fn synchronize_all(&self) -> Result<()> {
        // SAFETY: context bound by the caller.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn begin_capture(&self, s: StreamRef, mode: CaptureMode) -> Result<()> {
        let mode = match mode {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            }
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: live stream, not capturing (orchestration guarantees it).
        check("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(s.0 as sys::CUstream, mode)
        })
    }

    fn end_capture(&self, s: StreamRef) -> Result<CaptureEnd> {
        graph::end_capture(&self.inner, s)
    }

    fn is_capturing(&self, s: StreamRef) -> Result<bool> {
        Ok(capture_status(s)? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn capture_invalidated(&self, s: StreamRef) -> Result<bool> {
        Ok(capture_status(s)? == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED)
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out pointers; context bound by the caller.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        let _ctx = self.inner.bind()?;
        // SAFETY: `dst` is device memory of at least src.len() bytes.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
        })
    }

    fn download(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        let _ctx = self.inner.bind()?;
        // SAFETY: `src` is device memory of at least dst.len() bytes.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }
}
