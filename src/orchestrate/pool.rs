//! The memory pool of scratch arenas, which sessions may share (the C
//! counterpart of sharing a graph pool between `make_graphed_callables`
//! calls). Everything scratch a capture allocated is free once its graphs
//! are captured, so a later capture into the same pool reuses the same
//! memory, on the condition PyTorch states for shared pools: graphs of
//! sessions sharing a pool are replayed in the order they were captured,
//! one iteration at a time.

use crate::backend::{Backend, DevPtr};
use crate::error::Result;
use std::sync::{Arc, Mutex};

struct Chunk {
    ptr: DevPtr,
    bytes: usize,
    users: usize,
}

pub struct Pool {
    backend: Arc<dyn Backend>,
    chunks: Mutex<Vec<Chunk>>,
}

impl Pool {
    pub fn new(backend: Arc<dyn Backend>) -> Arc<Pool> {
        Arc::new(Pool {
            backend,
            chunks: Mutex::new(Vec::new()),
        })
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// An arena of at least `bytes` for a capture (0 bytes: none). Reuses the
    /// smallest chunk that fits, else allocates one. Returns (base, size).
    pub fn acquire(&self, bytes: usize) -> Result<(DevPtr, usize)> {
        if bytes == 0 {
            return Ok((0, 0));
        }
        let mut chunks = self.chunks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = chunks
            .iter_mut()
            .filter(|c| c.bytes >= bytes)
            .min_by_key(|c| c.bytes)
        {
            c.users += 1;
            return Ok((c.ptr, c.bytes));
        }
        let ptr = self.backend.alloc(bytes)?;
        chunks.push(Chunk {
            ptr,
            bytes,
            users: 1,
        });
        Ok((ptr, bytes))
    }

    /// A capture that used the arena at `base` is gone; a chunk no capture
    /// uses any more is freed (the caller has synchronized the device).
    pub fn release(&self, base: DevPtr) {
        if base == 0 {
            return;
        }
        let mut chunks = self.chunks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = chunks.iter().position(|c| c.ptr == base) {
            chunks[i].users -= 1;
            if chunks[i].users == 0 {
                let c = chunks.swap_remove(i);
                self.backend.free(c.ptr);
            }
        }
    }

    /// Bytes the pool holds.
    pub fn bytes(&self) -> usize {
        self.chunks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|c| c.bytes)
            .sum()
    }
}
