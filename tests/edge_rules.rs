//! Rules at the edges of the C ABI, each said in the header and in
//! docs/c-api.md, through the C ABI on the host backend: which steps need a
//! clone slot and which grads they sum, what becomes of a callback's stream
//! when the session's graphs go, chained inputs of bucketed callables,
//! what a weight-grad replay reads, the device's choice and moved
//! parameters, which pass clone slots belong to, and which refusal answers
//! when several apply.

use graphed::ffi::*;
use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::{null, null_mut};

use graphed_status as S;

mod common;
use common::{create, empty_ref, host_config, layer_desc, msg, ok, stats, step_replay};

const N: usize = 16;
const BYTES: usize = N * 4;
const COLS: usize = 4;

unsafe extern "C" fn nothing(_: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    0
}

fn tensor(bytes: usize) -> graphed_tensor_desc {
    graphed_tensor_desc {
        bytes,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    }
}

fn leak<T: Clone>(v: T, n: usize) -> *mut T {
    Box::leak(vec![v; n].into_boxed_slice()).as_mut_ptr()
}

/// A parameter of `bytes` of `dtype`, grads by `policy`, flags `flags`.
fn param(dtype: graphed_dtype, bytes: usize, policy: graphed_grad_policy) -> graphed_param_desc {
    graphed_param_desc {
        data: leak(0u8, bytes).cast(),
        bytes,
        dtype: dtype as u32,
        policy: policy as u32,
        ..graphed_param_desc_default()
    }
}

/// Registers a callable of one input and one output of BYTES with
/// `params`, callbacks that record nothing, and a weight-grad pass when
/// `wgrad`.
fn add(s: *mut graphed_session, params: &[graphed_param_desc], wgrad: bool) -> u32 {
    let t = tensor(BYTES);
    let mut d = layer_desc(&t, &t, params, Some(nothing), Some(nothing));
    if wgrad {
        d.wgrad = Some(nothing);
    }
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    idx
}

/// A step over callable 0: `microbatches`, WHILE when `looping`, and one
/// io copy of its input from `io` when given; its destinations `dsts`.
fn add_step(
    s: *mut graphed_session,
    microbatches: u32,
    looping: bool,
    io: Option<*mut c_void>,
    dsts: &[*mut c_void],
) {
    let callables = [0u32];
    let e = io.map(|ptr| graphed_step_io {
        ptr,
        stride: BYTES,
        ..graphed_step_io_default()
    });
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = 1;
    d.microbatches = microbatches;
    if looping {
        d.loop_mode = graphed_step_loop::While as u32;
    }
    if let Some(e) = &e {
        d.io = e;
        d.num_io = 1;
    }
    if !dsts.is_empty() {
        d.param_dsts = dsts.as_ptr().cast();
        d.num_param_dsts = dsts.len();
    }
    let mut idx = 7;
    // SAFETY: a valid descriptor and its arrays.
    ok(unsafe { graphed_session_add_step(s, &d, &mut idx) });
}

/// A session of `clone_slots` clone slots, with a callable of one CLONE
/// parameter and a step of one microbatch over it, WHILE when `looping`,
/// with an io copy from `io` when given; it and the status of its capture.
fn clone_step(
    clone_slots: u32,
    looping: bool,
    io: Option<*mut c_void>,
) -> (*mut graphed_session, S) {
    let mut cfg = host_config();
    cfg.clone_slots = clone_slots;
    let s = create(&cfg);
    add(
        s,
        &[param(graphed_dtype::F32, BYTES, graphed_grad_policy::Clone)],
        false,
    );
    add_step(s, 1, looping, io, &[]);
    (s, graphed_session_capture(s))
}

