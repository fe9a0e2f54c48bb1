//! The callbacks: forward, backward, weight-grad and hooks read what to do
//! from the input (fail, ask for scratch, synchronize, keep their handles,
//! call back into their session, replay or destroy sessions, hand over
//! external buffers), the host tasks they record, and in-callback handles
//! used after their call.

use super::*;

pub unsafe extern "C" fn fill_task(data: *mut c_void) {
    // SAFETY: a Fill kept alive in the World until every session is gone.
    let f = unsafe { &*(data as *const Fill) };
    let e = EPOCH.load(Ordering::Relaxed);
    for &(p, n, s) in &f.targets {
        // SAFETY: static buffers, scratch or harness memory of n bytes.
        unsafe { std::ptr::write_bytes(p as *mut u8, s ^ e, n) };
    }
    match f.action {
        1 => own_session_call(f.sess),
        2 => sync_null(),
        3 if !waived("lease-in-replay") => release_lease_of(f.sess),
        // A deleter running on the replaying thread.
        4 => release_some_block(),
        _ => {}
    }
}

/// A call into session `k`, which a call in progress holds: BUSY (lease
/// release never is).
pub fn own_session_call(k: usize) {
    let wd = w();
    let (h, alive) = {
        let s = &wd.sessions.borrow()[k];
        (s.h as *mut graphed_session, s.alive)
    };
    if !alive || !wd.pinned.borrow().contains(&k) {
        return;
    }
    let i = &wd.input;
    mark();
    match i.below(9) {
        8 => {
            // Gone for every later call at once; destroyed when the call in
            // progress returns.
            expect(
                graphed_session_destroy_when_idle(h),
                &[S::Ok],
                "graphed_session_destroy_when_idle",
                "own session",
            );
            wd.sessions.borrow_mut()[k].alive = false;
        }
        0 => {
            let mut st = graphed_session_stats_default();
            // SAFETY: a full struct.
            let r = unsafe { graphed_session_stats_get(h, &mut st) };
            expect(r, &[S::Busy], "graphed_session_stats_get", "own session");
        }
        1 => expect(
            graphed_session_destroy(h),
            &[S::Busy],
            "graphed_session_destroy",
            "own session",
        ),
        2 => expect(
            graphed_session_capture(h),
            &[S::Busy],
            "graphed_session_capture",
            "own session",
        ),
        3 => expect(
            graphed_session_reset(h),
            &[S::Busy],
            "graphed_session_reset",
            "own session",
        ),
        4 => {
            let a = graphed_replay_args_default();
            let mut out = [0u8; 64];
            // SAFETY: args and room for one ref.
            let r = unsafe { graphed_forward(h, &a, out.as_mut_ptr().cast(), 0) };
            expect(r, &[S::Busy], "graphed_forward", "own session");
        }
        5 => expect(
            graphed_session_set_param_flags(h, 0, 0, 0),
            &[S::Busy],
            "graphed_session_set_param_flags",
            "own session",
        ),
        6 => {
            let mut len = 0;
            // SAFETY: NULL buffer.
            let r = unsafe { graphed_session_plan_dump(h, null_mut(), 0, &mut len) };
            expect(r, &[S::Busy], "graphed_session_plan_dump", "own session");
        }
        _ if !waived("lease-in-replay") => {
            let r = graphed_lease_release(h, 0x1_0000_0100_0001);
            expect(
                r,
                &[S::InvalidArgument, S::Ok],
                "graphed_lease_release",
                "own session (never BUSY)",
            );
            if r == S::Ok {
                forget_lease(k, 0x1_0000_0100_0001);
            }
        }
        _ => {}
    }
}

pub fn sync_null() {
    let capturing = w().frames.borrow().iter().any(|f| f.capturing);
    mark();
    let r = graphed_host_synchronize(null_mut());
    if capturing {
        expect(
            r,
            &[S::CaptureInvalidated],
            "graphed_host_synchronize",
            "NULL under capture",
        );
        for f in w().frames.borrow_mut().iter_mut().filter(|f| f.capturing) {
            f.invalidated = true;
        }
    } else {
        expect(r, &[S::Ok], "graphed_host_synchronize", "NULL");
    }
}

