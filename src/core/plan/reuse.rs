//! Buffer reuse: buffers of the same size whose lifetimes do not overlap
//! share memory, a slot per size class, as few slots as the most buffers of
//! that size live at once.

use super::{disjoint, peak_live, size, Lifetime, Plan};
use crate::core::layout::BufferDesc;
use crate::error::Result;
use std::collections::HashMap;

/// Shares memory between buffers of the same size whose lifetimes do not
/// overlap. Greedy by start: a buffer takes a free slot of its size if one
/// is free, else a new slot, which is optimal per size class (the slot count
/// equals the most buffers of that size live at once).
pub fn reuse(buffers: &[BufferDesc], lifetimes: &[Lifetime]) -> Result<Plan> {
    let disjoint_bytes = disjoint(buffers)?.total_bytes;
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by_key(|&i| (lifetimes[i].start, lifetimes[i].end, i));
    // Per size: slots with the end of their last lifetime.
    let mut free_at: HashMap<usize, Vec<(usize, usize)>> = HashMap::new();
    let mut slot_size: Vec<usize> = Vec::new();
    let mut slot_of = vec![0; buffers.len()];
    for i in order {
        let sz = size(&buffers[i])?;
        let lt = lifetimes[i];
        let slots = free_at.entry(sz).or_default();
        match slots.iter_mut().find(|(_, end)| *end < lt.start) {
            Some((slot, end)) => {
                *end = lt.end;
                slot_of[i] = *slot;
            }
            None => {
                slot_size.push(sz);
                slots.push((slot_size.len() - 1, lt.end));
                slot_of[i] = slot_size.len() - 1;
            }
        }
    }
    let mut slot_offset = Vec::with_capacity(slot_size.len());
    let mut total = 0;
    for &sz in &slot_size {
        slot_offset.push(total);
        // At most the disjoint total, which fits.
        total += sz;
    }
    Ok(Plan {
        offsets: slot_of.iter().map(|&s| slot_offset[s]).collect(),
        slot_of,
        total_bytes: total,
        disjoint_bytes,
        peak_live_bytes: peak_live(buffers, lifetimes)?,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{buffer, random_schedules, setup, three_chunks};
    use super::*;
    use crate::core::layout::Role;
    use crate::core::policy::GradPolicy;
    use crate::core::schedule::tests::{te, TE_ORDER};
    use crate::core::schedule::Schedule;

    fn check_no_overlap(buffers: &[BufferDesc], lt: &[Lifetime], plan: &Plan) {
        for i in 0..buffers.len() {
            for j in i + 1..buffers.len() {
                let (a0, a1) = (plan.offsets[i], plan.offsets[i] + buffers[i].bytes);
                let (b0, b1) = (plan.offsets[j], plan.offsets[j] + buffers[j].bytes);
                let mem = a0 < b1 && b0 < a1;
                assert!(
                    !(mem && lt[i].overlaps(&lt[j])),
                    "buffers {i} {:?} {:?} and {j} {:?} {:?} share memory while both live",
                    buffers[i],
                    lt[i],
                    buffers[j],
                    lt[j]
                );
            }
        }
    }

    /// Per size class, the plan uses exactly as many slots as the most
    /// buffers of that size live at one pass.
    fn check_optimal(buffers: &[BufferDesc], lt: &[Lifetime], plan: &Plan) {
        let mut sizes: Vec<usize> = buffers.iter().map(|b| size(b).unwrap()).collect();
        sizes.sort();
        sizes.dedup();
        for sz in sizes {
            let members: Vec<usize> = (0..buffers.len())
                .filter(|&i| size(&buffers[i]).unwrap() == sz)
                .collect();
            let mut slots: Vec<usize> = members.iter().map(|&i| plan.slot_of[i]).collect();
            slots.sort();
            slots.dedup();
            let end = members.iter().map(|&i| lt[i].end).max().unwrap_or(0);
            let most = (0..=end)
                .map(|t| {
                    members
                        .iter()
                        .filter(|&&i| lt[i].start <= t && t <= lt[i].end)
                        .count()
                })
                .max();
            assert_eq!(Some(slots.len()), most, "size {sz}");
        }
    }

    #[test]
    fn te_scenario_assignments() {
        let s = Schedule::derive(&te(&TE_ORDER), None, &[false, false]).unwrap();
        let (l, lt) = setup(&s, false, GradPolicy::Clone);
        let inst = |c: usize, m: usize| c * 3 + m;
        let plan = reuse(&l.buffers, &lt).unwrap();
        check_no_overlap(&l.buffers, &lt, &plan);
        // Microbatch 2's inputs take over microbatch 0's once its backward ran.
        let a = buffer(&l, inst(0, 0), Role::Input);
        let b = buffer(&l, inst(0, 2), Role::Input);
        assert_eq!(plan.slot_of[a], plan.slot_of[b]);
        // Grad-outputs are never live together: they need one slot's worth
        // of memory between them, and the plan is optimal per size.
        check_optimal(&l.buffers, &lt, &plan);
        // CLONE slabs are live only during their backward: one slot for all six.
        let slabs: Vec<usize> = (0..l.buffers.len())
            .filter(|&i| l.buffers[i].role == Role::ParamGrads)
            .map(|i| plan.slot_of[i])
            .collect();
        assert!(slabs.windows(2).all(|w| w[0] == w[1]), "{slabs:?}");
        assert!(plan.total_bytes < plan.disjoint_bytes);
        assert!(plan.peak_live_bytes <= plan.total_bytes);
        // ALIAS slabs are kept: never shared.
        let (l2, lt2) = setup(&s, false, GradPolicy::Alias);
        let plan2 = reuse(&l2.buffers, &lt2).unwrap();
        let slabs2: Vec<usize> = (0..l2.buffers.len())
            .filter(|&i| l2.buffers[i].role == Role::ParamGrads)
            .map(|i| plan2.slot_of[i])
            .collect();
        let mut uniq = slabs2.clone();
        uniq.dedup();
        assert_eq!(uniq.len(), 6, "{slabs2:?}");
        check_no_overlap(&l2.buffers, &lt2, &plan2);
    }

    #[test]
    fn three_chunk_schedule() {
        let s = three_chunks();
        let (l, lt) = setup(&s, true, GradPolicy::Clone);
        let plan = reuse(&l.buffers, &lt).unwrap();
        check_no_overlap(&l.buffers, &lt, &plan);
        assert!(plan.total_bytes < plan.disjoint_bytes);
        assert!(plan.peak_live_bytes <= plan.total_bytes);
    }

    #[test]
    fn random_schedules_never_share_live_memory() {
        for (s, _, first_input_grad) in random_schedules() {
            for policy in [GradPolicy::Clone, GradPolicy::Alias] {
                let (l, lt) = setup(&s, first_input_grad, policy);
                let plan = reuse(&l.buffers, &lt).unwrap();
                check_no_overlap(&l.buffers, &lt, &plan);
                check_optimal(&l.buffers, &lt, &plan);
                assert!(plan.peak_live_bytes <= plan.total_bytes);
                assert!(plan.total_bytes <= plan.disjoint_bytes);
            }
        }
    }
}