/// A step with io copies, or looping on the device, has no pass-by-pass
/// replay even for one microbatch: its CLONE grads need a clone slot.
#[test]
fn a_step_with_io_or_a_loop_needs_a_clone_slot_even_for_one_microbatch() {
    let io = leak(0u8, BYTES).cast::<c_void>();
    for (looping, with_io, says) in [
        (
            false,
            true,
            "copies data in or out and returns CLONE grads, which need a clone slot",
        ),
        (
            true,
            false,
            "copies data in or out and returns CLONE grads, which need a clone slot",
        ),
    ] {
        let (s, st) = clone_step(0, looping, with_io.then_some(io));
        assert_eq!(st, S::Incompatible, "{}", msg());
        assert!(
            msg().contains(says) && msg().contains("clone_slots is 0"),
            "{}",
            msg()
        );
        ok(graphed_session_destroy(s));
    }
    // Without io or a loop, the same step replays pass by pass.
    let (s, st) = clone_step(0, false, None);
    ok(st);
    let (st, refs) = step_replay(s, 1, None);
    assert_eq!(st, S::Ok, "{}", msg());
    ok(graphed_buffer_release(refs[0].owner));
    ok(graphed_session_destroy(s));
    // With a slot: captured; with the slot held, ALIAS_HELD.
    let (s, st) = clone_step(1, false, Some(io));
    ok(st);
    let (st, held) = step_replay(s, 1, None);
    assert_eq!(st, S::Ok, "{}", msg());
    assert_eq!(step_replay(s, 1, None).0, S::AliasHeld, "{}", msg());
    ok(graphed_buffer_release(held[0].owner));
    ok(graphed_session_destroy(s));
}

/// graphed sums f32, f16 and bf16 grads over microbatches: CLONE and
/// COPY_INTO grads of another dtype are INCOMPATIBLE at capture (a WHILE
/// step sums even for one microbatch); a step of one microbatch without a
/// loop sums nothing and takes them.
#[test]
fn only_f32_f16_and_bf16_grads_are_summed_over_microbatches() {
    use graphed_dtype as D;
    use graphed_grad_policy as P;
    let cases = [
        (D::F64, P::Clone, 2, false, Some("f64")),
        (D::I32, P::Clone, 2, false, Some("i32")),
        (D::F64, P::CopyInto, 2, false, Some("f64")),
        (D::I32, P::CopyInto, 3, false, Some("i32")),
        (D::F64, P::Clone, 1, true, Some("f64")),
        (D::F16, P::Clone, 2, false, None),
        (D::Bf16, P::CopyInto, 2, false, None),
        (D::F64, P::Clone, 1, false, None),
        (D::I32, P::CopyInto, 1, false, None),
    ];
    for (dtype, policy, microbatches, looping, refused) in cases {
        let what = format!("{dtype:?} {policy:?}, {microbatches} microbatches, WHILE {looping}");
        let s = create(&host_config());
        add(s, &[param(dtype, BYTES, policy)], false);
        let dst = leak(0u8, BYTES).cast::<c_void>();
        let dsts = if policy == P::CopyInto {
            vec![dst]
        } else {
            Vec::new()
        };
        add_step(s, microbatches, looping, None, &dsts);
        let st = graphed_session_capture(s);
        match refused {
            Some(name) => {
                assert_eq!(st, S::Incompatible, "{what}: {}", msg());
                assert!(
                    msg().contains(&format!("has {name} grads, which graphed does not sum"))
                        && msg().contains("it sums f32, f16 and bf16"),
                    "{what}: {}",
                    msg()
                );
            }
            None => assert_eq!(st, S::Ok, "{what}: {}", msg()),
        }
        ok(graphed_session_destroy(s));
    }
    // ACCUMULATE_INTO takes the same three only, at registration.
    let s = create(&host_config());
    let t = tensor(BYTES);
    let p = [param(D::F64, BYTES, P::AccumulateInto)];
    let d = layer_desc(&t, &t, &p, Some(nothing), Some(nothing));
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    let st = unsafe { graphed_session_add_callable(s, &d, &mut idx) };
    assert_eq!(st, S::InvalidArgument);
    assert!(
        msg().contains("ACCUMULATE_INTO supports f32, f16 and bf16"),
        "{}",
        msg()
    );
    ok(graphed_session_destroy(s));
}

thread_local! {
    static KEPT: Cell<usize> = const { Cell::new(0) };
    static FAIL: Cell<bool> = const { Cell::new(false) };
}

