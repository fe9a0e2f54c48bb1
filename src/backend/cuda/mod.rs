//! The CUDA backend: the driver API through cudarc's `sys` layer, with raw
//! device pointers and streams (never cudarc's tracked slices, whose events
//! would invalidate a capture). One backend per device, shared by the
//! sessions on it: the primary context (the one the CUDA runtime and
//! PyTorch use), a memory pool for returned clones, and the accumulate
//! kernels, loaded once from embedded PTX.

pub mod driver;
mod rebind;

use super::teardown;
use super::{
    AccItem, Backend, BackendKind, CaptureEnd, CaptureMode, ContextGuard, DevPtr, EventRef, Graph,
    Made, RebindPlan, StreamRef,
};
use crate::core::dtype::DType;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use driver::{check, error_name};
use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The library's kernels (accumulate, compare; scripts/gen_ptx.py),
/// NUL-terminated for cuModuleLoadData.
static KERNELS_PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

/// Descriptors per batched accumulate launch (the kernel's parameter array).
const BATCH: usize = 160;

/// The kernels of one dtype.
#[derive(Clone, Copy)]
struct AccKernels {
    vector: sys::CUfunction,
    scalar: sys::CUfunction,
    batch: sys::CUfunction,
    /// Elements per 16-byte vector.
    per_vec: usize,
}

struct Kernels {
    module: sys::CUmodule,
    f32: AccKernels,
    f16: AccKernels,
    bf16: AccKernels,
    /// Whether two buffers differ, by 4-byte words and by bytes.
    differ_b32: sys::CUfunction,
    differ_b8: sys::CUfunction,
}

impl Kernels {
    fn of(&self, dtype: DType) -> Result<AccKernels> {
        match dtype {
            DType::F32 => Ok(self.f32),
            DType::F16 => Ok(self.f16),
            DType::Bf16 => Ok(self.bf16),
            other => Err(Error::invalid(format!(
                "cannot accumulate {}",
                other.name()
            ))),
        }
    }
}

struct Inner {
    ordinal: i32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    pool: sys::CUmemoryPool,
    sm_count: u32,
    kernels: OnceLock<std::result::Result<Kernels, String>>,
}

// SAFETY: the handles are process-wide driver objects; the driver API is
// thread-safe, and every call that needs the context binds it first.
unsafe impl Send for Inner {}
// SAFETY: as above; the only interior mutability is behind Mutex/OnceLock.
unsafe impl Sync for Inner {}

fn restore_ctx(prev: usize) {
    // SAFETY: restores the context that was current before a bind (or none).
    unsafe { sys::cuCtxSetCurrent(prev as sys::CUcontext) };
}

impl Inner {
    fn bind(&self) -> Result<ContextGuard> {
        let mut cur: sys::CUcontext = null_mut();
        // SAFETY: valid out pointer; the driver is initialised.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur == self.ctx {
            return Ok(ContextGuard::none());
        }
        // SAFETY: self.ctx is our retained primary context.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })?;
        Ok(ContextGuard::restoring(restore_ctx, cur as usize))
    }

    fn kernels(&self) -> Result<&Kernels> {
        let k = self.kernels.get_or_init(|| {
            let _g = self.bind().map_err(|e| e.to_string())?;
            load_kernels().map_err(|e| e.to_string())
        });
        k.as_ref()
            .map_err(|e| Error::Internal(format!("loading graphed's kernels failed: {e}")))
    }
}

fn load_kernels() -> Result<Kernels> {
    let mut module: sys::CUmodule = null_mut();
    // SAFETY: the image is a NUL-terminated PTX string; the context is bound.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut module, KERNELS_PTX.as_ptr().cast())
    })?;
    let get = |name: &'static str| -> Result<sys::CUfunction> {
        let mut f: sys::CUfunction = null_mut();
        let cname =
            std::ffi::CString::new(name).map_err(|_| Error::Internal("kernel name".into()))?;
        // SAFETY: module is loaded; valid out pointer and C string.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut f, module, cname.as_ptr())
        })?;
        Ok(f)
    };
    let k = (|| {
        let kernels = |vector, scalar, batch, per_vec| -> Result<AccKernels> {
            Ok(AccKernels {
                vector: get(vector)?,
                scalar: get(scalar)?,
                batch: get(batch)?,
                per_vec,
            })
        };
        Ok(Kernels {
            module,
            f32: kernels(
                "graphed_acc_f32x4",
                "graphed_acc_f32",
                "graphed_acc_batch_f32",
                4,
            )?,
            f16: kernels(
                "graphed_acc_f16x8",
                "graphed_acc_f16",
                "graphed_acc_batch_f16",
                8,
            )?,
            bf16: kernels(
                "graphed_acc_bf16x8",
                "graphed_acc_bf16",
                "graphed_acc_batch_bf16",
                8,
            )?,
            differ_b32: get("graphed_differ_b32")?,
            differ_b8: get("graphed_differ_b8")?,
        })
    })();
    if k.is_err() {
        // SAFETY: the module was loaded above and is not used after this.
        unsafe { sys::cuModuleUnload(module) };
    }
    k
}

