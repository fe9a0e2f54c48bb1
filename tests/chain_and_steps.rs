//! Chained inputs, clone slots and steps through the C ABI on the host
//! backend: each must give bit-for-bit the results of the plain path
//! (copies into static inputs, clones copied out of the slab, one replay
//! per pass), with fewer static bytes or fewer launches.
//!
//! The layers are elementwise `y = w * x` over f32: backward
//! `gx = w * gy`, `gw = x * gy`, enqueued as host tasks.

use graphed::ffi::*;
use std::ffi::c_void;
use std::ptr::null_mut;

mod common;
use common::{create, empty_ref, free_nothing, layer_desc, msg, ok, refuse_alloc, stats};

const N: usize = 64;

/// One elementwise operation on `N` floats: `out[i] (+)= a[i] * b[i]`.
struct Mul {
    a: *const f32,
    b: *const f32,
    out: *mut f32,
}

unsafe extern "C" fn run_mul(data: *mut c_void) {
    // SAFETY: `data` is a leaked Mul whose buffers hold N floats while the
    // session's graphs exist (the test keeps them alive).
    unsafe {
        let m = &*(data as *const Mul);
        for i in 0..N {
            *m.out.add(i) = *m.a.add(i) * *m.b.add(i);
        }
    }
}

fn enqueue(stream: graphed_stream, a: *const f32, b: *const f32, out: *mut f32) -> i32 {
    let m = Box::into_raw(Box::new(Mul { a, b, out }));
    // SAFETY: the task and its data stay valid for the test's lifetime.
    unsafe { graphed_host_enqueue(stream, Some(run_mul), m.cast()) as i32 }
}

/// Every callback under capture, a step's and a clone slot's too, gets
/// ctx->capture (a step's captures once handed out NULL).
fn capture_handle_missing(c: &graphed_pass_ctx) -> bool {
    c.phase == graphed_phase::Capture as u32 && c.capture.is_null()
}

unsafe extern "C" fn forward(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: the context and its arrays are valid during the call.
    unsafe {
        let c = &*ctx;
        if capture_handle_missing(c) {
            return 99;
        }
        enqueue(
            c.stream,
            *c.inputs as *const f32,
            *c.params as *const f32,
            *c.outputs as *mut f32,
        )
    }
}

unsafe extern "C" fn backward(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: as above.
    unsafe {
        let c = &*ctx;
        if capture_handle_missing(c) {
            return 99;
        }
        let gy = *c.grad_outputs as *const f32;
        let gx = *c.grad_inputs as *mut f32;
        if !gx.is_null() {
            let r = enqueue(c.stream, *c.params as *const f32, gy, gx);
            if r != 0 {
                return r;
            }
        }
        enqueue(
            c.stream,
            *c.inputs as *const f32,
            gy,
            *c.param_grads as *mut f32,
        )
    }
}

/// A chain of `layers` elementwise layers with their own weights.
struct Model {
    weights: Vec<Vec<f32>>,
    input: Vec<f32>,
    grad: Vec<f32>,
}

impl Model {
    fn new(layers: usize) -> Model {
        let v = |seed: usize| {
            (0..N)
                .map(|i| ((i * 7 + seed * 13) % 11) as f32 * 0.25 - 1.0)
                .collect()
        };
        Model {
            weights: (0..layers).map(|l| v(l + 1)).collect(),
            input: v(100),
            grad: v(200),
        }
    }
}

struct Built {
    s: *mut graphed_session,
}

impl Drop for Built {
    fn drop(&mut self) {
        ok(graphed_session_destroy(self.s));
    }
}

fn tensor(requires_grad: bool) -> graphed_tensor_desc {
    graphed_tensor_desc {
        bytes: N * 4,
        requires_grad: requires_grad as u32,
        ..graphed_tensor_desc_default()
    }
}

/// A host-backend config, the defaults otherwise.
fn host() -> graphed_session_config {
    let mut c = graphed_session_config_default();
    c.backend = graphed_backend::Host as u32;
    c
}

