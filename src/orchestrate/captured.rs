//! The captured state of a session, built whole at the end of a capture:
//! its instances with their graphs, its steps, the static-buffer plan, the
//! capture's timing, and the resources the graphs use (static memory,
//! scratch arena, side stream, events). Dropping it waits for the device,
//! destroys the graphs, then frees the memory; a failure on the way is a
//! teardown error, recorded, never dropped.

use super::buckets::{SizeBlock, Zeroed};
use super::clock::CaptureTimes;
use super::instance::{Instance, PassRef};
use super::pool::Arena;
use super::returned::{CloneBlock, Returned};
use super::spec::MemCounters;
use super::statics::Statics;
use super::tensor::Param;
use super::update::StepUpdate;
use crate::backend::{teardown, AccItem, Backend, DevPtr, DeviceMemory, Event, Graph, Stream};
use crate::core::collective::CollectiveEntry;
use crate::core::layout::BufferDesc;
use crate::core::lease::Leases;
use crate::core::plan::{Lifetime, Owned, Plan};
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};

/// A step captured as one graph: its callables' passes back to back, with
/// their parameter grads returned inside the graph.
pub(crate) struct CapturedStep {
    /// Instances of the step's callables, in order.
    pub instances: Vec<usize>,
    /// Those of `instances` that return CLONE grads, in order.
    pub cloned: Vec<usize>,
    /// Every pass, in step (capture) order.
    pub passes: Vec<PassRef>,
    /// The destination of each parameter, the callables' parameters in
    /// order (0 where its policy needs none).
    pub dsts: Vec<DevPtr>,
    /// The graph, when no parameter grad is CLONE.
    pub graph: Option<Box<dyn Graph>>,
    /// With CLONE grads: graph k writes them into each instance's slot
    /// block k. None of either: the step replays pass by pass.
    pub slots: Vec<Box<dyn Graph>>,
    /// Lease slots the step's replay overwrites (strict leases).
    pub overwritten: Vec<usize>,
    /// The parameters of the step's callables, in order, as its graphs
    /// read them.
    pub params: Vec<Param>,
    /// Where the last replay had them (a replay given no address for one
    /// keeps it there, in its graphs or, pass by pass, in its callables').
    pub at: Vec<DevPtr>,
    /// Its graphs run several microbatches, copy data in and out or run
    /// an update: no pass-by-pass replay gives its results.
    pub looped: bool,
    /// The microbatches it was declared with (a replay runs them all, or,
    /// looping on the device, up to that many).
    pub microbatches: u32,
    /// Looping on the device: the loop's index and count (two u32), the
    /// count written before each launch.
    pub loop_state: Option<DeviceMemory>,
    /// Its update stage's memory (flag, skipped count, scalars) and event.
    pub update: Option<StepUpdate>,
    /// With a collective stage: the collectives its graphs record, in
    /// order (looping on the device, its last microbatch follows the loop).
    pub collectives: Option<Vec<CollectiveEntry>>,
}

impl CapturedStep {
    pub fn graph_count(&self) -> usize {
        self.graph.is_some() as usize + self.slots.len()
    }
}

/// The static-buffer plan and what it placed, for stats and the plan dump.
pub(crate) struct PlanRecord {
    pub plan: Plan,
    /// Which allocation each buffer lives in.
    pub owned: Owned,
    pub buffers: Vec<BufferDesc>,
    pub lifetimes: Vec<Lifetime>,
}

/// Vectors replays reuse, so that the steady state allocates nothing.
#[derive(Default)]
pub(crate) struct Stage {
    pub a: Vec<Returned>,
    pub b: Vec<Returned>,
    pub acc: Vec<AccItem>,
    pub blocks: Vec<Arc<CloneBlock>>,
    /// The slot blocks a step replay takes, one per cloned instance.
    pub taken: Vec<Arc<CloneBlock>>,
}

/// The strict-lease table, reachable without the session's lock so that a
/// lease can be released from any thread at any time (a tensor deleter).
#[derive(Default)]
pub struct LeaseBook(Mutex<Leases>);