impl Drop for Inner {
    fn drop(&mut self) {
        let guard = self.bind();
        // SAFETY: nothing refers to the pool or the module any more: every
        // graph, clone and session holds an Arc to this Inner.
        unsafe {
            if let Some(Ok(k)) = self.kernels.get() {
                let r = check("cuModuleUnload", sys::cuModuleUnload(k.module));
                teardown::check("unloading graphed's kernels", r);
            }
            let r = check("cuMemPoolDestroy", sys::cuMemPoolDestroy(self.pool));
            teardown::check("destroying the clone memory pool", r);
        }
        drop(guard);
        // SAFETY: balances the retain in CudaBackend::open.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        let r = check("cuDevicePrimaryCtxRelease", r);
        teardown::check("releasing the device's primary context", r);
    }
}

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
        let b = Arc::new(CudaBackend::open(ordinal)?);
        reg.insert(ordinal, Arc::downgrade(&b));
        Ok(b)
    }

    fn open(ordinal: i32) -> Result<CudaBackend> {
        let count = driver::device_count()?;
        if ordinal < 0 || ordinal as u32 >= count {
            return Err(Error::invalid(format!(
                "device {ordinal} does not exist: this machine has {count} CUDA device(s)"
            )));
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: driver initialised by device_count; valid out pointers.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, ordinal)
        })?;
        let mut ctx: sys::CUcontext = null_mut();
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;
        let mut sm: i32 = 0;
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        // SAFETY: valid out pointer and device.
        let r = unsafe { sys::cuDeviceGetAttribute(&mut sm, attr, device) };
        let release = |e: Error| {
            // SAFETY: balances the retain above on a failure path.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) };
            e
        };
        check("cuDeviceGetAttribute", r).map_err(release)?;

        let mut prev: sys::CUcontext = null_mut();
        // SAFETY: valid out pointer; then bind our context for the pool.
        unsafe {
            sys::cuCtxGetCurrent(&mut prev);
            sys::cuCtxSetCurrent(ctx);
        }
        let pool = create_pool(ordinal);
        restore_ctx(prev as usize);
        let pool = pool.map_err(release)?;
        Ok(CudaBackend {
            inner: Arc::new(Inner {
                ordinal,
                device,
                ctx,
                pool,
                sm_count: sm.max(1) as u32,
                kernels: OnceLock::new(),
            }),
        })
    }

    /// One tensor: vectorised where both addresses are 16-byte aligned.
    fn accumulate_one(
        &self,
        dst: DevPtr,
        src: DevPtr,
        count: usize,
        dtype: DType,
        stream: StreamRef,
    ) -> Result<()> {
        let k = self.inner.kernels()?.of(dtype)?;
        if dst % 16 == 0 && src % 16 == 0 {
            let nvec = count / k.per_vec;
            self.launch_acc(k.vector, dst, src, nvec, stream)?;
            let done = (nvec * 16) as u64;
            self.launch_acc(
                k.scalar,
                dst + done,
                src + done,
                count - nvec * k.per_vec,
                stream,
            )
        } else {
            self.launch_acc(k.scalar, dst, src, count, stream)
        }
    }

    fn launch_acc(
        &self,
        f: sys::CUfunction,
        dst: DevPtr,
        src: DevPtr,
        n: usize,
        stream: StreamRef,
    ) -> Result<()> {
        // SAFETY: the accumulate kernels take (dst, src, n); dst/src hold n
        // elements (or vectors) per the caller's contract.
        unsafe { self.launch_grid(f, &mut [dst, src, n as u64], n, stream) }
    }

    /// Launches `f`, which takes `args.len()` u64 parameters, over a grid
    /// striding across `n` items (nothing for n = 0).
    ///
    /// # Safety
    /// `f` takes exactly these u64 parameters, and the memory they name
    /// holds what the kernel reads and writes for `n` items.
    unsafe fn launch_grid(
        &self,
        f: sys::CUfunction,
        args: &mut [u64],
        n: usize,
        stream: StreamRef,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let threads = 256u32;
        let blocks = n
            .div_ceil(threads as usize)
            .min(self.inner.sm_count as usize * 16)
            .max(1) as u32;
        let mut params: Vec<*mut c_void> =
            args.iter_mut().map(|a| (a as *mut u64).cast()).collect();
        // SAFETY: the parameters are passed by address, one per u64 the
        // kernel takes (the caller's promise).
        let r = unsafe {
            sys::cuLaunchKernel(
                f,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream.0 as sys::CUstream,
                params.as_mut_ptr(),
                null_mut(),
            )
        };
        check("cuLaunchKernel", r)
    }
}

