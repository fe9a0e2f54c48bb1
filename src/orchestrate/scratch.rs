//! The scratch allocator callbacks use for tensors saved from forward for
//! backward (and for temporaries). During the first warmup iteration every
//! request gets real device memory while an offset arena measures the
//! high-water mark; from then on requests are served from one arena of that
//! size, replaying the same sequence of offsets, and capture bakes those
//! addresses into the graphs.
//!
//! A session with buckets gives each callable a region of its own in the
//! arena, sized for its largest need over its buckets: a callable's buckets
//! share its region, and what one callable keeps for its backward survives
//! another's passes in any bucket (one shared arena would have laid out
//! each bucket round from the start again).

use crate::backend::{teardown, Backend, DevPtr};
use crate::core::arena::Arena;
use crate::core::size;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

enum Mode {
    /// Real allocations (region, offset), measured by the unbounded arenas.
    Measuring {
        real: HashMap<DevPtr, (usize, usize)>,
        deferred: Vec<DevPtr>,
    },
    /// Offsets in [base, base + capacity); region r at `starts[r]`.
    Arena {
        base: DevPtr,
        capacity: usize,
        starts: Vec<usize>,
    },
}

/// The arenas' state, to capture a pass again from the same point.
#[derive(Clone)]
pub struct Snapshot(Vec<Arena>);

struct State {
    mode: Mode,
    /// One arena per region (one region without buckets).
    arenas: Vec<Arena>,
    /// The region of the running pass.
    region: usize,
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
    /// Starts in measuring mode (first warmup iteration), with `regions`
    /// regions (1: one arena shared by every pass).
    pub fn measuring(backend: Arc<dyn Backend>, regions: usize) -> Arc<Scratch> {
        Arc::new(Scratch {
            backend,
            state: Mutex::new(State {
                mode: Mode::Measuring {
                    real: HashMap::new(),
                    deferred: Vec::new(),
                },
                arenas: vec![Arena::unbounded(); regions.max(1)],
                region: 0,
                context: String::new(),
                failure: None,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Names the pass about to run, for error messages, and its callable,
    /// whose region serves it when there are regions.
    pub fn set_context(&self, context: String, callable: usize) {
        let mut st = self.lock();
        st.context = context;
        st.failure = None;
        st.region = match st.arenas.len() {
            1 => 0,
            n => callable.min(n - 1),
        };
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
        let region = st.region;
        let arena = &mut st.arenas[region];
        match &mut st.mode {
            Mode::Measuring { real, .. } => {
                // The memory first: a request the device refuses must not
                // reach the arena, whose high-water mark sizes the capture's
                // arena even after the offset is freed.
                let p = self.backend.alloc(bytes)?;
                match arena.alloc(bytes) {
                    Some(offset) => {
                        real.insert(p, (region, offset));
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
            Mode::Arena { base, starts, .. } => match arena.alloc(bytes) {
                Some(offset) => Ok(*base + (starts[region] + offset) as u64),
                None => {
                    let msg = format!(
                    "{} asked the scratch allocator for {bytes} more bytes, beyond the {} bytes \
                     the first warmup iteration used ({} bytes live in {} allocations); scratch requests \
                     must be the same in every iteration and at least one warmup iteration must run",
                    st.context,
                    arena.capacity().unwrap_or(0),
                    arena.live_bytes(),
                    arena.live_count()
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
        let at = match &mut st.mode {
            Mode::Measuring { real, deferred } => real.remove(&ptr).inspect(|_| deferred.push(ptr)),
            Mode::Arena {
                base,
                capacity,
                starts,
            } => ptr
                .checked_sub(*base)
                .map(|o| o as usize)
                .filter(|&o| o < *capacity || (*capacity == 0 && o == 0))
                .map(|o| {
                    // The last region starting at or before it.
                    let r = starts.partition_point(|&s| s <= o).saturating_sub(1);
                    (r, o - starts[r])
                }),
        };
        match at {
            Some((r, o)) if st.arenas.get_mut(r).is_some_and(|a| a.free(o)) => Ok(()),
            _ => Err(Error::invalid(format!(
                "{}: 0x{ptr:x} is not a live scratch allocation (freed twice, or not from this scratch allocator)",
                st.context
            ))),
        }
    }

    /// The arena size capture needs: every region's high-water mark.
    pub fn high_water(&self) -> usize {
        self.lock().arenas.iter().map(Arena::high_water).sum()
    }

    /// Ends measuring: releases the real allocations (the caller has
    /// synchronized the stream that used them) and serves later requests
    /// from `[base, base + capacity)`, the regions one after the other,
    /// each as large as its high-water mark (the last takes the rest).
    pub fn use_arena(&self, base: DevPtr, capacity: usize) {
        let mut st = self.lock();
        if let Mode::Measuring { real, deferred } = &mut st.mode {
            for p in deferred.drain(..).chain(real.drain().map(|(p, _)| p)) {
                teardown::check("freeing a scratch allocation", self.backend.free(p));
            }
        }
        let sizes: Vec<usize> = st.arenas.iter().map(Arena::high_water).collect();
        let mut starts = Vec::with_capacity(sizes.len());
        let mut at = 0usize;
        for (r, &sz) in sizes.iter().enumerate() {
            starts.push(at);
            let cap = match r + 1 == sizes.len() {
                true => capacity.saturating_sub(at),
                false => sz,
            };
            st.arenas[r] = Arena::bounded(cap);
            at = at.saturating_add(sz);
        }
        st.mode = Mode::Arena {
            base,
            capacity,
            starts,
        };
    }

    /// The arenas' state, to capture a pass again from the same point.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot(self.lock().arenas.clone())
    }

    /// Puts the arenas back to a snapshot taken in arena mode.
    pub fn restore(&self, snapshot: Snapshot) {
        self.lock().arenas = snapshot.0;
    }

    /// Starts an iteration: in arena mode every offset is free again, so
    /// each iteration (and the capture) lays out the same sequence.
    pub fn restart(&self) {
        let mut st = self.lock();
        if matches!(st.mode, Mode::Arena { .. }) {
            for a in &mut st.arenas {
                *a = Arena::bounded(a.capacity().unwrap_or(0));
            }
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
