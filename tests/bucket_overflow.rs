//! A size above the largest bucket, chosen on the device, through the C ABI
//! on the host backend: the device cannot refuse it, so none of the
//! callable's bucket graphs runs and the pass writes zeros where it would
//! have written its results: the outputs of a forward, the input grads of
//! a backward and the parameter grads of the pass that writes them (CLONE
//! grads are zeros, COPY_INTO destinations get zeros, ACCUMULATE_INTO
//! destinations get zeros added). Each such pass is counted in
//! `graphed_session_stats.bucket_overflows`, and the session goes on.
//!
//! The layer is over rows of 4 floats, buckets of 2 and 4 rows: forward
//! `y[r] = x[r] * w0`, backward `gx[r] = gy[r] * w0` and, for every
//! parameter j, `gw_j = (j + 1) * sum_r x[r] * gy[r]` (in the weight-grad
//! pass where there is one), enqueued as host tasks over the bucket's rows.

use graphed::ffi::*;
use std::ffi::c_void;
use std::ptr::null_mut;

use graphed_status as S;

mod common;
use common::{empty_ref, layer_desc, msg, ok, stats};

const COLS: usize = 4;
const ROWS: usize = 4;
const ALL: usize = ROWS * COLS;
const PARAMS: usize = 3;

/// One pass's work over `rows` rows.
struct Work {
    rows: usize,
    x: *const f32,
    w: *const f32,
    /// The forward's output or the backward's input grad (NULL: none).
    out: *mut f32,
    /// What is multiplied by the weight: x (forward), gy (backward).
    by: *const f32,
    /// The parameter grads to write (empty: none), and the grad-output.
    grads: Vec<*mut f32>,
    gy: *const f32,
}

unsafe extern "C" fn run(data: *mut c_void) {
    // SAFETY: a leaked Work whose buffers hold the largest bucket's rows
    // (the parameters and their grads COLS floats) while the session's
    // graphs exist.
    unsafe {
        let k = &*(data as *const Work);
        if !k.out.is_null() {
            for i in 0..k.rows * COLS {
                *k.out.add(i) = *k.by.add(i) * *k.w.add(i % COLS);
            }
        }
        for (j, &g) in k.grads.iter().enumerate() {
            for c in 0..COLS {
                let sum: f32 = (0..k.rows)
                    .map(|r| *k.x.add(r * COLS + c) * *k.gy.add(r * COLS + c))
                    .sum();
                *g.add(c) = (j + 1) as f32 * sum;
            }
        }
    }
}

/// The pointer at `i` of a pass context's array (NULL past its end or
/// where the array is NULL).
///
/// # Safety
/// `p` is NULL or holds more than `i` pointers.
unsafe fn at(p: *const *mut c_void, i: usize) -> *mut f32 {
    if p.is_null() {
        return null_mut();
    }
    // SAFETY: the caller's promise.
    unsafe { *p.add(i) as *mut f32 }
}

unsafe extern "C" fn pass(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: the context and its arrays are valid during the call.
    unsafe {
        let c = &*ctx;
        let fwd = c.pass == graphed_pass::Forward as u32;
        let wgrad = c.pass == graphed_pass::Wgrad as u32;
        let grads: Vec<*mut f32> = if fwd {
            Vec::new()
        } else {
            (0..c.num_params)
                .map(|j| at(c.param_grads, j))
                .filter(|g| !g.is_null())
                .collect()
        };
        let work = Work {
            rows: c.bucket_size as usize,
            x: at(c.inputs, 0),
            w: at(c.params, 0),
            out: match (fwd, wgrad) {
                (true, _) => at(c.outputs, 0),
                (false, false) => at(c.grad_inputs, 0),
                (false, true) => null_mut(),
            },
            by: if fwd {
                at(c.inputs, 0)
            } else {
                at(c.grad_outputs, 0)
            },
            grads,
            gy: at(c.grad_outputs, 0),
        };
        let p = Box::into_raw(Box::new(work));
        graphed_host_enqueue(c.stream, Some(run), p.cast()) as i32
    }
}