/// A stream-ordered pool for returned clones that keeps freed memory cached
/// (release threshold at the maximum), so that steady-state clones never go
/// to the OS.
fn create_pool(ordinal: i32) -> Result<sys::CUmemoryPool> {
    // SAFETY: an all-zero CUmemPoolProps is the documented starting point.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = ordinal;
    let mut pool: sys::CUmemoryPool = null_mut();
    // SAFETY: valid props and out pointer.
    check("cuMemPoolCreate", unsafe {
        sys::cuMemPoolCreate(&mut pool, &props)
    })?;
    let mut threshold: u64 = u64::MAX;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: the attribute takes a u64 by pointer.
    let r = unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut threshold as *mut u64).cast()) };
    if let Err(e) = check("cuMemPoolSetAttribute", r) {
        // SAFETY: created above, unused.
        unsafe { sys::cuMemPoolDestroy(pool) };
        return Err(e);
    }
    Ok(pool)
}

/// A captured graph's template. Rebinding plans read its nodes and update
/// the executable through them, so it lives while the graph keeps it or a
/// plan needs it.
pub(super) struct Template {
    graph: sys::CUgraph,
    inner: Arc<Inner>,
}

// SAFETY: a CUgraph may be used and destroyed from any thread; it is only
// read after capture.
unsafe impl Send for Template {}
// SAFETY: as above: nothing writes the template after capture.
unsafe impl Sync for Template {}

impl Drop for Template {
    fn drop(&mut self) {
        let _g = self.inner.bind();
        // SAFETY: destroyed exactly once, when the last holder goes.
        let r = check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(self.graph) });
        teardown::check("destroying a graph template", r);
    }
}

struct CudaGraph {
    exec: sys::CUgraphExec,
    /// The captured template, while rebinding may need it.
    template: Option<Arc<Template>>,
    inner: Arc<Inner>,
    /// The kernel nodes rebinding plans patch, shared between the plans.
    rebound_nodes: rebind::NodeTable,
    made: Made,
}

// SAFETY: a CUgraphExec may be launched and destroyed from any thread.
unsafe impl Send for CudaGraph {}

impl Graph for CudaGraph {
    fn launch(&self, stream: StreamRef) -> Result<()> {
        // SAFETY: exec is a live instantiated graph; the stream is the caller's.
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, stream.0 as sys::CUstream)
        })
    }

    fn made(&self) -> Made {
        self.made
    }

    fn rebinder(&self, base: DevPtr, bytes: usize) -> Result<RebindPlan> {
        let template = self.template.as_ref().ok_or_else(rebind::no_template)?;
        rebind::plan(
            template,
            self.exec,
            &self.inner,
            &self.rebound_nodes,
            base,
            bytes,
        )
    }

    fn release_template(&mut self) -> bool {
        self.template
            .take()
            .is_some_and(|t| Arc::strong_count(&t) > 1)
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let _g = self.inner.bind();
        // SAFETY: destroyed exactly once; callers synchronize before dropping.
        let r = unsafe { sys::cuGraphExecDestroy(self.exec) };
        teardown::check(
            "destroying an executable graph",
            check("cuGraphExecDestroy", r),
        );
    }
}

