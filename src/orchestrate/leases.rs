//! Strict leases at placement: every alias an instance hands out (outputs,
//! input grads, ALIAS parameter grads) gets a lease slot, and every pass
//! learns which slots its replay overwrites: the buffers it writes and,
//! with buffer reuse, every buffer sharing memory with them.

use super::context::Inputs;
use super::instance::Placed;
use super::place::Planned;
use crate::core::layout::InstanceBuffers;
use crate::core::lease::Leases;
use crate::core::policy::GradPolicy;
use crate::error::Result;

/// Logical buffer ids: the layout's, then fresh ones past them for
/// external buffers (nothing shares their memory).
struct Ids<'a> {
    planned: &'a Planned,
    next: usize,
}

impl Ids<'_> {
    fn fresh(&mut self) -> usize {
        self.next += 1;
        self.next - 1
    }

    /// Every buffer id sharing memory with those in `written`.
    fn sharing(&self, written: &[usize]) -> Vec<usize> {
        let p = self.planned;
        let nbuf = p.layout.buffers.len();
        let slots: Vec<usize> = written
            .iter()
            .filter(|&&b| b < nbuf)
            .map(|&b| p.plan.slot_of[b])
            .collect();
        let mut all: Vec<usize> = (0..nbuf)
            .filter(|&b| slots.contains(&p.plan.slot_of[b]))
            .collect();
        all.extend(written.iter().filter(|&&b| b >= nbuf));
        all
    }
}

/// Gives every alias of `placed` a lease slot in `leases`, and every pass
/// the slots its replay overwrites. Two rounds: every instance's slots
/// first, then what each pass overwrites, so that a pass also sees the
/// slots of instances placed after it that share its memory (the buckets
/// of a callable, buffers that reuse memory).
pub(crate) fn assign(
    s: &Inputs,
    planned: &Planned,
    placed: &mut [Placed],
    leases: &mut Leases,
) -> Result<()> {
    let mut ids = Ids {
        planned,
        next: planned.layout.buffers.len(),
    };
    let mut written = Vec::with_capacity(placed.len());
    for inst in placed.iter_mut() {
        let ib = &planned.layout.instances[inst.site];
        written.push(add_slots(s, &mut ids, inst, ib, leases)?);
    }
    for (inst, [fwd, bwd, params]) in placed.iter_mut().zip(written) {
        inst.overwritten = [
            leases.slots_in(&ids.sharing(&fwd)),
            leases.slots_in(&ids.sharing(&bwd)),
            leases.slots_in(&ids.sharing(&params)),
        ];
    }
    Ok(())
}

/// Adds the lease slots of `inst`'s aliases; returns the buffers its
/// forward, backward and weight-grad replays write.
fn add_slots(
    s: &Inputs,
    ids: &mut Ids,
    inst: &mut Placed,
    ib: &InstanceBuffers,
    leases: &mut Leases,
) -> Result<[Vec<usize>; 3]> {
    let (name, mb) = (&s.callables[inst.callable].name, inst.microbatch);
    let who = |what: String| format!("{what} of callable '{name}' (microbatch {mb})");
    let out_ids: Vec<usize> = ib
        .outputs
        .iter()
        .map(|b| b.unwrap_or_else(|| ids.fresh()))
        .collect();
    let gin_ids: Vec<Option<usize>> = ib
        .grad_inputs
        .iter()
        .zip(&inst.grad_inputs)
        .map(|(b, t)| b.or_else(|| t.external().then(|| ids.fresh())))
        .collect();
    let param_ids: Vec<Option<usize>> = inst
        .param_grads
        .iter()
        .map(|t| match t.place {
            super::tensor::Place::Absent => None,
            super::tensor::Place::External => Some(ids.fresh()),
            _ => Some(ib.slab.unwrap_or(usize::MAX)),
        })
        .collect();
    for (t, &b) in inst.outputs.iter_mut().zip(&out_ids) {
        t.lease = Some(leases.add_slot(who(t.describe()), b)?);
    }
    for (t, b) in inst.grad_inputs.iter_mut().zip(&gin_ids) {
        if let Some(b) = b {
            t.lease = Some(leases.add_slot(who(t.describe()), *b)?);
        }
    }
    for ((t, b), pol) in inst
        .param_grads
        .iter_mut()
        .zip(&param_ids)
        .zip(&inst.returns.policies)
    {
        if let (Some(b), Some(GradPolicy::Alias)) = (b, pol) {
            t.lease = Some(leases.add_slot(who(t.describe()), *b)?);
        }
    }
    let params: Vec<usize> = param_ids.iter().flatten().copied().collect();
    // Replays write by copy-in the inputs (forward) and grad-outputs
    // (backward), except chained ones, which take no data.
    let chained: Vec<usize> = ids.planned.layout.shared.iter().map(|u| u.buffer).collect();
    let copied_in = |b: &usize| !chained.contains(b);
    let mut fwd: Vec<usize> = ib.inputs.iter().copied().filter(copied_in).collect();
    fwd.extend(&out_ids);
    let mut bwd: Vec<usize> = ib
        .grad_outputs
        .iter()
        .flatten()
        .copied()
        .filter(copied_in)
        .collect();
    bwd.extend(gin_ids.iter().flatten());
    if !s.callables[inst.callable].callbacks.has_wgrad() {
        bwd.extend(&params);
    }
    Ok([fwd, bwd, params])
}
