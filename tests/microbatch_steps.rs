//! Steps over several microbatches through the C ABI on the host backend:
//! one replay runs every microbatch's forward and backward in turn, each
//! reading its input and incoming grad from caller memory (io), and the
//! parameter grads come back summed as eager accumulation sums them, bit
//! for bit, under every grad policy; every rule of the declaration and of
//! capture refused with a message.
//!
//! The model is two chained elementwise layers `y = w * x + b` over f32,
//! where `b` is the step microbatch the callback was captured for (the
//! way a callback keys its random numbers on it): backward `gx = w * gy`,
//! `gw = x * gy`.

use graphed::ffi::*;
use std::ffi::c_void;
use std::ptr::{null, null_mut};

mod common;
use common::{empty_ref, layer_desc, msg, ok};

const N: usize = 32;
const BYTES: usize = N * 4;

/// `out[i] = a[i] * b[i] + add`, `add` read at `index` when the task runs
/// where that is not NULL (the running microbatch of a loop).
struct Mul {
    a: *const f32,
    b: *const f32,
    out: *mut f32,
    add: f32,
    index: *const u32,
}

unsafe extern "C" fn run_mul(data: *mut c_void) {
    // SAFETY: `data` is a leaked Mul whose buffers hold N floats while the
    // session's graphs exist (the tests keep them alive).
    unsafe {
        let m = &*(data as *const Mul);
        let add = match m.index.is_null() {
            true => m.add,
            false => *m.index as f32,
        };
        for i in 0..N {
            *m.out.add(i) = *m.a.add(i) * *m.b.add(i) + add;
        }
    }
}

fn enqueue(s: graphed_stream, a: *const f32, b: *const f32, out: *mut f32, add: f32) -> i32 {
    enqueue_at(s, a, b, out, add, null())
}

fn enqueue_at(
    s: graphed_stream,
    a: *const f32,
    b: *const f32,
    out: *mut f32,
    add: f32,
    index: *const u32,
) -> i32 {
    let m = Box::into_raw(Box::new(Mul {
        a,
        b,
        out,
        add,
        index,
    }));
    // SAFETY: the task and its data stay valid for the test's lifetime.
    unsafe { graphed_host_enqueue(s, Some(run_mul), m.cast()) as i32 }
}

unsafe extern "C" fn forward(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: the context and its arrays are valid during the call.
    unsafe {
        let c = &*ctx;
        if c.step_microbatch >= c.step_microbatches {
            return 98;
        }
        let (x, w) = (*c.inputs as *const f32, *c.params as *const f32);
        let (y, mb) = (*c.outputs as *mut f32, c.step_microbatch as f32);
        enqueue_at(c.stream, x, w, y, mb, c.step_microbatch_index)
    }
}

unsafe extern "C" fn backward(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: as above.
    unsafe {
        let c = &*ctx;
        let gy = *c.grad_outputs as *const f32;
        let gx = *c.grad_inputs as *mut f32;
        if !gx.is_null() {
            let r = enqueue(c.stream, *c.params as *const f32, gy, gx, 0.0);
            if r != 0 {
                return r;
            }
        }
        let gw = *c.param_grads as *mut f32;
        enqueue(c.stream, *c.inputs as *const f32, gy, gw, 0.0)
    }
}

fn values(seed: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + seed * 13) % 17) as f32 * 0.125 - 1.0)
        .collect()
}

/// Two weights, `mbs` microbatches of input x and incoming grad g side by
/// side in one buffer (x0 g0 x1 g1 ...), room for each microbatch's output
/// and first-layer input grad, grad destinations.
struct Data {
    w: [Vec<f32>; 2],
    xg: Vec<f32>,
    y: Vec<f32>,
    gx: Vec<f32>,
    dsts: [Vec<f32>; 2],
    mbs: usize,
}

impl Data {
    fn new(mbs: usize) -> Data {
        Data {
            w: [values(1, N), values(2, N)],
            xg: values(3, 2 * N * mbs),
            y: vec![f32::NAN; N * mbs],
            gx: vec![f32::NAN; N * mbs],
            dsts: [values(4, N), values(5, N)],
            mbs,
        }
    }
    fn x(&self, i: usize) -> &[f32] {
        &self.xg[2 * N * i..2 * N * i + N]
    }
    fn g(&self, i: usize) -> &[f32] {
        &self.xg[2 * N * i + N..2 * N * (i + 1)]
    }
}

