//! Buckets on another dimension than the first, and grids of two, through
//! the C ABI on the host backend (issue 40): a per-token linear layer over
//! [B, T, H] with buckets on T (`dynamic_dim` 1), and on B and T at once
//! (`bucket_sizes2`, `dynamic_dim2`), gives every output, input grad and
//! parameter grad of an eager run on the actual sizes bit for bit; outputs
//! and input grads come back as rows of a pitch (`graphed_ref.rows`,
//! `row_bytes`, `pitch`). The masking contract: a causal layer needs
//! nothing (padding at the end reaches no earlier position); a mean over T
//! differs unless the lengths come in as an ordinary input. And the
//! refusals of what is not supported.

use graphed::ffi::*;
use std::ffi::c_void;
use std::ptr::null_mut;

mod common;
use common::{create, empty_ref, host_config, layer_desc, msg, ok};

const H: usize = 3;
const B: usize = 2;
const T: usize = 8;

/// What a layer computes over [b, t, H] rows (`y` [b, H] for a mean).
#[derive(Clone, Copy, PartialEq)]
enum Op {
    /// y[i] = x[i] W for every row i; gW = sum_i x[i]^T gy[i].
    Linear,
    /// y[b, t] = (sum_{s <= t} x[b, s]) W / (t + 1).
    Causal,
    /// y[b] = (sum_{t < T} x[b, t]) W / T over the bucket's T (wrong).
    MeanOfBucket,
    /// y[b] = (sum_{t < len[b]} x[b, t]) W / len[b], len input 1 (right).
    MeanOfLengths,
}

/// How a pass learns its [b, t]: from the bucket (ctx sizes).
#[derive(Clone, Copy)]
struct Layer {
    op: Op,
    /// A grid: (bucket_size, bucket_size2) is (b, t); else b is B and t
    /// the bucket's size.
    grid: bool,
}

/// One pass's work, run by the host stream (recorded once per bucket's
/// capture, run again by every replay).
struct Work {
    op: Op,
    fwd: bool,
    dims: (usize, usize),
    x: *const f32,
    len: *const f32,
    w: *const f32,
    y: *mut f32,
    gy: *const f32,
    gx: *mut f32,
    gw: *mut f32,
}

/// The rows a mean or a causal sum reads for output row (b, t): (start,
/// count, divisor).
fn window(
    op: Op,
    (_, tt): (usize, usize),
    b: usize,
    t: usize,
    len: &dyn Fn(usize) -> usize,
) -> (usize, usize, f32) {
    match op {
        Op::Linear => (b * tt + t, 1, 1.0),
        Op::Causal => (b * tt, t + 1, (t + 1) as f32),
        Op::MeanOfBucket => (b * tt, tt, tt as f32),
        Op::MeanOfLengths => (b * tt, len(b), len(b) as f32),
    }
}

/// The reference: forward (y) and backward (gx, gw) of `op` over
/// contiguous [b, t, H] data, in the same order of operations as the
/// layer's tasks.
unsafe fn compute(k: &Work) {
    let (bb, tt) = k.dims;
    // SAFETY (all reads and writes): buffers of the bucket's sizes, as
    // the pass was given them.
    unsafe {
        let len = |b: usize| *k.len.add(b) as usize;
        let out_rows: Vec<(usize, usize)> = match k.op {
            Op::Linear | Op::Causal => (0..bb).flat_map(|b| (0..tt).map(move |t| (b, t))).collect(),
            _ => (0..bb).map(|b| (b, 0)).collect(),
        };
        if k.fwd {
            for (o, &(b, t)) in out_rows.iter().enumerate() {
                let (start, count, div) = window(k.op, k.dims, b, t, &len);
                for j in 0..H {
                    let mut acc = 0.0f32;
                    for kk in 0..H {
                        let mut sum = 0.0f32;
                        for r in start..start + count {
                            sum += *k.x.add(r * H + kk);
                        }
                        acc += sum / div * *k.w.add(kk * H + j);
                    }
                    *k.y.add(o * H + j) = acc;
                }
            }
            return;
        }
        // Backward: gx[r] = sum over the outputs reading r of gy[o] W^T /
        // div; gW[kk][j] = sum_o (mean of x over o's window)[kk] gy[o][j].
        for r in 0..bb * tt * H {
            *k.gx.add(r) = 0.0;
        }
        for kk in 0..H {
            for j in 0..H {
                *k.gw.add(kk * H + j) = 0.0;
            }
        }
        for (o, &(b, t)) in out_rows.iter().enumerate() {
            let (start, count, div) = window(k.op, k.dims, b, t, &len);
            for kk in 0..H {
                let mut g = 0.0f32;
                for j in 0..H {
                    g += *k.gy.add(o * H + j) * *k.w.add(kk * H + j);
                }
                let mut sum = 0.0f32;
                for r in start..start + count {
                    *k.gx.add(r * H + kk) += g / div;
                    sum += *k.x.add(r * H + kk);
                }
                for j in 0..H {
                    *k.gw.add(kk * H + j) += sum / div * *k.gy.add(o * H + j);
                }
            }
        }
    }
}

