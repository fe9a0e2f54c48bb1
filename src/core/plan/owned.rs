//! A plan's memory split by owner: the slots only one callable uses in an
//! allocation of that callable's own, the slots several callables use in
//! one shared allocation.

use super::{size, Plan, WHAT};
use crate::core::layout::BufferDesc;
use crate::error::Result;

/// Which allocation each buffer of a plan lives in, so that memory has an
/// owner: the memory slots only one callable uses (no chaining to another
/// callable, no reuse with another callable's buffers) go into an
/// allocation of that callable's own, which releasing it frees; the slots
/// several callables use go into one shared allocation, kept until the
/// last of them is released. Each allocation lays its slots out in plan
/// order; together they take the plan's `total_bytes`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owned {
    /// Per buffer: its allocation (Some(callable): that callable's own;
    /// None: the shared one) and its offset there.
    pub place: Vec<(Option<usize>, usize)>,
    /// Bytes of the shared allocation.
    pub shared_bytes: usize,
    /// Per callable: bytes of its own allocation.
    pub own_bytes: Vec<usize>,
    /// Per callable: bytes of the shared allocation's slots it uses (0:
    /// it uses none).
    pub shared_use: Vec<usize>,
}

impl Owned {
    /// Where buffer `id` lives, its allocations at `bases` (the shared one
    /// first, then one per callable).
    pub fn at(&self, bases: &[u64], id: usize) -> u64 {
        let (owner, offset) = self.place[id];
        let base = match owner {
            None => bases[0],
            Some(c) => bases[1 + c],
        };
        base + offset as u64
    }

    /// The allocations laid one after the other from `base` (the shared one
    /// first, then one per callable): their bases, as `at` takes them.
    pub fn contiguous(&self, base: u64) -> Vec<u64> {
        let mut bases = Vec::with_capacity(1 + self.own_bytes.len());
        let mut next = base;
        for bytes in std::iter::once(self.shared_bytes).chain(self.own_bytes.iter().copied()) {
            bases.push(next);
            next += bytes as u64;
        }
        bases
    }
}