fn leak(v: Vec<f32>) -> *mut f32 {
    Box::leak(v.into_boxed_slice()).as_mut_ptr()
}

fn read(p: *const c_void, n: usize) -> Vec<f32> {
    // SAFETY: n floats of a buffer the test or the session owns.
    unsafe { std::slice::from_raw_parts(p as *const f32, n) }.to_vec()
}

struct Layer {
    s: *mut graphed_session,
    /// COPY_INTO and ACCUMULATE_INTO destinations of params 1 and 2.
    dsts: [*mut f32; 2],
    wgrad: bool,
    size: Box<u64>,
}

/// A session choosing buckets on the device, of one layer with params
/// CLONE, COPY_INTO and ACCUMULATE_INTO, `clone_slots` slots, and a
/// weight-grad pass when `wgrad`.
fn layer(clone_slots: u32, wgrad: bool) -> Layer {
    let mut cfg = graphed_session_config_default();
    cfg.backend = graphed_backend::Host as u32;
    cfg.warmup_iterations = 1;
    cfg.clone_slots = clone_slots;
    cfg.bucket_choice_on_device = 1;
    let mut s = null_mut();
    // SAFETY: a valid config and out pointer.
    ok(unsafe { graphed_session_create(&cfg, &mut s) });
    let shape = [ROWS as i64, COLS as i64];
    let t = graphed_tensor_desc {
        bytes: ALL * 4,
        requires_grad: 1,
        ndim: 2,
        shape: shape.as_ptr(),
        flags: graphed_tensor_flags::Dynamic as u32,
        ..graphed_tensor_desc_default()
    };
    use graphed_grad_policy as P;
    let p: Vec<graphed_param_desc> = [P::Clone, P::CopyInto, P::AccumulateInto]
        .iter()
        .enumerate()
        .map(|(j, &policy)| graphed_param_desc {
            data: leak(vec![0.5 + j as f32; COLS]).cast(),
            bytes: COLS * 4,
            policy: policy as u32,
            ..graphed_param_desc_default()
        })
        .collect();
    let buckets = [2u64, ROWS as u64];
    let mut d = layer_desc(&t, &t, &p, Some(pass), Some(pass));
    d.bucket_sizes = buckets.as_ptr();
    d.num_buckets = 2;
    if wgrad {
        d.wgrad = Some(pass);
    }
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    ok(graphed_session_capture(s));
    Layer {
        s,
        dsts: [leak(vec![7.0; COLS]), leak(vec![7.0; COLS])],
        wgrad,
        size: Box::new(0),
    }
}

/// What one iteration returns: the output, the input grad, the CLONE grad
/// and the two destinations after it.
#[derive(Debug, PartialEq)]
struct Got {
    y: Vec<f32>,
    gx: Vec<f32>,
    clone: Vec<f32>,
    dsts: [Vec<f32>; 2],
}

