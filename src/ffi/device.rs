//! Device discovery: whether a backend can run here at all, how many CUDA
//! devices there are, and which driver, answered with a clear status on
//! machines without a driver or a GPU.

use super::args::arg_out;
use super::boundary::boundary;
use super::enums::graphed_backend;
use super::status::graphed_status;
use crate::backend;

/// GRAPHED_STATUS_OK when a backend (a graphed_backend value) can run
/// here; otherwise the reason (GRAPHED_STATUS_NO_DRIVER, _NO_DEVICE).
#[no_mangle]
pub extern "C" fn graphed_backend_available(backend: u32) -> graphed_status {
    boundary("graphed_backend_available", || {
        backend::available(graphed_backend::decode(backend, "backend")?)
    })
}

/// Writes the number of CUDA devices to `*count_out`.
///
/// Never aborts: on a machine without the NVIDIA driver it returns
/// GRAPHED_STATUS_NO_DRIVER, with a driver but no device
/// GRAPHED_STATUS_NO_DEVICE (a count of zero is reported that way too), and
/// leaves `*count_out` untouched in both cases.
///
/// # Safety
/// `count_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_device_count(count_out: *mut u32) -> graphed_status {
    boundary("graphed_device_count", || {
        let out = arg_out(count_out, "count_out")?;
        let n = backend::cuda_device_count()?;
        // SAFETY: `out` is non-NULL and the caller passes a writable u32.
        unsafe { out.write(n) };
        Ok(())
    })
}

/// Writes the CUDA version of the installed driver to `*version_out`, as
/// 1000 * major + 10 * minor (13000 for CUDA 13.0). GRAPHED_STATUS_NO_DRIVER
/// when there is no driver.
///
/// # Safety
/// `version_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_driver_version(version_out: *mut i32) -> graphed_status {
    boundary("graphed_driver_version", || {
        let out = arg_out(version_out, "version_out")?;
        let v = backend::cuda_driver_version()?;
        // SAFETY: non-NULL, caller passes a writable int32_t.
        unsafe { out.write(v) };
        Ok(())
    })
}