/// Registers the model's layers, chained or not, with grad `policy`, and
/// the step `step` (None: no step); captures.
fn build(
    m: &mut Model,
    chained: bool,
    slots: u32,
    policy: u32,
    step: Option<&[*mut c_void]>,
) -> Built {
    let mut cfg = host();
    cfg.warmup_iterations = 1;
    cfg.clone_slots = slots;
    let s = create(&cfg);
    let built = Built { s };
    let layers = m.weights.len();
    for l in 0..layers {
        let mut input = tensor(l > 0);
        if l == 0 {
            input.sample = m.input.as_ptr().cast();
        } else if chained {
            input.flags = graphed_tensor_flags::Chained as u32;
            input.chain_callable = l as u32 - 1;
            input.chain_output = 0;
        }
        add_layer(s, &input, &mut m.weights[l], policy);
    }
    if let Some(dsts) = step {
        let callables: Vec<u32> = (0..layers as u32).collect();
        let mut d = graphed_step_desc_default();
        d.callables = callables.as_ptr();
        d.num_callables = callables.len();
        if !dsts.is_empty() {
            d.param_dsts = dsts.as_ptr();
            d.num_param_dsts = dsts.len();
        }
        let mut idx = 7;
        // SAFETY: as above.
        ok(unsafe { graphed_session_add_step(s, &d, &mut idx) });
        assert_eq!(idx, 0);
    }
    ok(graphed_session_capture(s));
    built
}

/// Registers one layer `y = w * x`: `input`, one output, the weights `w`
/// with grad `policy`.
fn add_layer(s: *mut graphed_session, input: &graphed_tensor_desc, w: &mut [f32], policy: u32) {
    add_layer_with(s, input, 0, w, policy)
}

/// `add_layer` with flags on the layer's output.
fn add_layer_with(
    s: *mut graphed_session,
    input: &graphed_tensor_desc,
    output_flags: u32,
    w: &mut [f32],
    policy: u32,
) {
    let mut output = tensor(true);
    output.flags = output_flags;
    let param = graphed_param_desc {
        data: w.as_mut_ptr().cast(),
        bytes: N * 4,
        policy,
        ..graphed_param_desc_default()
    };
    let params = [param];
    let d = layer_desc(input, &output, &params, Some(forward), Some(backward));
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
}

fn read(p: *mut c_void) -> Vec<f32> {
    // SAFETY: `p` is a static buffer or clone of N floats.
    unsafe { std::slice::from_raw_parts(p as *const f32, N) }.to_vec()
}

fn buffer(s: *mut graphed_session, callable: u32, role: graphed_buffer_role) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: room for one pointer.
    ok(unsafe { graphed_session_buffers(s, callable, 0, role as u32, &mut p, 1) });
    p
}

/// One training step pass by pass: forwards with copies of the input
/// (`chained`: later layers read their producers in place), backwards with
/// the grad. Returns (last output, every parameter grad) and releases.
fn per_pass(m: &Model, b: &Built, chained: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
    let s = b.s;
    let layers = m.weights.len();
    let mut x: *const c_void = m.input.as_ptr().cast();
    let mut out = empty_ref();
    for l in 0..layers {
        let mut a = graphed_replay_args_default();
        a.callable = l as u32;
        let data = [x];
        if !(chained && l > 0) {
            a.data = data.as_ptr();
            a.num_data = 1;
        }
        // SAFETY: valid args and room for one ref.
        ok(unsafe { graphed_forward(s, &a, &mut out, 1) });
        x = out.ptr;
    }
    let y = read(out.ptr);
    let mut g: *const c_void = m.grad.as_ptr().cast();
    let mut grads = vec![Vec::new(); layers];
    for l in (0..layers).rev() {
        let mut a = graphed_replay_args_default();
        a.callable = l as u32;
        let data = [g];
        if !(chained && l + 1 < layers) {
            a.data = data.as_ptr();
            a.num_data = 1;
        }
        let (mut gi, mut gp) = (empty_ref(), empty_ref());
        // SAFETY: as above.
        ok(unsafe { graphed_backward(s, &a, &mut gi, 1, &mut gp, 1) });
        grads[l] = read(gp.ptr);
        ok(graphed_buffer_release(gp.owner));
        g = gi.ptr;
    }
    (y, grads)
}