pub fn forget_lease(k: usize, token: u64) {
    let mut ls = w().leases.borrow_mut();
    if let Some(at) = ls.iter().position(|l| l.sess == k && l.token == token) {
        let l = ls.remove(at);
        w().stale_leases.borrow_mut().push((l.sess, l.token));
    }
}

/// Releases one lease the model holds for session `k` (from a deleter).
pub fn release_lease_of(k: usize) {
    let wd = w();
    let tok = wd
        .leases
        .borrow()
        .iter()
        .find(|l| l.sess == k)
        .map(|l| l.token);
    let Some(tok) = tok else { return };
    let h = wd.sessions.borrow()[k].h as *mut graphed_session;
    mark();
    let r = graphed_lease_release(h, tok);
    expect(
        r,
        &[S::Ok],
        "graphed_lease_release",
        "a held lease, from a callback",
    );
    forget_lease(k, tok);
}

pub fn release_some_block() {
    let wd = w();
    let n = wd.blocks.borrow().len();
    if n == 0 {
        return;
    }
    let at = wd.input.below(n);
    let owner = wd.blocks.borrow()[at].owner;
    mark();
    let r = graphed_buffer_release(owner as *mut graphed_buffer);
    expect(r, &[S::Ok], "graphed_buffer_release", "held block");
    let mut bs = wd.blocks.borrow_mut();
    bs[at].refs -= 1;
    if bs[at].refs == 0 {
        let b = bs.remove(at);
        wd.stale_blocks.borrow_mut().push(b.owner);
    }
}

/// The external buffers a pass must hand over: (role, index, bytes).
pub fn externals(cl: &Callable, pass: u32) -> Vec<(u32, usize, usize)> {
    let mut v = Vec::new();
    match pass {
        0 => {
            for (j, t) in cl.outputs.iter().enumerate() {
                if t.external {
                    v.push((ROLE_OUT, j, t.bytes));
                }
            }
        }
        _ => {
            if pass == 1 {
                for (j, t) in cl.inputs.iter().enumerate() {
                    if t.external && t.grad {
                        v.push((ROLE_GIN, j, t.bytes));
                    }
                }
            }
            if (pass == 1 && !cl.wgrad) || pass == 2 {
                for (j, p) in cl.params.iter().enumerate() {
                    if p.external && p.grad {
                        v.push((ROLE_PARAM, j, p.bytes));
                    }
                }
            }
        }
    }
    v
}