impl LeaseBook {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Leases> {
        // Every lease operation is a complete update under the lock.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn release(&self, lease: u64) -> Result<()> {
        self.lock().release(lease)
    }

    pub fn held(&self) -> usize {
        self.lock().held_count()
    }
}

/// What the graphs of a capture run on and in.
pub(crate) struct Resources {
    pub statics: Statics,
    pub arena: Option<Arena>,
    /// The capture stream: held (and, when the session made it, destroyed)
    /// with the graphs.
    pub _side: Stream,
    pub ev_in: Event,
    pub ev_out: Event,
}

impl Resources {
    /// Bytes of the static allocations still held.
    pub fn statics_bytes(&self) -> usize {
        self.statics.bytes()
    }

    pub fn arena_bytes(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.bytes)
    }
}

/// A callable's graphs that choose its bucket on the device: per pass kind,
/// and per clone slot of the pass that writes the grads (choosing among
/// the buckets' captures for that slot).
#[derive(Default)]
pub(crate) struct Switches {
    pub passes: [Option<Box<dyn Graph>>; 3],
    pub slots: Vec<Box<dyn Graph>>,
}

impl Switches {
    pub fn pass(&self, kind: PassKind) -> Result<&dyn Graph> {
        self.passes[kind.index()]
            .as_deref()
            .ok_or_else(|| Error::Internal(format!("no {kind} graph choosing on the device")))
    }

    pub fn slot(&self, k: usize) -> Option<&dyn Graph> {
        self.slots.get(k).map(|g| g.as_ref())
    }

    pub fn count(&self) -> usize {
        self.passes.iter().flatten().count() + self.slots.len()
    }
}

/// The rows a replay of a bucketed callable runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rows {
    /// Not bucketed: the buffers whole.
    All,
    /// Chosen on the host: this many (and, with a grid, this many of the
    /// second size; 0 otherwise).
    Host(u64, u64),
    /// Chosen on the device, from the size a replay put there.
    Device,
}

/// Everything a capture made.
pub(crate) struct Captured {
    pub backend: Arc<dyn Backend>,
    pub counters: Arc<MemCounters>,
    /// Dropped before the instances whose blocks and buffers they use.
    pub steps: Vec<CapturedStep>,
    pub instances: Vec<Instance>,
    /// Instance index by [callable][microbatch].
    pub by_callable: Vec<Vec<usize>>,
    /// Every pass, in capture order.
    pub order: Vec<PassRef>,
    pub plan: PlanRecord,
    /// Where the capture's host time went.
    pub times: CaptureTimes,
    pub stage: Stage,
    /// Parameter moves replays followed.
    pub param_moves: u64,
    /// Callables with buckets: where the device holds callable c's actual
    /// size (a u64 at `sizes + 8 c`, in the static allocation; 0 without
    /// buckets), and per callable the instance and size of its last
    /// forward (what its backward runs).
    pub sizes: Option<SizeBlock>,
    pub last_forward: Vec<Option<(usize, Rows)>>,
    /// The padding rows of bucketed buffers known to be zero.
    pub zeroed: Zeroed,
    /// Per callable with buckets, when they are chosen on the device: per
    /// pass, the graph that chooses (its bodies are copies of the buckets'
    /// graphs, made at capture: it needs no template of theirs).
    pub switches: Vec<Switches>,
    /// Per callable: released (graphed_session_release_callable): its
    /// graphs, those of the steps that include it, and the static memory
    /// only it used are gone (`released`).
    pub released: Vec<bool>,
    /// Last: fields drop in order, so these go after the graphs.
    pub resources: Resources,
}

impl Captured {
    /// The instance of (callable, microbatch) whose buffers queries
    /// describe: with buckets, the largest bucket's (the others use a
    /// prefix of its buffers).
    pub fn instance_index(&self, callable: u32, microbatch: u32) -> Result<usize> {
        let per = self.per_callable(callable)?;
        let buckets = self.bucket_count(callable as usize);
        if buckets > 1 {
            return match microbatch {
                0 => Ok(per[buckets - 1]),
                mb => Err(Error::invalid(format!(
                    "microbatch {mb} does not exist for callable {callable} (a callable with buckets has one \
                     microbatch)"
                ))),
            };
        }
        self.microbatch_index(callable, microbatch)
    }