fn eager(m: &Model) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut acts = vec![m.input.clone()];
    for w in &m.weights {
        let x = acts.last().unwrap();
        acts.push(x.iter().zip(w).map(|(a, b)| a * b).collect());
    }
    let mut g = m.grad.clone();
    let mut grads = vec![Vec::new(); m.weights.len()];
    for l in (0..m.weights.len()).rev() {
        grads[l] = acts[l].iter().zip(&g).map(|(a, b)| a * b).collect();
        g = m.weights[l].iter().zip(&g).map(|(a, b)| a * b).collect();
    }
    (acts.pop().unwrap(), grads)
}

#[test]
fn chained_inputs_match_copies_with_fewer_static_bytes() {
    let mut m = Model::new(4);
    let want = eager(&m);
    let copied = build(&mut m, false, 0, 0, None);
    let chained = build(&mut m, true, 0, 0, None);
    for _ in 0..3 {
        assert_eq!(per_pass(&m, &copied, false), want);
        assert_eq!(per_pass(&m, &chained, true), want);
    }
    let (a, b) = (stats(copied.s), stats(chained.s));
    // Each chained layer saves its input and that input's grad.
    assert_eq!(
        a.static_bytes - b.static_bytes,
        3 * 2 * (N as u64 * 4).next_multiple_of(256)
    );
    // A chained input is read in place: its producer's output buffer.
    assert_eq!(
        buffer(chained.s, 1, graphed_buffer_role::Input),
        buffer(chained.s, 0, graphed_buffer_role::Output)
    );
}

#[test]
fn a_chained_input_takes_no_other_data() {
    let mut m = Model::new(2);
    let b = build(&mut m, true, 0, 0, None);
    let mut a = graphed_replay_args_default();
    a.callable = 1;
    let data = [m.input.as_ptr() as *const c_void];
    a.data = data.as_ptr();
    a.num_data = 1;
    let mut out = empty_ref();
    // SAFETY: valid args and room for one ref.
    let st = unsafe { graphed_forward(b.s, &a, &mut out, 1) };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(
        msg().contains("is chained to another callable's buffer"),
        "{}",
        msg()
    );
    assert!(out.ptr.is_null(), "outputs are written only on success");
}

#[test]
fn chaining_is_checked_at_registration() {
    let mut m = Model::new(1);
    let s = create(&host());
    let mut input = tensor(true);
    input.flags = graphed_tensor_flags::Chained as u32;
    input.chain_callable = 0; // itself: not registered yet
    let output = tensor(true);
    let param = graphed_param_desc {
        data: m.weights[0].as_mut_ptr().cast(),
        bytes: N * 4,
        ..graphed_param_desc_default()
    };
    let params = [param];
    let d = layer_desc(&input, &output, &params, Some(forward), Some(backward));
    let mut idx = 0;
    // SAFETY: valid descriptor.
    let st = unsafe { graphed_session_add_callable(s, &d, &mut idx) };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("not registered yet"), "{}", msg());
    ok(graphed_session_destroy(s));
}