impl Layer {
    /// A forward and a backward (and weight-grad) at `size` rows chosen on
    /// the device, on inputs `x` and grad-outputs `gy` (the largest
    /// bucket's rows).
    fn iteration(&mut self, size: u64, x: &[f32], gy: &[f32]) -> Got {
        *self.size = size;
        let data = [x.as_ptr() as *const c_void];
        let mut a = graphed_replay_args_default();
        a.data = data.as_ptr();
        a.num_data = 1;
        a.device_size = &*self.size;
        let mut y = empty_ref();
        // SAFETY: valid args and room for one ref.
        ok(unsafe { graphed_forward(self.s, &a, &mut y, 1) });
        assert_eq!(y.bytes, ALL * 4, "the largest bucket's rows");
        let y = read(y.ptr, ALL);
        let data = [gy.as_ptr() as *const c_void];
        let dsts = [null_mut(), self.dsts[0], self.dsts[1]];
        let mut a = graphed_replay_args_default();
        a.data = data.as_ptr();
        a.num_data = 1;
        a.param_dsts = dsts.as_ptr().cast();
        a.num_param_dsts = PARAMS;
        let mut gi = [empty_ref()];
        let mut gp = [empty_ref(); PARAMS];
        // SAFETY: valid args and room for the stated refs.
        ok(unsafe { graphed_backward(self.s, &a, gi.as_mut_ptr(), 1, gp.as_mut_ptr(), PARAMS) });
        let gx = read(gi[0].ptr, ALL);
        if self.wgrad {
            assert!(
                gp.iter().all(|r| r.ptr.is_null()),
                "the weight-grad pass returns them"
            );
            let mut a = graphed_replay_args_default();
            a.param_dsts = dsts.as_ptr().cast();
            a.num_param_dsts = PARAMS;
            // SAFETY: valid args and room for the stated refs.
            ok(unsafe { graphed_backward_wgrad(self.s, &a, gp.as_mut_ptr(), PARAMS) });
        }
        assert_eq!(gp[0].kind, graphed_ref_kind::Clone as u32);
        let clone = read(gp[0].ptr, COLS);
        ok(graphed_buffer_release(gp[0].owner));
        Got {
            y,
            gx,
            clone,
            dsts: [
                read(self.dsts[0].cast(), COLS),
                read(self.dsts[1].cast(), COLS),
            ],
        }
    }
}

fn values(seed: f32) -> Vec<f32> {
    (0..ALL).map(|i| seed + i as f32 * 0.25).collect()
}

fn check(clone_slots: u32, wgrad: bool) {
    let mut l = layer(clone_slots, wgrad);
    let (x, gy) = (values(1.0), values(-2.1));
    let before = l.iteration(3, &x, &gy);
    assert!(
        before.y[..12]
            .iter()
            .chain(&before.gx[..12])
            .chain(&before.clone)
            .all(|&v| v != 0.0),
        "results worth comparing: {before:?}"
    );
    assert_eq!(stats(l.s).bucket_overflows, 0);
    let acc_before = read(l.dsts[1].cast(), COLS);
    let over = l.iteration(ROWS as u64 + 1, &values(3.0), &values(5.0));
    let zeros = vec![0.0f32; ALL];
    assert_eq!(over.y, zeros, "the outputs of a pass above every bucket");
    assert_eq!(over.gx, zeros, "the input grads");
    assert_eq!(over.clone, zeros[..COLS], "a CLONE grad");
    assert_eq!(over.dsts[0], zeros[..COLS], "a COPY_INTO destination");
    assert_eq!(
        over.dsts[1], acc_before,
        "an ACCUMULATE_INTO destination adds nothing"
    );
    // Forward, backward (and weight-grad): each pass counted once.
    let passes = if wgrad { 3 } else { 2 };
    assert_eq!(stats(l.s).bucket_overflows, passes, "{}", msg());
    // The session goes on: the same iteration as before gives the same.
    let again = l.iteration(3, &x, &gy);
    assert_eq!(
        (&again.y, &again.gx, &again.clone),
        (&before.y, &before.gx, &before.clone)
    );
    assert_eq!(again.dsts[0], before.dsts[0]);
    assert_eq!(stats(l.s).bucket_overflows, passes);
    ok(graphed_session_destroy(l.s));
    assert_eq!(graphed_session_destroy(l.s), S::UseAfterDestroy);
}

#[test]
fn a_size_above_every_bucket_writes_zeros_copied_from_the_slab() {
    check(0, false);
}

#[test]
fn a_size_above_every_bucket_writes_zeros_in_a_clone_slot() {
    check(2, false);
}

#[test]
fn a_size_above_every_bucket_writes_zeros_in_the_weight_grad_pass() {
    check(2, true);
    check(0, true);
}