unsafe extern "C" fn run(data: *mut c_void) {
    // SAFETY: a leaked Work whose buffers live as long as the session.
    unsafe { compute(&*(data as *const Work)) }
}

unsafe fn at(p: *const *mut c_void, i: usize) -> *mut f32 {
    if p.is_null() {
        return null_mut();
    }
    // SAFETY: the context's arrays hold the stated counts.
    unsafe { *p.add(i) as *mut f32 }
}

unsafe extern "C" fn pass(ctx: *const graphed_pass_ctx, data: *mut c_void) -> i32 {
    // SAFETY: the context is valid during the call; `data` a leaked Layer.
    unsafe {
        let c = &*ctx;
        let l = &*(data as *const Layer);
        let dims = match l.grid {
            true => (c.bucket_size as usize, c.bucket_size2 as usize),
            false => (B, c.bucket_size as usize),
        };
        let fwd = c.pass == graphed_pass::Forward as u32;
        let work = Work {
            op: l.op,
            fwd,
            dims,
            x: at(c.inputs, 0),
            len: if c.num_inputs > 1 {
                at(c.inputs, 1)
            } else {
                null_mut()
            },
            w: at(c.params, 0),
            y: at(c.outputs, 0),
            gy: at(c.grad_outputs, 0),
            gx: if fwd {
                null_mut()
            } else {
                at(c.grad_inputs, 0)
            },
            gw: if fwd {
                null_mut()
            } else {
                at(c.param_grads, 0)
            },
        };
        let p = Box::into_raw(Box::new(work));
        graphed_host_enqueue(c.stream, Some(run), p.cast()) as i32
    }
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| seed + ((i * 7 + 3) % 11) as f32 * 0.37 - 1.5)
        .collect()
}

/// The eager run of `op` on the actual sizes: (y, gx, gw).
fn eager(
    op: Op,
    dims: (usize, usize),
    x: &[f32],
    len: &[f32],
    w: &[f32],
    gy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = match op {
        Op::Linear | Op::Causal => dims.0 * dims.1,
        _ => dims.0,
    };
    let mut y = vec![0.0; rows * H];
    let mut gx = vec![0.0; x.len()];
    let mut gw = vec![0.0; H * H];
    let mut k = Work {
        op,
        fwd: true,
        dims,
        x: x.as_ptr(),
        len: len.as_ptr(),
        w: w.as_ptr(),
        y: y.as_mut_ptr(),
        gy: gy.as_ptr(),
        gx: gx.as_mut_ptr(),
        gw: gw.as_mut_ptr(),
    };
    // SAFETY: buffers of the stated sizes.
    unsafe { compute(&k) };
    k.fwd = false;
    // SAFETY: as above.
    unsafe { compute(&k) };
    (y, gx, gw)
}

/// Reads a ref's data as contiguous floats (its rows, packed).
fn packed(r: &graphed_ref) -> Vec<f32> {
    let mut out = Vec::new();
    for i in 0..r.rows {
        // SAFETY: a live ref: `rows` blocks of `row_bytes` every `pitch`.
        let row = unsafe {
            std::slice::from_raw_parts(
                (r.ptr as *const u8).add(i * r.pitch) as *const f32,
                r.row_bytes / 4,
            )
        };
        out.extend_from_slice(row);
    }
    assert_eq!(r.rows * r.row_bytes, r.bytes, "the blocks hold the bytes");
    out
}

