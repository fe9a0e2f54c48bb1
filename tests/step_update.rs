//! A step's update stage through the C ABI on the host backend: the
//! optimizer captured into the step's graph after the last microbatch's
//! backward, its scalars set by each replay, and a check that skips the
//! update on the device when the grads are not finite. Checked against the
//! same kernels run eagerly, bit for bit, over 100 iterations with 1 and 4
//! microbatches, unrolled and looping on the device, with COPY_INTO and
//! CLONE grads; iterations that overflow are exactly those skipped. Then
//! every refusal, and failing or capture-breaking update callbacks.
//!
//! The model is one elementwise layer `y = w * x` over f32 (backward:
//! `gw = x * gy`; tests/common/mul.rs), trained by SGD with momentum
//! (tests/common/momentum.rs): `m = mu * m + g`, `w -= lr * m`, lr and mu
//! read from the step's scalar block.

use graphed::ffi::*;
use std::ffi::{c_void, CString};
use std::ptr::null_mut;

mod common;
use common::momentum::sgd;
use common::mul::{enqueue, leak};
use common::{
    add_step, create, host_config, msg, mul, ok, step_desc, step_replay, step_replay_args, Session,
};

const N: usize = 16;

/// The optimizer's state and what its callbacks were told.
struct Opt {
    /// Momentum, N floats.
    m: Vec<f32>,
    /// What to do under capture: 0 works; otherwise the check (1) or
    /// the apply (2) returns 5, or breaks the capture (3, 4).
    fail: u32,
    /// Phases seen, in order, with the grads pointer of param 0.
    calls: Vec<(u32, usize, u32)>,
}

/// The check's task: the flag set when a grad is not finite.
struct Check {
    g: *const f32,
    flag: *mut u32,
}

unsafe extern "C" fn run_check(data: *mut c_void) {
    // SAFETY: leaked, valid buffers.
    unsafe {
        let c = &*(data as *const Check);
        if (0..N).any(|i| !(*c.g.add(i)).is_finite()) {
            *c.flag = 1;
        }
    }
}

/// The apply's task: SGD with momentum (the eager model's `sgd`), lr and
/// mu from the scalars.
struct Sgd {
    w: *mut f32,
    g: *const f32,
    m: *mut f32,
    scalars: *const f32,
}

unsafe extern "C" fn run_sgd(data: *mut c_void) {
    // SAFETY: leaked, valid buffers of N floats each, none overlapping.
    unsafe {
        let s = &*(data as *const Sgd);
        let (lr, mu) = (*s.scalars, *s.scalars.add(1));
        let w = std::slice::from_raw_parts_mut(s.w, N);
        let m = std::slice::from_raw_parts_mut(s.m, N);
        sgd(w, m, std::slice::from_raw_parts(s.g, N), lr, mu);
    }
}

unsafe extern "C" fn check(ctx: *const graphed_update_ctx, data: *mut c_void) -> i32 {
    // SAFETY: the context and its arrays are valid during the call; data
    // is the test's Opt.
    let (c, o) = unsafe { (&*ctx, &mut *(data as *mut Opt)) };
    // SAFETY: one param.
    let g = unsafe { *c.grads };
    o.calls.push((c.phase, g as usize, c.slot));
    match o.fail {
        1 => {
            let m = CString::new("the grads were odd").unwrap();
            // SAFETY: a NUL-terminated string.
            unsafe { graphed_callback_fail_message(m.as_ptr()) };
            return 5;
        }
        3 => {
            // The capturing stream: breaks the capture, reports 0.
            let _ = graphed_host_synchronize(c.stream);
            return 0;
        }
        _ => {}
    }
    let t = Check {
        g: g as *const f32,
        flag: c.skip_flag,
    };
    enqueue(c.stream, Some(run_check), leak(t))
}

