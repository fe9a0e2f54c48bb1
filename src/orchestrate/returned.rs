//! What replay hands back: references to static buffers (aliases), caller
//! buffers (COPY_INTO, ACCUMULATE_INTO) and clone blocks. All CLONE grads
//! of one backward live in one block (filled by one copy of the slab's clone
//! span); the caller names it by a handle that counts one reference per
//! grad. When the last reference goes, the block returns to its instance's
//! ring for a later replay (in stream order, through an event), or is
//! freed when it came from the caller's allocator or its session is gone.

use super::spec::{CloneAllocator, MemCounters};
use crate::backend::{teardown, Backend, DevPtr, Event, StreamRef};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// What a returned reference is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RefKind {
    /// Nothing is returned for this slot (no gradient, or returned by
    /// another call).
    #[default]
    None,
    /// The static buffer itself; valid until the replay that overwrites it.
    Alias,
    /// An owned copy in the replay's clone block.
    Clone,
    /// Copied into the caller's buffer.
    CopyInto,
    /// Added into the caller's buffer.
    AccumulateInto,
}

/// One returned reference.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Returned {
    pub ptr: DevPtr,
    pub bytes: usize,
    pub kind: RefKind,
    /// Strict-lease token, 0 for none.
    pub lease: u64,
    /// CLONE: which of the replay's blocks holds it.
    pub block: u32,
    /// A DYNAMIC tensor whose data is not contiguous in its buffer: its
    /// blocks (`bytes / rows` bytes each, every `pitch` bytes). 0:
    /// contiguous.
    pub rows: usize,
    pub pitch: usize,
}

/// Where a clone block comes from and goes back to.
enum Origin {
    /// The instance's ring: released blocks are recycled for later replays.
    Ring(Weak<CloneRing>),
    /// The caller's allocator (a fresh block per replay, freed through it).
    Caller(Arc<dyn CloneAllocator>),
}

/// One block of returned clones: every CLONE grad of one replay.
pub struct CloneBlock {
    pub ptr: DevPtr,
    pub bytes: usize,
    backend: Arc<dyn Backend>,
    counters: Arc<MemCounters>,
    /// Ring blocks: the bytes of its callable's blocks handed out and not
    /// yet released (its rings' blocks only: a caller's allocator's memory
    /// is the caller's).
    callable_out: Option<Arc<AtomicU64>>,
    origin: Origin,
    /// The stream the block was last returned on: its release is ordered
    /// after the work enqueued there.
    stream: AtomicUsize,
    /// Ring blocks: recorded on that stream at release; a replay that
    /// reuses the block waits for it before writing.
    event: Option<Event>,
    recorded: AtomicBool,
    /// Ring blocks made at capture: the slot whose graph writes this block.
    pub slot: Option<usize>,
}

impl CloneBlock {
    /// A block from the caller's allocator, on `stream`.
    pub fn from_caller(
        backend: &Arc<dyn Backend>,
        allocator: &Arc<dyn CloneAllocator>,
        counters: &Arc<MemCounters>,
        bytes: usize,
        stream: StreamRef,
    ) -> Result<Arc<CloneBlock>> {
        let ptr = allocator.alloc(bytes, stream).map_err(|code| {
            Error::OutOfMemory(format!(
                "the session's clone allocator returned {code} for {bytes} bytes"
            ))
        })?;
        if ptr == 0 {
            return Err(Error::OutOfMemory(format!(
                "the session's clone allocator returned NULL for {bytes} bytes"
            )));
        }
        let block = Arc::new(CloneBlock {
            ptr,
            bytes,
            backend: backend.clone(),
            counters: counters.clone(),
            callable_out: None,
            origin: Origin::Caller(allocator.clone()),
            stream: AtomicUsize::new(stream.0),
            event: None,
            recorded: AtomicBool::new(false),
            slot: None,
        });
        block.handed_out();
        Ok(block)
    }

    fn handed_out(&self) {
        MemCounters::add(&self.counters.clone_bytes, self.bytes);
        MemCounters::add(&self.counters.clone_blocks, 1);
        if let Some(c) = &self.callable_out {
            MemCounters::add(c, self.bytes);
        }
    }