struct Session {
    s: *mut graphed_session,
    w: Vec<f32>,
    grid: bool,
}

/// A session of one layer: x [B or b, T or t, H] DYNAMIC on T (and B in a
/// grid), optionally a lengths input [B] (not DYNAMIC, or DYNAMIC on
/// dimension 0 in a grid), output [.., T, H] or [B, H].
fn session(op: Op, buckets: &[u64], grid: Option<&[u64]>) -> Session {
    let mut cfg = host_config();
    cfg.warmup_iterations = 1;
    let s = create(&cfg);
    let bmax = grid.map_or(B, |g| *g.last().unwrap() as usize);
    let tmax = *buckets.last().unwrap() as usize;
    // A grid's first size is B (dimension 0), its second T (dimension 1).
    let (xs, sizes, sizes2) = match grid {
        Some(g) => ([bmax as i64, tmax as i64, H as i64], g, Some(buckets)),
        None => ([B as i64, tmax as i64, H as i64], buckets, None),
    };
    let mut x = graphed_tensor_desc {
        bytes: bmax * tmax * H * 4,
        requires_grad: 1,
        ndim: 3,
        shape: xs.as_ptr(),
        flags: graphed_tensor_flags::Dynamic as u32,
        ..graphed_tensor_desc_default()
    };
    match grid {
        Some(_) => x.dynamic_dim2 = 1,
        None => x.dynamic_dim = 1,
    }
    let ls = [bmax as i64];
    let len = graphed_tensor_desc {
        bytes: bmax * 4,
        ndim: 1,
        shape: ls.as_ptr(),
        flags: if grid.is_some() {
            graphed_tensor_flags::Dynamic as u32
        } else {
            0
        },
        ..graphed_tensor_desc_default()
    };
    let mean = matches!(op, Op::MeanOfBucket | Op::MeanOfLengths);
    let ys = [bmax as i64, H as i64];
    let y = match mean {
        true => graphed_tensor_desc {
            bytes: bmax * H * 4,
            requires_grad: 1,
            ndim: 2,
            shape: ys.as_ptr(),
            flags: if grid.is_some() {
                graphed_tensor_flags::Dynamic as u32
            } else {
                0
            },
            ..graphed_tensor_desc_default()
        },
        false => x,
    };
    let w = values(H * H, 0.25);
    let params = [graphed_param_desc {
        data: w.as_ptr() as *mut c_void,
        bytes: H * H * 4,
        ..graphed_param_desc_default()
    }];
    let inputs = [x, len];
    let mut d = layer_desc(&x, &y, &params, Some(pass), Some(pass));
    d.inputs = inputs.as_ptr();
    d.num_inputs = if op == Op::MeanOfLengths { 2 } else { 1 };
    d.bucket_sizes = sizes.as_ptr();
    d.num_buckets = sizes.len();
    if let Some(b2) = sizes2 {
        d.bucket_sizes2 = b2.as_ptr();
        d.num_buckets2 = b2.len();
    }
    d.user_data = Box::into_raw(Box::new(Layer {
        op,
        grid: grid.is_some(),
    }))
    .cast();
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    ok(graphed_session_capture(s));
    Session {
        s,
        w,
        grid: grid.is_some(),
    }
}