unsafe extern "C" fn apply(ctx: *const graphed_update_ctx, data: *mut c_void) -> i32 {
    // SAFETY: as above.
    let (c, o) = unsafe { (&*ctx, &mut *(data as *mut Opt)) };
    // SAFETY: one param.
    let (w, g) = unsafe { (*c.params, *c.grads) };
    o.calls.push((c.phase, g as usize, c.slot));
    match o.fail {
        2 => return 5,
        4 => {
            let _ = graphed_host_synchronize(c.stream);
            return 0;
        }
        _ => {}
    }
    if c.scalar_bytes != 8 || c.scalars.is_null() {
        return 77;
    }
    let t = Sgd {
        w: w as *mut f32,
        g: g as *const f32,
        m: o.m.as_mut_ptr(),
        scalars: c.scalars as *const f32,
    };
    enqueue(c.stream, Some(run_sgd), leak(t))
}

/// One test's memory: the weight, `mbs` microbatches of x and gy side by
/// side (x0 g0 x1 g1 ...), the grad destination, the optimizer.
struct Model {
    w: Vec<f32>,
    xg: Vec<f32>,
    dst: Vec<f32>,
    opt: Box<Opt>,
    mbs: usize,
}

impl Model {
    fn new(mbs: usize) -> Model {
        Model {
            w: (0..N).map(|i| 0.5 + i as f32 * 0.03125).collect(),
            xg: vec![0.0; 2 * N * mbs],
            dst: vec![0.0; N],
            opt: Box::new(Opt {
                m: vec![0.0; N],
                fail: 0,
                calls: Vec::new(),
            }),
            mbs,
        }
    }

    /// Iteration `it`'s data; `overflow` puts an infinity in one x.
    fn fill(&mut self, it: usize, overflow: bool) {
        mul::fill::<N>(&mut self.xg, self.mbs, it, 0);
        if overflow {
            self.xg[N * 2 * (self.mbs - 1) + 3] = f32::INFINITY;
        }
    }

    /// The grad eager accumulation makes of this iteration's data.
    fn grad(&self) -> Vec<f32> {
        mul::grad::<N>(&self.xg, self.mbs)
    }
}

/// How the session and step are built.
#[derive(Clone, Copy)]
struct Setup {
    policy: graphed_grad_policy,
    loop_mode: graphed_step_loop,
    check: bool,
    slots: u32,
    /// The parameter is registered with GRAPHED_PARAM_FLAGS_REBIND.
    rebind: bool,
}

const PLAIN: Setup = Setup {
    policy: graphed_grad_policy::CopyInto,
    loop_mode: graphed_step_loop::Unrolled,
    check: true,
    slots: 2,
    rebind: false,
};

/// The session with the layer and the step over `m.mbs` microbatches
/// (uncaptured); the add_step status.
fn build(m: &mut Model, setup: Setup) -> (Session, graphed_status) {
    let mut cfg = host_config();
    cfg.clone_slots = setup.slots;
    let b = Session(create(&cfg));
    let flags = if setup.rebind {
        graphed_param_flags::Rebind as u32
    } else {
        0
    };
    mul::add_layer::<N>(b.0, m.w.as_mut_ptr(), setup.policy, flags);
    let io = mul::io::<N>(0, m.xg.as_mut_ptr());
    let dsts = [m.dst.as_mut_ptr().cast::<c_void>()];
    let dsts: &[_] = if setup.policy == graphed_grad_policy::CopyInto {
        &dsts
    } else {
        &[]
    };
    let callables = [0u32];
    let mut d = step_desc(&callables, m.mbs, setup.loop_mode, &io, dsts);
    d.update_check = if setup.check { Some(check) } else { None };
    d.update_apply = Some(apply);
    d.update_data = (&mut *m.opt as *mut Opt).cast();
    d.scalar_bytes = 8;
    let st = add_step(b.0, &d);
    (b, st)
}