#[test]
fn clone_slots_return_owned_grads_without_a_copy_and_fall_back_when_held() {
    let mut m = Model::new(2);
    let want = eager(&m);
    let b = build(&mut m, false, 2, 0, None);
    // Two slot graphs per callable on top of its forward and backward.
    assert_eq!(
        (stats(b.s).graph_count, stats(b.s).slot_graphs),
        (2 * 2, 2 * 2)
    );
    for _ in 0..3 {
        assert_eq!(per_pass(&m, &b, false), want);
    }
    // Hold the grads of three backwards of callable 1, each from another
    // grad-output (x1, x2, x4: the grads scale exactly): two slots, then a
    // copy into a block of its own; each stays what its backward returned.
    let base = per_pass(&m, &b, false).1[1].clone();
    let mut held = Vec::new();
    for round in 0..3 {
        let mut a = graphed_replay_args_default();
        a.callable = 1;
        let gy: Vec<f32> = m.grad.iter().map(|x| x * (1 << round) as f32).collect();
        let data = [gy.as_ptr() as *const c_void];
        a.data = data.as_ptr();
        a.num_data = 1;
        let (mut gi, mut gp) = (empty_ref(), empty_ref());
        // SAFETY: valid args, room for one ref each.
        ok(unsafe { graphed_backward(b.s, &a, &mut gi, 1, &mut gp, 1) });
        assert_eq!(gp.kind, graphed_ref_kind::Clone as u32);
        assert!(
            held.iter().all(|r: &graphed_ref| r.ptr != gp.ptr),
            "round {round}: a held block was reused"
        );
        held.push(gp);
    }
    let st = stats(b.s);
    assert_eq!(st.clone_blocks_outstanding, 3);
    for (round, r) in held.iter().enumerate() {
        let k = (1 << round) as f32;
        let want: Vec<f32> = base.iter().map(|x| x * k).collect();
        assert_eq!(read(r.ptr), want, "round {round}: a held grad changed");
    }
    for r in held {
        ok(graphed_buffer_release(r.owner));
    }
    assert_eq!(stats(b.s).clone_blocks_outstanding, 0);
}

fn step(b: &Built, grads: &mut [graphed_ref]) {
    let a = graphed_step_args_default();
    // SAFETY: valid args and room for the refs.
    ok(unsafe { graphed_step_replay(b.s, &a, grads.as_mut_ptr(), grads.len()) });
}

#[test]
fn a_step_replays_every_pass_in_one_launch_and_matches_per_pass() {
    let mut m = Model::new(3);
    let want = eager(&m);
    let b = build(&mut m, true, 2, 0, Some(&[]));
    // The step reads the static input and grad-output: fill them.
    let x = buffer(b.s, 0, graphed_buffer_role::Input);
    let g = buffer(b.s, 2, graphed_buffer_role::GradOutput);
    // SAFETY: static buffers of N floats.
    unsafe {
        std::ptr::copy_nonoverlapping(m.input.as_ptr(), x as *mut f32, N);
        std::ptr::copy_nonoverlapping(m.grad.as_ptr(), g as *mut f32, N);
    }
    // One launch: a slot is free in every callable.
    let mut grads = vec![empty_ref(); 3];
    step(&b, &mut grads);
    let got: Vec<Vec<f32>> = grads.iter().map(|r| read(r.ptr)).collect();
    assert_eq!(got, want.1);
    assert_eq!(read(buffer(b.s, 2, graphed_buffer_role::Output)), want.0);
    // Held: the second step takes the other slot, the third replays pass
    // by pass; each with another grad-output (x2, x4: the grads scale
    // exactly), none overwriting another's blocks.
    let scaled = |k: f32| -> Vec<Vec<f32>> {
        want.1
            .iter()
            .map(|v| v.iter().map(|x| x * k).collect())
            .collect()
    };
    let mut grads2 = vec![empty_ref(); 3];
    let mut grads3 = vec![empty_ref(); 3];
    for (set, k) in [(&mut grads2, 2.0f32), (&mut grads3, 4.0)] {
        let gk: Vec<f32> = m.grad.iter().map(|x| x * k).collect();
        // SAFETY: the static grad-output of N floats.
        unsafe { std::ptr::copy_nonoverlapping(gk.as_ptr(), g as *mut f32, N) };
        step(&b, set);
    }
    for (set, k) in [(&grads, 1.0f32), (&grads2, 2.0), (&grads3, 4.0)] {
        let got: Vec<Vec<f32>> = set.iter().map(|r| read(r.ptr)).collect();
        assert_eq!(
            got,
            scaled(k),
            "the grads of the step with grad-output x{k}"
        );
    }
    let mut ptrs: Vec<usize> = grads
        .iter()
        .chain(&grads2)
        .chain(&grads3)
        .map(|r| r.ptr as usize)
        .collect();
    ptrs.sort_unstable();
    ptrs.dedup();
    assert_eq!(ptrs.len(), 9, "two held steps' grads share memory");
    for r in grads.iter().chain(&grads2).chain(&grads3) {
        ok(graphed_buffer_release(r.owner));
    }
    assert_eq!(stats(b.s).clone_blocks_outstanding, 0);
    // The step's graphs: one per slot.
    let st = stats(b.s);
    assert_eq!(
        (st.graph_count, st.slot_graphs, st.step_graphs),
        (3 * 2, 3 * 2, 2)
    );
}