/// What a replay of (b, t) gives: y, gx, gw (packed), and the refs.
fn replay(
    l: &Session,
    op: Op,
    (b, t): (usize, usize),
    x: &[f32],
    len: &[f32],
    gy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, graphed_ref, graphed_ref) {
    let data = [x.as_ptr() as *const c_void, len.as_ptr() as *const c_void];
    let mut a = graphed_replay_args_default();
    a.data = data.as_ptr();
    a.num_data = if op == Op::MeanOfLengths { 2 } else { 1 };
    match l.grid {
        true => (a.size, a.size2) = (b as u64, t as u64),
        false => a.size = t as u64,
    }
    let mut y = empty_ref();
    // SAFETY: valid args and room for one ref.
    ok(unsafe { graphed_forward(l.s, &a, &mut y, 1) });
    let yv = packed(&y);
    let gdata = [gy.as_ptr() as *const c_void];
    let mut a = graphed_replay_args_default();
    a.data = gdata.as_ptr();
    a.num_data = 1;
    let mut gi = [empty_ref(), empty_ref()];
    let mut gp = empty_ref();
    let n = if op == Op::MeanOfLengths { 2 } else { 1 };
    // SAFETY: valid args and room for the stated refs.
    ok(unsafe { graphed_backward(l.s, &a, gi.as_mut_ptr(), n, &mut gp, 1) });
    let gx = packed(&gi[0]);
    let gw = packed(&gp);
    ok(graphed_buffer_release(gp.owner));
    (yv, gx, gw, y, gi[0])
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn buckets_on_the_time_dimension_give_eager_on_the_actual_length_bit_for_bit() {
    let l = session(Op::Linear, &[2, 4, T as u64], None);
    for n in 1..=T {
        let x = values(B * n * H, n as f32);
        let gy = values(B * n * H, -(n as f32));
        let (y, gx, gw, yr, gr) = replay(&l, Op::Linear, (B, n), &x, &[], &gy);
        let (ey, egx, egw) = eager(Op::Linear, (B, n), &x, &[], &l.w, &gy);
        assert_eq!(bits(&y), bits(&ey), "output at T = {n}");
        assert_eq!(bits(&gx), bits(&egx), "input grad at T = {n}");
        assert_eq!(bits(&gw), bits(&egw), "param grad at T = {n}");
        let bucket = [2, 4, T].into_iter().find(|&b| b >= n).unwrap();
        match n == bucket {
            true => assert_eq!(
                (yr.rows, yr.pitch),
                (1, yr.bytes),
                "a full bucket is contiguous"
            ),
            false => {
                assert_eq!(
                    (yr.rows, yr.row_bytes, yr.pitch),
                    (B, n * H * 4, bucket * H * 4)
                );
                assert_eq!(
                    (gr.rows, gr.row_bytes, gr.pitch),
                    (B, n * H * 4, bucket * H * 4)
                );
            }
        }
    }
    // Longer, then shorter: the padding a longer call left is zeroed again.
    let (x, gy) = (values(B * 3 * H, 9.0), values(B * 3 * H, 4.0));
    let (y, gx, gw, _, _) = replay(&l, Op::Linear, (B, 3), &x, &[], &gy);
    let (ey, egx, egw) = eager(Op::Linear, (B, 3), &x, &[], &l.w, &gy);
    assert_eq!(
        (bits(&y), bits(&gx), bits(&gw)),
        (bits(&ey), bits(&egx), bits(&egw))
    );
    ok(graphed_session_destroy(l.s));
}

#[test]
fn a_grid_of_batch_and_length_buckets_gives_eager_on_the_actual_sizes_bit_for_bit() {
    let (ts, bs) = ([2u64, 4, 8], [1u64, 2, 4]);
    let l = session(Op::Linear, &ts, Some(&bs));
    let mut bucket = 0;
    let (mut bo, mut b2o) = (0u64, 0u64);
    for b in 1..=4 {
        for t in 1..=T {
            let x = values(b * t * H, (b * 10 + t) as f32);
            let gy = values(b * t * H, -((b + t) as f32));
            let (y, gx, gw, _, _) = replay(&l, Op::Linear, (b, t), &x, &[], &gy);
            let (ey, egx, egw) = eager(Op::Linear, (b, t), &x, &[], &l.w, &gy);
            assert_eq!(bits(&y), bits(&ey), "output at {b} x {t}");
            assert_eq!(bits(&gx), bits(&egx), "input grad at {b} x {t}");
            assert_eq!(bits(&gw), bits(&egw), "param grad at {b} x {t}");
            // SAFETY: valid out pointers.
            ok(unsafe {
                graphed_session_bucket_of2(
                    l.s,
                    0,
                    b as u64,
                    t as u64,
                    &mut bucket,
                    &mut bo,
                    &mut b2o,
                )
            });
            let want = (
                bs.iter().position(|&s| s >= b as u64).unwrap(),
                ts.iter().position(|&s| s >= t as u64).unwrap(),
            );
            assert_eq!(bucket as usize, want.0 * 3 + want.1);
            assert_eq!((bo, b2o), (bs[want.0], ts[want.1]));
        }
    }
    // A grid's forward names both sizes; its second size is bounded.
    let x = values(4 * T * H, 1.0);
    let data = [x.as_ptr() as *const c_void];
    let mut a = graphed_replay_args_default();
    a.data = data.as_ptr();
    a.num_data = 1;
    a.size = 2;
    let mut y = empty_ref();
    // SAFETY: valid args and room for one ref.
    let st = unsafe { graphed_forward(l.s, &a, &mut y, 1) };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("names both actual sizes"), "{}", msg());
    a.size2 = T as u64 + 1;
    // SAFETY: as above.
    let st = unsafe { graphed_forward(l.s, &a, &mut y, 1) };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(
        msg().contains("above the largest second bucket size"),
        "{}",
        msg()
    );
    ok(graphed_session_destroy(l.s));
}