/// The allocations of `plan` over `callables` callables: `users[b]` names
/// the callables that use buffer `b` (its owner, and those chained to it).
pub fn owned(
    plan: &Plan,
    buffers: &[BufferDesc],
    users: &[Vec<usize>],
    callables: usize,
) -> Result<Owned> {
    let slots = plan.slot_of.iter().max().map_or(0, |m| m + 1);
    let mut slot_users: Vec<Vec<usize>> = vec![Vec::new(); slots];
    let mut slot_bytes = vec![0usize; slots];
    let mut slot_offset = vec![0usize; slots];
    for (b, buf) in buffers.iter().enumerate() {
        let s = plan.slot_of[b];
        slot_bytes[s] = slot_bytes[s].max(size(buf)?);
        slot_offset[s] = plan.offsets[b];
        for &c in &users[b] {
            if !slot_users[s].contains(&c) {
                slot_users[s].push(c);
            }
        }
    }
    // Slots in plan order (by their offset in the one-allocation plan).
    let mut order: Vec<usize> = (0..slots).collect();
    order.sort_by_key(|&s| (slot_offset[s], s));
    let mut out = Owned {
        place: Vec::with_capacity(buffers.len()),
        shared_bytes: 0,
        own_bytes: vec![0; callables],
        shared_use: vec![0; callables],
    };
    let mut slot_place = vec![(None, 0usize); slots];
    for s in order {
        let bytes = slot_bytes[s];
        slot_place[s] = match slot_users[s].as_slice() {
            [c] if *c < callables => {
                let at = out.own_bytes[*c];
                out.own_bytes[*c] = size::add(at, bytes, WHAT)?;
                (Some(*c), at)
            }
            many => {
                let at = out.shared_bytes;
                out.shared_bytes = size::add(at, bytes, WHAT)?;
                for &c in many.iter().filter(|&&c| c < callables) {
                    out.shared_use[c] = size::add(out.shared_use[c], bytes, WHAT)?;
                }
                (None, at)
            }
        };
    }
    out.place = plan.slot_of.iter().map(|&s| slot_place[s]).collect();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{buffer, random_schedules, setup};
    use super::super::{disjoint, reuse};
    use super::*;
    use crate::core::layout::Role;
    use crate::core::policy::GradPolicy;
    use crate::core::schedule::tests::{te, TE_ORDER};
    use crate::core::schedule::Schedule;

    /// Checks an `Owned` against its plan: the allocations take the plan's
    /// bytes; buffers sharing a plan slot share an address, and no two
    /// slots of one allocation overlap; a slot used by one callable is in
    /// its own allocation, the others in the shared one.
    fn check_owned(plan: &Plan, buffers: &[BufferDesc], users: &[Vec<usize>], o: &Owned) {
        let total = o.shared_bytes + o.own_bytes.iter().sum::<usize>();
        assert_eq!(total, plan.total_bytes, "the same memory, split by owner");
        let bases = o.contiguous(0x1000);
        for i in 0..buffers.len() {
            // Every user of every buffer in its slot.
            let mut slot_users: Vec<usize> = (0..buffers.len())
                .filter(|&j| plan.slot_of[j] == plan.slot_of[i])
                .flat_map(|j| users[j].iter().copied())
                .collect();
            slot_users.sort();
            slot_users.dedup();
            let want = match slot_users.as_slice() {
                [c] => Some(*c),
                _ => None,
            };
            assert_eq!(
                o.place[i].0, want,
                "buffer {i}, slot used by {slot_users:?}"
            );
            for j in i + 1..buffers.len() {
                let (a, b) = (o.at(&bases, i), o.at(&bases, j));
                if plan.slot_of[i] == plan.slot_of[j] {
                    assert_eq!(a, b, "buffers {i} and {j} share a slot");
                } else {
                    let (sa, sb) = (size(&buffers[i]).unwrap(), size(&buffers[j]).unwrap());
                    assert!(
                        a + sa as u64 <= b || b + sb as u64 <= a,
                        "buffers {i} and {j} overlap"
                    );
                }
            }
        }
    }

    #[test]
    fn each_callable_owns_the_buffers_only_it_uses() {
        // Callable 0: two buffers; callable 1: one of its own and one it
        // shares with 0 (a chained output); callable 2: none.
        let bufs: Vec<BufferDesc> = [100, 300, 50, 700]
            .iter()
            .enumerate()
            .map(|(i, &bytes)| BufferDesc {
                instance: i,
                role: Role::Output,
                index: 0,
                bytes,
            })
            .collect();
        let users = vec![vec![0], vec![0, 1], vec![1], vec![0]];
        let plan = disjoint(&bufs).unwrap();
        let o = owned(&plan, &bufs, &users, 3).unwrap();
        check_owned(&plan, &bufs, &users, &o);
        assert_eq!(o.own_bytes, vec![256 + 768, 256, 0]);
        assert_eq!(o.shared_bytes, 512);
        assert_eq!(o.shared_use, vec![512, 512, 0]);
        assert_eq!(o.place[1], (None, 0));
        assert_eq!(o.place[3], (Some(0), 256), "callable 0's second buffer");
        // No buffer at all: nothing anywhere.
        let none = owned(&disjoint(&[]).unwrap(), &[], &[], 2).unwrap();
        assert_eq!((none.shared_bytes, none.own_bytes), (0, vec![0, 0]));
    }

    #[test]
    fn memory_reused_between_callables_is_shared_and_within_one_is_its_own() {
        let s = Schedule::derive(&te(&TE_ORDER), None, &[false, false]).unwrap();
        let (l, lt) = setup(&s, false, GradPolicy::Clone);
        let m = s.microbatches;
        let users: Vec<Vec<usize>> = l.buffers.iter().map(|b| vec![b.instance / m]).collect();
        let plan = reuse(&l.buffers, &lt).unwrap();
        let o = owned(&plan, &l.buffers, &users, 2).unwrap();
        check_owned(&plan, &l.buffers, &users, &o);
        // Microbatch 2's inputs take over microbatch 0's, in the callable's
        // own memory.
        let input = |c: usize, mb: usize| buffer(&l, c * m + mb, Role::Input);
        assert_eq!(plan.slot_of[input(0, 0)], plan.slot_of[input(0, 2)]);
        assert_eq!(o.place[input(0, 0)].0, Some(0));
        // The CLONE slabs of both callables share one slot: shared.
        assert!(o.shared_bytes > 0);
        assert!(o.shared_use.iter().all(|&u| u > 0));
    }

    #[test]
    fn random_schedules_split_by_owner() {
        for (s, n, first_input_grad) in random_schedules() {
            for policy in [GradPolicy::Clone, GradPolicy::Alias] {
                let (l, lt) = setup(&s, first_input_grad, policy);
                let plan = reuse(&l.buffers, &lt).unwrap();
                let m = s.microbatches;
                let users: Vec<Vec<usize>> =
                    l.buffers.iter().map(|b| vec![b.instance / m]).collect();
                let o = owned(&plan, &l.buffers, &users, n).unwrap();
                check_owned(&plan, &l.buffers, &users, &o);
            }
        }
    }
}