/// Replays step 0 with `scalars` (None: none given); the status and the ref.
fn replay(s: *mut graphed_session, scalars: Option<&[f32]>) -> (graphed_status, graphed_ref) {
    let mut a = graphed_step_args_default();
    if let Some(v) = scalars {
        a.scalars = v.as_ptr().cast();
        a.scalar_bytes = std::mem::size_of_val(v);
    }
    let (st, r) = step_replay_args(s, &a, 1);
    (st, r[0])
}

/// (skipped, total) of step 0.
fn skipped(s: *mut graphed_session) -> (u32, u64) {
    let (mut last, mut total) = (9u32, 9u64);
    // SAFETY: valid out pointers.
    ok(unsafe { graphed_step_skipped(s, 0, &mut last, &mut total) });
    (last, total)
}

/// 100 iterations, every 7th from the 3rd overflowing (with a check);
/// the weight, momentum and skips against eager's, bit for bit.
fn trains_as_eager(mbs: usize, setup: Setup) {
    let what = format!(
        "{mbs} microbatch(es), {:?}, {:?}",
        setup.loop_mode, setup.policy
    );
    let mut m = Model::new(mbs);
    let (b, st) = build(&mut m, setup);
    ok(st);
    let s = b.0;
    ok(graphed_session_capture(s));
    // Capture ran nothing of the update: the weights are as registered.
    let (mut w, mut mom) = (m.w.clone(), vec![0.0f32; N]);
    assert_eq!(m.opt.m, mom, "{what}");
    let mut skips = 0u64;
    for it in 0..100 {
        let overflow = setup.check && it % 7 == 3;
        m.fill(it, overflow);
        let g = m.grad();
        let (lr, mu) = (0.01 * (1 + it % 3) as f32, 0.9f32);
        let scalars = [lr, mu];
        // Every third iteration gives none: the block keeps the last ones.
        let (st, r) = replay(s, (it % 3 != 2).then_some(&scalars[..]));
        assert_eq!(st, graphed_status::Ok, "{what}, iteration {it}: {}", msg());
        if r.kind == graphed_ref_kind::Clone as u32 {
            ok(graphed_buffer_release(r.owner));
        }
        let lr_used = if it % 3 == 2 {
            0.01 * (1 + (it - 1) % 3) as f32
        } else {
            lr
        };
        if overflow {
            skips += 1;
        } else {
            sgd(&mut w, &mut mom, &g, lr_used, mu);
        }
        if setup.check {
            assert_eq!(
                skipped(s),
                (overflow as u32, skips),
                "{what}, iteration {it}"
            );
        }
        assert_eq!(m.w, w, "{what}, iteration {it}: the weights");
        assert_eq!(m.opt.m, mom, "{what}, iteration {it}: the momentum");
    }
    // One capture per graph, each phase once: (check, apply) per graph.
    let phases: Vec<u32> = m.opt.calls.iter().map(|c| c.0).collect();
    let per = if setup.check { vec![0, 1] } else { vec![1] };
    let graphs = if setup.policy == graphed_grad_policy::Clone {
        setup.slots as usize
    } else {
        1
    };
    assert_eq!(phases, per.repeat(graphs), "{what}");
}

#[test]
fn an_update_trains_as_eager_bit_for_bit_and_skips_exactly_the_overflows() {
    for mbs in [1, 4] {
        for loop_mode in [graphed_step_loop::Unrolled, graphed_step_loop::While] {
            for policy in [graphed_grad_policy::CopyInto, graphed_grad_policy::Clone] {
                let setup = Setup {
                    policy,
                    loop_mode,
                    ..PLAIN
                };
                trains_as_eager(mbs, setup);
            }
        }
    }
    // Without a check: no IF node, every iteration updates.
    trains_as_eager(
        4,
        Setup {
            check: false,
            ..PLAIN
        },
    );
}