/// Keeps its stream; fails under capture when FAIL is set.
unsafe extern "C" fn keep_stream(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: the context is valid during the call.
    let c = unsafe { &*ctx };
    KEPT.set(c.stream as usize);
    let capturing = c.phase == graphed_phase::Capture as u32;
    if FAIL.get() && capturing {
        return 5;
    }
    0
}

unsafe extern "C" fn noop_task(_: *mut c_void) {}

fn enqueue_on_kept() -> S {
    // SAFETY: a task without data; the stream is checked by the call.
    unsafe { graphed_host_enqueue(KEPT.get() as graphed_stream, Some(noop_task), null_mut()) }
}

/// The stream a callback is given is the session's capture stream: it goes
/// with the session's graphs, at a reset or a failed capture, though the
/// session lives on; a kept one is then USE_AFTER_DESTROY, saying so.
#[test]
fn a_kept_callback_stream_goes_with_the_sessions_graphs() {
    let t = tensor(BYTES);
    let d = layer_desc(&t, &t, &[], Some(keep_stream), Some(keep_stream));
    for fail in [false, true] {
        FAIL.set(fail);
        let s = create(&host_config());
        let mut idx = 0;
        // SAFETY: the descriptor and its arrays are valid locals.
        ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
        let st = graphed_session_capture(s);
        if fail {
            assert_eq!(st, S::CallbackFailed, "{}", msg());
        } else {
            ok(st);
            assert_eq!(
                enqueue_on_kept(),
                S::Ok,
                "live while the graphs are: {}",
                msg()
            );
            ok(graphed_session_reset(s));
        }
        assert_eq!(
            enqueue_on_kept(),
            S::UseAfterDestroy,
            "failed capture {fail}"
        );
        assert!(
            msg().contains("a session's capture stream goes with its graphs")
                && msg().contains("the session may live on"),
            "{}",
            msg()
        );
        assert_eq!(
            graphed_host_synchronize(KEPT.get() as graphed_stream),
            S::UseAfterDestroy
        );
        ok(graphed_session_destroy(s));
    }
    FAIL.set(false);
    // As another session's replay stream too.
    let kept = KEPT.get();
    let other = create(&host_config());
    add(other, &[], false);
    ok(graphed_session_capture(other));
    let mut a = graphed_replay_args_default();
    a.stream = kept as graphed_stream;
    let mut out = [empty_ref()];
    // SAFETY: valid args and room for one ref.
    let st = unsafe { graphed_forward(other, &a, out.as_mut_ptr(), 1) };
    assert_eq!(st, S::UseAfterDestroy, "{}", msg());
    ok(graphed_session_destroy(other));
}

/// Buckets [2, 4] of rows of COLS floats.
const BUCKETS: [u64; 2] = [2, 4];
static SHAPE: [i64; 2] = [4, COLS as i64];

fn dynamic() -> graphed_tensor_desc {
    graphed_tensor_desc {
        ndim: 2,
        shape: SHAPE.as_ptr(),
        flags: graphed_tensor_flags::Dynamic as u32,
        ..tensor(BYTES)
    }
}

/// Registers a bucketed callable with `input` and `outputs`, without
/// parameters, whose callbacks record nothing.
fn add_bucketed(
    s: *mut graphed_session,
    input: &graphed_tensor_desc,
    outputs: &[graphed_tensor_desc],
) -> S {
    add_bucketed_with(s, input, outputs, &[], Some(nothing), false)
}

/// Registers a bucketed callable with `input`, `outputs`, `params` and
/// callbacks `cb` (also the weight-grad one when `wgrad`).
fn add_bucketed_with(
    s: *mut graphed_session,
    input: &graphed_tensor_desc,
    outputs: &[graphed_tensor_desc],
    params: &[graphed_param_desc],
    cb: graphed_pass_fn,
    wgrad: bool,
) -> S {
    let mut d = layer_desc(input, &outputs[0], params, cb, cb);
    d.outputs = outputs.as_ptr();
    d.num_outputs = outputs.len();
    d.bucket_sizes = BUCKETS.as_ptr();
    d.num_buckets = BUCKETS.len();
    if wgrad {
        d.wgrad = cb;
    }
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    unsafe { graphed_session_add_callable(s, &d, &mut idx) }
}

