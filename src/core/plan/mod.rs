//! Where the static buffers live. Without reuse every buffer has its own
//! memory. With reuse (a pipeline schedule only), buffers whose lifetimes
//! do not overlap share memory, one slot per signature (size), following
//! Transformer Engine's reuse rules, as `core::release` states them for
//! every buffer of a schedule's instances (a later microbatch's inputs take
//! over an earlier one's once its backward ran; grad-outputs, used only
//! inside their backward, share memory by signature); a parameter-grad slab
//! with an ALIAS slot is kept for the whole session.
//!
//! Lifetimes are in pass positions of the capture order (inclusive); the
//! plan is a pure function of them and the buffer sizes. `owned` then
//! splits the plan's memory by owner: each callable's slots that no other
//! callable uses in an allocation of its own, the others in one shared
//! allocation.

use super::layout::{BufferDesc, Layout, Role};
use super::policy::GradPolicy;
use super::release::Spans;
use super::schedule::Schedule;
use super::size;
use crate::error::Result;
use std::collections::HashMap;

/// The passes (inclusive) during which a buffer's contents matter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub start: usize,
    pub end: usize,
}

impl Lifetime {
    pub fn overlaps(&self, o: &Lifetime) -> bool {
        self.start <= o.end && o.start <= self.end
    }
}

/// Where each buffer lives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Offset of each buffer in the static allocation.
    pub offsets: Vec<usize>,
    /// Physical slot of each buffer: buffers sharing memory share a slot.
    pub slot_of: Vec<usize>,
    /// Size of the static allocation.
    pub total_bytes: usize,
    /// What it would be without reuse.
    pub disjoint_bytes: usize,
    /// Lower bound of any plan: the most bytes live at one pass.
    pub peak_live_bytes: usize,
}

const WHAT: &str = "the static buffers";

/// The memory a buffer takes: its size rounded up to the alignment.
fn size(b: &BufferDesc) -> Result<usize> {
    size::aligned(b.bytes.max(1), WHAT)
}

/// Every buffer in its own memory.
pub fn disjoint(buffers: &[BufferDesc]) -> Result<Plan> {
    let mut offsets = Vec::with_capacity(buffers.len());
    let mut total = 0usize;
    for b in buffers {
        offsets.push(total);
        total = size::add(total, size(b)?, WHAT)?;
    }
    Ok(Plan {
        offsets,
        slot_of: (0..buffers.len()).collect(),
        total_bytes: total,
        disjoint_bytes: total,
        peak_live_bytes: total,
    })
}

/// The lifetime of every buffer of `layout` under schedule `s`: the spans
/// of `core::release` (a span needed to the end of the session ends at the
/// last pass), except that a slab with an ALIAS slot is kept for the whole
/// session. `instance(callable, microbatch)` is the instance index of the
/// layout.
pub fn lifetimes(
    s: &Schedule,
    layout: &Layout,
    instance: impl Fn(usize, usize) -> usize,
) -> Vec<Lifetime> {
    let last = s.passes.len().saturating_sub(1);
    let spans = Spans::of(s);
    let mut owner = vec![(0, 0); layout.instances.len()];
    for p in &s.passes {
        owner[instance(p.callable, p.microbatch)] = (p.callable, p.microbatch);
    }
    // The lifetime of a buffer as used by instance `i` in `role`.
    let span = |i: usize, role: Role| {
        let aliased = || {
            layout.instances[i]
                .slab_layout
                .slots
                .iter()
                .flatten()
                .any(|s| s.policy == GradPolicy::Alias)
        };
        if role == Role::ParamGrads && aliased() {
            return Lifetime {
                start: 0,
                end: last,
            };
        }
        let (callable, microbatch) = owner[i];
        let sp = spans.get(callable, microbatch, role);
        Lifetime {
            start: sp.start,
            end: sp.end.unwrap_or(last),
        }
    };
    let mut out: Vec<Lifetime> = layout
        .buffers
        .iter()
        .map(|b| span(b.instance, b.role))
        .collect();
    // A chained buffer lives as long as any of its users needs it.
    for u in &layout.shared {
        let l = span(u.instance, u.role);
        let o = &mut out[u.buffer];
        o.start = o.start.min(l.start);
        o.end = o.end.max(l.end);
    }
    out
}

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

