//! Placement, the first step of a capture: the static buffers of every
//! instance are laid out (`core::layout`), given lifetimes from the capture
//! order and a place in memory (`core::plan`, with reuse when the session
//! asks for it), split by owner (`plan::owned`: each callable's buffers no
//! other callable uses in an allocation of its own, the others in one
//! shared allocation), and every instance gets its tensors (where each
//! lives, what replays feed it and return for it), its frozen return plan,
//! its clone ring and its passes' positions.

use super::context::Inputs;
use super::instance::{PassRef, Placed};
use super::returned::CloneRing;
use super::spec::{CallableSpec, TensorSpec};
use super::tensor::{Feed, Param, Place, Return, Tensor, Varying};
use crate::backend::DevPtr;
use crate::core::layout::{
    layout, InstanceBuffers, InstanceShape, Layout, ParamShape, Role, TensorShape,
};
use crate::core::plan::{self, Lifetime, Owned, Plan};
use crate::core::policy::snapshot;
use crate::core::returns::ReturnPlan;
use crate::core::schedule::Schedule;
use crate::error::Result;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// The static buffers of a session, planned but not yet placed.
pub(crate) struct Planned {
    pub shapes: Vec<InstanceShape>,
    /// (callable, microbatch) of each instance.
    pub owners: Vec<(usize, usize)>,
    pub layout: Layout,
    pub lifetimes: Vec<Lifetime>,
    pub plan: Plan,
    /// Which allocation each buffer lives in, and where.
    pub owned: Owned,
}

impl Planned {
    /// The address of logical buffer `id`, the allocations at `bases` (the
    /// shared one first, then one per callable: `Owned::at`).
    fn at(&self, bases: &[DevPtr], id: usize) -> DevPtr {
        self.owned.at(bases, id)
    }
}

/// The layout shape of one callable's instances (before chaining).
fn shape_of(spec: &CallableSpec, clone_on_return: bool) -> InstanceShape {
    let policies = snapshot(clone_on_return, &spec.params);
    let tensor = |t: &TensorSpec| TensorShape {
        bytes: t.bytes,
        requires_grad: t.requires_grad,
        external: t.external,
        chained: None,
    };
    InstanceShape {
        inputs: spec.inputs.iter().map(tensor).collect(),
        outputs: spec.outputs.iter().map(tensor).collect(),
        params: spec
            .params
            .iter()
            .zip(&policies)
            .map(|(p, pol)| {
                pol.map(|policy| ParamShape {
                    bytes: p.bytes,
                    policy,
                    external: p.external_grad(),
                })
            })
            .collect(),
    }
}

/// Lays out the static buffers of every instance (callable x microbatch,
/// instance `callable * microbatches + microbatch`) with their frozen
/// policies, and plans where they live.
pub(crate) fn plan(s: &Inputs, schedule: &Schedule) -> Result<Planned> {
    let m = schedule.microbatches;
    let mut shapes = Vec::new();
    let mut owners = Vec::new();
    for (c, spec) in s.callables.iter().enumerate() {
        let shape = shape_of(spec, s.opts.clone_param_grads_on_return);
        for mb in 0..m {
            let mut shape = shape.clone();
            for (t, spec) in shape.inputs.iter_mut().zip(&spec.inputs) {
                t.chained = spec
                    .chained
                    .map(|(pc, j)| (pc as usize * m + mb, j as usize));
            }
            shapes.push(shape);
            owners.push((c, mb));
        }
    }
    let layout = layout(&shapes)?;
    let lifetimes = plan::lifetimes(schedule, &layout, |c, mb| c * m + mb);
    let plan = if s.opts.reuse_buffers {
        plan::reuse(&layout.buffers, &lifetimes)?
    } else {
        Plan {
            peak_live_bytes: plan::peak_live(&layout.buffers, &lifetimes)?,
            ..plan::disjoint(&layout.buffers)?
        }
    };
    // The callables using each buffer: its instance's, and those of the
    // instances chained to it.
    let mut users: Vec<Vec<usize>> = layout
        .buffers
        .iter()
        .map(|b| vec![owners[b.instance].0])
        .collect();
    for u in &layout.shared {
        let c = owners[u.instance].0;
        if !users[u.buffer].contains(&c) {
            users[u.buffer].push(c);
        }
    }
    let owned = plan::owned(&plan, &layout.buffers, &users, s.callables.len())?;
    Ok(Planned {
        shapes,
        owners,
        layout,
        lifetimes,
        plan,
        owned,
    })
}

