//! The captured state of a session, as small owned types: per instance (a
//! callable, or with a schedule each (callable, microbatch) pair) its
//! static buffers, its return plan, its graphs and its lease slots; and the
//! resources of the whole capture (static memory, scratch arena, side
//! stream, events). Dropping a `Captured` waits for the device, destroys
//! the graphs, then frees the memory, so a failed capture leaves nothing.

use super::pool::Arena;
use super::rebind::Rebind;
use super::returned::{CloneBlock, CloneRing, Returned};
use super::spec::MemCounters;
use crate::backend::{AccItem, Backend, DevPtr, DeviceMemory, Event, Graph, Stream};
use crate::core::layout::{BufferDesc, Role};
use crate::core::lease::Leases;
use crate::core::plan::{Lifetime, Plan};
use crate::core::returns::ReturnPlan;
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::cell::Cell;
use std::sync::{Arc, Mutex, MutexGuard};

/// The static buffers of one instance, by address (0 where there is none).
#[derive(Clone, Debug, Default)]
pub(crate) struct Buffers {
    pub inputs: Vec<DevPtr>,
    pub outputs: Vec<DevPtr>,
    pub grad_outputs: Vec<DevPtr>,
    pub grad_inputs: Vec<DevPtr>,
    /// The caller's parameters, as registered.
    pub params: Vec<DevPtr>,
    pub param_grads: Vec<DevPtr>,
    pub param_bytes: Vec<usize>,
    /// Start of the parameter-grad slab (0: none).
    pub slab: DevPtr,
}

impl Buffers {
    pub fn of_role(&self, role: Role) -> &[DevPtr] {
        match role {
            Role::Input => &self.inputs,
            Role::Output => &self.outputs,
            Role::GradOutput => &self.grad_outputs,
            Role::GradInput => &self.grad_inputs,
            Role::ParamGrads => &self.param_grads,
        }
    }

    /// Records the address a callback provided for an external buffer.
    pub fn provide(&mut self, role: Role, index: usize, ptr: DevPtr) {
        match role {
            Role::Output => self.outputs[index] = ptr,
            Role::GradInput => self.grad_inputs[index] = ptr,
            _ => self.param_grads[index] = ptr,
        }
    }
}

/// Lease slots of one instance (strict leases only; empty otherwise).
#[derive(Clone, Debug, Default)]
pub(crate) struct LeaseSlots {
    /// Per pass kind: the slots its replay overwrites.
    pub overwritten: [Vec<usize>; 3],
    /// The slot of each output, input grad and ALIAS parameter grad.
    pub outputs: Vec<usize>,
    pub grad_inputs: Vec<Option<usize>>,
    pub params: Vec<Option<usize>>,
}

/// One captured (callable, microbatch) pair.
pub(crate) struct Instance {
    pub callable: usize,
    pub microbatch: u32,
    pub buffers: Buffers,
    /// Per input, and per output's grad-output: rebound at replay, or
    /// copied.
    pub rebind: Vec<Rebind>,
    pub rebind_grad_outputs: Vec<Rebind>,
    /// Inputs read in place from another instance's output, and
    /// grad-outputs written in place by another instance's backward: they
    /// take no replay data but their own buffer.
    pub chained_inputs: Vec<bool>,
    pub chained_grad_outputs: Vec<bool>,
    /// What backward / weight-grad replays return, frozen at capture.
    pub returns: ReturnPlan,
    /// Recycled clone blocks (CLONE grads without a caller allocator).
    pub ring: Option<Arc<CloneRing>>,
    /// The pass that writes the parameter grads, captured once per clone
    /// slot: graph k writes the CLONE grads into slot block k.
    pub rotating: Vec<Box<dyn Graph>>,
    /// The address of slot block k.
    pub slot_blocks: Vec<DevPtr>,
    /// Per pass kind: the external buffers its callback provides.
    pub external: [Vec<(Role, usize)>; 3],
    /// Per pass kind: the graph (None: that pass does not exist).
    pub graphs: [Option<Box<dyn Graph>>; 3],
    /// Per pass kind: the pass's position in capture order.
    pub position: [Option<usize>; 3],
    pub leases: LeaseSlots,
}