pub fn callback(ctx: *const graphed_pass_ctx, ud: *mut c_void, which: u32) -> i32 {
    let wd = w();
    let i = &wd.input;
    // SAFETY: graphed passes the user data registered with this callable.
    let cb = unsafe { &*(ud as *const Cb) };
    assert!(!ctx.is_null());
    // SAFETY: valid for the call.
    let ctx = unsafe { &*ctx };
    trace!(
        "  callback sess {} callable {} pass {} phase {} it {} mb {} hook {}",
        cb.sess,
        cb.callable,
        ctx.pass,
        ctx.phase,
        ctx.iteration,
        ctx.microbatch,
        cb.hook
    );
    assert_eq!(ctx.struct_size, size_of::<graphed_pass_ctx>());
    assert_eq!(ctx.callable as usize, cb.callable, "ctx.callable");
    if which != 9 {
        assert_eq!(ctx.pass, which, "a callback ran for another pass");
    }
    assert!(ctx.phase <= 1 && ctx.pass <= 2);
    let (cl, sess_h, mb_known) = {
        let s = &wd.sessions.borrow()[cb.sess];
        (s.callables[cb.callable].clone(), s.h, s.mb)
    };
    if mb_known != 0 {
        assert!(ctx.microbatch < mb_known, "microbatch {}", ctx.microbatch);
    }
    assert_eq!(ctx.num_inputs, cl.inputs.len());
    assert_eq!(ctx.num_outputs, cl.outputs.len());
    assert_eq!(ctx.num_params, cl.params.len());
    assert!(!ctx.stream.is_null());
    assert!(!ctx.tape.is_null());
    assert_eq!(
        ctx.scratch.is_null(),
        cb.hook,
        "scratch is for callbacks only"
    );
    assert_eq!(
        !ctx.capture.is_null(),
        !cb.hook && ctx.phase == 1,
        "capture only for callbacks under capture"
    );
    let capture_phase = ctx.phase == 1 && !cb.hook;
    let mb = ctx.microbatch;
    let pass = ctx.pass;
    // SAFETY (arrays): graphed passes arrays of the stated lengths.
    let arr = |p: *const *mut c_void, n: usize| -> Vec<usize> {
        if n == 0 {
            return Vec::new();
        }
        unsafe { std::slice::from_raw_parts(p as *const usize, n) }.to_vec()
    };
    let inputs = arr(ctx.inputs, ctx.num_inputs);
    let outputs = arr(ctx.outputs, ctx.num_outputs);
    let gouts = arr(ctx.grad_outputs, ctx.num_outputs);
    let gins = arr(ctx.grad_inputs, ctx.num_inputs);
    let pgrads = arr(ctx.param_grads, ctx.num_params);
    // An external buffer reads 0 until the pass that writes it was captured
    // and handed it over; then the address it handed over.
    let ext_ok = |p: usize, role: u32, j: usize| {
        p == 0
            || w()
                .ext
                .borrow()
                .get(&(cb.sess, cb.callable, ctx.microbatch, role, j))
                == Some(&p)
    };
    for (j, t) in cl.inputs.iter().enumerate() {
        assert_ne!(inputs[j], 0);
        if t.grad && t.external {
            assert!(
                ext_ok(gins[j], ROLE_GIN, j),
                "external grad input {j}: 0x{:x}",
                gins[j]
            );
        } else {
            assert_eq!(gins[j] != 0, t.grad, "grad input {j}");
        }
    }
    for (j, t) in cl.outputs.iter().enumerate() {
        if t.external {
            assert!(
                ext_ok(outputs[j], ROLE_OUT, j),
                "external output {j}: 0x{:x}",
                outputs[j]
            );
        } else {
            assert_ne!(outputs[j], 0, "output {j}");
        }
        assert_eq!(gouts[j] != 0, t.grad, "grad output {j}");
    }
    for (j, p) in cl.params.iter().enumerate() {
        if p.grad && p.external {
            assert!(
                ext_ok(pgrads[j], ROLE_PARAM, j),
                "external param grad {j}: 0x{:x}",
                pgrads[j]
            );
        } else {
            assert_eq!(pgrads[j] != 0, p.grad, "param grad {j}");
        }
    }
    // The frame of this session's capture.
    {
        let mut fs = wd.frames.borrow_mut();
        let f = fs.last_mut().expect("a callback outside capture");
        assert_eq!(
            f.sess, cb.sess,
            "a callback of another session than the innermost capture"
        );
        assert!(
            f.first.is_none(),
            "a callback ran after its capture had failed ({:?})",
            f.first
        );
        f.ran = true;
        if f.stream == 0 {
            f.stream = ctx.stream as usize;
        }
        assert_eq!(
            f.stream, ctx.stream as usize,
            "the side stream changed during a capture"
        );
        if !cb.hook {
            f.scratch_fail = false;
            f.capturing = capture_phase;
            if capture_phase {
                f.invalidated = false;
            }
        }
    }
    let measuring = ctx.phase == 0 && ctx.iteration == 0;

    let shallow = wd.depth.get() < 3;
    let mut code = 0;
    let mut skip_provide = false;
    let mut provided: Vec<(u32, usize)> = Vec::new();
    let mut extra_scratch: Vec<usize> = Vec::new();
    let mut irregular = false;
    for _ in 0..6 {
        let a = i.byte();
        if a < 144 {
            break;
        }
        match a % 16 {
            0 => {
                code = i.pick(&[-1, 1, 7, i32::MIN, i32::MAX]);
                break;
            }
            1 if !cb.hook => {
                let bytes = i.pick(&[
                    0,
                    1,
                    255,
                    4096,
                    1 << 48,
                    (1 << 48) + 1,
                    1 << 47,
                    1 << 41,
                    usize::MAX,
                    usize::MAX - 3,
                    1 << 63,
                ]);
                let mut p: *mut c_void = 0x33 as *mut c_void;
                mark();
                // SAFETY: a local out pointer.
                let r = unsafe { graphed_scratch_alloc(ctx.scratch, bytes, &mut p) };
                let want: &[graphed_status] = if bytes > 1 << 48 {
                    &[S::OutOfMemory]
                } else if measuring {
                    if bytes >= 1 << 41 {
                        &[S::OutOfMemory]
                    } else {
                        &[S::Ok]
                    }
                } else {
                    &[S::Ok, S::ScratchExhausted]
                };
                expect(r, want, "graphed_scratch_alloc", "a fuzzed size");
                irregular = true;
                if r == S::ScratchExhausted {
                    wd.frames.borrow_mut().last_mut().unwrap().scratch_fail = true;
                }
                if r == S::Ok {
                    assert!(
                        !p.is_null() && p as usize % 256 == 0,
                        "scratch 0x{:x}",
                        p as usize
                    );
                    if i.chance(128) {
                        let r = graphed_scratch_free(ctx.scratch, p);
                        expect(r, &[S::Ok], "graphed_scratch_free", "live");
                        let r = graphed_scratch_free(ctx.scratch, p);
                        expect(r, &[S::InvalidArgument], "graphed_scratch_free", "twice");
                    } else {
                        extra_scratch.push(p as usize);
                    }
                } else {
                    assert_eq!(p as usize, 0x33, "scratch out pointer written on failure");
                }
            }
            2 if !cb.hook => {
                let bad = i.pick(&[0x10usize, 1, usize::MAX]);
                let r = graphed_scratch_free(ctx.scratch, bad as *mut c_void);
                expect(r, &[S::InvalidArgument], "graphed_scratch_free", "garbage");
            }
            3 if !cb.hook => {
                let mut slot = [0u64; 2];
                let out = if i.chance(128) {
                    null_mut()
                } else {
                    // SAFETY: 4 bytes into a 16-byte local.
                    unsafe { (slot.as_mut_ptr() as *mut u8).add(4) as *mut *mut c_void }
                };
                // SAFETY: checked by graphed before any write.
                let r = unsafe { graphed_scratch_alloc(ctx.scratch, 64, out) };
                let want = if out.is_null() {
                    S::NullPointer
                } else {
                    S::InvalidArgument
                };
                expect(r, &[want], "graphed_scratch_alloc", "bad out pointer");
                assert_eq!(slot, [0, 0]);
            }
            4 => {
                mark();
                let r = graphed_host_synchronize(ctx.stream);
                if capture_phase {
                    expect(
                        r,
                        &[S::CaptureInvalidated],
                        "graphed_host_synchronize",
                        "own stream under capture",
                    );
                    wd.frames.borrow_mut().last_mut().unwrap().invalidated = true;
                } else {
                    expect(
                        r,
                        &[S::Ok],
                        "graphed_host_synchronize",
                        "own stream, not capturing",
                    );
                }
            }
            5 => sync_null(),
            6 => {
                if !ctx.scratch.is_null() {
                    wd.kept_scratch.borrow_mut().push(Kept {
                        h: ctx.scratch as usize,
                        live: true,
                    });
                }
                if !ctx.capture.is_null() {
                    wd.kept_capture.borrow_mut().push(Kept {
                        h: ctx.capture as usize,
                        live: true,
                    });
                }
                let attempt = wd.frames.borrow().last().unwrap().attempt;
                wd.kept_streams.borrow_mut().push(KeptStream {
                    h: ctx.stream as usize,
                    sess: cb.sess,
                    attempt,
                });
            }
            7 => own_session_call(cb.sess),
            8 if shallow => {
                // Replay a session (maybe another) on this stream.
                if let Some(k) = live_target() {
                    let (s, side) = if i.chance(128) {
                        (ctx.stream as usize, 0)
                    } else {
                        (0, ctx.stream as usize)
                    };
                    op_replay(Target::Live(k), i.below(3) as u32, Some((s, side)));
                }
            }
            9 if shallow => {
                if let Some(k) = live_target() {
                    op_destroy(Target::Live(k));
                }
            }
            10 if shallow => {
                if let Some(k) = live_target() {
                    op_capture(Target::Live(k));
                }
            }
            11 => {
                // Fuzzed hand-over.
                let role = i.pick(&[ROLE_OUT, ROLE_GIN, ROLE_PARAM, 0, 2, 7]);
                let index = i.pick(&[0usize, 1, 2, usize::MAX]);
                let null_ptr = i.chance(60);
                let exp = if capture_phase {
                    externals(&cl, pass)
                } else {
                    Vec::new()
                };
                let declared = exp.iter().any(|&(r, j, _)| r == role && j == index);
                let p = if null_ptr {
                    0
                } else {
                    ext_mem(cb.sess, cb.callable, mb, 100 + role, index.min(8), 64)
                };
                let want = if ctx.capture.is_null() {
                    S::WrongState
                } else if role > 4 {
                    S::InvalidArgument
                } else if !declared {
                    S::InvalidArgument
                } else if null_ptr {
                    S::NullPointer
                } else {
                    // Providing memory of the wrong size would be the
                    // caller's bug: provide it twice instead.
                    S::Ok
                };
                if want == S::Ok {
                    // Declared and non-NULL: hand over the right memory now;
                    // the plain hand-over below then gets "already provided".
                    let (_, _, bytes) = *exp
                        .iter()
                        .find(|&&(r, j, _)| r == role && j == index)
                        .unwrap();
                    let q = ext_mem(cb.sess, cb.callable, mb, role, index, bytes);
                    let r = graphed_pass_set_buffer(ctx.capture, role, index, q as *mut c_void);
                    expect(r, &[S::Ok], "graphed_pass_set_buffer", "declared");
                    provided.push((role, index));
                    let r = graphed_pass_set_buffer(ctx.capture, role, index, q as *mut c_void);
                    expect(r, &[S::InvalidArgument], "graphed_pass_set_buffer", "twice");
                } else {
                    mark();
                    let r = graphed_pass_set_buffer(ctx.capture, role, index, p as *mut c_void);
                    expect(r, &[want], "graphed_pass_set_buffer", "fuzzed");
                }
            }
            12 if capture_phase && !externals(&cl, pass).is_empty() => skip_provide = true,
            13 => {
                if i.chance(128) {
                    release_some_block();
                } else if let Some(l) = {
                    let ls = wd.leases.borrow();
                    (!ls.is_empty()).then(|| ls.len())
                } {
                    let at = i.below(l);
                    let (s, tok) = {
                        let ls = wd.leases.borrow();
                        (ls[at].sess, ls[at].token)
                    };
                    let h = wd.sessions.borrow()[s].h as *mut graphed_session;
                    if wd.sessions.borrow()[s].alive {
                        let r = graphed_lease_release(h, tok);
                        expect(
                            r,
                            &[S::Ok],
                            "graphed_lease_release",
                            "held, from a callback",
                        );
                        forget_lease(s, tok);
                    }
                }
            }
            14 => {
                let (s, want) = if i.chance(128) {
                    (ctx.stream as usize, S::NullPointer)
                } else {
                    (forged_id(), S::InvalidArgument)
                };
                let task = if want == S::NullPointer {
                    None
                } else {
                    Some(fill_task as unsafe extern "C" fn(*mut c_void))
                };
                // SAFETY: graphed refuses both before running anything.
                let r = unsafe { graphed_host_enqueue(s as graphed_stream, task, null_mut()) };
                expect(r, &[want], "graphed_host_enqueue", "bad");
            }
            15 => use_kept(),
            _ => {}
        }
    }
    if irregular {
        wd.frames.borrow_mut().last_mut().unwrap().irregular = true;
    }
    // The plain work: scratch for backward, external hand-over, the task.
    let mut targets: Vec<(usize, usize, u8)> = Vec::new();
    let s = cb.sess;
    let c = cb.callable;
    if !cb.hook && code == 0 {
        // SAFETY: the tape slot is valid during the call.
        let tape = unsafe { &mut *ctx.tape };
        if pass == 0 && cb.scratch > 0 {
            let mut p: *mut c_void = null_mut();
            // SAFETY: a local out pointer.
            let r = unsafe { graphed_scratch_alloc(ctx.scratch, cb.scratch, &mut p) };
            let regular =
                !wd.frames.borrow().last().unwrap().irregular && wd.sessions.borrow()[s].warmup > 0;
            let want: &[graphed_status] = if measuring || regular {
                &[S::Ok]
            } else {
                &[S::Ok, S::ScratchExhausted]
            };
            expect(
                r,
                want,
                "graphed_scratch_alloc",
                "the callable's own scratch",
            );
            if r == S::Ok {
                targets.push((p as usize, cb.scratch, seed(s, c, mb, ROLE_SCRATCH, 0)));
                *tape = p;
            } else {
                wd.frames.borrow_mut().last_mut().unwrap().scratch_fail = true;
                *tape = null_mut();
            }
        } else if pass == 1 && !tape.is_null() {
            let regular = !wd.frames.borrow().last().unwrap().irregular;
            let r = graphed_scratch_free(ctx.scratch, *tape);
            let want: &[graphed_status] = if regular {
                &[S::Ok]
            } else {
                &[S::Ok, S::InvalidArgument]
            };
            expect(r, want, "graphed_scratch_free", "saved for backward");
            *tape = null_mut();
        }
        if pass == 0 && i.chance(10) && !cb.hook {
            // A forward that leaves garbage for its backward.
            *tape = 0x1234 as *mut c_void;
            wd.frames.borrow_mut().last_mut().unwrap().irregular = true;
        }
        match pass {
            0 => {
                for (j, t) in cl.outputs.iter().enumerate() {
                    let p = if t.external {
                        ext_mem(s, c, mb, ROLE_OUT, j, t.bytes)
                    } else {
                        outputs[j]
                    };
                    targets.push((p, t.bytes, seed(s, c, mb, ROLE_OUT, j)));
                }
            }
            _ => {
                if pass == 1 {
                    for (j, t) in cl.inputs.iter().enumerate() {
                        if t.grad {
                            let p = if t.external {
                                ext_mem(s, c, mb, ROLE_GIN, j, t.bytes)
                            } else {
                                gins[j]
                            };
                            targets.push((p, t.bytes, seed(s, c, mb, ROLE_GIN, j)));
                        }
                    }
                }
                if (pass == 1 && !cl.wgrad) || pass == 2 {
                    for (j, p) in cl.params.iter().enumerate() {
                        if p.grad {
                            let q = if p.external {
                                ext_mem(s, c, mb, ROLE_PARAM, j, p.bytes)
                            } else {
                                pgrads[j]
                            };
                            targets.push((q, p.bytes, seed(s, c, mb, ROLE_PARAM, j)));
                        }
                    }
                }
            }
        }
        if capture_phase && !skip_provide {
            for (role, j, bytes) in externals(&cl, pass) {
                let q = ext_mem(s, c, mb, role, j, bytes);
                let r = graphed_pass_set_buffer(ctx.capture, role, j, q as *mut c_void);
                let again = provided.contains(&(role, j));
                expect(
                    r,
                    &[if again { S::InvalidArgument } else { S::Ok }],
                    "graphed_pass_set_buffer",
                    "plain hand-over",
                );
                provided.push((role, j));
            }
        }
        let action = if capture_phase && i.chance(24) {
            1 + i.below(4) as u8
        } else {
            0
        };
        let fill = Box::new(Fill {
            targets,
            sess: s,
            action,
        });
        let fp = &*fill as *const Fill as *mut c_void;
        wd.fills.borrow_mut().push(fill);
        mark();
        // SAFETY: fill_task with a Fill kept until the end of the input.
        let r = unsafe { graphed_host_enqueue(ctx.stream, Some(fill_task), fp) };
        expect(r, &[S::Ok], "graphed_host_enqueue", "the pass's work");
    }
    let _ = (extra_scratch, sess_h);
    // Handles kept during this call die with it.
    for k in wd
        .kept_scratch
        .borrow_mut()
        .iter_mut()
        .filter(|k| k.h == ctx.scratch as usize)
    {
        k.live = false;
    }
    for k in wd
        .kept_capture
        .borrow_mut()
        .iter_mut()
        .filter(|k| k.h == ctx.capture as usize)
    {
        k.live = false;
    }
    // The failure this run decides.
    let mut fs = wd.frames.borrow_mut();
    let f = fs.last_mut().unwrap();
    // A refused scratch request fails the capture only through the
    // callback: one that carries on without it is fine; one that fails is
    // reported as the refusal. An invalidated capture is the root cause
    // before either.
    let decided = if capture_phase && f.invalidated {
        Some(S::CaptureInvalidated)
    } else if code != 0 && !cb.hook && f.scratch_fail {
        Some(S::ScratchExhausted)
    } else if code != 0 {
        Some(S::CallbackFailed)
    } else if capture_phase
        && externals(&cl, pass)
            .iter()
            .any(|&(r, j, _)| !provided.contains(&(r, j)))
    {
        Some(S::InvalidArgument)
    } else {
        None
    };
    if !cb.hook {
        f.capturing = false;
    }
    // A failing callback says why (some codes), or clears what it said.
    let said = matches!(code, 1 | 7 | i32::MAX).then(|| format!("fuzz callback says {code}"));
    if code != 0 {
        let text = said
            .as_ref()
            .map(|t| std::ffi::CString::new(t.as_str()).unwrap());
        mark();
        // SAFETY: NULL or a NUL-terminated string.
        let r =
            unsafe { graphed_callback_fail_message(text.as_ref().map_or(null(), |t| t.as_ptr())) };
        expect(
            r,
            &[S::Ok],
            "graphed_callback_fail_message",
            "before failing",
        );
    }
    if let Some(e) = decided {
        if f.first.is_none() && e == S::CallbackFailed {
            f.said = said;
        }
        f.first.get_or_insert(e);
    }
    code
}