/// The placed instances of a planned session whose allocations are laid
/// one after the other from `base` (see [`place_at`]).
#[cfg(test)]
pub(crate) fn place(
    s: &Inputs,
    p: &Planned,
    base: DevPtr,
    order: &[PassRef],
) -> Result<Vec<Placed>> {
    place_at(s, p, &p.owned.contiguous(base), order)
}

/// The placed instances of a planned session whose static allocations
/// are at `bases` (the shared one, then one per callable: `Owned::at`),
/// with their passes at their positions in `order`: one per planned
/// instance and bucket (see [`first_instances`]), every bucket in the
/// planned instance's buffers.
pub(crate) fn place_at(
    s: &Inputs,
    p: &Planned,
    bases: &[DevPtr],
    order: &[PassRef],
) -> Result<Vec<Placed>> {
    let mut placed: Vec<Placed> = Vec::with_capacity(p.shapes.len());
    // Per callable: the bytes of its clone blocks handed out.
    let clone_out: Vec<Arc<AtomicU64>> = s.callables.iter().map(|_| Arc::default()).collect();
    for n in 0..p.shapes.len() {
        let first = placed.len();
        let out = &clone_out[p.owners[n].0];
        for b in 0..s.callables[p.owners[n].0].bucket_count() {
            let mut inst = place_one(s, p, (n, b), bases, out)?;
            // The buckets share the clone blocks too (their grads have one
            // shape): one ring, one set of slot blocks.
            if b > 0 {
                inst.ring = placed[first].ring.clone();
            }
            placed.push(inst);
        }
    }
    for (pos, r) in order.iter().enumerate() {
        placed[r.instance].position[r.kind.index()] = Some(pos);
    }
    Ok(placed)
}

/// The index of each callable's first placed instance: placed instances
/// go callable by callable, microbatch by microbatch, bucket by bucket, so
/// (callable c, microbatch mb, bucket b) is `first[c] + mb * buckets + b`
/// (a callable with buckets has one microbatch).
pub(crate) fn first_instances(s: &Inputs, microbatches: usize) -> Vec<usize> {
    let mut next = 0;
    s.callables
        .iter()
        .map(|c| {
            let first = next;
            next += microbatches * c.bucket_count();
            first
        })
        .collect()
}

/// One instance's share of a plan, with its static allocations at
/// `bases`, in the bucket of sizes `size` ((0, 0): no buckets).
struct Site<'a> {
    p: &'a Planned,
    n: usize,
    bases: &'a [DevPtr],
    size: (u64, u64),
}