/// A parameter of COLS floats whose grads are ALIAS.
fn row_param() -> graphed_param_desc {
    param(graphed_dtype::F32, COLS * 4, graphed_grad_policy::Alias)
}

/// A captured session of `cfg` with one bucketed callable of a DYNAMIC
/// input and output, `params` and callbacks `cb`, a weight-grad pass too.
fn with_wgrad(
    cfg: &graphed_session_config,
    params: &[graphed_param_desc],
    cb: graphed_pass_fn,
) -> *mut graphed_session {
    let s = create(cfg);
    ok(add_bucketed_with(
        s,
        &dynamic(),
        &[dynamic()],
        params,
        cb,
        true,
    ));
    ok(graphed_session_capture(s));
    s
}

fn chained(shape: Option<&[i64; 2]>, output: u32) -> graphed_tensor_desc {
    graphed_tensor_desc {
        flags: graphed_tensor_flags::Chained as u32,
        chain_callable: 0,
        chain_output: output,
        ndim: shape.map_or(0, |_| 2),
        shape: shape.map_or(null(), |s| s.as_ptr()),
        ..tensor(BYTES)
    }
}

fn fwd(s: *mut graphed_session, callable: u32, size: u64) -> S {
    let mut a = graphed_replay_args_default();
    a.callable = callable;
    a.size = size;
    let mut out = [empty_ref(); 2];
    let (mut i, mut p, mut n) = (0, 0, 0);
    // SAFETY: locals.
    ok(unsafe { graphed_session_callable_arity(s, callable, &mut i, &mut p, &mut n) });
    // SAFETY: valid args and room for the callable's outputs (1 or 2).
    unsafe { graphed_forward(s, &a, out.as_mut_ptr(), n) }
}

/// An input chained to a DYNAMIC output is DYNAMIC: a shape of its own
/// must have the largest bucket first, and its forward runs the rows its
/// producer ran. One chained to an output of one shape is read as it is,
/// at any size, before the producer's first forward too.
#[test]
fn chained_inputs_of_bucketed_callables() {
    let fixed = tensor(BYTES);
    for (shape, accepted) in [(Some([2i64, 8]), false), (Some([4, 4]), true), (None, true)] {
        let s = create(&host_config());
        ok(add_bucketed(s, &dynamic(), &[dynamic()]));
        let st = add_bucketed(s, &chained(shape.as_ref(), 0), &[dynamic()]);
        if accepted {
            assert_eq!(st, S::Ok, "{shape:?}: {}", msg());
        } else {
            assert_eq!(st, S::InvalidArgument, "{shape:?}");
            assert!(
                msg().contains(
                    "is DYNAMIC: its shape's first dimension must be the largest bucket (4)"
                ),
                "{}",
                msg()
            );
        }
        ok(graphed_session_destroy(s));
    }
    // A producer with a DYNAMIC output (0) and one of one shape (1).
    let s = create(&host_config());
    ok(add_bucketed(s, &dynamic(), &[dynamic(), fixed]));
    ok(add_bucketed(s, &chained(None, 0), &[dynamic()]));
    ok(add_bucketed(s, &chained(None, 1), &[dynamic()]));
    ok(graphed_session_capture(s));
    // Before the producer's first forward: the DYNAMIC one is refused, the
    // other runs any size.
    assert_eq!(fwd(s, 1, 3), S::InvalidArgument);
    assert!(
        msg().contains("whose last forward has not run since capture"),
        "{}",
        msg()
    );
    assert_eq!(fwd(s, 2, 3), S::Ok, "{}", msg());
    assert_eq!(fwd(s, 2, 1), S::Ok, "{}", msg());
    ok(fwd(s, 0, 1));
    assert_eq!(fwd(s, 1, 3), S::InvalidArgument);
    assert!(msg().contains("whose last forward ran 1 rows"), "{}", msg());
    assert_eq!(fwd(s, 1, 1), S::Ok, "{}", msg());
    assert_eq!(fwd(s, 2, 4), S::Ok, "{}", msg());
    ok(graphed_session_destroy(s));
}