    /// Counts the block as no longer handed out.
    fn given_back(&self) {
        MemCounters::sub(&self.counters.clone_bytes, self.bytes);
        MemCounters::sub(&self.counters.clone_blocks, 1);
        if let Some(c) = &self.callable_out {
            MemCounters::sub(c, self.bytes);
        }
    }

    /// The stream whose order the block's release follows (the stream it
    /// is returned on).
    pub fn set_stream(&self, stream: StreamRef) {
        self.stream.store(stream.0, Ordering::Relaxed);
    }

    fn stream(&self) -> StreamRef {
        StreamRef(self.stream.load(Ordering::Relaxed))
    }

    /// The backend the block's memory belongs to: a stream its release is
    /// ordered on must be one of that backend's.
    pub fn backend_kind(&self) -> crate::backend::BackendKind {
        self.backend.kind()
    }

    /// The caller released the last reference: a ring block goes back to
    /// its ring (after the work enqueued on its stream, through its event);
    /// any other block is freed, in that stream's order.
    pub fn release(self: Arc<CloneBlock>) -> Result<()> {
        self.given_back();
        if let (Origin::Ring(ring), Some(event)) = (&self.origin, &self.event) {
            if let Some(ring) = ring.upgrade() {
                let _ctx = self.backend.bind()?;
                self.backend.record(event.raw(), self.stream())?;
                self.recorded.store(true, Ordering::Relaxed);
                MemCounters::add(&self.counters.clone_cached_bytes, self.bytes);
                ring.lock().push(self);
                return Ok(());
            }
        }
        drop(self);
        Ok(())
    }
}

impl Drop for CloneBlock {
    fn drop(&mut self) {
        let _ctx = self.backend.bind();
        match &self.origin {
            Origin::Caller(a) => a.free(self.ptr, self.bytes, self.stream()),
            Origin::Ring(_) => teardown::check(
                "freeing a clone block",
                self.backend.free_async(self.ptr, self.stream()),
            ),
        }
    }
}

/// The recycled clone blocks of one instance: a backward replay takes a
/// released block (its writes wait for the release's event) or, when none
/// is free, allocates one; the caller's release puts it back. In steady
/// state (each step's grads released before the next step's) no memory is
/// allocated and nothing is allocated on the host.
///
/// The first blocks are the clone slots, made at capture: the grad pass is
/// captured once per slot, writing into its block directly, so a replay
/// that takes a slot block copies nothing. Slot blocks are taken first.
pub struct CloneRing {
    backend: Arc<dyn Backend>,
    counters: Arc<MemCounters>,
    /// Bytes of its callable's ring blocks handed out (shared by the rings
    /// of the callable's instances).
    callable_out: Arc<AtomicU64>,
    bytes: usize,
    free: Mutex<Vec<Arc<CloneBlock>>>,
    /// The slot blocks' addresses, slot by slot (instances sharing the
    /// ring, a callable's buckets, share them).
    slots: Mutex<Vec<DevPtr>>,
}