/// The capture status of `s` (0: the legacy default stream).
fn capture_status(s: StreamRef) -> Result<sys::CUstreamCaptureStatus> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's stream and a valid out pointer.
    check("cuStreamIsCapturing", unsafe {
        sys::cuStreamIsCapturing(s.0 as sys::CUstream, &mut status)
    })?;
    Ok(status)
}

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
        Ok(p)
    }

    fn free(&self, ptr: DevPtr) -> Result<()> {
        // SAFETY: ptr came from alloc and is freed once.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })
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
        Ok(p)
    }

    fn free_async(&self, ptr: DevPtr, stream: StreamRef) -> Result<()> {
        // SAFETY: ptr came from alloc_async and is freed once, in stream order.
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr, stream.0 as sys::CUstream)
        })
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

    fn zero(&self, dst: DevPtr, bytes: usize, stream: StreamRef) -> Result<()> {
        // SAFETY: dst holds at least `bytes` of device memory.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst, 0, bytes, stream.0 as sys::CUstream)
        })
    }

    fn accumulate(&self, items: &[AccItem], dtype: DType, stream: StreamRef) -> Result<()> {
        let k = self.inner.kernels()?.of(dtype)?;
        if items.iter().any(|it| it.dst % 16 != 0 || it.src % 16 != 0) {
            // The batched kernel reads 16-byte vectors; element-aligned
            // tensors go one launch each.
            for it in items {
                self.accumulate_one(it.dst, it.src, it.count, dtype, stream)?;
            }
            return Ok(());
        }
        for group in items.chunks(BATCH) {
            // The kernel's parameters: a u32 count, then the descriptor array
            // (8-aligned); unused descriptors are never read.
            let mut count = group.len() as u32;
            let mut desc = [0u64; BATCH * 3];
            for (i, it) in group.iter().enumerate() {
                desc[3 * i] = it.dst;
                desc[3 * i + 1] = it.src;
                desc[3 * i + 2] = it.count as u64;
            }
            let most = group
                .iter()
                .map(|it| it.count / k.per_vec)
                .max()
                .unwrap_or(0)
                .max(1);
            let per_tensor = (self.inner.sm_count as usize * 16)
                .div_ceil(group.len())
                .max(1);
            let blocks_x = most.div_ceil(256).min(per_tensor).max(1) as u32;
            let mut params: [*mut c_void; 2] =
                [(&mut count as *mut u32).cast(), desc.as_mut_ptr().cast()];
            // SAFETY: the kernel takes (u32, 3840-byte array), passed by
            // address; every descriptor's buffers hold `count` elements of
            // `dtype`, 16-byte aligned, per the caller's contract.
            let r = unsafe {
                sys::cuLaunchKernel(
                    k.batch,
                    blocks_x,
                    group.len() as u32,
                    1,
                    256,
                    1,
                    1,
                    0,
                    stream.0 as sys::CUstream,
                    params.as_mut_ptr(),
                    null_mut(),
                )
            };
            check("cuLaunchKernel(accumulate batch)", r)?;
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
        let k = self.inner.kernels()?;
        // Whole 4-byte words where both are aligned to them, bytes for the rest.
        let words = if a % 4 == 0 && b % 4 == 0 {
            bytes / 4
        } else {
            0
        };
        let done = 4 * words as u64;
        // SAFETY: both kernels take (a, b, n, flag); a and b hold `bytes`
        // bytes and flag a u32 of device memory, per the caller's contract.
        unsafe {
            self.launch_grid(k.differ_b32, &mut [a, b, words as u64, flag], words, stream)?;
            let rest = bytes - 4 * words;
            self.launch_grid(
                k.differ_b8,
                &mut [a + done, b + done, rest as u64, flag],
                rest,
                stream,
            )
        }
    }

    fn prepare_kernels(&self) -> Result<()> {
        self.inner.kernels().map(|_| ())
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
        let mut graph: sys::CUgraph = null_mut();
        // SAFETY: the stream is capturing (begun by begin_capture).
        let r = unsafe { sys::cuStreamEndCapture(s.0 as sys::CUstream, &mut graph) };
        if r != sys::CUresult::CUDA_SUCCESS {
            if !graph.is_null() {
                // SAFETY: a graph returned with an error is still ours to destroy.
                unsafe { sys::cuGraphDestroy(graph) };
            }
            return Ok(CaptureEnd::Invalidated(format!(
                "cuStreamEndCapture returned {} (something enqueued under capture was not capturable: \
                 a synchronize, a plain allocation, or work on another stream that was not joined back)",
                error_name(r)
            )));
        }
        let mut exec: sys::CUgraphExec = null_mut();
        let started = std::time::Instant::now();
        // SAFETY: graph is a valid captured graph; exec a valid out pointer.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        if let Err(e) = check("cuGraphInstantiateWithFlags", r) {
            // SAFETY: the template is ours and nothing refers to it.
            unsafe { sys::cuGraphDestroy(graph) };
            return Err(e);
        }
        let instantiated = std::time::Instant::now();
        // The template stays with the executable until the orchestration
        // knows that no rebinding plan needs it.
        let template = Arc::new(Template {
            graph,
            inner: self.inner.clone(),
        });
        let mut g = CudaGraph {
            exec,
            template: Some(template),
            inner: self.inner.clone(),
            rebound_nodes: Default::default(),
            made: Made::default(),
        };
        // SAFETY: exec is live; uploading prepares its first launch.
        check("cuGraphUpload", unsafe {
            sys::cuGraphUpload(exec, s.0 as sys::CUstream)
        })?;
        g.made = Made {
            instantiate: instantiated - started,
            upload: instantiated.elapsed(),
        };
        Ok(CaptureEnd::Graph(Box::new(g)))
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
