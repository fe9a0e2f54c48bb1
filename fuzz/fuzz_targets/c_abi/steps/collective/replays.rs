//! Fuzzed replays of the collective step, checked against the model: the
//! grad summed over the microbatches run, doubled once per collective.

use super::super::*;
use super::callbacks::*;
use crate::moves::empty_ref;

/// Fuzzed replays of step 0: the grad summed over the microbatches run,
/// doubled once per collective recorded.
pub(super) fn replays(
    h: *mut graphed_session,
    u: &mut Coll,
    mbs: usize,
    looping: bool,
    policy: graphed_grad_policy,
    doublings: usize,
) {
    let i = &w().input;
    let what = "a step's collective replay";
    for it in 0..1 + i.below(3) {
        for k in 0..2 * N * mbs {
            u.xg[k] = (i.below(17) as f32 - 8.0) * 0.25;
        }
        let count = if looping { i.below(mbs + 2) } else { 0 };
        let want = if count > mbs {
            S::InvalidArgument
        } else {
            S::Ok
        };
        let mut a = graphed_step_args_default();
        a.microbatches = count as u32;
        let mut r = [empty_ref()];
        // SAFETY: valid args and room for a ref.
        let st = unsafe { graphed_step_replay(h, &a, r.as_mut_ptr(), 1) };
        expect(st, &[want], "graphed_step_replay", what);
        trace!("  collective: replay of {count} (of {mbs}): {st:?}");
        if st != S::Ok {
            continue;
        }
        let n = if count == 0 { mbs } else { count };
        let grad = |mb: usize, k: usize| u.xg[2 * N * mb + k] * u.xg[2 * N * mb + N + k];
        let want: Vec<f32> = (0..N)
            .map(|k| {
                let s = (1..n).fold(grad(0, k), |s, mb| s + grad(mb, k));
                (0..doublings).fold(s, |v, _| v * 2.0)
            })
            .collect();
        let got: Vec<f32> = if policy == graphed_grad_policy::Clone {
            assert_eq!(r[0].kind, graphed_ref_kind::Clone as u32, "iteration {it}");
            // SAFETY: the clone holds N floats until it is released.
            let g = unsafe { std::slice::from_raw_parts(r[0].ptr as *const f32, N) }.to_vec();
            expect(
                graphed_buffer_release(r[0].owner),
                &[S::Ok],
                "graphed_buffer_release",
                what,
            );
            g
        } else {
            u.dst.to_vec()
        };
        let same = got
            .iter()
            .zip(&want)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "iteration {it}, {n} microbatches, {doublings} collectives: {got:?} vs {want:?}"
        );
    }
}