impl Instance {
    /// Every rebinding state: ("input" or "grad-output", index, state).
    pub fn rebinds(&self) -> impl Iterator<Item = (&'static str, usize, &Rebind)> {
        let inputs = self.rebind.iter().enumerate().map(|(i, r)| ("input", i, r));
        let grad_outputs = self.rebind_grad_outputs.iter().enumerate();
        inputs.chain(grad_outputs.map(|(o, r)| ("grad-output", o, r)))
    }

    /// The rebinding states of the inputs or of the grad-outputs (None for
    /// a role that is never rebound).
    pub fn rebinds_of(&self, role: Role) -> Option<&[Rebind]> {
        match role {
            Role::Input => Some(&self.rebind),
            Role::GradOutput => Some(&self.rebind_grad_outputs),
            _ => None,
        }
    }

    /// Whether parameter grads come from a separate weight-grad replay.
    pub fn has_wgrad(&self) -> bool {
        self.position[PassKind::Wgrad.index()].is_some()
    }

    pub fn graph(&self, kind: PassKind) -> Result<&dyn Graph> {
        self.graphs[kind.index()]
            .as_deref()
            .ok_or_else(|| Error::Internal(format!("the {kind} graph is missing")))
    }
}

/// One pass of one instance, in warmup/capture order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PassRef {
    pub instance: usize,
    pub kind: PassKind,
}

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
}

/// The static-buffer plan and what it placed, for stats and the plan dump.
#[derive(Default)]
pub(crate) struct PlanRecord {
    pub plan: Plan,
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

/// Everything a capture made.
pub(crate) struct Captured {
    pub backend: Arc<dyn Backend>,
    pub counters: Arc<MemCounters>,
    pub instances: Vec<Instance>,
    /// Instance index by [callable][microbatch].
    pub by_callable: Vec<Vec<usize>>,
    /// Every pass, in capture order.
    pub order: Vec<PassRef>,
    pub tapes: Box<[Cell<usize>]>,
    /// Where the capture's host time went.
    pub times: super::clock::CaptureTimes,
    /// Graphs of single passes, of clone slots, of steps.
    pub graph_count: u32,
    pub slot_graphs: u32,
    pub step_graphs: u32,
    pub plan: PlanRecord,
    pub steps: Vec<CapturedStep>,
    pub stage: Stage,
    pub statics: Option<DeviceMemory>,
    pub arena: Option<Arena>,
    pub side: Stream,
    pub ev_in: Event,
    pub ev_out: Event,
}

impl Captured {
    pub fn instance_index(&self, callable: u32, microbatch: u32) -> Result<usize> {
        let per = self.by_callable.get(callable as usize).ok_or_else(|| {
            Error::invalid(format!(
                "callable {callable} does not exist (the session has {} callables)",
                self.by_callable.len()
            ))
        })?;
        per.get(microbatch as usize).copied().ok_or_else(|| {
            Error::invalid(format!(
                "microbatch {microbatch} does not exist for callable {callable} (it was captured for {} microbatch(es))",
                per.len()
            ))
        })
    }

    pub fn statics_bytes(&self) -> usize {
        self.statics.as_ref().map_or(0, |m| m.bytes())
    }

    pub fn arena_bytes(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.bytes)
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        let _ctx = self.backend.bind();
        // Replays may still be running on the caller's streams.
        let _ = self.backend.synchronize_all();
        // Blocks of the last replay no caller took go back first.
        for b in self.stage.blocks.drain(..) {
            let _ = b.release();
        }
        // Graphs first, then the memory they use.
        self.steps.clear();
        self.instances.clear();
        MemCounters::sub(&self.counters.static_bytes, self.statics_bytes());
        MemCounters::sub(&self.counters.scratch_bytes, self.arena_bytes());
        self.statics = None;
        self.arena = None;
    }
}
