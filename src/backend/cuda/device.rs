//! One CUDA device as the backend holds it: opening it (the primary
//! context the CUDA runtime and PyTorch use, retained; a memory pool for
//! returned clones), binding its context, loading graphed's kernels once,
//! and releasing it all, with failures reported as teardown errors.

use super::driver::{self, check};
use super::kernels::{load_kernels, Kernels, On};
use super::loops::{load_loops, Loops};
use crate::backend::{teardown, ContextGuard};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ptr::null_mut;
use std::sync::OnceLock;

/// One device as the backend holds it: its primary context (retained), the
/// clone pool, its multiprocessor count, and graphed's kernels once loaded.
pub(super) struct Inner {
    pub ordinal: i32,
    device: sys::CUdevice,
    pub ctx: sys::CUcontext,
    pub pool: sys::CUmemoryPool,
    sm_count: u32,
    kernels: OnceLock<std::result::Result<Kernels, String>>,
    /// The loop kernels and entry points, or why this driver has none.
    loops: OnceLock<std::result::Result<Loops, Error>>,
}

// SAFETY: the handles are process-wide driver objects; the driver API is
// thread-safe, and every call that needs the context binds it first.
unsafe impl Send for Inner {}
// SAFETY: as above; the only interior mutability is behind Mutex/OnceLock.
unsafe impl Sync for Inner {}

pub(super) fn restore_ctx(prev: usize) {
    // SAFETY: restores the context that was current before a bind (or none).
    unsafe { sys::cuCtxSetCurrent(prev as sys::CUcontext) };
}

impl Inner {
    pub fn bind(&self) -> Result<ContextGuard> {
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

    /// graphed's kernels, loaded on first use, and where they launch.
    pub fn on(&self) -> Result<On<'_>> {
        Ok(On {
            kernels: self.kernels()?,
            sm_count: self.sm_count,
        })
    }

    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The loop kernels, loaded on first use; Unsupported where the driver
    /// cannot loop inside a graph.
    pub fn loops(&self) -> Result<&Loops> {
        let l = self.loops.get_or_init(|| {
            let _g = self.bind()?;
            load_loops()
        });
        l.as_ref().map_err(|e| match e {
            Error::Unsupported(m) => Error::Unsupported(m.clone()),
            other => Error::Unsupported(format!("loading graphed's loop kernels failed: {other}")),
        })
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

/// Opens device `ordinal`: retains its primary context, makes the clone
/// pool.
pub(super) fn open(ordinal: i32) -> Result<Inner> {
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
    Ok(Inner {
        ordinal,
        device,
        ctx,
        pool,
        sm_count: sm.max(1) as u32,
        kernels: OnceLock::new(),
        loops: OnceLock::new(),
    })
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
            if let Some(Ok(l)) = self.loops.get() {
                let r = check("cuModuleUnload", sys::cuModuleUnload(l.module));
                teardown::check("unloading graphed's loop kernels", r);
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