/// Eager accumulation: per microbatch its forward (adding the microbatch
/// index), its backward, the grads summed in microbatch order onto `init`
/// (None: the first microbatch's grad is the start). Returns the outputs,
/// the first layer's input grads and the two sums.
fn eager(d: &Data, init: Option<&[Vec<f32>; 2]>) -> (Vec<f32>, Vec<f32>, [Vec<f32>; 2]) {
    eager_first(d, init, d.mbs)
}

/// `eager` over the first `count` microbatches only.
fn eager_first(
    d: &Data,
    init: Option<&[Vec<f32>; 2]>,
    count: usize,
) -> (Vec<f32>, Vec<f32>, [Vec<f32>; 2]) {
    let (mut ys, mut gxs) = (Vec::new(), Vec::new());
    let mut sums: Option<[Vec<f32>; 2]> = init.cloned();
    for i in 0..count {
        let b = i as f32;
        let h: Vec<f32> = (0..N).map(|k| d.x(i)[k] * d.w[0][k] + b).collect();
        ys.extend((0..N).map(|k| h[k] * d.w[1][k] + b));
        // The layers' tasks add 0.0 in backward (which turns -0.0 into 0.0).
        let gh: Vec<f32> = (0..N).map(|k| d.w[1][k] * d.g(i)[k] + 0.0).collect();
        gxs.extend((0..N).map(|k| d.w[0][k] * gh[k] + 0.0));
        let gw1: Vec<f32> = (0..N).map(|k| h[k] * d.g(i)[k] + 0.0).collect();
        let gw0: Vec<f32> = (0..N).map(|k| d.x(i)[k] * gh[k] + 0.0).collect();
        sums = Some(match sums {
            None => [gw0, gw1],
            Some([a, c]) => [
                (0..N).map(|k| a[k] + gw0[k]).collect(),
                (0..N).map(|k| c[k] + gw1[k]).collect(),
            ],
        });
    }
    (ys, gxs, sums.unwrap_or_default())
}

struct Built(*mut graphed_session);

impl Drop for Built {
    fn drop(&mut self) {
        ok(graphed_session_destroy(self.0));
    }
}

fn tensor(requires_grad: bool) -> graphed_tensor_desc {
    graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: requires_grad as u32,
        ..graphed_tensor_desc_default()
    }
}

fn io(callable: u32, role: graphed_buffer_role, ptr: *mut f32, stride: usize) -> graphed_step_io {
    graphed_step_io {
        callable,
        role: role as u32,
        ptr: ptr.cast(),
        stride,
        ..graphed_step_io_default()
    }
}

/// How a session is built.
struct Setup {
    policy: u32,
    slots: u32,
    /// The first layer's input takes a grad (so GRAD_INPUT io exists).
    input_grad: bool,
}

const CLONE: Setup = Setup {
    policy: graphed_grad_policy::Clone as u32,
    slots: 2,
    input_grad: true,
};

/// A session with the two layers (the second chained to the first),
/// their weights with `setup.policy`; returns it uncaptured.
fn session(d: &mut Data, setup: &Setup) -> Built {
    let mut cfg = graphed_session_config_default();
    cfg.backend = graphed_backend::Host as u32;
    cfg.warmup_iterations = 1;
    cfg.clone_slots = setup.slots;
    let mut s = null_mut();
    // SAFETY: a valid config and out pointer.
    ok(unsafe { graphed_session_create(&cfg, &mut s) });
    let b = Built(s);
    for l in 0..2 {
        let mut input = tensor(l == 1 || setup.input_grad);
        if l == 1 {
            input.flags = graphed_tensor_flags::Chained as u32;
            input.chain_callable = 0;
        }
        let output = tensor(true);
        let params = [graphed_param_desc {
            data: d.w[l].as_mut_ptr().cast(),
            bytes: BYTES,
            policy: setup.policy,
            ..graphed_param_desc_default()
        }];
        let desc = layer_desc(&input, &output, &params, Some(forward), Some(backward));
        let mut idx = 0;
        // SAFETY: the descriptor and its arrays are valid locals.
        ok(unsafe { graphed_session_add_callable(s, &desc, &mut idx) });
    }
    b
}

