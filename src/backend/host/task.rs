//! The unit of host stream work ([`Task`]) and how one runs; the task list a
//! graph records, shared with its rebinders.

use crate::core::dtype::{accumulate_host, DType};
use crate::error::Result;
use std::sync::{Arc, Mutex, MutexGuard};

/// User work on a host stream.
pub type HostTask = Arc<dyn Fn() + Send + Sync>;

/// One unit of stream work. Addresses are stored as integers: they are
/// device addresses in the CUDA sense, only dereferenced when the task runs.
#[derive(Clone)]
pub(super) enum Task {
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

pub(super) fn run(task: &Task) -> Result<()> {
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

/// A graph's recorded tasks, shared by the graph and the rebinders made
/// from it.
pub(super) type TaskList = Arc<Mutex<Vec<Task>>>;

pub(super) fn lock(list: &TaskList) -> MutexGuard<'_, Vec<Task>> {
    // Rebinds replace whole addresses; a task list is never half written.
    list.lock().unwrap_or_else(|p| p.into_inner())
}

/// A task that counts its runs in `c` (for the host backend's tests).
#[cfg(test)]
pub(super) fn counter_task(c: &Arc<std::sync::atomic::AtomicU32>) -> HostTask {
    let c = c.clone();
    Arc::new(move || {
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    })
}
