//! What graphed holds and what letting go of it met: the process's
//! teardown errors, the driver's memory figure for a session's device, the
//! process's own accounting (graphed_memory_stats) and one callable's
//! (graphed_callable_memory).

use super::args::{arg_out, assert_header, check_struct, write_struct, CStruct};
use super::boundary::boundary;
use super::handles::graphed_session;
use super::query::write_text;
use super::session::session;
use super::status::graphed_status;
use std::ffi::c_char;
use std::mem::size_of;

/// How many errors the process's teardowns met (a free, a destroy or a
/// synchronize that failed while a session, a graph or a buffer was
/// released), and the last one's text into `buffer` (`capacity` bytes,
/// NUL-terminated, truncated if short; its full length to `*length_out`,
/// 0 when there was none). Teardown never fails its caller: such errors
/// are counted here, in each session's stats (teardown_errors) and sent
/// to the session's log. Pass a NULL buffer to ask for the length.
///
/// # Safety
/// `count_out` and `length_out` must be writable; `buffer` must be NULL or
/// have room for `capacity` bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_teardown_errors(
    count_out: *mut u64,
    buffer: *mut c_char,
    capacity: usize,
    length_out: *mut usize,
) -> graphed_status {
    boundary("graphed_teardown_errors", || {
        let count = arg_out(count_out, "count_out")?;
        let len_out = arg_out(length_out, "length_out")?;
        let (n, last) = crate::backend::teardown::last();
        // SAFETY: per this function's contract.
        unsafe { write_text(last.as_deref().unwrap_or(""), buffer, capacity, len_out)? };
        // SAFETY: checked non-NULL.
        unsafe { count.write(n) };
        Ok(())
    })
}

/// The driver's figure for the session's device: free and total bytes
/// (cuMemGetInfo). GRAPHED_STATUS_UNSUPPORTED on the host backend.
///
/// # Safety
/// `free_out` and `total_out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_device_memory(
    session: *mut graphed_session,
    free_out: *mut usize,
    total_out: *mut usize,
) -> graphed_status {
    boundary("graphed_session_device_memory", || {
        let cell = self::session(session)?;
        let f = arg_out(free_out, "free_out")?;
        let t = arg_out(total_out, "total_out")?;
        let (free, total) = cell.lock()?.device_memory()?;
        // SAFETY: both checked non-NULL.
        unsafe {
            f.write(free);
            t.write(total);
        }
        Ok(())
    })
}

/// The magic graphed_memory_stats_default() sets.
pub const GRAPHED_MEMORY_STATS_MAGIC: u32 = 0x6772_0012;

/// What graphed holds in this process, over every session and backend
/// (graphed's own accounting). Initialise with graphed_memory_stats_default()
/// before asking.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_memory_stats {
    /// sizeof(graphed_memory_stats); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_MEMORY_STATS_MAGIC; set by the _default() function.
    pub magic: u32,
    /// Sessions created and not yet destroyed (a session destroyed with
    /// graphed_session_destroy_when_idle counts until the call in progress
    /// on it returns).
    pub sessions: u32,
    /// Bytes of device memory graphed allocated and still holds (host
    /// memory on the host backend): static buffers, scratch arenas, clone
    /// blocks handed out and not yet released or kept for reuse,
    /// verification workspaces, loop state of steps. Memory from a
    /// session's clone_alloc is the caller's and not counted. 0 once every
    /// session is destroyed and every returned clone block released.
    pub device_bytes: u64,
    /// How many allocations those bytes are.
    pub allocations: u64,
    /// Graph executables alive (instantiated and not yet destroyed).
    pub graphs: u64,
}

// SAFETY: repr(C), integers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_memory_stats {
    const NAME: &'static str = "graphed_memory_stats";
    const MAGIC: u32 = GRAPHED_MEMORY_STATS_MAGIC;
    const MIN_SIZE: usize = 40;
    fn defaults() -> Self {
        graphed_memory_stats_default()
    }
}
assert_header!(graphed_memory_stats);

/// A zeroed graphed_memory_stats with its size and magic set.
#[no_mangle]
pub extern "C" fn graphed_memory_stats_default() -> graphed_memory_stats {
    graphed_memory_stats {
        struct_size: size_of::<graphed_memory_stats>(),
        magic: GRAPHED_MEMORY_STATS_MAGIC,
        sessions: 0,
        device_bytes: 0,
        allocations: 0,
        graphs: 0,
    }
}

/// Writes what graphed holds in this process (every session, every
/// backend): device bytes and allocations it made and has not freed, live
/// sessions, live graph executables. Needs no session; never BUSY.
/// GRAPHED_STATUS_NULL_POINTER for a NULL `out`, BAD_STRUCT for one not
/// initialised by graphed_memory_stats_default().
///
/// # Safety
/// `out` must be NULL or point to a graphed_memory_stats initialised by
/// graphed_memory_stats_default(), of at least its struct_size bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_memory_stats_get(
    out: *mut graphed_memory_stats,
) -> graphed_status {
    boundary("graphed_memory_stats_get", || {
        let h = crate::backend::accounting::held();
        let full = graphed_memory_stats {
            sessions: u32::try_from(h.sessions).unwrap_or(u32::MAX),
            device_bytes: h.bytes,
            allocations: h.allocations,
            graphs: h.graphs,
            ..graphed_memory_stats_default()
        };
        // SAFETY: per this function's contract.
        unsafe { write_struct(out, &full, "out") }
    })
}