#[test]
fn a_step_accumulates_into_fixed_destinations() {
    let mut m = Model::new(3);
    let want = eager(&m);
    let mut dst: Vec<Vec<f32>> = vec![vec![0.0; N]; 3];
    let ptrs: Vec<*mut c_void> = dst.iter_mut().map(|d| d.as_mut_ptr().cast()).collect();
    let b = build(
        &mut m,
        true,
        0,
        graphed_grad_policy::AccumulateInto as u32,
        Some(&ptrs),
    );
    let x = buffer(b.s, 0, graphed_buffer_role::Input);
    let g = buffer(b.s, 2, graphed_buffer_role::GradOutput);
    // SAFETY: static buffers of N floats.
    unsafe {
        std::ptr::copy_nonoverlapping(m.input.as_ptr(), x as *mut f32, N);
        std::ptr::copy_nonoverlapping(m.grad.as_ptr(), g as *mut f32, N);
    }
    let mut grads = vec![empty_ref(); 3];
    step(&b, &mut grads);
    step(&b, &mut grads);
    for (l, r) in grads.iter().enumerate() {
        assert_eq!(r.kind, graphed_ref_kind::AccumulateInto as u32);
        assert_eq!(r.ptr, ptrs[l]);
        let twice: Vec<f32> = want.1[l].iter().map(|v| v + v).collect();
        assert_eq!(dst[l], twice, "layer {l}");
    }
}

#[test]
fn rebinding_opaque_host_tasks_is_refused_with_the_reason_and_copies() {
    let mut m = Model::new(2);
    let want = eager(&m);
    let mut cfg = host();
    cfg.warmup_iterations = 1;
    let s = create(&cfg);
    let b = Built { s };
    for l in 0..2 {
        let mut input = tensor(l > 0);
        input.flags = graphed_tensor_flags::Rebind as u32;
        // The last layer's grad-output too.
        let out_flags = if l == 1 {
            graphed_tensor_flags::Rebind as u32
        } else {
            0
        };
        add_layer_with(
            s,
            &input,
            out_flags,
            &mut m.weights[l],
            graphed_grad_policy::Default as u32,
        );
    }
    // Which buffers are rebound is known once captured.
    let mut on = [7u32];
    // SAFETY: room for one value.
    let st = unsafe {
        graphed_session_rebound(
            s,
            0,
            0,
            graphed_buffer_role::Input as u32,
            on.as_mut_ptr(),
            1,
        )
    };
    assert_eq!(st, graphed_status::WrongState, "{}", msg());
    ok(graphed_session_capture(s));
    let st = stats(s);
    assert_eq!((st.inputs_rebound, st.inputs_rebind_refused), (0, 3));
    // Refused: copied, so 0 for each.
    for (callable, role) in [
        (0, graphed_buffer_role::Input),
        (1, graphed_buffer_role::Input),
        (1, graphed_buffer_role::GradOutput),
    ] {
        on[0] = 7;
        // SAFETY: room for one value.
        ok(unsafe { graphed_session_rebound(s, callable, 0, role as u32, on.as_mut_ptr(), 1) });
        assert_eq!(on, [0], "callable {callable} {role:?}");
    }
    // Only inputs and grad-outputs are rebound; counts must match.
    // SAFETY: room for one value (count 2 is refused before writing).
    let st = unsafe {
        graphed_session_rebound(
            s,
            0,
            0,
            graphed_buffer_role::Output as u32,
            on.as_mut_ptr(),
            1,
        )
    };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("role is output"), "{}", msg());
    let st = unsafe {
        graphed_session_rebound(
            s,
            0,
            0,
            graphed_buffer_role::Input as u32,
            on.as_mut_ptr(),
            2,
        )
    };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("count is 2; that role has 1"), "{}", msg());
    let st = unsafe {
        graphed_session_rebound(s, 0, 0, graphed_buffer_role::Input as u32, null_mut(), 1)
    };
    assert_eq!(st, graphed_status::NullPointer, "{}", msg());
    let st = unsafe {
        graphed_session_rebound(
            s,
            0,
            1,
            graphed_buffer_role::Input as u32,
            on.as_mut_ptr(),
            1,
        )
    };
    assert_eq!(st, graphed_status::InvalidArgument, "{}", msg());
    let mut len = 0;
    // SAFETY: NULL buffer asks for the length.
    ok(unsafe { graphed_session_plan_dump(s, null_mut(), 0, &mut len) });
    let mut text = vec![0u8; len + 1];
    // SAFETY: room for len + 1 bytes.
    ok(unsafe { graphed_session_plan_dump(s, text.as_mut_ptr().cast(), len + 1, &mut len) });
    let text = String::from_utf8_lossy(&text[..len]).into_owned();
    assert!(
        text.contains("input 0 of callable 0 (microbatch 0): copied at replay"),
        "{text}"
    );
    assert!(
        text.contains("grad-output 0 of callable 1 (microbatch 0): copied at replay"),
        "{text}"
    );
    assert!(text.contains("opaque"), "{text}");
    for _ in 0..2 {
        assert_eq!(per_pass(&m, &b, false), want);
    }
}

