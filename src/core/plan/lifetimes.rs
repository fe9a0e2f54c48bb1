//! How long each static buffer of a schedule is needed: the spans of
//! `core::release`, in pass positions of the capture order, with a slab
//! that has an ALIAS slot kept for the whole session and a chained buffer
//! living as long as any of its users needs it; and the most bytes live at
//! one pass, the lower bound of any plan.

use super::{size, Lifetime, WHAT};
use crate::core::layout::{BufferDesc, Layout, Role};
use crate::core::policy::GradPolicy;
use crate::core::release::Spans;
use crate::core::schedule::Schedule;
use crate::error::Result;

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
    use super::super::tests::{buffer, random_schedules, setup, three_chunks};
    use super::*;
    use crate::core::schedule::tests::{te, TE_ORDER};
    use crate::core::PassKind;

    #[test]
    fn te_scenario_lifetimes() {
        let s = Schedule::derive(&te(&TE_ORDER), None, &[false, false]).unwrap();
        let (l, lt) = setup(&s, false, GradPolicy::Clone);
        // Pass positions: F00 F10 F01 F11 B10 B00 F02 F12 B11 B01 B12 B02
        //                  0   1   2   3   4   5   6   7   8   9  10  11
        let find = |inst: usize, role: Role| lt[buffer(&l, inst, role)];
        let inst = |c: usize, m: usize| c * 3 + m;
        assert_eq!(find(inst(0, 0), Role::Input), Lifetime { start: 0, end: 5 });
        assert_eq!(
            find(inst(1, 2), Role::Output),
            Lifetime { start: 7, end: 10 }
        );
        assert_eq!(
            find(inst(1, 0), Role::GradOutput),
            Lifetime { start: 4, end: 4 }
        );
        // The grad-input of chunk 1 (first layer) lives until chunk 0 took it.
        assert_eq!(
            find(inst(1, 0), Role::GradInput),
            Lifetime { start: 4, end: 5 }
        );
        assert_eq!(
            find(inst(1, 1), Role::ParamGrads),
            Lifetime { start: 8, end: 8 }
        );
    }

    #[test]
    fn three_chunk_grad_input_lives_until_taken() {
        let s = three_chunks();
        let (l, lt) = setup(&s, true, GradPolicy::Clone);
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

    #[test]
    fn random_schedules_end_where_released() {
        for (s, _, first_input_grad) in random_schedules() {
            let (l, lt) = setup(&s, first_input_grad, GradPolicy::Clone);
            // Every buffer is used inside its lifetime's passes.
            for (b, t) in l.buffers.iter().zip(&lt) {
                assert!(t.start <= t.end, "{b:?} {t:?}");
            }
            check_ends_where_released(&s, &l, &lt);
            // ALIAS slabs too have well-formed lifetimes.
            let (l, lt) = setup(&s, first_input_grad, GradPolicy::Alias);
            for (b, t) in l.buffers.iter().zip(&lt) {
                assert!(t.start <= t.end, "{b:?} {t:?}");
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
}