/// The step's io over `d`: x into layer 0, g into layer 1's grad-output,
/// y out of layer 1, gx out of layer 0 (when its input takes a grad).
fn step_io(d: &mut Data, input_grad: bool) -> Vec<graphed_step_io> {
    let xg = d.xg.as_mut_ptr();
    let mut v = vec![
        io(0, graphed_buffer_role::Input, xg, 2 * BYTES),
        // SAFETY: N floats into the interleaved buffer.
        io(
            1,
            graphed_buffer_role::GradOutput,
            unsafe { xg.add(N) },
            2 * BYTES,
        ),
        io(1, graphed_buffer_role::Output, d.y.as_mut_ptr(), BYTES),
    ];
    if input_grad {
        v.push(io(
            0,
            graphed_buffer_role::GradInput,
            d.gx.as_mut_ptr(),
            BYTES,
        ));
    }
    v
}

/// Declares the step over both layers; returns its status.
fn add_step(
    s: *mut graphed_session,
    mbs: u32,
    io: &[graphed_step_io],
    dsts: &[*mut c_void],
) -> graphed_status {
    add_step_looping(s, mbs, io, dsts, graphed_step_loop::Unrolled as u32)
}

/// `add_step` with a loop mode.
fn add_step_looping(
    s: *mut graphed_session,
    mbs: u32,
    io: &[graphed_step_io],
    dsts: &[*mut c_void],
    loop_mode: u32,
) -> graphed_status {
    let callables = [0u32, 1];
    let mut d = graphed_step_desc_default();
    d.loop_mode = loop_mode;
    d.callables = callables.as_ptr();
    d.num_callables = 2;
    d.microbatches = mbs;
    d.io = if io.is_empty() { null() } else { io.as_ptr() };
    d.num_io = io.len();
    if !dsts.is_empty() {
        d.param_dsts = dsts.as_ptr();
        d.num_param_dsts = dsts.len();
    }
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    unsafe { graphed_session_add_step(s, &d, &mut idx) }
}

/// Replays step 0; returns the two grad refs.
fn replay(s: *mut graphed_session) -> Result<[graphed_ref; 2], (graphed_status, String)> {
    replay_count(s, 0)
}

/// Replays step 0 over `count` microbatches (0: all).
fn replay_count(
    s: *mut graphed_session,
    count: u32,
) -> Result<[graphed_ref; 2], (graphed_status, String)> {
    let mut a = graphed_step_args_default();
    a.microbatches = count;
    let mut refs = [empty_ref(), empty_ref()];
    // SAFETY: valid args and room for two refs.
    match unsafe { graphed_step_replay(s, &a, refs.as_mut_ptr(), 2) } {
        graphed_status::Ok => Ok(refs),
        st => Err((st, msg())),
    }
}