#[test]
fn steps_are_checked() {
    let mut m = Model::new(2);
    let b = build(&mut m, false, 2, 0, None);
    let callables = [1u32, 0];
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = 2;
    let mut idx = 0;
    // SAFETY: valid descriptor.
    let st = unsafe { graphed_session_add_step(b.s, &d, &mut idx) };
    assert_eq!(st, graphed_status::WrongState, "{}", msg());
    let mut a = graphed_step_args_default();
    a.step = 3;
    let mut grads = vec![empty_ref(); 2];
    // SAFETY: valid args.
    let st = unsafe { graphed_step_replay(b.s, &a, grads.as_mut_ptr(), 2) };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("step 3 does not exist"), "{}", msg());
}

/// A step is checked when it is declared: every refusal says why, writes
/// no index and declares nothing (the next good step is still step 0).
#[test]
fn step_declarations_are_checked() {
    let mut m = Model::new(2);
    let s = create(&host());
    let built = Built { s };
    for l in 0..2 {
        let mut input = tensor(l > 0);
        input.sample = m.input.as_ptr().cast();
        add_layer(s, &input, &mut m.weights[l], 0);
    }
    let mut dst = [0f32; N];
    let one: [*mut c_void; 1] = [dst.as_mut_ptr().cast()];
    let two: [*mut c_void; 2] = [dst.as_mut_ptr().cast(); 2];
    /// Callables, destinations (None: NULL), destination count, words of
    /// the message.
    type Case<'a> = (&'a [u32], Option<&'a [*mut c_void]>, usize, &'a str);
    let cases: [Case; 6] = [
        (&[], None, 0, "at least one callable"),
        (&[1, 0], None, 0, "registration order"),
        (&[0, 0], None, 0, "registration order"),
        (
            &[0, 5],
            None,
            0,
            "callables[1] is 5; the session has 2 callables",
        ),
        (&[0, 1], Some(&one), 1, "1 param destinations were given"),
        (&[0, 1], None, 2, "is NULL but its count is 2"),
    ];
    for (i, (callables, dsts, n, words)) in cases.into_iter().enumerate() {
        let mut d = graphed_step_desc_default();
        d.callables = callables.as_ptr();
        d.num_callables = callables.len();
        d.param_dsts = dsts.map_or(std::ptr::null(), |d| d.as_ptr().cast());
        d.num_param_dsts = n;
        let mut idx = 7;
        // SAFETY: the arrays hold at least the stated counts.
        let st = unsafe { graphed_session_add_step(built.s, &d, &mut idx) };
        assert_eq!(st, graphed_status::InvalidArgument, "case {i}: {}", msg());
        assert!(msg().contains(words), "case {i}: {}", msg());
        assert_eq!(idx, 7, "case {i}: no index written");
    }
    let callables = [0u32, 1];
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = 2;
    d.param_dsts = two.as_ptr().cast();
    d.num_param_dsts = 2;
    let mut idx = 7;
    // SAFETY: as above.
    ok(unsafe { graphed_session_add_step(built.s, &d, &mut idx) });
    assert_eq!(idx, 0, "the refused steps declared nothing");
    ok(graphed_session_capture(built.s));
    // CLONE grads (the default) and two clone slots: one step graph per slot.
    assert_eq!(stats(built.s).step_graphs, 2);
}

