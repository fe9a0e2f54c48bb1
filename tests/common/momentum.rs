//! SGD with momentum over f32, the reference arithmetic of the step
//! update's tests: the kernels their update callbacks record and the eager
//! model the replays are compared against, bit for bit. Shared by the
//! integration tests (tests/common) and the fuzz target's update op
//! (fuzz/fuzz_targets/c_abi/steps/update.rs includes this file by path),
//! so it uses nothing but core.

/// One step over `w`, `m` and `g` (`w` and `m` as long as `g`):
/// `m = mu * m + g`, then `w -= lr * m`.
pub fn sgd(w: &mut [f32], m: &mut [f32], g: &[f32], lr: f32, mu: f32) {
    assert!(w.len() == g.len() && m.len() == g.len());
    for ((w, m), g) in w.iter_mut().zip(m.iter_mut()).zip(g) {
        *m = mu * *m + *g;
        *w -= lr * *m;
    }
}
