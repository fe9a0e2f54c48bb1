//! The scratch allocator callbacks use for tensors saved from forward for
//! backward (and for temporaries). During the first warmup iteration every
//! request gets real device memory while an offset arena measures the
//! high-water mark; from then on requests are served from one arena of that
//! size, replaying the same sequence of offsets, and capture bakes those
//! addresses into the graphs.

use crate::backend::{teardown, Backend, DevPtr};
use crate::core::arena::Arena;
use crate::core::size;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

enum Mode {
    /// Real allocations, measured by the unbounded arena.
    Measuring {
        real: HashMap<DevPtr, usize>,
        deferred: Vec<DevPtr>,
    },
    /// Offsets in [base, base + capacity).
    Arena { base: DevPtr, capacity: usize },
}

struct State {
    mode: Mode,
    arena: Arena,
    /// Which pass is running, for messages.
    context: String,
    /// The first refused request of the running pass: when the callback
    /// then fails, capture reports it rather than the callback's code.
    failure: Option<String>,
}

/// The scratch allocator of one capture.
pub struct Scratch {
    backend: Arc<dyn Backend>,
    state: Mutex<State>,
}

impl Scratch {
    /// Starts in measuring mode (first warmup iteration).
    pub fn measuring(backend: Arc<dyn Backend>) -> Arc<Scratch> {
        Arc::new(Scratch {
            backend,
            state: Mutex::new(State {
                mode: Mode::Measuring {
                    real: HashMap::new(),
                    deferred: Vec::new(),
                },
                arena: Arena::unbounded(),
                context: String::new(),
                failure: None,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Names the pass about to run, for error messages.
    pub fn set_context(&self, context: String) {
        let mut st = self.lock();
        st.context = context;
        st.failure = None;
    }

    /// The first refused request since `set_context`, if any.
    pub fn take_failure(&self) -> Option<Error> {
        self.lock().failure.take().map(Error::ScratchExhausted)
    }

    pub fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        if bytes > size::MAX_BYTES {
            return Err(Error::OutOfMemory(format!(
                "{bytes} bytes of scratch: graphed places at most 2^48 bytes per allocation"
            )));
        }
        let mut st = self.lock();
        let st = &mut *st;
        match &mut st.mode {
            Mode::Measuring { real, .. } => {
                // The memory first: a request the device refuses must not
                // reach the arena, whose high-water mark sizes the capture's
                // arena even after the offset is freed.
                let p = self.backend.alloc(bytes)?;
                match st.arena.alloc(bytes) {
                    Some(offset) => {
                        real.insert(p, offset);
                        Ok(p)
                    }
                    None => {
                        teardown::check("freeing a scratch allocation", self.backend.free(p));
                        Err(Error::OutOfMemory(format!(
                            "{}: scratch requests total more than the address space",
                            st.context
                        )))
                    }
                }
            }
            Mode::Arena { base, capacity } => match st.arena.alloc(bytes) {
                Some(offset) => Ok(*base + offset as u64),
                None => {
                    let msg = format!(
                    "{} asked the scratch allocator for {bytes} more bytes, beyond the {capacity} bytes \
                     the first warmup iteration used ({} bytes live in {} allocations); scratch requests \
                     must be the same in every iteration and at least one warmup iteration must run",
                    st.context,
                    st.arena.live_bytes(),
                    st.arena.live_count()
                    );
                    st.failure.get_or_insert(msg.clone());
                    Err(Error::ScratchExhausted(msg))
                }
            },
        }
    }

    pub fn free(&self, ptr: DevPtr) -> Result<()> {
        let mut st = self.lock();
        let st = &mut *st;
        let offset = match &mut st.mode {
            Mode::Measuring { real, deferred } => real.remove(&ptr).inspect(|_| deferred.push(ptr)),
            Mode::Arena { base, capacity } => ptr
                .checked_sub(*base)
                .map(|o| o as usize)
                .filter(|&o| o < *capacity || (*capacity == 0 && o == 0)),
        };
        match offset {
            Some(o) if st.arena.free(o) => Ok(()),
            _ => Err(Error::invalid(format!(
                "{}: 0x{ptr:x} is not a live scratch allocation (freed twice, or not from this scratch allocator)",
                st.context
            ))),
        }
    }

    /// The arena size capture needs.
    pub fn high_water(&self) -> usize {
        self.lock().arena.high_water()
    }

    /// Ends measuring: releases the real allocations (the caller has
    /// synchronized the stream that used them) and serves later requests
    /// from `[base, base + capacity)`.
    pub fn use_arena(&self, base: DevPtr, capacity: usize) {
        let mut st = self.lock();
        if let Mode::Measuring { real, deferred } = &mut st.mode {
            for p in deferred.drain(..).chain(real.drain().map(|(p, _)| p)) {
                teardown::check("freeing a scratch allocation", self.backend.free(p));
            }
        }
        st.mode = Mode::Arena { base, capacity };
        st.arena = Arena::bounded(capacity);
    }

    /// The arena's state, to capture a pass again from the same point.
    pub fn snapshot(&self) -> Arena {
        self.lock().arena.clone()
    }

    /// Puts the arena back to a snapshot taken in arena mode.
    pub fn restore(&self, arena: Arena) {
        self.lock().arena = arena;
    }

    /// Starts an iteration: in arena mode every offset is free again, so
    /// each iteration (and the capture) lays out the same sequence.
    pub fn restart(&self) {
        let mut st = self.lock();
        if let Mode::Arena { capacity, .. } = st.mode {
            st.arena = Arena::bounded(capacity);
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Only reached with real allocations when capture failed during the
        // first iteration; the capture code synchronized before dropping.
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Mode::Measuring { real, deferred } = &mut st.mode {
            for p in deferred.drain(..).chain(real.drain().map(|(p, _)| p)) {
                teardown::check("freeing a scratch allocation", self.backend.free(p));
            }
        }
    }
}