impl CloneRing {
    /// A ring of `bytes` blocks; `callable_out` counts the bytes of its
    /// callable's blocks handed out.
    pub fn new(
        backend: &Arc<dyn Backend>,
        counters: &Arc<MemCounters>,
        callable_out: &Arc<AtomicU64>,
        bytes: usize,
    ) -> Arc<CloneRing> {
        Arc::new(CloneRing {
            backend: backend.clone(),
            counters: counters.clone(),
            callable_out: callable_out.clone(),
            bytes,
            free: Mutex::new(Vec::new()),
            slots: Mutex::new(Vec::new()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Arc<CloneBlock>>> {
        // Pushes and pops are complete updates.
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn block(
        self: &Arc<CloneRing>,
        ptr: DevPtr,
        stream: StreamRef,
        slot: Option<usize>,
    ) -> Result<CloneBlock> {
        Ok(CloneBlock {
            ptr,
            bytes: self.bytes,
            backend: self.backend.clone(),
            counters: self.counters.clone(),
            callable_out: Some(self.callable_out.clone()),
            origin: Origin::Ring(Arc::downgrade(self)),
            stream: AtomicUsize::new(stream.0),
            event: Some(Event::new(&self.backend)?),
            recorded: AtomicBool::new(false),
            slot,
        })
    }

    /// The addresses of the `n` slot blocks, making those not made yet (at
    /// capture, on `stream`); they wait in the ring until a replay takes
    /// them.
    pub fn add_slots(self: &Arc<CloneRing>, n: usize, stream: StreamRef) -> Result<Vec<DevPtr>> {
        let mut ptrs = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        for k in ptrs.len()..n {
            let ptr = self.backend.alloc_async(self.bytes, stream)?;
            let b = match self.block(ptr, stream, Some(k)) {
                Ok(b) => b,
                Err(e) => {
                    teardown::check(
                        "freeing a clone block",
                        self.backend.free_async(ptr, stream),
                    );
                    return Err(e);
                }
            };
            MemCounters::add(&self.counters.clone_cached_bytes, self.bytes);
            ptrs.push(ptr);
            self.lock().push(Arc::new(b));
        }
        Ok(ptrs[..n].to_vec())
    }

    /// A block for a replay on `stream`: a free slot block if there is one,
    /// else any free block, else a new one. Later work on `stream` is
    /// ordered after the block's previous release.
    pub fn take(self: &Arc<CloneRing>, stream: StreamRef) -> Result<Arc<CloneBlock>> {
        let reused = {
            let mut free = self.lock();
            match free.iter().rposition(|b| b.slot.is_some()) {
                Some(i) => Some(free.swap_remove(i)),
                None => free.pop(),
            }
        };
        if let Some(b) = reused {
            return self.hand_out(b, stream);
        }
        let ptr = self.backend.alloc_async(self.bytes, stream)?;
        let block = match self.block(ptr, stream, None) {
            Ok(b) => Arc::new(b),
            Err(e) => {
                teardown::check(
                    "freeing a clone block",
                    self.backend.free_async(ptr, stream),
                );
                return Err(e);
            }
        };
        block.set_stream(stream);
        block.handed_out();
        Ok(block)
    }

    /// Hands out `b`, taken from the free list, for work on `stream`: that
    /// work is ordered after the block's previous release. When it cannot
    /// be, the block goes back to the free list.
    fn hand_out(&self, b: Arc<CloneBlock>, stream: StreamRef) -> Result<Arc<CloneBlock>> {
        if b.recorded.load(Ordering::Relaxed) {
            if let Some(e) = &b.event {
                if let Err(err) = self.backend.wait(stream, e.raw()) {
                    self.lock().push(b);
                    return Err(err);
                }
            }
        }
        MemCounters::sub(&self.counters.clone_cached_bytes, b.bytes);
        b.set_stream(stream);
        b.handed_out();
        Ok(b)
    }

    /// Slot block `k` if it is free (later work on `stream` is ordered
    /// after its previous release).
    pub fn take_slot(
        self: &Arc<CloneRing>,
        k: usize,
        stream: StreamRef,
    ) -> Result<Option<Arc<CloneBlock>>> {
        let b = {
            let mut free = self.lock();
            match free.iter().position(|b| b.slot == Some(k)) {
                Some(i) => free.swap_remove(i),
                None => return Ok(None),
            }
        };
        self.hand_out(b, stream).map(Some)
    }

    /// Returns a block from `take` or `take_slot` that was not handed to
    /// the caller after all (it was written by nothing).
    pub fn put_back(&self, b: Arc<CloneBlock>) {
        b.given_back();
        MemCounters::add(&self.counters.clone_cached_bytes, b.bytes);
        self.lock().push(b);
    }

    /// Blocks held for reuse, and their bytes.
    pub fn cached(&self) -> (usize, usize) {
        let n = self.lock().len();
        (n, n * self.bytes)
    }
}

impl Drop for CloneRing {
    fn drop(&mut self) {
        // The session is going: it waited for the device, so the cached
        // blocks are idle; their last streams may be gone, so they are freed
        // in the default stream's order.
        for b in self.lock().drain(..) {
            MemCounters::sub(&self.counters.clone_cached_bytes, b.bytes);
            b.set_stream(StreamRef(0));
        }
    }
}