/// `gw[c] = sum over the bucket's rows of gy[r][c]` (the weight-grad
/// pass); the forward and backward record nothing.
struct SumRows {
    rows: usize,
    gy: *const f32,
    gw: *mut f32,
}

unsafe extern "C" fn run_sum(data: *mut c_void) {
    // SAFETY: a leaked SumRows over the session's buffers.
    unsafe {
        let k = &*(data as *const SumRows);
        for c in 0..COLS {
            *k.gw.add(c) = (0..k.rows).map(|r| *k.gy.add(r * COLS + c)).sum();
        }
    }
}

unsafe extern "C" fn sum_rows(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: the context and its arrays are valid during the call.
    unsafe {
        let c = &*ctx;
        if c.pass != graphed_pass::Wgrad as u32 {
            return 0;
        }
        let k = Box::into_raw(Box::new(SumRows {
            rows: c.bucket_size as usize,
            gy: *c.grad_outputs as *const f32,
            gw: *c.param_grads as *mut f32,
        }));
        graphed_host_enqueue(c.stream, Some(run_sum), k.cast()) as i32
    }
}

/// A weight-grad replay takes no data: it reads the grad-outputs as the
/// last backward left them. After a forward of another size with no
/// backward between, the rows past the new size are that backward's data.
#[test]
fn a_weight_grad_replay_reads_the_grad_outputs_its_last_backward_left() {
    let p = [row_param()];
    let s = with_wgrad(&host_config(), &p, Some(sum_rows));
    let ones = [1.0f32; N];
    let backward = |size: u64| {
        let data = [ones.as_ptr() as *const c_void];
        let mut a = graphed_replay_args_default();
        a.data = data.as_ptr();
        a.num_data = 1;
        a.size = size;
        let mut gi = [empty_ref()];
        let mut gp = [empty_ref()];
        // SAFETY: valid args and room for one ref each.
        ok(unsafe { graphed_backward(s, &a, gi.as_mut_ptr(), 1, gp.as_mut_ptr(), 1) });
    };
    let wgrad = || {
        let a = graphed_replay_args_default();
        let mut gp = [empty_ref()];
        // SAFETY: valid args and room for one ref.
        ok(unsafe { graphed_backward_wgrad(s, &a, gp.as_mut_ptr(), 1) });
        // SAFETY: an ALIAS of COLS floats.
        unsafe { std::slice::from_raw_parts(gp[0].ptr as *const f32, COLS) }.to_vec()
    };
    ok(fwd(s, 0, 4));
    backward(4);
    assert_eq!(wgrad(), vec![4.0; COLS], "four rows of ones");
    // One row, bucket 2: without its backward, row 1 is the earlier
    // backward's grad-output, not a zero padding row.
    ok(fwd(s, 0, 1));
    assert_eq!(wgrad(), vec![2.0; COLS], "the earlier backward's rows");
    // After its own backward, the padding row is zero.
    backward(1);
    assert_eq!(wgrad(), vec![1.0; COLS]);
    ok(graphed_session_destroy(s));
}