thread_local! {
    /// Captures of (forward, backward) on this thread.
    static CAPTURES: std::cell::Cell<(u32, u32)> = const { std::cell::Cell::new((0, 0)) };
}

/// Counts its captures; the second forward capture (the step's) enqueues
/// something uncapturable (a synchronize), invalidating it.
unsafe extern "C" fn forward_invalidating_the_step(
    ctx: *const graphed_pass_ctx,
    _: *mut c_void,
) -> i32 {
    // SAFETY: valid during the call.
    let c = unsafe { &*ctx };
    if c.phase == graphed_phase::Capture as u32 {
        let (f, b) = CAPTURES.get();
        CAPTURES.set((f + 1, b));
        if f + 1 == 2 {
            assert_eq!(
                graphed_host_synchronize(c.stream),
                graphed_status::CaptureInvalidated
            );
        }
    }
    0
}

unsafe extern "C" fn backward_counted(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: valid during the call.
    if unsafe { (*ctx).phase } == graphed_phase::Capture as u32 {
        let (f, b) = CAPTURES.get();
        CAPTURES.set((f, b + 1));
    }
    0
}

#[test]
fn an_invalidated_step_capture_runs_no_further_callback() {
    let s = create(&host());
    let output = graphed_tensor_desc {
        bytes: 16,
        ..graphed_tensor_desc_default()
    };
    let mut d = graphed_callable_desc_default();
    d.num_outputs = 1;
    d.outputs = &output;
    d.forward = Some(forward_invalidating_the_step);
    d.backward = Some(backward_counted);
    let mut idx = 0;
    // SAFETY: the descriptor and its array are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    let callables = [0u32];
    let mut sd = graphed_step_desc_default();
    sd.callables = callables.as_ptr();
    sd.num_callables = 1;
    // SAFETY: as above.
    ok(unsafe { graphed_session_add_step(s, &sd, &mut idx) });
    CAPTURES.set((0, 0));
    assert_eq!(
        graphed_session_capture(s),
        graphed_status::CaptureInvalidated,
        "{}",
        msg()
    );
    // The pass-by-pass captures ran forward and backward once each; the
    // step's sequence stopped at its invalidated forward.
    assert_eq!(CAPTURES.get(), (2, 1));
    ok(graphed_session_destroy(s));
}

