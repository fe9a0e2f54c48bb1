//! Parameters that move, through the C ABI on the host backend: what
//! replays and step replays do with the parameters' addresses
//! (graphed_replay_args.params, graphed_step_args.params) and what
//! graphed_session_params_movable, the stats and the plan dump say.
//!
//! The host backend's graphs run the callbacks' host tasks, whose data is
//! opaque: no parameter can be pointed elsewhere there, so capture refuses
//! every one registered with GRAPHED_PARAM_FLAGS_REBIND and says why. A
//! forward given another address is refused with PARAM_MOVED (naming the
//! callable, the microbatch, the parameter and both addresses), a backward
//! or weight-grad replay given another address than its forward read with
//! INVALID_ARGUMENT, a wrong count with INVALID_ARGUMENT; NULL entries and
//! the registered addresses are accepted. A refused replay enqueues
//! nothing: the replays after it give what they give without it.
//!
//! The layer is elementwise over f32, `y = (x * w0) * w1`; backward
//! `gx = w0 * gy`, `gw0 = gw1 = x * gy` (or the weight-grad pass computes
//! the parameter grads), enqueued as host tasks.

use graphed::ffi::*;
use std::ffi::{c_char, c_void};
use std::ptr::{null, null_mut};

use graphed_status as S;

mod common;
use common::{empty_ref, msg, ok, stats};

const N: usize = 16;
const BYTES: usize = N * 4;
const REBIND: u32 = graphed_param_flags::Rebind as u32;
const FWD: u32 = graphed_pass::Forward as u32;
const BWD: u32 = graphed_pass::Backward as u32;

/// `out[i] = a[i] * b[i]` over N floats.
struct Mul {
    a: *const f32,
    b: *const f32,
    out: *mut f32,
}