#[test]
fn clone_grads_are_read_in_each_slots_block() {
    let mut m = Model::new(2);
    let setup = Setup {
        policy: graphed_grad_policy::Clone,
        slots: 3,
        ..PLAIN
    };
    let (b, st) = build(&mut m, setup);
    ok(st);
    ok(graphed_session_capture(b.0));
    let calls = m.opt.calls.clone();
    assert_eq!(calls.len(), 6);
    let slots: Vec<u32> = calls.iter().map(|c| c.2).collect();
    assert_eq!(slots, [0, 0, 1, 1, 2, 2]);
    // Each graph's grads are in its own block, and a replay returns the
    // block the update read.
    let blocks: Vec<usize> = calls.iter().step_by(2).map(|c| c.1).collect();
    assert!(blocks[0] != blocks[1] && blocks[1] != blocks[2]);
    m.fill(0, false);
    let (st, r) = replay(b.0, Some(&[0.0, 0.0]));
    ok(st);
    assert!(
        blocks.contains(&(r.ptr as usize)),
        "{blocks:x?} {:x}",
        r.ptr as usize
    );
    ok(graphed_buffer_release(r.owner));
}

#[test]
fn refused_declarations_and_replays_change_nothing() {
    let mut m = Model::new(1);
    // A check without an apply; scalars without an update; too many.
    let (b, _) = build(
        &mut m,
        Setup {
            rebind: true,
            ..PLAIN
        },
    );
    let s = b.0;
    let callables = [0u32];
    let dsts = [m.dst.as_mut_ptr().cast::<c_void>()];
    let declare = |f: &dyn Fn(&mut graphed_step_desc)| {
        let mut d = step_desc(&callables, 1, graphed_step_loop::Unrolled, &[], &dsts);
        f(&mut d);
        (add_step(s, &d), msg())
    };
    let (st, text) = declare(&|d| d.update_check = Some(check));
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(text.contains("update_apply is NULL"), "{text}");
    let (st, text) = declare(&|d| d.scalar_bytes = 4);
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(text.contains("scalar_bytes is 4"), "{text}");
    let (st, text) = declare(&|d| {
        d.update_apply = Some(apply);
        d.scalar_bytes = GRAPHED_STEP_MAX_SCALAR_BYTES + 1;
    });
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(text.contains("at most 4096"), "{text}");
    // Before capture, the flag cannot be read.
    let mut last = 0u32;
    // SAFETY: a valid out pointer.
    let st = unsafe { graphed_step_skipped(s, 0, &mut last, null_mut()) };
    assert_eq!(st, graphed_status::WrongState, "{}", msg());
    ok(graphed_session_capture(s));
    m.fill(0, false);
    let w0 = m.w.clone();
    // Scalars of another size: refused, nothing ran.
    let (st, _) = replay(s, Some(&[1.0]));
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("scalar block is 8 bytes"), "{}", msg());
    let mut a = graphed_step_args_default();
    a.scalar_bytes = 8;
    // Scalars NULL with a size.
    let (st, _) = step_replay_args(s, &a, 1);
    assert_eq!(st, graphed_status::NullPointer, "{}", msg());
    assert_eq!(m.w, w0, "a refused replay ran nothing");
    assert_eq!(skipped(s), (0, 0));
    // The flag's query: its pointers and the step.
    // SAFETY: NULL out pointer.
    let st = unsafe { graphed_step_skipped(s, 0, null_mut(), null_mut()) };
    assert_eq!(st, graphed_status::NullPointer);
    // SAFETY: a valid out pointer.
    let st = unsafe { graphed_step_skipped(s, 3, &mut last, null_mut()) };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("step 3 does not exist"), "{}", msg());
    // SAFETY: a NULL session.
    let st = unsafe { graphed_step_skipped(null_mut(), 0, &mut last, null_mut()) };
    assert_eq!(st, graphed_status::NullPointer);
    // A moved parameter: the update writes where capture had it (its
    // callable's own graphs could follow it; the step's cannot).
    let mut other = vec![0.0f32; N];
    let params = [other.as_mut_ptr() as *const c_void];
    let (st, _) = step_replay(s, 1, Some(&params));
    assert_eq!(st, graphed_status::ParamMoved, "{}", msg());
    // (Host tasks are opaque: the callable's own graphs cannot follow it
    // either; orchestrate/replay/tests.rs covers a step whose callables' graphs can.)
    assert!(msg().contains("moved from"), "{}", msg());
    assert_eq!(m.w, w0);
    // A reset session answers SESSION_RESET.
    ok(graphed_session_reset(s));
    // SAFETY: a valid out pointer.
    let st = unsafe { graphed_step_skipped(s, 0, &mut last, null_mut()) };
    assert_eq!(st, graphed_status::SessionReset);
}