/// Uses a handle a callback kept after its call ended.
pub fn use_kept() {
    let wd = w();
    let i = &wd.input;
    match i.below(3) {
        0 => {
            let h = wd
                .kept_scratch
                .borrow()
                .iter()
                .filter(|k| !k.live)
                .map(|k| k.h)
                .last();
            if let Some(h) = h {
                let mut p: *mut c_void = null_mut();
                // SAFETY: a local out pointer.
                let r = unsafe { graphed_scratch_alloc(h as *mut graphed_scratch, 64, &mut p) };
                expect(
                    r,
                    &[S::UseAfterDestroy],
                    "graphed_scratch_alloc",
                    "kept scratch",
                );
                let r = graphed_scratch_free(h as *mut graphed_scratch, 0x100 as *mut c_void);
                expect(
                    r,
                    &[S::UseAfterDestroy],
                    "graphed_scratch_free",
                    "kept scratch",
                );
            }
        }
        1 => {
            let h = wd
                .kept_capture
                .borrow()
                .iter()
                .filter(|k| !k.live)
                .map(|k| k.h)
                .last();
            if let Some(h) = h {
                let role = i.pick(&[ROLE_OUT, 8]);
                let r = graphed_pass_set_buffer(
                    h as *mut graphed_capture,
                    role,
                    0,
                    0x100 as *mut c_void,
                );
                let want = if role > 4 {
                    S::InvalidArgument
                } else {
                    S::UseAfterDestroy
                };
                expect(r, &[want], "graphed_pass_set_buffer", "kept capture");
            }
        }
        _ => {
            let n = wd.kept_streams.borrow().len();
            if n > 0 {
                let at = i.below(n);
                let (h, live) = {
                    let ks = wd.kept_streams.borrow();
                    (ks[at].h, stream_live(&ks[at]))
                };
                let capturing = stream_capturing(h);
                let r = graphed_host_synchronize(h as graphed_stream);
                let want = if !live {
                    S::UseAfterDestroy
                } else if capturing {
                    S::CaptureInvalidated
                } else {
                    S::Ok
                };
                expect(r, &[want], "graphed_host_synchronize", "kept stream");
                if capturing && want == S::CaptureInvalidated {
                    for f in wd
                        .frames
                        .borrow_mut()
                        .iter_mut()
                        .filter(|f| f.capturing && f.stream == h)
                    {
                        f.invalidated = true;
                    }
                }
                if live && !capturing {
                    let mut x = [0u8; 8];
                    let fill = Box::new(Fill {
                        targets: vec![(x.as_mut_ptr() as usize, 8, 9)],
                        sess: 0,
                        action: 0,
                    });
                    let fp = &*fill as *const Fill as *mut c_void;
                    // SAFETY: runs now (the stream is not capturing).
                    let r =
                        unsafe { graphed_host_enqueue(h as graphed_stream, Some(fill_task), fp) };
                    expect(r, &[S::Ok], "graphed_host_enqueue", "kept stream");
                    assert!(
                        x.iter().all(|&b| b == 9 ^ EPOCH.load(Ordering::Relaxed)),
                        "a task on an idle stream did not run now"
                    );
                }
            }
        }
    }
}
