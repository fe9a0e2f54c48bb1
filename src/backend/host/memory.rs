//! Host "device" memory: aligned, zeroed host allocations tracked per
//! backend (so a free of an unknown address is caught) and in the
//! process's record (`backend::accounting`), uploads and downloads, and
//! the injected free failures tests use.

use crate::backend::{accounting, BackendKind, DevPtr};
use crate::core::ALIGN;
use crate::error::{Error, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

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

/// The live allocations of one host backend; dropping it frees them all.
#[derive(Default)]
pub(super) struct HostMemory {
    allocs: Mutex<HashMap<DevPtr, Layout>>,
}

impl HostMemory {
    fn allocs(&self) -> MutexGuard<'_, HashMap<DevPtr, Layout>> {
        self.allocs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn alloc(&self, bytes: usize) -> Result<DevPtr> {
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
        accounting::allocated(BackendKind::Host, p as DevPtr, bytes);
        Ok(p as DevPtr)
    }

    pub(super) fn free(&self, ptr: DevPtr) -> Result<()> {
        let layout = self.allocs().remove(&ptr).ok_or_else(|| {
            Error::invalid(format!(
                "0x{ptr:x} is not memory of this host backend (freed twice?)"
            ))
        })?;
        accounting::freed(BackendKind::Host, ptr);
        // SAFETY: allocated by alloc_zeroed with this layout, removed once.
        unsafe { dealloc(ptr as *mut u8, layout) };
        injected_free_failure()
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        for (ptr, layout) in self.allocs().drain() {
            accounting::freed(BackendKind::Host, ptr);
            // SAFETY: every entry was allocated by alloc_zeroed with this layout.
            unsafe { dealloc(ptr as *mut u8, layout) };
        }
    }
}

pub(super) fn upload(dst: DevPtr, src: &[u8]) -> Result<()> {
    // SAFETY: `dst` is host memory of at least src.len() bytes (a buffer
    // of this backend, per the caller).
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
    Ok(())
}

pub(super) fn download(dst: &mut [u8], src: DevPtr) -> Result<()> {
    // SAFETY: as above, for `src`.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
    Ok(())
}