/// A backward or weight-grad replay given another parameter address than
/// its forward read: INVALID_ARGUMENT after a forward the host chose,
/// PARAM_MOVED after one that chose its bucket on the device (such replays
/// read every parameter where capture did).
#[test]
fn a_backward_after_the_devices_choice_answers_param_moved_for_another_address() {
    let mut cfg = host_config();
    cfg.bucket_choice_on_device = 1;
    let p = [row_param()];
    let registered = p[0].data as *const c_void;
    let s = with_wgrad(&cfg, &p, Some(nothing));
    let other = [leak(0u8, COLS * 4 + 256) as *const c_void];
    let size = Box::new(3u64);
    let replay = |kind: u32, device: bool, params: &[*const c_void]| {
        let mut a = graphed_replay_args_default();
        a.params = params.as_ptr();
        a.num_params = params.len();
        match (kind, device) {
            (0, true) => a.device_size = &*size,
            (0, false) => a.size = 3,
            _ => {}
        }
        let mut r = [empty_ref(); 1];
        // SAFETY: valid args and room for one ref per array.
        unsafe {
            match kind {
                0 => graphed_forward(s, &a, r.as_mut_ptr(), 1),
                1 => graphed_backward(s, &a, r.as_mut_ptr(), 1, [empty_ref()].as_mut_ptr(), 1),
                _ => graphed_backward_wgrad(s, &a, r.as_mut_ptr(), 1),
            }
        }
    };
    for (device, want) in [(false, S::InvalidArgument), (true, S::ParamMoved)] {
        assert_eq!(replay(0, device, &[registered]), S::Ok, "{}", msg());
        for kind in [1, 2] {
            assert_eq!(
                replay(kind, device, &other),
                want,
                "device {device}, pass {kind}: {}",
                msg()
            );
            assert_eq!(replay(kind, device, &[registered]), S::Ok, "{}", msg());
        }
    }
    ok(graphed_session_destroy(s));
}

thread_local! {
    static GRAD_IN: Cell<usize> = const { Cell::new(0) };
}

/// Hands its input's grad over (EXTERNAL) in the backward's captures
/// (refused in a step's, where the buffer is the one already given);
/// records nothing.
unsafe extern "C" fn provide_grad_input(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: the context is valid during the call.
    let c = unsafe { &*ctx };
    if c.pass == graphed_pass::Backward as u32 && !c.capture.is_null() {
        let r = graphed_pass_set_buffer(
            c.capture,
            graphed_buffer_role::GradInput as u32,
            0,
            GRAD_IN.get() as *mut c_void,
        );
        if r != S::Ok && r != S::WrongState {
            return r as i32;
        }
    }
    0
}

/// Clone slots are captures of the pass that writes the parameter grads:
/// the weight-grad pass where there is one. A backward that provides its
/// input grad (EXTERNAL) leaves the callable without slots only when it
/// writes the parameter grads too.
#[test]
fn clone_slots_belong_to_the_pass_that_writes_the_parameter_grads() {
    GRAD_IN.set(leak(0u8, BYTES) as usize);
    for wgrad in [true, false] {
        let s = create(&host_config());
        let input = graphed_tensor_desc {
            flags: graphed_tensor_flags::External as u32,
            ..tensor(BYTES)
        };
        let out = tensor(BYTES);
        let p = [param(graphed_dtype::F32, BYTES, graphed_grad_policy::Clone)];
        let mut d = layer_desc(
            &input,
            &out,
            &p,
            Some(provide_grad_input),
            Some(provide_grad_input),
        );
        if wgrad {
            d.wgrad = Some(provide_grad_input);
        }
        let mut idx = 0;
        // SAFETY: the descriptor and its arrays are valid locals.
        ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
        add_step(s, 2, false, None, &[]);
        let st = graphed_session_capture(s);
        if wgrad {
            assert_eq!(st, S::Ok, "the weight-grad pass keeps its slots: {}", msg());
            assert_eq!(
                stats(s).slot_graphs,
                2,
                "the weight-grad pass of each default slot"
            );
        } else {
            assert_eq!(st, S::Incompatible);
            assert!(
                msg().contains("external parameter or input grads, whose pass gets no clone slots"),
                "{}",
                msg()
            );
        }
        ok(graphed_session_destroy(s));
    }
}