#[test]
fn a_step_refused_by_its_shared_pool_keeps_no_clone_block() {
    let mut m = Model::new(2);
    let a = create(&host());
    let mut cb = host();
    cb.share_pool_with = a;
    let b = create(&cb);
    let policy = graphed_grad_policy::Default as u32;
    add_layer(a, &tensor(false), &mut m.weights[0], policy);
    add_layer(b, &tensor(false), &mut m.weights[1], policy);
    let callables = [0u32];
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = 1;
    let mut idx = 0;
    // SAFETY: a valid descriptor.
    ok(unsafe { graphed_session_add_step(b, &d, &mut idx) });
    ok(graphed_session_capture(a));
    ok(graphed_session_capture(b));
    // `a` is mid-iteration: the pool refuses `b`'s step, after it chose a
    // clone slot (its CLONE grads): the slot's block must go back.
    let mut out = empty_ref();
    let fa = graphed_replay_args_default();
    // SAFETY: valid args and room for one ref.
    ok(unsafe { graphed_forward(a, &fa, &mut out, 1) });
    let sa = graphed_step_args_default();
    let mut grads = [empty_ref()];
    // SAFETY: valid args and room for one ref.
    let st = unsafe { graphed_step_replay(b, &sa, grads.as_mut_ptr(), 1) };
    assert_eq!(st, graphed_status::WrongState, "{}", msg());
    assert_eq!(
        stats(b).clone_blocks_outstanding,
        0,
        "a block of the refused step is kept"
    );
    ok(graphed_session_destroy(b));
    ok(graphed_session_destroy(a));
}

#[test]
fn a_step_failing_pass_by_pass_keeps_no_lease() {
    let mut m = Model::new(2);
    let mut cfg = host();
    cfg.strict_leases = 1;
    // A caller allocator: a step with CLONE grads replays pass by pass, and
    // this one refuses every block.
    cfg.clone_alloc = Some(refuse_alloc::<1>);
    cfg.clone_free = Some(free_nothing);
    let s = create(&cfg);
    // Backward runs callable 1 (ALIAS: a lease) before callable 0 (CLONE:
    // the refused block).
    add_layer(
        s,
        &tensor(false),
        &mut m.weights[0],
        graphed_grad_policy::Clone as u32,
    );
    add_layer(
        s,
        &tensor(false),
        &mut m.weights[1],
        graphed_grad_policy::Alias as u32,
    );
    let callables = [0u32, 1];
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = 2;
    let mut idx = 0;
    // SAFETY: a valid descriptor.
    ok(unsafe { graphed_session_add_step(s, &d, &mut idx) });
    ok(graphed_session_capture(s));
    let a = graphed_step_args_default();
    let mut grads = [empty_ref(), empty_ref()];
    // SAFETY: valid args and room for two refs.
    let st = unsafe { graphed_step_replay(s, &a, grads.as_mut_ptr(), 2) };
    assert_eq!(st, graphed_status::OutOfMemory, "{}", msg());
    assert_eq!(
        stats(s).leases_held,
        0,
        "the failed step kept a lease nobody was given"
    );
    ok(graphed_session_destroy(s));
}

/// Saves a scratch block for backward through the tape.
unsafe extern "C" fn forward_saving(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: valid during the call; the tape is the instance's.
    unsafe {
        let c = &*ctx;
        let mut p = null_mut();
        let r = graphed_scratch_alloc(c.scratch, 16, &mut p);
        if r != graphed_status::Ok {
            return r as i32;
        }
        *c.tape = p;
    }
    0
}

/// Consumes the saved block: frees it and clears the tape, as a framework
/// freeing its saved tensors does.
unsafe extern "C" fn backward_consuming(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: as above.
    unsafe {
        let c = &*ctx;
        if (*c.tape).is_null() {
            return 5;
        }
        let r = graphed_scratch_free(c.scratch, *c.tape);
        *c.tape = null_mut();
        r as i32
    }
}

#[test]
fn clone_slot_captures_see_the_tape_the_first_capture_saw() {
    let mut m = Model::new(1);
    let s = create(&host());
    let output = tensor(true);
    let param = graphed_param_desc {
        data: m.weights[0].as_mut_ptr().cast(),
        bytes: N * 4,
        ..graphed_param_desc_default()
    };
    let mut d = graphed_callable_desc_default();
    d.num_outputs = 1;
    d.outputs = &output;
    d.num_params = 1;
    d.params = &param;
    d.forward = Some(forward_saving);
    d.backward = Some(backward_consuming);
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    // CLONE grads and two clone slots: the backward is captured three times.
    ok(graphed_session_capture(s));
    assert_eq!(stats(s).slot_graphs, 2);
    ok(graphed_session_destroy(s));
}