/// The most bytes live at any one pass (at most the disjoint total, so it
/// fits when that does; sums run in 128 bits).
pub fn peak_live(buffers: &[BufferDesc], lifetimes: &[Lifetime]) -> Result<usize> {
    let end = lifetimes.iter().map(|l| l.end + 1).max().unwrap_or(0);
    let mut delta = vec![0i128; end + 1];
    for (b, l) in buffers.iter().zip(lifetimes) {
        let sz = size(b)? as i128;
        delta[l.start] += sz;
        delta[l.end + 1] -= sz;
    }
    let (mut live, mut peak) = (0i128, 0i128);
    for d in delta {
        live += d;
        peak = peak.max(live);
    }
    usize::try_from(peak)
        .map_err(|_| crate::error::Error::OutOfMemory(format!("{WHAT} overflow the address space")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::layout::{layout, InstanceShape, ParamShape, TensorShape};
    use crate::core::schedule::tests::{te, TE_ORDER};
    use crate::core::schedule::{Pass, ScheduleStep};
    use crate::core::PassKind;

    const H: usize = 1024; // bytes of every activation in these tests

    /// A layout of `callables` x `mb` identical one-input one-output layers
    /// with one CLONE (or ALIAS) parameter, instance = callable * mb + m.
    fn setup(s: &Schedule, first_input_grad: bool, policy: GradPolicy) -> (Layout, Vec<Lifetime>) {
        let callables = s.layers_per_chunk.iter().sum::<usize>();
        let shapes: Vec<InstanceShape> = (0..callables * s.microbatches)
            .map(|i| InstanceShape {
                inputs: vec![TensorShape {
                    bytes: H,
                    requires_grad: first_input_grad || i >= s.microbatches,
                    external: false,
                    chained: None,
                }],
                outputs: vec![TensorShape {
                    bytes: H,
                    requires_grad: true,
                    external: false,
                    chained: None,
                }],
                params: vec![Some(ParamShape {
                    bytes: 4 * H,
                    policy,
                    external: false,
                })],
            })
            .collect();
        let l = layout(&shapes).unwrap();
        let m = s.microbatches;
        let lt = lifetimes(s, &l, |c, mb| c * m + mb);
        (l, lt)
    }

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
    fn te_scenario_lifetimes_and_assignments() {
        let s = Schedule::derive(&te(&TE_ORDER), None, &[false, false]).unwrap();
        let (l, lt) = setup(&s, false, GradPolicy::Clone);
        // Pass positions: F00 F10 F01 F11 B10 B00 F02 F12 B11 B01 B12 B02
        //                  0   1   2   3   4   5   6   7   8   9  10  11
        let find = |inst: usize, role: Role| {
            let i = l
                .buffers
                .iter()
                .position(|b| b.instance == inst && b.role == role)
                .unwrap();
            (i, lt[i])
        };
        let inst = |c: usize, m: usize| c * 3 + m;
        assert_eq!(
            find(inst(0, 0), Role::Input).1,
            Lifetime { start: 0, end: 5 }
        );
        assert_eq!(
            find(inst(1, 2), Role::Output).1,
            Lifetime { start: 7, end: 10 }
        );
        assert_eq!(
            find(inst(1, 0), Role::GradOutput).1,
            Lifetime { start: 4, end: 4 }
        );
        // The grad-input of chunk 1 (first layer) lives until chunk 0 took it.
        assert_eq!(
            find(inst(1, 0), Role::GradInput).1,
            Lifetime { start: 4, end: 5 }
        );
        assert_eq!(
            find(inst(1, 1), Role::ParamGrads).1,
            Lifetime { start: 8, end: 8 }
        );
        let plan = reuse(&l.buffers, &lt).unwrap();
        check_no_overlap(&l.buffers, &lt, &plan);
        // Microbatch 2's inputs take over microbatch 0's once its backward ran.
        let (a, _) = find(inst(0, 0), Role::Input);
        let (b, _) = find(inst(0, 2), Role::Input);
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
        let s = Schedule::derive(
            &te(&[
                1.0, 2.0, 3.0, 1.0, 2.0, 3.0, -3.0, -2.0, -1.0, -3.0, -2.0, -1.0,
            ]),
            Some(&[1, 2, 1]),
            &[false; 4],
        )
        .unwrap();
        let (l, lt) = setup(&s, true, GradPolicy::Clone);
        let plan = reuse(&l.buffers, &lt).unwrap();
        check_no_overlap(&l.buffers, &lt, &plan);
        assert!(plan.total_bytes < plan.disjoint_bytes);
        assert!(plan.peak_live_bytes <= plan.total_bytes);
        // The grad-input of chunk 2 (callable 3) for microbatch 0 lives until
        // callable 2 (last layer of chunk 1) took it and the next backward
        // step (chunk 1's, which ends with callable 1) has run.
        let gin = (0..l.buffers.len())
            .find(|&i| l.buffers[i].role == Role::GradInput && l.buffers[i].instance == 3 * 2)
            .unwrap();
        let bwd = |c: usize| {
            s.passes
                .iter()
                .position(|p| p.callable == c && p.microbatch == 0 && p.kind == PassKind::Backward)
                .unwrap()
        };
        assert!(bwd(2) < bwd(1));
        assert_eq!(lt[gin].end, bwd(1));
    }

    /// Random valid interleaved schedules: chunks run in order per
    /// microbatch, forwards lead backwards by a random amount.
    fn random_schedule(seed: &mut u64) -> (Vec<ScheduleStep>, usize, usize) {
        let mut rnd = |n: usize| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 33) as usize) % n
        };
        let chunks = 1 + rnd(3);
        let mb = 1 + rnd(4);
        // Per microbatch a sequence F0..F(c-1), B(c-1)..B0; interleave the
        // microbatches' sequences randomly, keeping microbatch order per step kind.
        let mut next = vec![0usize; mb];
        let seq: Vec<ScheduleStep> = (0..chunks)
            .map(|c| ScheduleStep {
                kind: PassKind::Forward,
                chunk: c as u32,
            })
            .chain((0..chunks).rev().map(|c| ScheduleStep {
                kind: PassKind::Backward,
                chunk: c as u32,
            }))
            .collect();
        let mut steps = Vec::new();
        let mut started = 0;
        while steps.len() < 2 * chunks * mb {
            // Candidates: the earliest unfinished microbatch (keeps per-chunk
            // microbatch order) or the next one to start.
            let mut cands: Vec<usize> = (0..started)
                .filter(|&m| next[m] < seq.len())
                .take(1)
                .collect();
            if started < mb {
                cands.push(started);
            }
            let m = cands[rnd(cands.len())];
            if m == started {
                started += 1;
            }
            steps.push(seq[next[m]]);
            next[m] += 1;
        }
        (steps, chunks, mb)
    }

    #[test]
    fn random_schedules_never_share_live_memory() {
        let mut seed = 42u64;
        for _ in 0..300 {
            let (steps, chunks, _) = random_schedule(&mut seed);
            let layers: Vec<u32> = (0..chunks)
                .map(|c| 1 + (c as u32 + seed as u32) % 3)
                .collect();
            let n: usize = layers.iter().map(|&x| x as usize).sum();
            let s = match Schedule::derive(&steps, Some(&layers), &vec![false; n]) {
                Ok(s) => s,
                Err(e) => panic!("generated an invalid schedule {steps:?}: {e}"),
            };
            for policy in [GradPolicy::Clone, GradPolicy::Alias] {
                let (l, lt) = setup(&s, (seed & 1) == 0, policy);
                let plan = reuse(&l.buffers, &lt).unwrap();
                check_no_overlap(&l.buffers, &lt, &plan);
                check_optimal(&l.buffers, &lt, &plan);
                assert!(plan.peak_live_bytes <= plan.total_bytes);
                assert!(plan.total_bytes <= plan.disjoint_bytes);
                // Every buffer is used inside its lifetime's passes.
                for (b, t) in l.buffers.iter().zip(&lt) {
                    assert!(t.start <= t.end, "{b:?} {t:?}");
                }
                if policy == GradPolicy::Clone {
                    check_ends_where_released(&s, &l, &lt);
                }
                let m = s.microbatches;
                let users: Vec<Vec<usize>> =
                    l.buffers.iter().map(|b| vec![b.instance / m]).collect();
                let o = owned(&plan, &l.buffers, &users, n).unwrap();
                check_owned(&plan, &l.buffers, &users, &o);
            }
        }
    }

    /// Outputs, grad-inputs and copied-out slabs end where the releases a
    /// caller gets say (the last pass when none is released).
    fn check_ends_where_released(s: &Schedule, l: &Layout, lt: &[Lifetime]) {
        let releases = Spans::of(s).releases();
        let last = s.passes.len() - 1;
        for (b, t) in l.buffers.iter().zip(lt) {
            if matches!(b.role, Role::Input | Role::GradOutput) {
                continue;
            }
            let (c, m) = (b.instance / s.microbatches, b.instance % s.microbatches);
            let r = releases
                .iter()
                .find(|r| (r.callable, r.microbatch, r.role) == (c, m, b.role));
            assert_eq!(r.map_or(last, |r| r.after), t.end, "{b:?}");
        }
    }

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
        let input = |c: usize, mb: usize| {
            (0..l.buffers.len())
                .find(|&i| l.buffers[i].instance == c * m + mb && l.buffers[i].role == Role::Input)
                .unwrap()
        };
        assert_eq!(plan.slot_of[input(0, 0)], plan.slot_of[input(0, 2)]);
        assert_eq!(o.place[input(0, 0)].0, Some(0));
        // The CLONE slabs of both callables share one slot: shared.
        assert!(o.shared_bytes > 0);
        assert!(o.shared_use.iter().all(|&u| u > 0));
    }

    #[test]
    fn disjoint_plan_gives_every_buffer_its_own_memory() {
        let bufs: Vec<BufferDesc> = (0..5)
            .map(|i| BufferDesc {
                instance: 0,
                role: Role::Input,
                index: i,
                bytes: 100 * (i + 1),
            })
            .collect();
        let p = disjoint(&bufs).unwrap();
        assert_eq!(p.slot_of, vec![0, 1, 2, 3, 4]);
        assert_eq!(p.total_bytes, 256 + 256 + 512 + 512 + 512);
        let _ = Pass {
            callable: 0,
            microbatch: 0,
            kind: PassKind::Forward,
        };
    }
}