fn read(p: *const c_void) -> Vec<f32> {
    // SAFETY: `p` is a clone or destination of N floats.
    unsafe { std::slice::from_raw_parts(p as *const f32, N) }.to_vec()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn clone_grads_are_the_sum_of_every_microbatch() {
    for mbs in [1usize, 3, 8] {
        let mut d = Data::new(mbs);
        let b = session(&mut d, &CLONE);
        let ios = step_io(&mut d, true);
        ok(add_step(b.0, mbs as u32, &ios, &[]));
        ok(graphed_session_capture(b.0));
        for round in 0..3 {
            // New data every replay, read from the same caller memory.
            d.xg.copy_from_slice(&values(10 + round, 2 * N * mbs));
            let (ys, gxs, [g0, g1]) = eager(&d, None);
            let refs = replay(b.0).unwrap();
            assert_eq!(
                bits(&read(refs[0].ptr)),
                bits(&g0),
                "mbs {mbs} round {round}"
            );
            assert_eq!(
                bits(&read(refs[1].ptr)),
                bits(&g1),
                "mbs {mbs} round {round}"
            );
            assert_eq!(bits(&d.y), bits(&ys), "outputs, mbs {mbs}");
            assert_eq!(bits(&d.gx), bits(&gxs), "input grads, mbs {mbs}");
            for r in refs {
                ok(graphed_buffer_release(r.owner));
            }
        }
    }
}

#[test]
fn copy_into_and_accumulate_into_sum_like_eager() {
    for (policy, accumulate) in [
        (graphed_grad_policy::CopyInto, false),
        (graphed_grad_policy::AccumulateInto, true),
    ] {
        let mut d = Data::new(5);
        let setup = Setup {
            policy: policy as u32,
            ..CLONE
        };
        let b = session(&mut d, &setup);
        let ios = step_io(&mut d, true);
        let dsts = [d.dsts[0].as_mut_ptr().cast(), d.dsts[1].as_mut_ptr().cast()];
        ok(add_step(b.0, 5, &ios, &dsts));
        ok(graphed_session_capture(b.0));
        let start = d.dsts.clone();
        let (_, _, sums) = eager(&d, accumulate.then_some(&start));
        let refs = replay(b.0).unwrap();
        assert_eq!(
            refs[0].ptr, dsts[0],
            "{policy:?}: the destination is the grad"
        );
        assert_eq!(bits(&d.dsts[0]), bits(&sums[0]), "{policy:?}");
        assert_eq!(bits(&d.dsts[1]), bits(&sums[1]), "{policy:?}");
        // A second replay: COPY_INTO starts again, ACCUMULATE_INTO goes on.
        let start = d.dsts.clone();
        let (_, _, sums) = eager(&d, accumulate.then_some(&start));
        replay(b.0).unwrap();
        assert_eq!(bits(&d.dsts[0]), bits(&sums[0]), "{policy:?}, again");
        assert_eq!(bits(&d.dsts[1]), bits(&sums[1]), "{policy:?}, again");
    }
}

#[test]
fn every_clone_slot_held_is_refused_then_released_replays() {
    let mut d = Data::new(2);
    let b = session(&mut d, &CLONE);
    let ios = step_io(&mut d, true);
    ok(add_step(b.0, 2, &ios, &[]));
    ok(graphed_session_capture(b.0));
    let held = [replay(b.0).unwrap(), replay(b.0).unwrap()];
    let Err((st, m)) = replay(b.0) else {
        panic!("a third replay with both slots held went through")
    };
    assert_eq!(st, graphed_status::AliasHeld, "{m}");
    assert!(m.contains("all 2 are held") && m.contains("step 0"), "{m}");
    for r in held.iter().flatten() {
        ok(graphed_buffer_release(r.owner));
    }
    let (_, _, [g0, _]) = eager(&d, None);
    let refs = replay(b.0).unwrap();
    assert_eq!(bits(&read(refs[0].ptr)), bits(&g0));
    for r in refs {
        ok(graphed_buffer_release(r.owner));
    }
}

/// Declares the step with `mbs` and `ios`; returns the status and message.
fn declare(mbs: u32, f: impl Fn(&mut Data) -> Vec<graphed_step_io>) -> (graphed_status, String) {
    let mut d = Data::new(4);
    let b = session(&mut d, &CLONE);
    let ios = f(&mut d);
    let st = add_step(b.0, mbs, &ios, &[]);
    (st, msg())
}

#[test]
fn declarations_that_break_a_rule_are_refused() {
    use graphed_buffer_role as R;
    let refused = |mbs: u32, f: &dyn Fn(&mut Data) -> Vec<graphed_step_io>, text: &str| {
        let (st, m) = declare(mbs, f);
        assert_eq!(st, graphed_status::InvalidArgument, "{text}: {m}");
        assert!(m.contains(text), "wanted '{text}' in: {m}");
    };
    refused(0, &|_| vec![], "microbatches is 0");
    refused(4097, &|_| vec![], "at most 4096");
    let x = |d: &mut Data| d.xg.as_mut_ptr();
    refused(
        4,
        &|d| vec![io(2, R::Input, x(d), 2 * BYTES)],
        "not one of the step's",
    );
    refused(
        4,
        &|d| vec![io(0, R::ParamGrads, x(d), 2 * BYTES)],
        "parameter grads",
    );
    refused(
        4,
        &|d| {
            let mut e = io(0, R::Input, x(d), 2 * BYTES);
            e.index = 1;
            vec![e]
        },
        "has 1 inputs",
    );
    refused(
        4,
        &|_| vec![io(0, R::Input, null_mut(), 2 * BYTES)],
        "is NULL",
    );
    refused(
        4,
        &|d| vec![io(0, R::Input, x(d), BYTES - 4)],
        "would overlap",
    );
    refused(
        4,
        &|d| {
            vec![
                io(0, R::Input, x(d), 2 * BYTES),
                io(0, R::Input, x(d), 2 * BYTES),
            ]
        },
        "names the same buffer",
    );
    // A copy out into memory a copy in reads.
    refused(
        4,
        &|d| {
            let p = x(d);
            vec![
                io(0, R::Input, p, 2 * BYTES),
                // SAFETY: inside the buffer, overlapping microbatch 0's x.
                io(1, R::Output, unsafe { p.add(4) }, 2 * BYTES),
            ]
        },
        "also reads",
    );
    // The role's code is checked.
    let (st, m) = declare(4, |d| {
        let mut e = io(0, R::Input, x(d), 2 * BYTES);
        e.role = 9;
        vec![e]
    });
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(m.contains("desc.io[0].role: 9"), "{m}");
    // Interleaved memory is fine: x and g side by side.
    let (st, m) = declare(4, |d| step_io(d, true));
    assert_eq!(st, graphed_status::Ok, "{m}");
}

/// Declares the step with `ios` (and `mbs`) on a session set up with
/// `setup`, then captures; returns capture's status and message.
fn capture_with(
    setup: &Setup,
    mbs: u32,
    f: impl Fn(&mut Data) -> Vec<graphed_step_io>,
) -> (graphed_status, String) {
    let mut d = Data::new(4);
    let b = session(&mut d, setup);
    let ios = f(&mut d);
    ok(add_step(b.0, mbs, &ios, &[]));
    let st = graphed_session_capture(b.0);
    (st, msg())
}

#[test]
fn capture_refuses_what_placement_and_policies_rule_out() {
    use graphed_buffer_role as R;
    // The chained input of layer 1 is layer 0's output.
    let (st, m) = capture_with(&CLONE, 4, |d| {
        vec![io(1, R::Input, d.y.as_mut_ptr(), BYTES)]
    });
    assert_eq!(st, graphed_status::InvalidArgument, "{m}");
    assert!(m.contains("chained"), "{m}");
    // Layer 0's input takes no grad: it has no grad-input buffer.
    let no_grad = Setup {
        input_grad: false,
        ..CLONE
    };
    let (st, m) = capture_with(&no_grad, 4, |d| {
        vec![io(0, R::GradInput, d.gx.as_mut_ptr(), BYTES)]
    });
    assert_eq!(st, graphed_status::InvalidArgument, "{m}");
    assert!(m.contains("no such buffer"), "{m}");
    // ALIAS grads would hold the last microbatch's grad only.
    let alias = Setup {
        policy: graphed_grad_policy::Alias as u32,
        ..CLONE
    };
    let (st, m) = capture_with(&alias, 4, |d| step_io(d, true));
    assert_eq!(st, graphed_status::Incompatible, "{m}");
    assert!(m.contains("ALIAS") && m.contains("4 microbatches"), "{m}");
    // One microbatch: ALIAS is what it always was.
    let (st, m) = capture_with(&alias, 1, |_| vec![]);
    assert_eq!(st, graphed_status::Ok, "{m}");
    // CLONE sums need clone slots.
    let no_slots = Setup { slots: 0, ..CLONE };
    let (st, m) = capture_with(&no_slots, 4, |d| step_io(d, true));
    assert_eq!(st, graphed_status::Incompatible, "{m}");
    assert!(m.contains("clone slots"), "{m}");
    let (st, m) = capture_with(&no_slots, 1, |d| step_io(d, true));
    assert_eq!(st, graphed_status::Incompatible, "{m}");
    assert!(m.contains("copies data in or out"), "{m}");
}

#[test]
fn an_old_descriptor_declares_one_microbatch() {
    let mut d = Data::new(1);
    let b = session(&mut d, &CLONE);
    let callables = [0u32, 1];
    let mut desc = graphed_step_desc_default();
    desc.callables = callables.as_ptr();
    desc.num_callables = 2;
    // The size of the first release: no io, no microbatch count.
    desc.struct_size = 48;
    desc.microbatches = 0;
    let mut idx = 9;
    // SAFETY: a valid descriptor of the old size.
    ok(unsafe { graphed_session_add_step(b.0, &desc, &mut idx) });
    assert_eq!(idx, 0);
    ok(graphed_session_capture(b.0));
}

/// Counts its calls in the u32 its data points to.
unsafe extern "C" fn counting_hook(_when: u32, data: *mut c_void) -> i32 {
    // SAFETY: the test passes a live u32.
    unsafe { *data.cast::<u32>() += 1 };
    0
}

#[test]
fn a_descriptor_without_the_hook_fields_runs_no_hook() {
    for (size, expected) in [
        (std::mem::offset_of!(graphed_step_desc, capture_hook), 0u32),
        (std::mem::size_of::<graphed_step_desc>(), 2),
    ] {
        let mut d = Data::new(1);
        let b = session(&mut d, &CLONE);
        let callables = [0u32, 1];
        let mut calls = 0u32;
        let mut desc = graphed_step_desc_default();
        desc.callables = callables.as_ptr();
        desc.num_callables = 2;
        desc.capture_hook = Some(counting_hook);
        desc.capture_hook_data = (&mut calls as *mut u32).cast();
        // The size before the hook: its fields are not read.
        desc.struct_size = size;
        let mut idx = 9;
        // SAFETY: a valid descriptor of that size.
        ok(unsafe { graphed_session_add_step(b.0, &desc, &mut idx) });
        ok(graphed_session_capture(b.0));
        // With it: before and after each of the step's graphs (one per
        // clone slot, at least one).
        assert_eq!(calls % 2, 0, "size {size}");
        assert_eq!(calls.min(2), expected, "size {size}: {calls} calls");
    }
}

#[test]
fn a_loop_on_the_device_runs_the_count_each_replay_asks() {
    let mut d = Data::new(6);
    let b = session(&mut d, &CLONE);
    let ios = step_io(&mut d, true);
    let mode = graphed_step_loop::While as u32;
    ok(add_step_looping(b.0, 6, &ios, &[], mode));
    ok(graphed_session_capture(b.0));
    for (round, count) in [6u32, 3, 1, 0, 4].into_iter().enumerate() {
        d.xg.copy_from_slice(&values(30 + round, 2 * N * 6));
        d.y.fill(f32::NAN);
        let k = if count == 0 { 6 } else { count as usize };
        let (ys, gxs, [g0, g1]) = eager_first(&d, None, k);
        let refs = replay_count(b.0, count).unwrap();
        assert_eq!(bits(&read(refs[0].ptr)), bits(&g0), "count {count}");
        assert_eq!(bits(&read(refs[1].ptr)), bits(&g1), "count {count}");
        assert_eq!(bits(&d.y[..N * k]), bits(&ys), "outputs, count {count}");
        assert_eq!(
            bits(&d.gx[..N * k]),
            bits(&gxs),
            "input grads, count {count}"
        );
        assert!(
            d.y[N * k..].iter().all(|v| v.is_nan()),
            "microbatches past {k} not run"
        );
        for r in refs {
            ok(graphed_buffer_release(r.owner));
        }
    }
    let Err((st, m)) = replay_count(b.0, 7) else {
        panic!("7 of 6 microbatches went through")
    };
    assert_eq!(st, graphed_status::InvalidArgument, "{m}");
    assert!(m.contains("declared with 6"), "{m}");
}

#[test]
fn a_loop_sums_into_destinations_like_eager() {
    for (policy, accumulate) in [
        (graphed_grad_policy::CopyInto, false),
        (graphed_grad_policy::AccumulateInto, true),
    ] {
        let mut d = Data::new(5);
        let setup = Setup {
            policy: policy as u32,
            ..CLONE
        };
        let b = session(&mut d, &setup);
        let ios = step_io(&mut d, true);
        let dsts = [d.dsts[0].as_mut_ptr().cast(), d.dsts[1].as_mut_ptr().cast()];
        let mode = graphed_step_loop::While as u32;
        ok(add_step_looping(b.0, 5, &ios, &dsts, mode));
        ok(graphed_session_capture(b.0));
        for count in [5u32, 2] {
            let start = d.dsts.clone();
            let (_, _, sums) = eager_first(&d, accumulate.then_some(&start), count as usize);
            replay_count(b.0, count).unwrap();
            assert_eq!(bits(&d.dsts[0]), bits(&sums[0]), "{policy:?} count {count}");
            assert_eq!(bits(&d.dsts[1]), bits(&sums[1]), "{policy:?} count {count}");
        }
    }
}

#[test]
fn counts_and_loop_modes_that_break_a_rule_are_refused() {
    // An unrolled step runs its own count only.
    let mut d = Data::new(4);
    let b = session(&mut d, &CLONE);
    let ios = step_io(&mut d, true);
    ok(add_step(b.0, 4, &ios, &[]));
    ok(graphed_session_capture(b.0));
    let Err((st, m)) = replay_count(b.0, 2) else {
        panic!("an unrolled step ran 2 of its 4 microbatches")
    };
    assert_eq!(st, graphed_status::InvalidArgument, "{m}");
    assert!(m.contains("captured unrolled for 4"), "{m}");
    let refs = replay_count(b.0, 4).unwrap();
    for r in refs {
        ok(graphed_buffer_release(r.owner));
    }
    // An unknown loop mode.
    let mut d = Data::new(4);
    let b = session(&mut d, &CLONE);
    let st = add_step_looping(b.0, 4, &[], &[], 7);
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("desc.loop_mode: 7"), "{}", msg());
}
