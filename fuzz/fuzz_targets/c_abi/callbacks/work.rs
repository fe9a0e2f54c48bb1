//! The plain work of a pass: the external buffers it must hand over, its
//! own scratch (kept on the tape from forward to backward), the host task
//! that fills what it writes (and may act from the stream), and the
//! hand-over of its external buffers under capture.

use super::*;

pub unsafe extern "C" fn fill_task(data: *mut c_void) {
    // SAFETY: a Fill kept alive in the World until every session is gone.
    let f = unsafe { &*(data as *const Fill) };
    let e = EPOCH.load(Ordering::Relaxed);
    // The microbatch this run is for: the running one in a loop body.
    let m = match f.index {
        0 => f.step_mb,
        // SAFETY: the loop's index (a u32 graphed keeps with the graph).
        ix => unsafe { *(ix as *const u32) },
    };
    let data = match f.data {
        0 => 0,
        // SAFETY: a static buffer of the session (at least one byte), alive
        // while its graphs run.
        d => unsafe { *(d as *const u8) },
    };
    for (t, &(p, n, s)) in f.targets.iter().enumerate() {
        let v = if t >= f.grads {
            s ^ e ^ grad_mix(m, data)
        } else {
            s ^ e
        };
        // SAFETY: static buffers, scratch or harness memory of n bytes.
        unsafe { std::ptr::write_bytes(p as *mut u8, v, n) };
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

/// The pass's plain work, when it does not fail (`code` 0) and is not a
/// hook: scratch for backward, external hand-over, the task.
pub(super) fn pass_work(
    ctx: &graphed_pass_ctx,
    cb: &Cb,
    seen: &Seen,
    code: i32,
    skip_provide: bool,
    provided: &mut Vec<(u32, usize)>,
) {
    let wd = w();
    let i = &wd.input;
    let (cl, mb, pass) = (&seen.cl, seen.mb, seen.pass);
    let (capture_phase, measuring) = (seen.capture_phase, seen.measuring);
    let (outputs, gins, pgrads) = (&seen.outputs, &seen.gins, &seen.pgrads);
    let mut targets: Vec<(usize, usize, u8)> = Vec::new();
    // targets[grads..] are parameter grads (none: targets.len()).
    let mut grads = usize::MAX;
    let s = cb.sess;
    let c = cb.callable;
    // Its external memory: this bucket's own (see `ext_key`).
    let ek = ext_key(mb, seen.bucket);
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
                        ext_mem(s, c, ek, ROLE_OUT, j, t.bytes)
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
                                ext_mem(s, c, ek, ROLE_GIN, j, t.bytes)
                            } else {
                                gins[j]
                            };
                            targets.push((p, t.bytes, seed(s, c, mb, ROLE_GIN, j)));
                        }
                    }
                }
                if (pass == 1 && !cl.wgrad) || pass == 2 {
                    grads = targets.len();
                    for (j, p) in cl.params.iter().enumerate() {
                        if p.grad {
                            let q = if p.external {
                                ext_mem(s, c, ek, ROLE_PARAM, j, p.bytes)
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
            for (role, j, bytes) in externals(cl, pass) {
                let q = ext_mem(s, c, ek, role, j, bytes);
                let r = graphed_pass_set_buffer(ctx.capture, role, j, q as *mut c_void);
                let again = provided.contains(&(role, j));
                let want = if seen.in_step {
                    S::WrongState
                } else if again {
                    S::InvalidArgument
                } else {
                    S::Ok
                };
                expect(r, &[want], "graphed_pass_set_buffer", "plain hand-over");
                if seen.in_step {
                    let m = msg();
                    assert!(
                        m.contains("in the capture of step")
                            && m.contains("write the results there"),
                        "graphed_pass_set_buffer in a step's capture: {m:?}"
                    );
                }
                provided.push((role, j));
            }
        }
        let action = if capture_phase && i.chance(24) {
            1 + i.below(4) as u8
        } else {
            0
        };
        let fill = Box::new(Fill {
            grads: grads.min(targets.len()),
            targets,
            sess: s,
            action,
            step_mb: seen.step_mb,
            index: seen.index,
            data: seen.data,
        });
        let fp = &*fill as *const Fill as *mut c_void;
        wd.fills.borrow_mut().push(fill);
        mark();
        // SAFETY: fill_task with a Fill kept until the end of the input.
        let r = unsafe { graphed_host_enqueue(ctx.stream, Some(fill_task), fp) };
        expect(r, &[S::Ok], "graphed_host_enqueue", "the pass's work");
    }
}