#[test]
fn a_step_without_a_check_or_scalars_refuses_them() {
    let mut m = Model::new(1);
    let (b, st) = build(
        &mut m,
        Setup {
            check: false,
            ..PLAIN
        },
    );
    ok(st);
    ok(graphed_session_capture(b.0));
    let mut last = 0u32;
    // SAFETY: a valid out pointer.
    let st = unsafe { graphed_step_skipped(b.0, 0, &mut last, null_mut()) };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(msg().contains("has no update_check"), "{}", msg());
}

#[test]
fn clone_grads_without_a_slot_are_incompatible() {
    let mut m = Model::new(1);
    let (b, st) = build(
        &mut m,
        Setup {
            policy: graphed_grad_policy::Clone,
            slots: 0,
            ..PLAIN
        },
    );
    ok(st);
    assert_eq!(graphed_session_capture(b.0), graphed_status::Incompatible);
    assert!(msg().contains("runs an update in its graph"), "{}", msg());
}

#[test]
fn a_failing_or_capture_breaking_update_fails_the_capture_and_keeps_nothing() {
    for (fail, status, words) in [
        (
            1,
            graphed_status::CallbackFailed,
            "the update's check callback of step 0 returned 5 during capture: the grads were odd",
        ),
        (
            2,
            graphed_status::CallbackFailed,
            "the update's apply callback of step 0 returned 5 during capture",
        ),
        (
            3,
            graphed_status::CaptureInvalidated,
            "the update's check callback of step 0 invalidated the capture of the step's graph",
        ),
        (
            4,
            graphed_status::CaptureInvalidated,
            "the update's apply callback of step 0 invalidated the capture of its apply part",
        ),
    ] {
        for loop_mode in [graphed_step_loop::Unrolled, graphed_step_loop::While] {
            let mut m = Model::new(2);
            m.opt.fail = fail;
            let (b, st) = build(&mut m, Setup { loop_mode, ..PLAIN });
            ok(st);
            let w0 = m.w.clone();
            let st = graphed_session_capture(b.0);
            assert_eq!(st, status, "fail {fail}: {}", msg());
            assert!(msg().contains(words), "fail {fail}: {}", msg());
            assert_eq!(m.w, w0);
            let stats = common::stats(b.0);
            assert_eq!(stats.graph_count, 0, "nothing kept");
            // The session is open again: a working update captures.
            m.opt.fail = 0;
            ok(graphed_session_capture(b.0));
            m.fill(1, false);
            let (st, _) = replay(b.0, Some(&[0.5, 0.0]));
            ok(st);
            assert_ne!(m.w, w0, "the update ran");
        }
    }
}

#[test]
fn a_null_scalars_array_without_a_size_keeps_the_block() {
    let mut m = Model::new(1);
    let (b, st) = build(&mut m, PLAIN);
    ok(st);
    ok(graphed_session_capture(b.0));
    m.fill(2, false);
    let g = m.grad();
    let (mut w, mut mom) = (m.w.clone(), vec![0.0; N]);
    ok(replay(b.0, Some(&[0.25, 0.5])).0);
    sgd(&mut w, &mut mom, &g, 0.25, 0.5);
    ok(replay(b.0, None).0);
    sgd(&mut w, &mut mom, &g, 0.25, 0.5);
    assert_eq!(m.w, w);
}
