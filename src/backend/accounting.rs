//! What graphed holds, process-wide: every device allocation either
//! backend makes for it (through `Backend::alloc` and `alloc_async`: static
//! buffers, scratch arenas and warmup scratch, clone blocks handed out or
//! kept for reuse, rebinding verification workspaces, loop and bucket
//! state) until it is freed, the graph executables alive, and the sessions
//! alive. Both backends report each allocation and free here; a free of an
//! address this record does not hold (freed twice, or never graphed's)
//! changes nothing. Memory from a caller's clone allocator is the
//! caller's, not counted here.

use super::{BackendKind, DevPtr};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The live allocations, by (backend, address): their bytes.
#[derive(Default)]
struct Live {
    sizes: HashMap<(BackendKind, DevPtr), usize>,
    bytes: u64,
}

fn live() -> MutexGuard<'static, Live> {
    static LIVE: OnceLock<Mutex<Live>> = OnceLock::new();
    // Every update is complete before the lock is released.
    LIVE.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

static GRAPHS: AtomicU64 = AtomicU64::new(0);
static SESSIONS: AtomicU64 = AtomicU64::new(0);

/// A backend of `kind` allocated `bytes` at `ptr`.
pub fn allocated(kind: BackendKind, ptr: DevPtr, bytes: usize) {
    let mut l = live();
    if let Some(old) = l.sizes.insert((kind, ptr), bytes) {
        // The address was never reported free: the newer size holds.
        l.bytes -= old as u64;
    }
    l.bytes += bytes as u64;
}

/// A backend of `kind` freed `ptr`; returns its bytes, None when the
/// record does not hold it (nothing changes then).
pub fn freed(kind: BackendKind, ptr: DevPtr) -> Option<usize> {
    let mut l = live();
    let bytes = l.sizes.remove(&(kind, ptr))?;
    l.bytes -= bytes as u64;
    Some(bytes)
}

/// One graph executable, counted while this value lives (held by the
/// backend's graph type).
#[derive(Debug)]
pub struct GraphMark(());

impl GraphMark {
    pub fn new() -> GraphMark {
        GRAPHS.fetch_add(1, Ordering::Relaxed);
        GraphMark(())
    }
}

impl Default for GraphMark {
    fn default() -> Self {
        GraphMark::new()
    }
}

impl Drop for GraphMark {
    fn drop(&mut self) {
        GRAPHS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One session, counted while this value lives (held by the session).
#[derive(Debug)]
pub struct SessionMark(());

impl SessionMark {
    pub fn new() -> SessionMark {
        SESSIONS.fetch_add(1, Ordering::Relaxed);
        SessionMark(())
    }
}

impl Default for SessionMark {
    fn default() -> Self {
        SessionMark::new()
    }
}

impl Drop for SessionMark {
    fn drop(&mut self) {
        SESSIONS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the process holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Bytes of device memory graphed allocated and has not freed.
    pub bytes: u64,
    /// How many allocations those are.
    pub allocations: u64,
    pub sessions: u64,
    /// Graph executables alive.
    pub graphs: u64,
}

/// What the process holds now (each figure read at once; the four are not
/// one snapshot while other threads allocate).
pub fn held() -> Held {
    let (bytes, allocations) = {
        let l = live();
        (l.bytes, l.sizes.len() as u64)
    };
    Held {
        bytes,
        allocations,
        sessions: SESSIONS.load(Ordering::Relaxed),
        graphs: GRAPHS.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_count_until_freed_and_unknown_frees_change_nothing() {
        // Addresses no backend hands out (the record is process-wide and
        // other tests allocate meanwhile: only these entries are checked).
        let (a, b) = (0xdead_0000_0100, 0xdead_0000_0200);
        allocated(BackendKind::Host, a, 100);
        allocated(BackendKind::Cuda, a, 7);
        assert_eq!(freed(BackendKind::Host, a), Some(100));
        assert_eq!(freed(BackendKind::Host, a), None, "freed twice");
        assert_eq!(freed(BackendKind::Host, b), None, "never allocated");
        assert_eq!(freed(BackendKind::Cuda, a), Some(7));
        let g = GraphMark::new();
        let s = SessionMark::new();
        assert!(held().graphs >= 1 && held().sessions >= 1);
        drop((g, s));
    }
}
