//! The behaviours a callback reads from the input, up to six in a call:
//! fail, ask for scratch of any size and free it (twice), free garbage,
//! synchronize, keep its handles, call into its own session, replay,
//! destroy or capture sessions, hand over external buffers (or not),
//! release leases and blocks, enqueue with bad arguments, use kept handles.

use super::*;

/// What the behaviours leave to the rest of the call.
pub(super) struct Behaviour {
    /// What the callback returns (0: success).
    pub code: i32,
    /// Skip the plain hand-over of the external buffers.
    pub skip_provide: bool,
    /// The external buffers already handed over: (role, index).
    pub provided: Vec<(u32, usize)>,
    pub extra_scratch: Vec<usize>,
}

/// Reads and does the behaviours of one call.
pub(super) fn fuzzed_behaviours(ctx: &graphed_pass_ctx, cb: &Cb, seen: &Seen) -> Behaviour {
    let wd = w();
    let i = &wd.input;
    let (cl, pass) = (&seen.cl, seen.pass);
    // The external memory of this call's instance (and bucket).
    let ek = ext_key(seen.mb, seen.bucket);
    let (capture_phase, measuring) = (seen.capture_phase, seen.measuring);
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
                    break_captures_on(ctx.stream as usize);
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
                    body: !ctx.step_microbatch_index.is_null(),
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
                    externals(cl, pass)
                } else {
                    Vec::new()
                };
                let declared = exp.iter().any(|&(r, j, _)| r == role && j == index);
                let p = if null_ptr {
                    0
                } else {
                    ext_mem(cb.sess, cb.callable, ek, 100 + role, index.min(8), 64)
                };
                let want = if ctx.capture.is_null() {
                    S::WrongState
                } else if role > 4 {
                    S::InvalidArgument
                } else if seen.in_step {
                    // Already handed over: a step's capture takes none.
                    S::WrongState
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
                    let q = ext_mem(cb.sess, cb.callable, ek, role, index, bytes);
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
            12 if capture_phase && !externals(cl, pass).is_empty() => skip_provide = true,
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
    Behaviour {
        code,
        skip_provide,
        provided,
        extra_scratch,
    }
}