/// Where several refusals apply, the first in the documented order
/// answers: the state before the size, the size before the parameters,
/// the parameters before the pool's order and the clone slots, the
/// schedule before the output capacity.
#[test]
fn the_first_refusal_in_the_documented_order_answers() {
    // Not captured, and a size on a callable without buckets.
    let s = create(&host_config());
    add(s, &[], false);
    assert_eq!(fwd(s, 0, 3), S::WrongState, "{}", msg());
    ok(graphed_session_capture(s));
    assert_eq!(fwd(s, 0, 3), S::InvalidArgument, "{}", msg());
    ok(graphed_session_destroy(s));
    // A size above every bucket, and a parameter given elsewhere (the
    // host backend's opaque tasks: not movable).
    let p = [graphed_param_desc {
        flags: graphed_param_flags::Rebind as u32,
        ..row_param()
    }];
    let s = with_wgrad(&host_config(), &p, Some(sum_rows));
    let other = [leak(0u8, COLS * 4) as *const c_void];
    let mut a = graphed_replay_args_default();
    a.size = 5;
    a.params = other.as_ptr();
    a.num_params = 1;
    let mut out = [empty_ref()];
    // SAFETY: valid args and room for one ref.
    assert_eq!(
        unsafe { graphed_forward(s, &a, out.as_mut_ptr(), 1) },
        S::InvalidArgument
    );
    assert!(
        msg().contains("args.size 5 is above the largest bucket"),
        "{}",
        msg()
    );
    a.size = 3;
    // SAFETY: as above.
    assert_eq!(
        unsafe { graphed_forward(s, &a, out.as_mut_ptr(), 1) },
        S::ParamMoved,
        "{}",
        msg()
    );
    ok(graphed_session_destroy(s));
    // A step over microbatches whose slot is held, given a parameter less
    // aligned than registered, then sharing a pool with a session in the
    // middle of its iteration.
    let a0 = create(&host_config());
    add(a0, &[], false);
    let mut cfg = host_config();
    cfg.clone_slots = 1;
    cfg.share_pool_with = a0;
    let s = create(&cfg);
    let at = (leak(0u8, BYTES + 512) as usize + 255) & !255;
    let p = [graphed_param_desc {
        data: at as *mut c_void,
        flags: graphed_param_flags::Rebind as u32,
        ..param(graphed_dtype::F32, BYTES, graphed_grad_policy::Clone)
    }];
    add(s, &p, false);
    add_step(s, 2, false, None, &[]);
    ok(graphed_session_capture(a0));
    ok(graphed_session_capture(s));
    let (st, held) = step_replay(s, 1, None);
    assert_eq!(st, S::Ok, "{}", msg());
    let mut f = graphed_replay_args_default();
    f.callable = 0;
    let mut out = [empty_ref()];
    // SAFETY: valid args and room for one ref.
    ok(unsafe { graphed_forward(a0, &f, out.as_mut_ptr(), 1) });
    let less = [(at + 256 + 4) as *const c_void];
    assert_eq!(step_replay(s, 1, Some(&less)).0, S::ParamMoved, "{}", msg());
    assert_eq!(step_replay(s, 1, None).0, S::WrongState, "{}", msg());
    let mut b = graphed_replay_args_default();
    b.callable = 0;
    let mut gi = [empty_ref()];
    // SAFETY: valid args and room for one ref and none.
    ok(unsafe { graphed_backward(a0, &b, gi.as_mut_ptr(), 1, null_mut(), 0) });
    assert_eq!(step_replay(s, 1, None).0, S::AliasHeld, "{}", msg());
    ok(graphed_buffer_release(held[0].owner));
    ok(graphed_session_destroy(s));
    ok(graphed_session_destroy(a0));
    // A schedule without steps given layers per chunk, and a capacity whose
    // bytes overflow.
    let split = [1u32];
    let mut passes = [graphed_pass_ref {
        callable: 7,
        microbatch: 7,
        pass: 7,
    }];
    let mut count = 0x77usize;
    // SAFETY: the arrays hold the stated counts; the capacity is refused
    // before anything is written.
    let st = unsafe {
        graphed_schedule_passes(
            null(),
            0,
            size_of::<graphed_schedule_step>(),
            split.as_ptr(),
            1,
            null(),
            1,
            passes.as_mut_ptr(),
            usize::MAX / 8,
            size_of::<graphed_pass_ref>(),
            &mut count,
        )
    };
    assert_eq!(st, S::InvalidSchedule, "{}", msg());
    assert_eq!(count, 0x77);
}