unsafe extern "C" fn run_mul(data: *mut c_void) {
    // SAFETY: a leaked Mul whose buffers hold N floats while the session's
    // graphs exist (the tests keep them alive).
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

/// The pointer at `i` of a pass context's array.
///
/// # Safety
/// `p` holds more than `i` pointers.
unsafe fn at(p: *const *mut c_void, i: usize) -> *mut f32 {
    // SAFETY: the caller's promise.
    unsafe { *p.add(i) as *mut f32 }
}

unsafe extern "C" fn forward(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: the context and its arrays are valid during the call.
    unsafe {
        let c = &*ctx;
        let (x, y) = (at(c.inputs, 0), at(c.outputs, 0));
        let r = enqueue(c.stream, x, at(c.params, 0), y);
        if r != 0 {
            return r;
        }
        enqueue(c.stream, y, at(c.params, 1), y)
    }
}

/// The parameter grads `gw0 = gw1 = x * gy`.
///
/// # Safety
/// A context of the layer's callable.
unsafe fn param_grads(c: &graphed_pass_ctx) -> i32 {
    // SAFETY: the caller's promise.
    unsafe {
        let (x, gy) = (at(c.inputs, 0), at(c.grad_outputs, 0));
        for j in 0..2 {
            let r = enqueue(c.stream, x, gy, at(c.param_grads, j));
            if r != 0 {
                return r;
            }
        }
        0
    }
}

unsafe extern "C" fn backward(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: as above.
    unsafe {
        let c = &*ctx;
        let r = enqueue(
            c.stream,
            at(c.params, 0),
            at(c.grad_outputs, 0),
            at(c.grad_inputs, 0),
        );
        if r != 0 || at(c.param_grads, 0).is_null() {
            return r;
        }
        // With a weight-grad pass too: the same grads, computed twice.
        param_grads(c)
    }
}

unsafe extern "C" fn wgrad(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: as above.
    unsafe { param_grads(&*ctx) }
}

fn host() -> graphed_session_config {
    let mut c = graphed_session_config_default();
    c.backend = graphed_backend::Host as u32;
    c.warmup_iterations = 1;
    c
}

/// A new host session; with `microbatches` > 1, a schedule of that many
/// forwards then as many backwards of one chunk.
fn create(microbatches: usize) -> *mut graphed_session {
    let mut cfg = host();
    let steps: Vec<graphed_schedule_step> = (0..2 * microbatches)
        .map(|k| graphed_schedule_step {
            pass: if k < microbatches { FWD } else { BWD },
            chunk: 0,
        })
        .collect();
    if microbatches > 1 {
        cfg.schedule = steps.as_ptr();
        cfg.num_schedule_steps = steps.len();
        cfg.schedule_step_size = size_of::<graphed_schedule_step>();
    }
    let mut s = null_mut();
    // SAFETY: a valid config and out pointer.
    ok(unsafe { graphed_session_create(&cfg, &mut s) });
    s
}

/// Weights that live for the whole test: `w0 = 2 + i/4`, `w1 = 0.5 * k`.
fn weights(k: f32) -> (*mut f32, *mut f32) {
    let w0: Vec<f32> = (0..N).map(|i| 2.0 + i as f32 / 4.0).collect();
    let w1: Vec<f32> = (0..N).map(|_| 0.5 * k).collect();
    (
        Box::leak(w0.into_boxed_slice()).as_mut_ptr(),
        Box::leak(w1.into_boxed_slice()).as_mut_ptr(),
    )
}

/// Registers the layer `name` with weights `w` (flags `flags` each, ALIAS
/// grads), and a weight-grad pass when `with_wgrad`; returns its index.
fn add(
    s: *mut graphed_session,
    name: &str,
    w: (*mut f32, *mut f32),
    flags: [u32; 2],
    with_wgrad: bool,
) -> u32 {
    let tensor = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    let (input, output) = (tensor, tensor);
    let params: Vec<graphed_param_desc> = [w.0, w.1]
        .iter()
        .zip(flags)
        .map(|(&data, flags)| graphed_param_desc {
            data: data.cast(),
            bytes: BYTES,
            flags,
            policy: graphed_grad_policy::Alias as u32,
            ..graphed_param_desc_default()
        })
        .collect();
    let name = std::ffi::CString::new(name).unwrap();
    let mut d = common::layer_desc(&input, &output, &params, Some(forward), Some(backward));
    d.name = name.as_ptr();
    if with_wgrad {
        d.wgrad = Some(wgrad);
    }
    let mut idx = 7;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    idx
}

/// A session of one layer with weights `w` registered with `flags`,
/// captured.
fn layer(w: (*mut f32, *mut f32), flags: [u32; 2]) -> *mut graphed_session {
    let s = create(1);
    add(s, "mover", w, flags, false);
    ok(graphed_session_capture(s));
    s
}

fn read(p: *const c_void) -> Vec<f32> {
    // SAFETY: a static buffer of N floats, or the test's own.
    unsafe { std::slice::from_raw_parts(p as *const f32, N) }.to_vec()
}

fn input(seed: f32) -> Vec<f32> {
    (0..N).map(|i| seed + i as f32).collect()
}

/// The parameters' addresses as replay args carry them.
fn addrs(ps: &[*const f32]) -> Vec<*const c_void> {
    ps.iter().map(|&p| p.cast()).collect()
}

/// A forward of (callable, mb) with input `x` and the parameters at
/// `params` (None: a NULL array); the status and the output ref.
fn fwd_at(
    s: *mut graphed_session,
    callable: u32,
    mb: u32,
    x: &[f32],
    params: Option<&[*const c_void]>,
) -> (graphed_status, graphed_ref) {
    let data = [x.as_ptr() as *const c_void];
    let mut a = graphed_replay_args_default();
    a.callable = callable;
    a.microbatch = mb;
    a.data = data.as_ptr();
    a.num_data = 1;
    if let Some(p) = params {
        a.params = p.as_ptr();
        a.num_params = p.len();
    }
    let mut out = empty_ref();
    // SAFETY: valid args and room for one ref.
    let st = unsafe { graphed_forward(s, &a, &mut out, 1) };
    (st, out)
}

fn fwd(s: *mut graphed_session, x: &[f32], params: Option<&[*const c_void]>) -> graphed_status {
    fwd_at(s, 0, 0, x, params).0
}

/// A forward that must succeed: the output.
fn output(s: *mut graphed_session, x: &[f32], params: Option<&[*const c_void]>) -> Vec<f32> {
    let (st, out) = fwd_at(s, 0, 0, x, params);
    assert_eq!(st, S::Ok, "{}", msg());
    read(out.ptr)
}

/// A backward of callable 0 with grad output `gy` and the parameters at
/// `params`: the status, the input grad and the parameter grads (read, when
/// it succeeded).
fn bwd(
    s: *mut graphed_session,
    gy: &[f32],
    params: Option<&[*const c_void]>,
) -> (graphed_status, Vec<f32>, Vec<Vec<f32>>) {
    let data = [gy.as_ptr() as *const c_void];
    let mut a = graphed_replay_args_default();
    a.data = data.as_ptr();
    a.num_data = 1;
    if let Some(p) = params {
        a.params = p.as_ptr();
        a.num_params = p.len();
    }
    let mut gi = [empty_ref()];
    let mut gp = [empty_ref(); 2];
    // SAFETY: valid args and room for the stated refs.
    let st = unsafe { graphed_backward(s, &a, gi.as_mut_ptr(), 1, gp.as_mut_ptr(), 2) };
    if st != S::Ok {
        assert!(gi[0].ptr.is_null() && gp.iter().all(|r| r.ptr.is_null()));
        return (st, Vec::new(), Vec::new());
    }
    // NONE refs (a callable with a weight-grad pass) read as empty.
    let grads = gp
        .iter()
        .map(|r| {
            if r.ptr.is_null() {
                Vec::new()
            } else {
                read(r.ptr)
            }
        })
        .collect();
    (st, read(gi[0].ptr), grads)
}

/// graphed_session_params_movable into `count` values (NULL when `null`):
/// the status and the values (7 where untouched, one more past count).
fn movable(
    s: *mut graphed_session,
    callable: u32,
    mb: u32,
    count: usize,
    null: bool,
) -> (graphed_status, Vec<u32>) {
    let mut on = vec![7u32; count + 1];
    let p = if null { null_mut() } else { on.as_mut_ptr() };
    // SAFETY: room for count values, or NULL (refused).
    let st = unsafe { graphed_session_params_movable(s, callable, mb, p, count) };
    (st, on)
}

/// The plan dump as text.
fn plan_dump(s: *mut graphed_session) -> String {
    let mut len = 0;
    // SAFETY: a NULL buffer asks for the length.
    ok(unsafe { graphed_session_plan_dump(s, null_mut(), 0, &mut len) });
    let mut buf = vec![0u8; len + 1];
    // SAFETY: room for len + 1 bytes.
    ok(unsafe {
        graphed_session_plan_dump(s, buf.as_mut_ptr() as *mut c_char, buf.len(), &mut len)
    });
    String::from_utf8_lossy(&buf[..len]).into_owned()
}

/// A static buffer's address.
fn buffer(s: *mut graphed_session, role: graphed_buffer_role) -> *mut c_void {
    let mut p = null_mut();
    // SAFETY: room for one pointer.
    ok(unsafe { graphed_session_buffers(s, 0, 0, role as u32, &mut p, 1) });
    p
}

/// Fresh parameter memory: aligned to 256 bytes, plus `off`.
fn elsewhere(off: usize) -> *const f32 {
    let b = Box::leak(vec![0u8; BYTES + 512].into_boxed_slice());
    let base = (b.as_ptr() as usize + 255) & !255;
    (base + off) as *const f32
}

fn hex(p: *const f32) -> String {
    format!("0x{:x}", p as usize)
}

#[test]
fn a_param_registered_without_the_flag_is_refused_elsewhere_and_the_message_names_it() {
    let w = weights(1.0);
    let s = layer(w, [0, 0]);
    let x = input(1.0);
    let plain = output(s, &x, None);
    let to = elsewhere(0);
    let (st, out) = fwd_at(s, 0, 0, &input(50.0), Some(&addrs(&[w.0, to])));
    assert_eq!(st, S::ParamMoved, "{}", msg());
    assert!(
        out.ptr.is_null() && out.kind == 0,
        "a ref written on refusal"
    );
    let m = msg();
    assert!(m.starts_with("graphed_forward: "), "{m}");
    for said in [
        "callable 'mover'",
        "microbatch 0",
        "param 1 ",
        &hex(w.1),
        &hex(to),
        "registered without the REBIND flag",
    ] {
        assert!(m.contains(said), "{said:?} missing: {m}");
    }
    // SAFETY: a static string.
    let name = unsafe { std::ffi::CStr::from_ptr(graphed_status_name(S::ParamMoved as u32)) };
    assert_eq!(name.to_bytes(), b"GRAPHED_STATUS_PARAM_MOVED");
    // Nothing was copied in or run: the static input and output still hold
    // the last forward's.
    assert_eq!(read(buffer(s, graphed_buffer_role::Input)), x);
    assert_eq!(read(buffer(s, graphed_buffer_role::Output)), plain);
    // Less aligned than registered is refused as well, and so is param 0.
    let (st, _) = fwd_at(s, 0, 0, &x, Some(&addrs(&[elsewhere(4), w.1])));
    assert_eq!(st, S::ParamMoved, "{}", msg());
    assert!(
        msg().contains("param 0 ") && msg().contains(&hex(w.0)),
        "{}",
        msg()
    );
    let st = stats(s);
    assert_eq!(
        (st.params_movable, st.params_move_refused, st.param_moves),
        (0, 0, 0),
        "nothing registered with REBIND, nothing moved"
    );
    ok(graphed_session_destroy(s));
}

#[test]
fn a_flagged_param_is_refused_at_capture_on_the_host_backend_and_says_why() {
    let w = weights(1.0);
    let s = create(1);
    // Param 0 flagged in its descriptor, param 1 afterwards.
    add(s, "mover", w, [REBIND, 0], false);
    ok(graphed_session_set_param_flags(s, 0, 1, REBIND));
    // An integer parameter asking to move: refused for its dtype.
    let ints = Box::leak(vec![0i32; N].into_boxed_slice()).as_mut_ptr();
    let tensor = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    let p = [graphed_param_desc {
        data: ints.cast(),
        bytes: BYTES,
        dtype: graphed_dtype::I32 as u32,
        flags: REBIND,
        requires_grad: 0,
        ..graphed_param_desc_default()
    }];
    let mut d = common::layer_desc(&tensor, &tensor, &p, Some(copy_fwd), Some(copy_bwd));
    d.name = c"counter".as_ptr();
    let mut idx = 0;
    // SAFETY: a valid descriptor and out pointer.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    // Before capture nothing is known.
    let (st, on) = movable(s, 0, 0, 2, false);
    assert_eq!(st, S::WrongState, "{}", msg());
    assert_eq!(on, [7, 7, 7]);
    ok(graphed_session_capture(s));

    let (st, on) = movable(s, 0, 0, 2, false);
    assert_eq!(st, S::Ok, "{}", msg());
    assert_eq!(on, [0, 0, 7], "nothing moves on the host backend");
    let (st, on) = movable(s, 1, 0, 1, false);
    assert_eq!((st, on), (S::Ok, vec![0, 7]));
    let st = stats(s);
    assert_eq!(
        (st.params_movable, st.params_move_refused, st.param_moves),
        (0, 3, 0)
    );
    let dump = plan_dump(s);
    let line = |j: usize, name: &str| {
        let head = format!("param {j} of {name} (microbatch 0): ");
        dump.lines()
            .find(|l| l.starts_with(&head))
            .unwrap_or_else(|| panic!("no line {head:?}:\n{dump}"))
            .to_string()
    };
    for j in 0..2 {
        let l = line(j, "mover");
        assert!(l.contains("fixed at its registered address: "), "{l}");
        assert!(l.contains("opaque"), "the host backend's reason: {l}");
    }
    let l = line(0, "counter");
    assert!(
        l.contains("fixed at its registered address: ")
            && l.contains("i32 parameters stay where they were registered"),
        "{l}"
    );
    // A forward at another address is refused with the reason capture gave.
    let to = elsewhere(0);
    let x = input(3.0);
    assert_eq!(fwd(s, &x, Some(&addrs(&[to, w.1]))), S::ParamMoved);
    let m = msg();
    assert!(
        m.contains("param 0 ") && m.contains(&hex(w.0)) && m.contains(&hex(to)),
        "{m}"
    );
    assert!(m.contains("opaque"), "{m}");
    assert_eq!(stats(s).param_moves, 0);
    // After a reset the session has no parameters to tell of.
    ok(graphed_session_reset(s));
    let (st, on) = movable(s, 0, 0, 2, false);
    assert_eq!((st, on), (S::SessionReset, vec![7, 7, 7]));
    let st = stats(s);
    assert_eq!(
        (st.params_movable, st.params_move_refused, st.param_moves),
        (0, 0, 0)
    );
    ok(graphed_session_destroy(s));
}

/// A forward that copies its input to its output; a backward that copies
/// the grad output to the input grad.
unsafe extern "C" fn copy_fwd(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: as above; ones are multiplied in, so the output is the input.
    unsafe {
        let c = &*ctx;
        enqueue(c.stream, at(c.inputs, 0), ONES.as_ptr(), at(c.outputs, 0))
    }
}

unsafe extern "C" fn copy_bwd(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: as above.
    unsafe {
        let c = &*ctx;
        enqueue(
            c.stream,
            at(c.grad_outputs, 0),
            ONES.as_ptr(),
            at(c.grad_inputs, 0),
        )
    }
}

static ONES: [f32; N] = [1.0; N];

#[test]
fn every_instance_counts_and_the_message_names_the_microbatch() {
    let w = weights(1.0);
    let s = create(2);
    add(s, "mover", w, [REBIND, 0], false);
    ok(graphed_session_capture(s));
    let st = stats(s);
    assert_eq!((st.microbatches, st.params_move_refused), (2, 2));
    for mb in 0..2 {
        let (st, on) = movable(s, 0, mb, 2, false);
        assert_eq!((st, on), (S::Ok, vec![0, 0, 7]));
    }
    let (st, on) = movable(s, 0, 2, 2, false);
    assert_eq!((st, on), (S::InvalidArgument, vec![7, 7, 7]));
    assert!(msg().contains("microbatch 2 does not exist"), "{}", msg());
    let to = elsewhere(0);
    let (st, _) = fwd_at(s, 0, 1, &input(0.0), Some(&addrs(&[w.0, to])));
    assert_eq!(st, S::ParamMoved);
    assert!(
        msg().contains("microbatch 1") && msg().contains("param 1 "),
        "{}",
        msg()
    );
    ok(graphed_session_destroy(s));
}

#[test]
fn null_entries_and_the_registered_addresses_are_where_the_graphs_read() {
    let w = weights(2.0);
    let s = layer(w, [REBIND, 0]);
    let x = input(2.0);
    let plain = output(s, &x, None);
    let n = null::<f32>();
    for given in [[n, n], [w.0, n], [n, w.1], [w.0, w.1]] {
        assert_eq!(output(s, &x, Some(&addrs(&given))), plain, "{given:?}");
        let (st, gx, gp) = bwd(s, &x, Some(&addrs(&given)));
        assert_eq!(st, S::Ok, "{given:?}: {}", msg());
        assert_eq!((gx.len(), gp.len()), (N, 2));
    }
    assert_eq!(stats(s).param_moves, 0, "nothing moved");
    ok(graphed_session_destroy(s));
}

#[test]
fn wrong_counts_and_bad_arrays_are_invalid_arguments() {
    let w = weights(1.0);
    let s = layer(w, [0, 0]);
    let x = input(1.0);
    let plain = output(s, &x, None);
    let p = addrs(&[w.0, w.1, w.1]);
    for count in [0, 1, 3] {
        let (st, out) = fwd_at(s, 0, 0, &input(9.0), Some(&p[..count]));
        assert_eq!(st, S::InvalidArgument, "count {count}");
        assert!(out.ptr.is_null());
        assert!(
            msg().contains(&format!("{count} parameter addresses were passed"))
                && msg().contains("it has 2 parameters"),
            "{}",
            msg()
        );
        let (st, ..) = bwd(s, &x, Some(&p[..count]));
        assert_eq!(st, S::InvalidArgument, "backward, count {count}");
    }
    // A NULL array with a count; an array off its alignment; a count whose
    // bytes do not fit.
    let data = [x.as_ptr() as *const c_void];
    let words = [w.0 as u64, w.1 as u64, 0];
    let off = (words.as_ptr() as usize + 4) as *const *const c_void;
    for (array, count, says) in [
        (null(), 2, "args.params is NULL but its count is 2"),
        (off, 2, "not aligned"),
        (p.as_ptr(), usize::MAX / 4, "do not fit"),
    ] {
        let mut a = graphed_replay_args_default();
        a.data = data.as_ptr();
        a.num_data = 1;
        a.params = array;
        a.num_params = count;
        let mut out = empty_ref();
        // SAFETY: the arrays are refused before they are read.
        let st = unsafe { graphed_forward(s, &a, &mut out, 1) };
        assert_eq!(st, S::InvalidArgument, "{says}");
        assert!(msg().contains(says), "{says:?}: {}", msg());
        assert!(out.ptr.is_null());
    }
    // A caller built against the header before the fields: not read.
    let mut a = graphed_replay_args_default();
    a.data = data.as_ptr();
    a.num_data = 1;
    a.params = 8 as *const *const c_void;
    a.num_params = usize::MAX;
    a.struct_size = std::mem::offset_of!(graphed_replay_args, params);
    let mut out = empty_ref();
    // SAFETY: the fields past struct_size are not read.
    ok(unsafe { graphed_forward(s, &a, &mut out, 1) });
    assert_eq!(read(out.ptr), plain);
    ok(graphed_session_destroy(s));
}

#[test]
fn a_backward_and_a_weight_grad_read_the_params_where_their_forward_did() {
    let w = weights(1.0);
    let s = create(1);
    add(s, "mover", w, [0, REBIND], true);
    ok(graphed_session_capture(s));
    let x = input(1.0);
    output(s, &x, Some(&addrs(&[w.0, w.1])));
    let to = elsewhere(0);
    let (st, ..) = bwd(s, &x, Some(&addrs(&[w.0, to])));
    assert_eq!(st, S::InvalidArgument);
    let m = msg();
    assert!(m.starts_with("graphed_backward: "), "{m}");
    assert!(
        m.contains("param 1 ")
            && m.contains("callable 'mover'")
            && m.contains(&hex(to))
            && m.contains(&format!("its forward read it at {}", hex(w.1))),
        "{m}"
    );
    let (st, ..) = bwd(s, &x, Some(&addrs(&[w.0, w.1])));
    assert_eq!(st, S::Ok, "{}", msg());
    // The weight-grad replay: the same rule.
    let wg = |params: &[*const c_void]| {
        let mut a = graphed_replay_args_default();
        a.params = params.as_ptr();
        a.num_params = params.len();
        let mut gp = [empty_ref(); 2];
        // SAFETY: valid args and room for two refs.
        let st = unsafe { graphed_backward_wgrad(s, &a, gp.as_mut_ptr(), 2) };
        (st, gp)
    };
    let (st, gp) = wg(&addrs(&[to, w.1]));
    assert_eq!(st, S::InvalidArgument);
    assert!(gp.iter().all(|r| r.ptr.is_null()));
    assert!(
        msg().starts_with("graphed_backward_wgrad: ")
            && msg().contains("param 0 ")
            && msg().contains(&hex(w.0)),
        "{}",
        msg()
    );
    let (st, _) = wg(&addrs(&[w.0, null()]));
    assert_eq!(st, S::Ok, "{}", msg());
    ok(graphed_session_destroy(s));
}

/// A refused replay enqueues nothing: a session that was refused gives,
/// replay for replay, what a twin that never saw the refused calls gives.
#[test]
fn a_refused_replay_changes_nothing() {
    let w = weights(1.0);
    let (a, b) = (layer(w, [REBIND, 0]), layer(w, [REBIND, 0]));
    let to = elsewhere(0);
    let (x1, x2, gy) = (input(1.0), input(-7.0), input(0.5));
    assert_eq!(output(a, &x1, None), output(b, &x1, None));
    // Refused on a: a moved parameter, a wrong count.
    assert_eq!(fwd(a, &x2, Some(&addrs(&[to, w.1]))), S::ParamMoved);
    assert_eq!(fwd(a, &x2, Some(&addrs(&[w.0]))), S::InvalidArgument);
    let ga = bwd(a, &gy, None);
    let gb = bwd(b, &gy, None);
    assert_eq!(ga.0, S::Ok);
    assert!(ga.2.iter().all(|g| g.iter().any(|&v| v != 0.0)), "{ga:?}");
    assert_eq!(ga, gb, "the backward after refused forwards");
    // A refused backward, then both replay the same.
    assert_eq!(bwd(a, &x2, Some(&addrs(&[w.0, to]))).0, S::InvalidArgument);
    assert_eq!(read(buffer(a, graphed_buffer_role::GradInput)), ga.1);
    assert_eq!(output(a, &x2, None), output(b, &x2, None));
    assert_eq!(bwd(a, &gy, None), bwd(b, &gy, None));
    let (sa, sb) = (stats(a), stats(b));
    assert_eq!(
        (sa.param_moves, sa.params_move_refused),
        (sb.param_moves, sb.params_move_refused)
    );
    ok(graphed_session_destroy(a));
    ok(graphed_session_destroy(b));
}

/// A session of two layers and the step of both: its parameters, in order,
/// are (layer 0: w0, w1), (layer 1: w0, w1).
fn stepped(w: [(*mut f32, *mut f32); 2]) -> *mut graphed_session {
    let s = create(1);
    add(s, "first", w[0], [REBIND, 0], false);
    add(s, "second", w[1], [0, 0], false);
    let callables = [0u32, 1];
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = 2;
    let mut idx = 7;
    // SAFETY: a valid descriptor and out pointer.
    ok(unsafe { graphed_session_add_step(s, &d, &mut idx) });
    assert_eq!(idx, 0);
    ok(graphed_session_capture(s));
    // The step reads what the static inputs and grad-outputs hold (no
    // buffer reuse: nothing else is placed there).
    use graphed_buffer_role as R;
    for c in 0..2 {
        for (role, seed) in [(R::Input, 4.0), (R::GradOutput, 0.25)] {
            let v = input(seed + c as f32);
            let mut p = null_mut();
            // SAFETY: room for one pointer; the buffer holds N floats.
            unsafe {
                ok(graphed_session_buffers(s, c, 0, role as u32, &mut p, 1));
                std::ptr::copy_nonoverlapping(v.as_ptr(), p as *mut f32, N);
            }
        }
    }
    s
}

/// A step replay with the parameters at `params` (None: a NULL array; a
/// NULL array with `null_count`): the status and the grads (read).
fn step(
    s: *mut graphed_session,
    params: Option<&[*const c_void]>,
    null_count: usize,
) -> (graphed_status, Vec<Vec<f32>>) {
    let mut a = graphed_step_args_default();
    if let Some(p) = params {
        a.params = p.as_ptr();
        a.num_params = p.len();
    } else {
        a.num_params = null_count;
    }
    let mut refs = [empty_ref(); 4];
    // SAFETY: valid args and room for four refs.
    let st = unsafe { graphed_step_replay(s, &a, refs.as_mut_ptr(), 4) };
    if st != S::Ok {
        assert!(
            refs.iter().all(|r| r.ptr.is_null()),
            "refs written on refusal"
        );
        return (st, Vec::new());
    }
    (st, refs.iter().map(|r| read(r.ptr)).collect())
}

#[test]
fn step_replays_check_the_parameters_addresses_as_forwards_do() {
    let w = [weights(1.0), weights(3.0)];
    let (a, b) = (stepped(w), stepped(w));
    let mut n = 0;
    // SAFETY: a local.
    ok(unsafe { graphed_step_param_count(a, 0, &mut n) });
    assert_eq!(n, 4);
    let plain = step(b, None, 0);
    assert_eq!(plain.0, S::Ok, "{}", msg());
    assert!(
        plain.1.iter().all(|g| g.iter().any(|&v| v != 0.0)),
        "grads worth comparing: {plain:?}"
    );
    // Wrong counts, and a NULL array with a count.
    for count in [0, 2, 5] {
        let p = vec![null(); count];
        let (st, _) = step(a, Some(&p), 0);
        assert_eq!(st, S::InvalidArgument, "count {count}");
        assert!(
            msg().starts_with("graphed_step_replay: ")
                && msg().contains(&format!(
                    "{count} parameter addresses were passed to step 0"
                )),
            "{}",
            msg()
        );
    }
    assert_eq!(step(a, None, 4).0, S::InvalidArgument);
    assert!(msg().contains("args.params is NULL"), "{}", msg());
    // A moved parameter of either layer, flagged or not: refused, naming
    // the callable and the parameter's index in it.
    let to = elsewhere(0);
    let reg: [*const f32; 4] = [w[0].0, w[0].1, w[1].0, w[1].1];
    for (k, name, j) in [(0, "first", 0), (3, "second", 1)] {
        let mut p = addrs(&reg);
        p[k] = to.cast();
        let (st, _) = step(a, Some(&p), 0);
        assert_eq!(st, S::ParamMoved, "{}", msg());
        let m = msg();
        assert!(
            m.contains(&format!("callable '{name}'"))
                && m.contains("in step 0")
                && m.contains(&format!("param {j} "))
                && m.contains(&hex(reg[k]))
                && m.contains(&hex(to)),
            "{m}"
        );
    }
    // The registered addresses and NULL entries: the step as without them,
    // and as the twin that was never refused.
    let at = step(a, Some(&addrs(&reg)), 0);
    assert_eq!(at, plain);
    let n = null::<f32>();
    let some = step(a, Some(&addrs(&[n, reg[1], n, n])), 0);
    assert_eq!(some, step(b, None, 0));
    assert_eq!(stats(a).param_moves, 0);
    // An older caller's args: the fields are not read.
    let mut old = graphed_step_args_default();
    old.struct_size = 32; // the first release: no addresses, no microbatch count
    old.params = 8 as *const *const c_void;
    old.num_params = 3;
    let mut refs = [empty_ref(); 4];
    // SAFETY: valid args and room for four refs.
    ok(unsafe { graphed_step_replay(a, &old, refs.as_mut_ptr(), 4) });
    ok(graphed_session_destroy(a));
    ok(graphed_session_destroy(b));
}

#[test]
fn params_movable_checks_its_arguments_as_the_other_queries_do() {
    let w = weights(1.0);
    let s = create(1);
    add(s, "mover", w, [REBIND, 0], false);
    // Not captured: as graphed_session_rebound and the others.
    let (st, on) = movable(s, 0, 0, 2, false);
    assert_eq!((st, on), (S::WrongState, vec![7, 7, 7]));
    let (st, _) = movable(s, 0, 0, 2, true);
    assert_eq!(st, S::WrongState, "the state before the output");
    let mut r = [7u32; 2];
    // SAFETY: room for two values.
    let other = unsafe {
        graphed_session_rebound(
            s,
            0,
            0,
            graphed_buffer_role::Input as u32,
            r.as_mut_ptr(),
            1,
        )
    };
    assert_eq!(other, S::WrongState);
    ok(graphed_session_capture(s));
    // A NULL output, a misaligned one, wrong counts, unknown instances.
    let (st, _) = movable(s, 0, 0, 2, true);
    assert_eq!(st, S::NullPointer);
    assert!(
        msg().starts_with("graphed_session_params_movable: "),
        "{}",
        msg()
    );
    let mut words = [7u32; 4];
    let off = (words.as_mut_ptr() as usize + 1) as *mut u32;
    // SAFETY: refused before anything is written.
    let st = unsafe { graphed_session_params_movable(s, 0, 0, off, 2) };
    assert_eq!(st, S::InvalidArgument);
    assert_eq!(words, [7; 4]);
    for count in [0, 1, 3] {
        let (st, on) = movable(s, 0, 0, count, false);
        assert_eq!(st, S::InvalidArgument, "count {count}");
        assert!(on.iter().all(|&v| v == 7));
        assert!(
            msg().contains(&format!("count is {count}")) && msg().contains("parameters number 2"),
            "{}",
            msg()
        );
    }
    let (st, _) = movable(s, 1, 0, 2, false);
    assert_eq!(st, S::InvalidArgument);
    assert!(msg().contains("callable 1 does not exist"), "{}", msg());
    let (st, on) = movable(s, 0, 0, 2, false);
    assert_eq!((st, on), (S::Ok, vec![0, 0, 7]));
    // NULL session, then reset, then destroyed.
    // SAFETY: refused.
    let st = unsafe { graphed_session_params_movable(null_mut(), 0, 0, r.as_mut_ptr(), 2) };
    assert_eq!(st, S::NullPointer);
    ok(graphed_session_reset(s));
    assert_eq!(movable(s, 0, 0, 2, false).0, S::SessionReset);
    ok(graphed_session_destroy(s));
    let (st, on) = movable(s, 0, 0, 2, false);
    assert_eq!((st, on), (S::UseAfterDestroy, vec![7, 7, 7]));
}

/// A callable with no parameter: count 0 and a NULL output are fine.
#[test]
fn a_callable_without_parameters_has_none_to_tell_of() {
    let s = create(1);
    let tensor = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    let d = common::layer_desc(&tensor, &tensor, &[], Some(copy_fwd), Some(copy_bwd));
    let mut idx = 0;
    // SAFETY: a valid descriptor and out pointer.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    ok(graphed_session_capture(s));
    let (st, on) = movable(s, 0, 0, 0, true);
    assert_eq!(st, S::Ok, "{}", msg());
    assert_eq!(on, [7]);
    // Any empty array of addresses, NULL or not.
    let x = input(1.0);
    assert_eq!(fwd(s, &x, Some(&[])), S::Ok, "{}", msg());
    assert_eq!(fwd(s, &x, None), S::Ok);
    assert_eq!(fwd(s, &x, Some(&[null()])), S::InvalidArgument);
    ok(graphed_session_destroy(s));
}

unsafe extern "C" fn nothing(_: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    0
}

/// The one parameter that moves on the host backend: one no graph reads
/// (callbacks that record no work). Capture verifies it (its bytes put
/// back afterwards), a forward follows its move and counts it, and the
/// backward then reads it where that forward did.
#[test]
fn a_flagged_param_no_graph_reads_is_verified_and_followed() {
    let s = create(1);
    let tensor = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    // Registered at an address aligned to 256 bytes.
    let at = elsewhere(0) as *mut f32;
    // SAFETY: fresh memory of N floats and more, kept for the test.
    let w = unsafe { std::slice::from_raw_parts_mut(at, N) };
    for (i, v) in w.iter_mut().enumerate() {
        *v = i as f32 * 1.5 - 3.0;
    }
    let (_, other) = weights(1.0);
    let p = [
        graphed_param_desc {
            data: w.as_mut_ptr().cast(),
            bytes: BYTES,
            flags: REBIND,
            ..graphed_param_desc_default()
        },
        graphed_param_desc {
            data: other.cast(),
            bytes: BYTES,
            ..graphed_param_desc_default()
        },
    ];
    let d = common::layer_desc(&tensor, &tensor, &p, Some(nothing), Some(nothing));
    let mut idx = 0;
    // SAFETY: a valid descriptor and out pointer.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    ok(graphed_session_capture(s));
    let restored: Vec<f32> = (0..N).map(|i| i as f32 * 1.5 - 3.0).collect();
    assert_eq!(w.to_vec(), restored, "the parameter's bytes after capture");
    assert_eq!(movable(s, 0, 0, 2, false), (S::Ok, vec![1, 0, 7]));
    let st = stats(s);
    assert_eq!(
        (st.params_movable, st.params_move_refused, st.param_moves),
        (1, 0, 0)
    );
    assert!(
        plan_dump(s).contains("param 0 of callable 0 (microbatch 0): movable ("),
        "{}",
        plan_dump(s)
    );
    let reg = w.as_ptr();
    let x = input(1.0);
    // Less aligned than registered: refused even so.
    let less = elsewhere(4);
    assert_eq!(fwd(s, &x, Some(&addrs(&[less, null()]))), S::ParamMoved);
    assert!(
        msg().contains("aligned to 4 bytes, the captured one to 256"),
        "{}",
        msg()
    );
    let to = elsewhere(0);
    assert_eq!(fwd(s, &x, Some(&addrs(&[to, null()]))), S::Ok, "{}", msg());
    assert_eq!(stats(s).param_moves, 1);
    // The backward reads it where its forward did: there, or NULL.
    assert_eq!(
        bwd(s, &x, Some(&addrs(&[reg, null()]))).0,
        S::InvalidArgument
    );
    assert!(
        msg().contains(&format!("its forward read it at {}", hex(to))),
        "{}",
        msg()
    );
    assert_eq!(
        bwd(s, &x, Some(&addrs(&[to, null()]))).0,
        S::Ok,
        "{}",
        msg()
    );
    assert_eq!(bwd(s, &x, None).0, S::Ok);
    // Back where it was registered: one more move.
    assert_eq!(fwd(s, &x, Some(&addrs(&[reg, null()]))), S::Ok, "{}", msg());
    assert_eq!(stats(s).param_moves, 2);
    ok(graphed_session_destroy(s));
}