    /// The instance of (callable, microbatch, bucket): instances are
    /// placed callable by callable, microbatch by microbatch, bucket by
    /// bucket (`place::first_instances`), so the index is dense.
    pub fn instance_of(&self, callable: u32, microbatch: u32, bucket: u32) -> Result<usize> {
        let per = self.per_callable(callable)?;
        let buckets = self.bucket_count(callable as usize);
        if bucket as usize >= buckets {
            let has = match buckets {
                1 => "it has no buckets: bucket 0 is its one shape".to_string(),
                n => format!("it has {n} buckets"),
            };
            return Err(Error::invalid(format!(
                "bucket {bucket} does not exist for callable {callable} ({has})"
            )));
        }
        let microbatches = per.len() / buckets;
        if microbatch as usize >= microbatches {
            return Err(Error::invalid(format!(
                "microbatch {microbatch} does not exist for callable {callable} (it was captured for \
                 {microbatches} microbatch(es))"
            )));
        }
        Ok(per[microbatch as usize * buckets + bucket as usize])
    }

    /// The instances of (callable, microbatch), one per bucket.
    pub fn bucket_instances(&self, callable: u32, microbatch: u32) -> Result<&[usize]> {
        self.instance_index(callable, microbatch)?;
        let per = self.per_callable(callable)?;
        let buckets = self.bucket_count(callable as usize);
        let first = microbatch as usize * buckets;
        Ok(&per[first..first + buckets])
    }

    /// How many buckets callable `c` was captured in (1: one shape).
    pub fn bucket_count(&self, c: usize) -> usize {
        let per = self.by_callable.get(c).map_or(&[][..], Vec::as_slice);
        per.iter()
            .filter(|&&n| self.instances[n].microbatch == 0)
            .count()
    }

    fn per_callable(&self, callable: u32) -> Result<&[usize]> {
        self.by_callable
            .get(callable as usize)
            .map(Vec::as_slice)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "callable {callable} does not exist (the session has {} callables)",
                    self.by_callable.len()
                ))
            })
    }

    fn microbatch_index(&self, callable: u32, microbatch: u32) -> Result<usize> {
        let per = self.per_callable(callable)?;
        per.get(microbatch as usize).copied().ok_or_else(|| {
            Error::invalid(format!(
                "microbatch {microbatch} does not exist for callable {callable} (it was captured for {} microbatch(es))",
                per.len()
            ))
        })
    }

    /// Device-chosen replays whose size no bucket held (read from the
    /// device; 0 when that fails: the stats are a report).
    pub fn bucket_overflows(&self) -> u64 {
        self.sizes
            .as_ref()
            .and_then(|b| b.overflow_count(self.backend.as_ref()).ok())
            .unwrap_or(0)
    }

    /// Graphs of single passes, of clone slots, of steps.
    pub fn graph_counts(&self) -> (usize, usize, usize) {
        let switches: usize = self.switches.iter().map(Switches::count).sum();
        let passes = self
            .instances
            .iter()
            .map(|i| i.graphs.count())
            .sum::<usize>()
            + switches;
        let slots = self.instances.iter().map(|i| i.graphs.slots.len()).sum();
        let steps = self.steps.iter().map(|s| s.graph_count()).sum();
        (passes, slots, steps)
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        let _ctx = self.backend.bind();
        // Replays may still be running on the caller's streams.
        teardown::check(
            "waiting for the device before releasing a capture",
            self.backend.synchronize_all(),
        );
        // Blocks of the last replay no caller took go back first.
        for b in self.stage.blocks.drain(..) {
            teardown::check("giving back a clone block", b.release());
        }
        MemCounters::sub(&self.counters.static_bytes, self.resources.statics_bytes());
        MemCounters::sub(&self.counters.scratch_bytes, self.resources.arena_bytes());
        // The fields drop next, in order: the graphs (steps, instances)
        // before the memory they use (resources).
    }
}
