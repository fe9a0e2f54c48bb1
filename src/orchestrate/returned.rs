//! What replay hands back: references to static buffers (aliases) and
//! clone blocks. All CLONE grads of one backward live in one block (one
//! allocation, filled by one copy of the slab's clone span); each grad
//! handed out holds one reference, and the block is freed, in stream order
//! on the stream it was returned on, when the last reference is released.

use crate::backend::{Backend, DevPtr, MemCounters, StreamRef};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::spec::CloneAllocator;

/// What a returned reference is. C name: `graphed_ref_kind`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RefKind {
    /// Nothing is returned for this slot (no gradient, or returned by
    /// another call).
    #[default]
    None = 0,
    /// The static buffer itself; valid until the replay that overwrites it.
    Alias = 1,
    /// An owned copy; release it with graphed_buffer_release.
    Clone = 2,
    /// Copied into the caller's buffer.
    CopyInto = 3,
    /// Added into the caller's buffer.
    AccumulateInto = 4,
}

/// One returned reference.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Returned {
    pub ptr: DevPtr,
    pub bytes: usize,
    pub kind: RefKind,
    /// Clone block handle (one reference), 0 for none.
    pub owner: usize,
    /// Strict-lease token, 0 for none.
    pub lease: u64,
}

/// One allocation of returned clones.
pub struct GradBlock {
    pub ptr: DevPtr,
    pub bytes: usize,
    stream: StreamRef,
    backend: Arc<dyn Backend>,
    allocator: Option<Arc<dyn CloneAllocator>>,
    counters: Arc<MemCounters>,
}

impl GradBlock {
    /// Allocates a block of `bytes` on `stream`, from the caller's
    /// allocator when the session has one, else from the backend's pool.
    pub fn alloc(
        backend: &Arc<dyn Backend>,
        allocator: &Option<Arc<dyn CloneAllocator>>,
        counters: &Arc<MemCounters>,
        bytes: usize,
        stream: StreamRef,
    ) -> Result<GradBlock> {
        let ptr = match allocator {
            Some(a) => a.alloc(bytes, stream).map_err(|code| {
                Error::OutOfMemory(format!(
                    "the session's clone allocator returned {code} for {bytes} bytes"
                ))
            })?,
            None => backend.alloc_async(bytes, stream)?,
        };
        if ptr == 0 {
            return Err(Error::OutOfMemory(format!(
                "the session's clone allocator returned NULL for {bytes} bytes"
            )));
        }
        MemCounters::add(&counters.clone_bytes, bytes);
        MemCounters::add(&counters.clone_blocks, 1);
        Ok(GradBlock {
            ptr,
            bytes,
            stream,
            backend: backend.clone(),
            allocator: allocator.clone(),
            counters: counters.clone(),
        })
    }
}

impl GradBlock {
    /// The stream whose order the block's release follows (the stream it
    /// is returned on).
    pub fn set_stream(&mut self, stream: StreamRef) {
        self.stream = stream;
    }
}

impl Drop for GradBlock {
    fn drop(&mut self) {
        let _ctx = self.backend.bind();
        match &self.allocator {
            Some(a) => a.free(self.ptr, self.bytes, self.stream),
            None => self.backend.free_async(self.ptr, self.stream),
        }
        MemCounters::sub(&self.counters.clone_bytes, self.bytes);
        MemCounters::sub(&self.counters.clone_blocks, 1);
    }
}

struct Entry {
    /// Held for its `Drop`, which frees the memory.
    _block: GradBlock,
    refs: usize,
}

/// Live blocks by handle, with their outstanding references. Handles are
/// never reused (a counter, not an address), so a release after the last
/// one is reported instead of freeing twice, and blocks live inline in the
/// map: once it has grown to the steady-state number of live blocks,
/// publishing and releasing allocate nothing.
fn blocks() -> MutexGuard<'static, HashMap<usize, Entry>> {
    static BLOCKS: OnceLock<Mutex<HashMap<usize, Entry>>> = OnceLock::new();
    BLOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Registers a block with `refs` references; returns its handle (never 0).
pub fn publish(block: GradBlock, refs: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    let handle = NEXT.fetch_add(1, Ordering::Relaxed);
    blocks().insert(
        handle,
        Entry {
            _block: block,
            refs,
        },
    );
    handle
}

fn unknown(handle: usize) -> Error {
    Error::UseAfterDestroy(format!(
        "graphed_buffer 0x{handle:x} is not live: every reference to it was already released"
    ))
}

pub fn retain(handle: usize) -> Result<()> {
    let mut b = blocks();
    let e = b.get_mut(&handle).ok_or_else(|| unknown(handle))?;
    e.refs += 1;
    Ok(())
}

/// Drops one reference; the last one frees the block.
pub fn release(handle: usize) -> Result<()> {
    let freed = {
        let mut b = blocks();
        let e = b.get_mut(&handle).ok_or_else(|| unknown(handle))?;
        e.refs -= 1;
        if e.refs == 0 {
            b.remove(&handle)
        } else {
            None
        }
    };
    // Free outside the registry lock: a caller's free callback may call back.
    drop(freed);
    Ok(())
}