/// Part 2 of issue 40: where padding can and cannot leak.
#[test]
fn a_causal_layer_needs_no_mask_and_a_mean_over_time_needs_the_lengths() {
    let buckets = [4u64, T as u64];
    let lens = [3.0f32, 3.0];
    for (op, exact) in [
        (Op::Causal, true),
        (Op::MeanOfBucket, false),
        (Op::MeanOfLengths, true),
    ] {
        let l = session(op, &buckets, None);
        let n = 3;
        let x = values(B * n * H, 2.0);
        let out_rows = if op == Op::Causal { B * n } else { B };
        let gy = values(out_rows * H, -1.0);
        let (y, gx, gw, _, _) = replay(&l, op, (B, n), &x, &lens, &gy);
        let (ey, egx, egw) = eager(op, (B, n), &x, &lens, &l.w, &gy);
        let same = bits(&y) == bits(&ey) && bits(&gx) == bits(&egx) && bits(&gw) == bits(&egw);
        match exact {
            true => assert!(
                same,
                "{}: padded equals unpadded on the real positions",
                op_name(op)
            ),
            false => assert!(
                bits(&y) != bits(&ey),
                "a mean over the bucket's T counts the padding"
            ),
        }
        ok(graphed_session_destroy(l.s));
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Linear => "linear",
        Op::Causal => "causal",
        Op::MeanOfBucket => "mean over the bucket",
        Op::MeanOfLengths => "mean over the lengths",
    }
}

/// Registers one layer with `x` as its input and output; the status.
fn register(
    x: graphed_tensor_desc,
    buckets: &[u64],
    buckets2: &[u64],
    cfg: Option<graphed_session_config>,
) -> (graphed_status, String) {
    let s = create(&cfg.unwrap_or_else(host_config));
    let w = [0.0f32; H * H];
    let params = [graphed_param_desc {
        data: w.as_ptr() as *mut c_void,
        bytes: H * H * 4,
        ..graphed_param_desc_default()
    }];
    let mut d = layer_desc(&x, &x, &params, Some(pass), Some(pass));
    if !buckets.is_empty() {
        d.bucket_sizes = buckets.as_ptr();
        d.num_buckets = buckets.len();
    }
    if !buckets2.is_empty() {
        d.bucket_sizes2 = buckets2.as_ptr();
        d.num_buckets2 = buckets2.len();
    }
    d.user_data = Box::into_raw(Box::new(Layer {
        op: Op::Linear,
        grid: !buckets2.is_empty(),
    }))
    .cast();
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    let mut st = unsafe { graphed_session_add_callable(s, &d, &mut idx) };
    if st == graphed_status::Ok {
        st = graphed_session_capture(s);
    }
    let m = msg();
    ok(graphed_session_destroy(s));
    (st, m)
}