impl Site<'_> {
    fn ib(&self) -> &InstanceBuffers {
        &self.p.layout.instances[self.n]
    }

    fn shape(&self) -> &InstanceShape {
        &self.p.shapes[self.n]
    }

    /// A tensor in buffer `id` (None: the layout placed nothing for it).
    fn tensor(
        &self,
        role: Role,
        i: usize,
        t: &TensorSpec,
        id: Option<usize>,
        place: Place,
    ) -> Tensor {
        let mut x = Tensor::new(role, i, t.bytes_in(self.size), t.dtype, place);
        if let Some(shape) = t.collapsed() {
            x.varies = Some(Varying {
                shape,
                bucket: self.size,
            });
            if shape.rows_first() {
                x.row_bytes = shape.inner as usize;
            }
        }
        if let (Place::Static | Place::Chained, Some(id)) = (place, id) {
            x.ptr = self.p.at(self.bases, id);
        }
        if matches!(role, Role::Output | Role::GradInput) && place != Place::Absent {
            x.ret = Return::Alias;
        }
        x
    }

    /// Inputs (copied, or read in place when chained) and their grads.
    fn inputs(&self, specs: &[TensorSpec]) -> (Vec<Tensor>, Vec<Tensor>) {
        let (ib, shape) = (self.ib(), self.shape());
        let mut inputs = Vec::with_capacity(specs.len());
        let mut grads = Vec::with_capacity(specs.len());
        for (i, t) in specs.iter().enumerate() {
            let chained = shape.inputs[i].chained.is_some();
            let (place, feed) = match chained {
                true => (Place::Chained, Feed::Chained),
                false => (Place::Static, Feed::Copied),
            };
            let mut x = self.tensor(Role::Input, i, t, Some(ib.inputs[i]), place);
            x.feed = feed;
            inputs.push(x);
            let place = match (t.requires_grad, t.external, chained) {
                (false, _, _) => Place::Absent,
                (true, true, _) => Place::External,
                (true, false, true) => Place::Chained,
                (true, false, false) => Place::Static,
            };
            grads.push(self.tensor(Role::GradInput, i, t, ib.grad_inputs[i], place));
        }
        (inputs, grads)
    }

    /// Outputs and their grad-outputs (copied, or written in place by a
    /// consumer's backward when the output is chained).
    fn outputs(&self, specs: &[TensorSpec]) -> (Vec<Tensor>, Vec<Tensor>) {
        let ib = self.ib();
        let shared = |b: usize| self.p.layout.shared.iter().any(|u| u.buffer == b);
        let mut outputs = Vec::with_capacity(specs.len());
        let mut grads = Vec::with_capacity(specs.len());
        for (o, t) in specs.iter().enumerate() {
            let place = if t.external {
                Place::External
            } else {
                Place::Static
            };
            outputs.push(self.tensor(Role::Output, o, t, ib.outputs[o], place));
            let id = ib.grad_outputs[o];
            let (place, feed) = match id {
                None => (Place::Absent, Feed::NotFed),
                Some(b) if shared(b) => (Place::Static, Feed::Chained),
                Some(_) => (Place::Static, Feed::Copied),
            };
            let mut g = self.tensor(Role::GradOutput, o, t, id, place);
            g.feed = feed;
            grads.push(g);
        }
        (outputs, grads)
    }

    /// The parameters' grads (in the slab at `slab`, provided by the
    /// callback, or none), returned as `returns` says.
    fn param_grads(&self, spec: &CallableSpec, slab: DevPtr, returns: &ReturnPlan) -> Vec<Tensor> {
        let slots = &self.ib().slab_layout.slots;
        let shapes = self.shape().params.iter().zip(slots);
        spec.params
            .iter()
            .zip(shapes)
            .enumerate()
            .map(|(j, (param, (sh, slot)))| {
                let place = match sh {
                    None => Place::Absent,
                    Some(sh) if sh.external => Place::External,
                    Some(_) => Place::Static,
                };
                let mut t = Tensor::new(Role::ParamGrads, j, param.bytes, param.dtype, place);
                t.ptr = slot.map_or(0, |sl| slab + sl.offset as DevPtr);
                t.ret = returns.params[j];
                t
            })
            .collect()
    }
}

