//! A captured instance: one callable, or with a schedule one (callable,
//! microbatch) pair. `Placed` is what placement decides (its tensors, its
//! return plan, its clone ring, its lease slots, its passes' positions in
//! capture order); an `Instance` is a placed instance with the graphs its
//! capture made.

use super::returned::CloneRing;
use super::tensor::{Param, Tensor};
use crate::backend::{DevPtr, Graph};
use crate::core::layout::Role;
use crate::core::returns::ReturnPlan;
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// One pass of one instance, in warmup/capture order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PassRef {
    pub instance: usize,
    pub kind: PassKind,
}

/// A placed instance.
pub(crate) struct Placed {
    pub callable: usize,
    pub microbatch: u32,
    /// Its bucket (0 without buckets): every bucket of a (callable,
    /// microbatch) lives in the same static buffers, a prefix of them.
    pub bucket: u32,
    /// The planned instance (layout, lifetimes) whose buffers it uses.
    pub site: usize,
    pub inputs: Vec<Tensor>,
    pub outputs: Vec<Tensor>,
    /// One per output (absent where the output takes no grad).
    pub grad_outputs: Vec<Tensor>,
    /// One per input (absent where the input takes no grad).
    pub grad_inputs: Vec<Tensor>,
    /// The caller's parameters: where they were registered, and where the
    /// instance's graphs read them now.
    pub params: Vec<Param>,
    /// One per parameter.
    pub param_grads: Vec<Tensor>,
    /// Start of the parameter-grad slab (0: none).
    pub slab: DevPtr,
    /// What backward / weight-grad replays return, frozen at capture.
    pub returns: ReturnPlan,
    /// Recycled clone blocks (CLONE grads without a caller allocator).
    pub ring: Option<Arc<CloneRing>>,
    /// Bytes of its callable's ring blocks handed out and not released
    /// (shared by the callable's instances).
    pub clone_out: Arc<AtomicU64>,
    /// Per pass kind: its position in capture order (None: no such pass).
    pub position: [Option<usize>; 3],
    /// Per pass kind: the lease slots its replay overwrites (strict leases).
    pub overwritten: [Vec<usize>; 3],
}

impl Placed {
    pub fn tensors(&self, role: Role) -> &[Tensor] {
        match role {
            Role::Input => &self.inputs,
            Role::Output => &self.outputs,
            Role::GradOutput => &self.grad_outputs,
            Role::GradInput => &self.grad_inputs,
            Role::ParamGrads => &self.param_grads,
        }
    }

    pub fn tensors_mut(&mut self, role: Role) -> &mut [Tensor] {
        match role {
            Role::Input => &mut self.inputs,
            Role::Output => &mut self.outputs,
            Role::GradOutput => &mut self.grad_outputs,
            Role::GradInput => &mut self.grad_inputs,
            Role::ParamGrads => &mut self.param_grads,
        }
    }

    /// Whether parameter grads come from a separate weight-grad pass.
    pub fn has_wgrad(&self) -> bool {
        self.position[PassKind::Wgrad.index()].is_some()
    }

    /// The pass that writes the parameter grads.
    pub fn grad_pass(&self) -> PassKind {
        if self.has_wgrad() {
            PassKind::Wgrad
        } else {
            PassKind::Backward
        }
    }

    /// The role whose data a replay of `kind` is fed: inputs (forward),
    /// grad-outputs (backward), none (weight-grad).
    pub fn fed_role(kind: PassKind) -> Option<Role> {
        match kind {
            PassKind::Forward => Some(Role::Input),
            PassKind::Backward => Some(Role::GradOutput),
            PassKind::Wgrad => None,
        }
    }

    /// The external buffers pass `kind`'s callback provides at capture:
    /// outputs (forward), input grads (backward), parameter grads (the
    /// pass that writes them).
    pub fn provided_by(&self, kind: PassKind) -> Vec<(Role, usize)> {
        let of = |ts: &[Tensor]| -> Vec<(Role, usize)> {
            ts.iter()
                .filter(|t| t.external())
                .map(|t| (t.role, t.index))
                .collect()
        };
        let mut v = match kind {
            PassKind::Forward => of(&self.outputs),
            PassKind::Backward => of(&self.grad_inputs),
            PassKind::Wgrad => Vec::new(),
        };
        if kind == self.grad_pass() {
            v.extend(of(&self.param_grads));
        }
        v
    }

    /// The buffers a replay of this instance writes that verification
    /// compares: outputs, input grads, parameter grads (address, bytes).
    pub fn results(&self) -> Vec<(DevPtr, usize)> {
        let grads = self.grad_inputs.iter().chain(&self.param_grads);
        self.outputs
            .iter()
            .chain(grads)
            .filter(|t| t.ptr != 0 && t.bytes > 0)
            .map(|t| (t.ptr, t.bytes))
            .collect()
    }

    /// The parameter-grad addresses the grad pass writes when its CLONE
    /// grads go into the block at `block` instead of the slab.
    pub fn param_grads_into(&self, block: DevPtr) -> Vec<DevPtr> {
        self.param_grads
            .iter()
            .map(|t| match t.ret {
                super::tensor::Return::Clone { offset } if !t.external() => {
                    block + offset as DevPtr
                }
                _ => t.ptr,
            })
            .collect()
    }
}

/// A clone slot: the grad pass captured once more, writing its CLONE
/// grads straight into the slot's block.
pub(crate) struct SlotGraph {
    pub block: DevPtr,
    pub graph: Box<dyn Graph>,
}

/// What capture made of one placed instance.
#[derive(Default)]
pub(crate) struct PassGraphs {
    /// Per pass kind: the graph (None: that pass does not exist).
    pub passes: [Option<Box<dyn Graph>>; 3],
    /// The clone slots, slot k at index k.
    pub slots: Vec<SlotGraph>,
}

impl PassGraphs {
    /// Every graph, passes in order (forward, backward, weight-grad), then
    /// the slots.
    pub fn all(&self) -> impl Iterator<Item = &dyn Graph> {
        let slots = self.slots.iter().map(|s| s.graph.as_ref());
        self.passes
            .iter()
            .flatten()
            .map(|g| g.as_ref())
            .chain(slots)
    }

    pub fn count(&self) -> usize {
        self.passes.iter().flatten().count()
    }
}

/// A placed instance and its graphs.
pub(crate) struct Instance {
    pub placed: Placed,
    pub graphs: PassGraphs,
}

impl std::ops::Deref for Instance {
    type Target = Placed;
    fn deref(&self) -> &Placed {
        &self.placed
    }
}

impl std::ops::DerefMut for Instance {
    fn deref_mut(&mut self) -> &mut Placed {
        &mut self.placed
    }
}

impl Instance {
    pub fn graph(&self, kind: PassKind) -> Result<&dyn Graph> {
        self.graphs.passes[kind.index()]
            .as_deref()
            .ok_or_else(|| Error::Internal(format!("the {kind} graph is missing")))
    }

    /// The graph of clone slot `k`, if there is one.
    pub fn slot_graph(&self, k: usize) -> Option<&dyn Graph> {
        self.graphs.slots.get(k).map(|s| s.graph.as_ref())
    }
}