#[test]
fn what_is_not_supported_is_refused_with_a_message() {
    let shape = [2i64, T as i64, H as i64];
    let x = graphed_tensor_desc {
        bytes: 2 * T * H * 4,
        ndim: 3,
        shape: shape.as_ptr(),
        requires_grad: 1,
        flags: graphed_tensor_flags::Dynamic as u32,
        dynamic_dim: 1,
        ..graphed_tensor_desc_default()
    };
    let b = [4u64, T as u64];
    let refused =
        |x: graphed_tensor_desc, b2: &[u64], cfg: Option<graphed_session_config>, said: &str| {
            let (st, m) = register(x, &b, b2, cfg);
            assert_eq!(st, graphed_status::InvalidArgument, "{m}");
            assert!(m.contains(said), "{m} (wanted: {said})");
        };
    refused(
        graphed_tensor_desc {
            dynamic_dim: 3,
            ..x
        },
        &[],
        None,
        "has 3 dimensions",
    );
    refused(
        graphed_tensor_desc {
            dynamic_dim: 2,
            ..x
        },
        &[],
        None,
        "must be the largest bucket's size (8)",
    );
    refused(
        graphed_tensor_desc {
            ndim: 0,
            shape: std::ptr::null(),
            ..x
        },
        &[],
        None,
        "it needs a shape",
    );
    refused(
        graphed_tensor_desc {
            dynamic_dim2: 2,
            ..x
        },
        &[],
        None,
        "one list of buckets",
    );
    refused(
        graphed_tensor_desc {
            dynamic_dim: GRAPHED_DIM_NONE,
            ..x
        },
        &[],
        None,
        "both GRAPHED_DIM_NONE",
    );
    refused(
        graphed_tensor_desc { flags: 0, ..x },
        &[],
        None,
        "not DYNAMIC",
    );
    // Two dimensions after one of more than one element: not rows of one pitch.
    let s4 = [2i64, 3, T as i64, H as i64];
    let four = graphed_tensor_desc {
        ndim: 4,
        shape: s4.as_ptr(),
        bytes: 2 * 3 * T * H * 4,
        dynamic_dim: 2,
        dynamic_dim2: 3,
        ..x
    };
    let s4 = [2i64, 3, T as i64, 3];
    refused(
        graphed_tensor_desc {
            shape: s4.as_ptr(),
            ..four
        },
        &[1, 3],
        None,
        "rows of one pitch",
    );
    // The device's choice over a tensor that varies on another dimension.
    let mut cfg = host_config();
    cfg.bucket_choice_on_device = 1;
    refused(x, &[], Some(cfg), "bucket_choice_on_device");
    // A second list without the first.
    let (st, m) = register(
        graphed_tensor_desc {
            dynamic_dim: 0,
            ..x
        },
        &[],
        &[2],
        None,
    );
    assert_eq!(st, graphed_status::InvalidArgument, "{m}");
    assert!(m.contains("without desc.bucket_sizes"), "{m}");
}

#[test]
fn a_caller_built_against_an_older_graphed_ref_is_refused_before_anything_runs() {
    let l = session(Op::Linear, &[4, T as u64], None);
    let x = values(B * 3 * H, 1.0);
    let data = [x.as_ptr() as *const c_void];
    let mut a = graphed_replay_args_default();
    a.data = data.as_ptr();
    a.num_data = 1;
    a.size = 3;
    a.ref_size = 40;
    let mut y = empty_ref();
    // SAFETY: valid args and room for one ref of 40 bytes.
    let st = unsafe { graphed_forward(l.s, &a, &mut y, 1) };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("rows of a pitch"), "{}", msg());
    // A backward before any forward ran: nothing was.
    let mut a = graphed_replay_args_default();
    let gy = values(B * 3 * H, 1.0);
    let gdata = [gy.as_ptr() as *const c_void];
    a.data = gdata.as_ptr();
    a.num_data = 1;
    let (mut gi, mut gp) = (empty_ref(), empty_ref());
    // SAFETY: valid args and room for the refs.
    let st = unsafe { graphed_backward(l.s, &a, &mut gi, 1, &mut gp, 1) };
    assert_eq!(st, graphed_status::WrongState, "{}", msg());
    ok(graphed_session_destroy(l.s));
}