/// The magic graphed_callable_memory_default() sets.
pub const GRAPHED_CALLABLE_MEMORY_MAGIC: u32 = 0x6772_0013;

/// What one callable of a captured session holds (graphed's accounting).
/// Initialise with graphed_callable_memory_default() before asking.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct graphed_callable_memory {
    /// sizeof(graphed_callable_memory); set by the _default() function.
    pub struct_size: usize,
    /// GRAPHED_CALLABLE_MEMORY_MAGIC; set by the _default() function.
    pub magic: u32,
    /// 1 once released by graphed_session_release_callable.
    pub released: u32,
    /// Bytes of its own static allocation: the static buffers of its
    /// instances that no other callable uses (not chained to another
    /// callable, sharing no memory with another's buffers through
    /// reuse_buffers). Freed by its release; 0 after.
    pub own_static_bytes: u64,
    /// Bytes of the static buffers it uses in the allocation callables
    /// share: buffers chained between it and another callable, and memory
    /// reuse_buffers gives to its buffers and another callable's (not the
    /// small block of bucket sizes that callables with buckets also keep
    /// there). That allocation is freed when the last callable using it is
    /// released; 0 once this one is released.
    pub shared_static_bytes: u64,
    /// Graph executables of its instances: every pass of every microbatch
    /// and bucket, clone slots, the graphs choosing its bucket on the
    /// device. 0 once released.
    pub graphs: u32,
    /// Graph executables of the steps that include it, which its release
    /// destroys too (they are counted for each of their callables).
    pub step_graphs: u32,
    /// Bytes of its returned clone blocks from graphed's memory not yet
    /// released with graphed_buffer_release (blocks from the session's
    /// clone_alloc are the caller's memory and not counted). Blocks stay
    /// valid after the release of their callable.
    pub clone_bytes_outstanding: u64,
    /// Bytes of its released clone blocks kept for reuse by its later
    /// replays (clone slots included); freed by its release.
    pub clone_bytes_cached: u64,
}

// SAFETY: repr(C), integers only, header at offsets 0 and 8.
unsafe impl CStruct for graphed_callable_memory {
    const NAME: &'static str = "graphed_callable_memory";
    const MAGIC: u32 = GRAPHED_CALLABLE_MEMORY_MAGIC;
    const MIN_SIZE: usize = 56;
    fn defaults() -> Self {
        graphed_callable_memory_default()
    }
}
assert_header!(graphed_callable_memory);

/// A zeroed graphed_callable_memory with its size and magic set.
#[no_mangle]
pub extern "C" fn graphed_callable_memory_default() -> graphed_callable_memory {
    graphed_callable_memory {
        struct_size: size_of::<graphed_callable_memory>(),
        magic: GRAPHED_CALLABLE_MEMORY_MAGIC,
        released: 0,
        own_static_bytes: 0,
        shared_static_bytes: 0,
        graphs: 0,
        step_graphs: 0,
        clone_bytes_outstanding: 0,
        clone_bytes_cached: 0,
    }
}

/// Writes what callable `callable` of a captured session holds (released
/// callables included: released = 1, their static bytes and graphs 0,
/// their clone blocks still outstanding counted). Checks, in order: a NULL
/// or stale session, a NULL `out`, a struct not initialised by
/// graphed_callable_memory_default() (BAD_STRUCT), BUSY, a session not
/// captured (WRONG_STATE) or reset (SESSION_RESET), a callable that does
/// not exist (INVALID_ARGUMENT).
///
/// # Safety
/// `out` must be NULL or point to a graphed_callable_memory initialised by
/// graphed_callable_memory_default(), of at least its struct_size bytes.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_callable_memory(
    session: *mut graphed_session,
    callable: u32,
    out: *mut graphed_callable_memory,
) -> graphed_status {
    boundary("graphed_session_callable_memory", || {
        let cell = self::session(session)?;
        // The struct before the session's lock and state.
        // SAFETY: per this function's contract.
        unsafe { check_struct(out, "out") }?;
        let mut full = graphed_callable_memory_default();
        let m = cell.lock()?.callable_memory(callable)?;
        full.released = m.released as u32;
        full.own_static_bytes = m.own_static_bytes;
        full.shared_static_bytes = m.shared_static_bytes;
        full.graphs = m.graphs;
        full.step_graphs = m.step_graphs;
        full.clone_bytes_outstanding = m.clone_bytes_outstanding;
        full.clone_bytes_cached = m.clone_bytes_cached;
        // SAFETY: per this function's contract.
        unsafe { write_struct(out, &full, "out") }
    })
}