fn place_one(
    s: &Inputs,
    p: &Planned,
    (n, bucket): (usize, usize),
    bases: &[DevPtr],
    clone_out: &Arc<AtomicU64>,
) -> Result<Placed> {
    let (c, mb) = p.owners[n];
    let spec = &s.callables[c];
    let size = spec.sizes(bucket);
    let site = Site { p, n, bases, size };
    let (inputs, grad_inputs) = site.inputs(&spec.inputs);
    let (outputs, grad_outputs) = site.outputs(&spec.outputs);
    let (shape, ib) = (site.shape(), site.ib());
    let slab = ib.slab.map_or(0, |id| p.at(bases, id));
    let policies: Vec<_> = shape.params.iter().map(|p| p.map(|p| p.policy)).collect();
    let dtypes: Vec<_> = spec.params.iter().map(|p| p.dtype).collect();
    let returns = ReturnPlan::of(&policies, &shape.params, &dtypes, &ib.slab_layout)?;
    let param_grads = site.param_grads(spec, slab, &returns);
    let ring = (returns.clone.count > 0 && s.opts.allocator.is_none())
        .then(|| CloneRing::new(s.backend, s.counters, clone_out, returns.clone.bytes));
    Ok(Placed {
        callable: c,
        microbatch: mb as u32,
        bucket: bucket as u32,
        site: n,
        inputs,
        outputs,
        grad_outputs,
        grad_inputs,
        params: spec
            .params
            .iter()
            .enumerate()
            .map(|(j, p)| {
                let why = if p.flags.rebind {
                    "its rebinding was not verified"
                } else {
                    "it was registered without the REBIND flag: its graphs read it where it was \
                     registered"
                };
                Param::fixed(j, p.data, p.bytes, p.dtype, why)
            })
            .collect(),
        param_grads,
        slab,
        returns,
        ring,
        clone_out: clone_out.clone(),
        position: [None; 3],
        overwritten: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{host_inputs, Fixture};
    use super::*;
    use crate::core::policy::GradPolicy;
    use crate::core::PassKind;

    fn placed(f: &Fixture) -> Vec<Placed> {
        f.placed(0x10000)
    }

    #[test]
    fn tensors_say_where_they_live_and_what_replays_do_with_them() {
        // Layer b reads layer a's output in place; b's second parameter
        // takes no grad.
        let mut f = host_inputs(&[("a", 2, false), ("b", 2, false)]);
        f.callables[1].inputs[0].chained = Some((0, 0));
        f.callables[1].params[1].requires_grad = false;
        let p = placed(&f);
        let (a, b) = (&p[0], &p[1]);
        assert!(matches!(a.inputs[0].feed, Feed::Copied));
        assert_eq!(b.inputs[0].place, Place::Chained);
        assert!(matches!(b.inputs[0].feed, Feed::Chained));
        assert_eq!(b.inputs[0].ptr, a.outputs[0].ptr, "read in place");
        assert_eq!(
            b.grad_inputs[0].ptr, a.grad_outputs[0].ptr,
            "written in place"
        );
        assert!(
            matches!(a.grad_outputs[0].feed, Feed::Chained),
            "the consumer's backward writes it: it takes no data"
        );
        assert!(matches!(b.grad_outputs[0].feed, Feed::Copied));
        assert_eq!(b.param_grads[1].place, Place::Absent);
        assert_eq!(b.param_grads[1].ptr, 0);
        assert_eq!(b.param_grads[1].ret, Return::None);
        assert!(matches!(b.param_grads[0].ret, Return::Clone { offset: 0 }));
        assert_eq!(
            b.param_grads[0].ptr, b.slab,
            "the CLONE slot opens the slab"
        );
        assert_eq!(a.outputs[0].ret, Return::Alias);
        assert!(
            a.ring.is_some(),
            "CLONE grads without an allocator recycle blocks"
        );
        // Forwards in order, then backwards in reverse.
        assert_eq!(a.position[PassKind::Forward.index()], Some(0));
        assert_eq!(b.position[PassKind::Backward.index()], Some(2));
        assert_eq!(a.position[PassKind::Backward.index()], Some(3));
        assert_eq!(a.grad_pass(), PassKind::Backward);
    }

    #[test]
    fn external_buffers_are_provided_by_the_pass_that_writes_them() {
        let mut f = host_inputs(&[("a", 1, true)]);
        f.callables[0].outputs[0].external = true;
        f.callables[0].inputs[0].external = true;
        f.callables[0].params[0].flags.external_grad = true;
        f.callables[0].params[0].policy = GradPolicy::Alias;
        let p = placed(&f);
        let a = &p[0];
        assert_eq!(a.outputs[0].ptr, 0, "provided at capture");
        assert_eq!(a.outputs[0].place, Place::External);
        assert_eq!(a.provided_by(PassKind::Forward), vec![(Role::Output, 0)]);
        assert_eq!(
            a.provided_by(PassKind::Backward),
            vec![(Role::GradInput, 0)]
        );
        assert_eq!(
            a.provided_by(PassKind::Wgrad),
            vec![(Role::ParamGrads, 0)],
            "a weight-grad pass writes the parameter grads"
        );
        assert_eq!(a.slab, 0, "nothing of the slab is left");
    }

    #[test]
    fn policies_order_the_slab_and_say_what_replays_return() {
        let mut f = host_inputs(&[("a", 3, false)]);
        f.callables[0].params[0].policy = GradPolicy::AccumulateInto;
        f.callables[0].params[1].policy = GradPolicy::Alias;
        let p = placed(&f);
        let a = &p[0];
        let rets: Vec<Return> = a.param_grads.iter().map(|t| t.ret).collect();
        assert_eq!(
            rets,
            vec![
                Return::AccumulateInto {
                    dtype: crate::core::dtype::DType::F32
                },
                Return::Alias,
                Return::Clone { offset: 0 }
            ]
        );
        assert_eq!(a.param_grads[2].ptr, a.slab, "CLONE first: one span");
        assert!(a.param_grads[1].ptr > a.param_grads[2].ptr);
    }
}
