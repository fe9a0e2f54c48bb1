//! The CUDA driver, loaded at run time through cudarc: finding libcuda
//! without panicking, initialising it once, checking that the entry points
//! this library calls exist, and turning `CUresult` codes into `Error`s.

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::CStr;
use std::sync::OnceLock;

/// Every driver entry point the CUDA backend calls. Checked once, before the
/// first call, so that a driver too old for us gives a clear error instead of
/// cudarc's panic on a missing symbol.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuMemsetD8Async",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolSetAttribute",
    "cuMemPoolTrimTo",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuStreamIsCapturing",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuGraphInstantiateWithFlags",
    "cuGraphUpload",
    "cuGraphLaunch",
    "cuGraphDestroy",
    "cuGraphExecDestroy",
    "cuGraphGetNodes",
    "cuGraphNodeGetType",
    "cuGraphKernelNodeGetParams_v2",
    "cuGraphExecKernelNodeSetParams_v2",
    "cuGraphMemcpyNodeGetParams",
    "cuGraphExecMemcpyNodeSetParams",
    "cuGraphMemsetNodeGetParams",
    "cuGraphExecMemsetNodeSetParams",
    "cuKernelGetFunction",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

static DRIVER: OnceLock<Result<(), String>> = OnceLock::new();

fn load_driver() -> Result<(), String> {
    // SAFETY: is_culib_present only tries to dlopen candidate library names.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "the CUDA driver library (libcuda.so) was not found on this machine; \
                    use the host backend, or install the NVIDIA driver"
                .to_string(),
        );
    }
    // SAFETY: the library is present, so culib() returns it instead of
    // panicking; `get` only looks the symbol up.
    let lib = unsafe { sys::culib() };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        // SAFETY: looking up a symbol address does not call it.
        .filter(|name| unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "the CUDA driver on this machine is too old for graphed (needs CUDA 12.0 or newer): missing {}",
            missing.join(", ")
        ));
    }
    Ok(())
}

/// Makes sure the driver is loaded and initialised. Cheap after the first call.
pub fn ensure_driver() -> Result<()> {
    DRIVER
        .get_or_init(load_driver)
        .clone()
        .map_err(Error::NoDriver)?;
    // cuInit is cheap after the first successful call, and must be tried
    // again after a failure (it reports NO_DEVICE each time).
    // SAFETY: the driver is loaded and every symbol we call exists.
    let r = unsafe { sys::cuInit(0) };
    if r == sys::CUresult::CUDA_ERROR_NO_DEVICE {
        return Err(Error::NoDevice(
            "the CUDA driver is installed but reports no CUDA-capable device (cuInit: CUDA_ERROR_NO_DEVICE)".into(),
        ));
    }
    check("cuInit", r)
}

fn error_text(r: sys::CUresult) -> (String, String) {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut desc: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName/String only write a pointer to a static string.
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut desc);
    }
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            None
        } else {
            // SAFETY: the driver returns NUL-terminated static strings.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    };
    (
        text(name).unwrap_or_else(|| format!("CUresult {}", r as u32)),
        text(desc).unwrap_or_else(|| "unknown error".into()),
    )
}

/// The error for a failed driver call.
pub fn cuda_error(call: &'static str, r: sys::CUresult) -> Error {
    let (name, description) = error_text(r);
    if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Error::OutOfMemory(format!("{call} failed with {name}: {description}"));
    }
    Error::Cuda {
        call,
        code: r as u32,
        name,
        description,
    }
}

/// `Ok` for CUDA_SUCCESS, else the named error.
pub fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        let e = cuda_error(call, r);
        crate::backend::journal::note(|| e.to_string());
        Err(e)
    }
}

/// The name of a driver error code (for messages about captured failures).
pub fn error_name(r: sys::CUresult) -> String {
    error_text(r).0
}

/// Number of CUDA devices. `NoDriver` when libcuda is absent, `NoDevice` when
/// the driver sees none.
pub fn device_count() -> Result<u32> {
    ensure_driver()?;
    let mut n: std::ffi::c_int = 0;
    // SAFETY: driver initialised; `n` is a valid out pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    if n <= 0 {
        return Err(Error::NoDevice("the CUDA driver reports 0 devices".into()));
    }
    Ok(n as u32)
}

/// The driver's CUDA version, as 1000 * major + 10 * minor (13000 for 13.0).
pub fn driver_version() -> Result<i32> {
    ensure_driver()?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: driver loaded; `v` is a valid out pointer.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut v)
    })?;
    Ok(v)
}
