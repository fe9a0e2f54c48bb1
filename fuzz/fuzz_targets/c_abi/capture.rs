//! Capture: the status the model expects of a capture attempt, and what a
//! successful one must show (static buffers, rebound slots, the plan dump).

use super::*;

/// Whether the model knows the schedule fits the callables, and the
/// microbatches it gives.
pub fn schedule_fits(s: &Sess) -> Option<bool> {
    let sched = s.sched.as_ref()?;
    let n = s.callables.len();
    Some(match sched {
        None => true,
        Some(sc) => {
            let layers: Vec<usize> = match &sc.layers {
                Some(l) => {
                    if l.iter().map(|&x| x as usize).sum::<usize>() != n {
                        return Some(false);
                    }
                    l.iter().map(|&x| x as usize).collect()
                }
                None => {
                    if n == 0 || n % sc.chunks != 0 {
                        return Some(false);
                    }
                    vec![n / sc.chunks; sc.chunks]
                }
            };
            if sc.wgrad {
                layers.iter().all(|&l| l == 1) && s.callables.iter().all(|c| c.wgrad)
            } else {
                s.callables.iter().all(|c| !c.wgrad)
            }
        }
    })
}

/// Whether capture must allocate a static buffer no allocator here grants.
pub fn huge(s: &Sess) -> bool {
    const H: usize = 1 << 40;
    s.callables.iter().any(|c| {
        c.inputs
            .iter()
            .any(|t| t.bytes >= H || (t.grad && !t.external && t.bytes >= H))
            || c.outputs
                .iter()
                .any(|t| t.bytes >= H && (!t.external || t.grad))
            || c.params
                .iter()
                .any(|p| p.grad && !p.external && p.bytes >= H)
    })
}

/// Records the failure the running capture of `sess` must report (the first
/// one wins).
pub fn decide(sess: usize, e: graphed_status) {
    let mut fs = w().frames.borrow_mut();
    if let Some(f) = fs.iter_mut().rev().find(|f| f.sess == sess) {
        f.first.get_or_insert(e);
    }
}

/// What capture answers for a session with a bucketed callable, found
/// where the order of passes is derived, before anything runs: the
/// schedule's own refusal, then buckets with a pipeline schedule (any
/// schedule given) or in a step, then the device's choice
/// (bucket_choice_on_device) over a bucketed callable with an external
/// buffer (see `device_over_external`). None: the capture goes ahead, in
/// bucket rounds (each callback checks its bucket fields and the frame
/// keys its passes by bucket). Some((status, also accepted, words the
/// message must hold)).
fn bucket_refusal(s: &Sess) -> Option<(graphed_status, bool, Option<&'static str>)> {
    match schedule_fits(s) {
        Some(false) => return Some((S::InvalidSchedule, false, None)),
        // A fuzzed schedule: refused as a schedule or for the buckets.
        None => return Some((S::InvalidArgument, true, None)),
        Some(true) => {}
    }
    if matches!(s.sched, Some(Some(_))) {
        return Some((S::InvalidArgument, false, None));
    }
    let in_step = s.steps.iter().any(|st| {
        st.callables
            .iter()
            .any(|&c| !s.callables[c].buckets.is_empty())
    });
    if in_step {
        return Some((S::InvalidArgument, false, None));
    }
    device_over_external(s).then_some((
        S::InvalidArgument,
        false,
        Some("bucket_choice_on_device needs buffers the library places"),
    ))
}

/// Whether the device would choose the bucket of a callable whose capture
/// provides buffers of its own, each bucket its own (the host could not say
/// where a replay's results are): an external output, the grad of an
/// external input that requires grad, or the grad of a parameter flagged
/// EXTERNAL_GRAD that requires grad.
fn device_over_external(s: &Sess) -> bool {
    s.bucket_device
        && s.callables.iter().any(|c| {
            !c.buckets.is_empty()
                && (c.outputs.iter().any(|t| t.external)
                    || c.inputs.iter().any(|t| t.external && t.grad)
                    || c.params.iter().any(|p| p.external && p.grad))
        })
}

pub fn op_capture(t: Target) {
    let wd = w();
    let mut want = t.lock();
    let mut pre_only = false;
    let mut lenient_sched = false;
    // What a bucket refusal's message must say.
    let mut refusal_says = None;
    if want.is_none() {
        let Target::Live(k) = t else { unreachable!() };
        let ss = wd.sessions.borrow();
        let s = &ss[k];
        let bucketed = s.callables.iter().any(|c| !c.buckets.is_empty());
        let refusal = if s.st == St::Open && bucketed {
            bucket_refusal(s)
        } else {
            None
        };
        want = match s.st {
            St::Captured => Some(S::WrongState),
            St::Reset => Some(S::SessionReset),
            St::Open if s.callables.is_empty() => Some(S::WrongState),
            St::Open if refusal.is_some() => {
                let (e, lenient, says) = refusal.unwrap();
                lenient_sched = lenient;
                refusal_says = says;
                Some(e)
            }
            St::Open => match schedule_fits(s) {
                Some(false) => Some(S::InvalidSchedule),
                None => {
                    lenient_sched = true;
                    huge(s).then_some(S::OutOfMemory)
                }
                Some(true) => huge(s).then_some(S::OutOfMemory),
            },
        };
        pre_only = want.is_some();
    }
    let attempt = wd.attempts.get() + 1;
    wd.attempts.set(attempt);
    let k = match t {
        Target::Live(k) => Some(k),
        _ => None,
    };
    let _pin = k.filter(|_| !pre_only).map(pin);
    if let (Some(k), false) = (k, pre_only) {
        wd.frames.borrow_mut().push(Frame {
            sess: k,
            attempt,
            stream: 0,
            capturing: false,
            invalidated: false,
            scratch_fail: false,
            irregular: false,
            first: None,
            said: None,
            ran: false,
            body: 0,
            loops: Vec::new(),
            broke: 0,
            named: Vec::new(),
            captured: Vec::new(),
            last: None,
            in_steps: false,
            places: Vec::new(),
        });
    }
    wd.depth.set(wd.depth.get() + 1);
    trace!("capture {t:?} want {want:?}");
    mark();
    let st = graphed_session_capture(t.ptr());
    trace!(
        "capture {t:?} -> {st:?}{}",
        if st == S::Ok {
            String::new()
        } else {
            format!(": {}", msg())
        }
    );
    wd.depth.set(wd.depth.get() - 1);
    let frame = if let (Some(_), false) = (k, pre_only) {
        wd.frames.borrow_mut().pop()
    } else {
        None
    };
    if let Some(f) = &frame {
        assert_eq!(f.attempt, attempt, "capture frames out of order");
    }
    match (&frame, want) {
        (_, Some(e)) => {
            if lenient_sched {
                expect(
                    st,
                    &[e, S::InvalidSchedule],
                    "graphed_session_capture",
                    "capture",
                )
            } else {
                expect(st, &[e], "graphed_session_capture", "capture before warmup")
            }
            if let Some(t) = refusal_says {
                let m = msg();
                assert!(
                    m.contains(t),
                    "capture refused buckets: {m:?} does not say {t:?}"
                );
            }
        }
        (Some(f), None) => {
            let step_err = k.and_then(step_capture_error);
            let mut ok: Vec<graphed_status> = match (f.first, &step_err) {
                (Some(e), _) => vec![e],
                // Steps are checked when they are captured, after every
                // pass, one after the other.
                (None, Some(e)) => e.statuses.clone(),
                // The measured scratch arena may be too large to allocate.
                (None, None) => vec![S::Ok, S::OutOfMemory],
            };
            if lenient_sched && !f.ran {
                ok.push(S::InvalidSchedule);
            }
            if waived("scratch-failed-request-sizes-arena") {
                ok.push(S::OutOfMemory);
            }
            expect(st, &ok, "graphed_session_capture", "capture outcome");
            if let (None, Some(e)) = (f.first, &step_err) {
                if st == e.statuses[0] {
                    let m = msg();
                    for t in &e.texts {
                        assert!(
                            m.contains(t.as_str()),
                            "capture refused a step: {m:?} does not say {t:?}"
                        );
                    }
                }
            }
            if st == S::CaptureInvalidated && f.first == Some(st) {
                // Broken from a loop's body: CAPTURE_INVALIDATED naming the
                // pass (tests/loop_capture_failures.rs).
                let m = msg();
                for t in &f.named {
                    assert!(
                        m.contains(t.as_str()),
                        "a loop body broke the capture: {m:?} does not say {t:?}"
                    );
                }
            }
            if st == S::CallbackFailed {
                let m = msg();
                match &f.said {
                    Some(t) => assert!(
                        m.contains(t.as_str()),
                        "the callback's message is missing: {m}"
                    ),
                    None => assert!(
                        !m.contains("fuzz callback says"),
                        "another callback's message: {m}"
                    ),
                }
            }
            if st == S::OutOfMemory
                && f.first.is_none()
                && !waived("scratch-failed-request-sizes-arena")
            {
                // Only a real arena that large may fail: a refused scratch
                // request must not size it.
                panic!("capture failed with OUT_OF_MEMORY though every scratch request it kept was small: {}", msg());
            }
        }
        (None, None) => unreachable!(),
    }
    // A session destroyed (when idle) by its own callback is gone now.
    if st == S::Ok && k.is_some_and(|k| wd.sessions.borrow()[k].alive) {
        let k = k.unwrap();
        {
            let mut ss = wd.sessions.borrow_mut();
            let s = &mut ss[k];
            s.st = St::Captured;
            s.live_attempt = Some(attempt);
            // No forward of a bucketed callable has run since capture.
            s.last_fwd = vec![None; s.callables.len()];
            s.overflows = 0;
        }
        after_capture(k);
    }
    if let Some(k) = k {
        forget_if_gone(k);
    }
}

/// Queries a captured session and checks it against the model.
pub fn after_capture(k: usize) {
    let wd = w();
    let (h, callables, clone, mb_model, bucket_device) = {
        let s = &wd.sessions.borrow()[k];
        (
            s.h as *mut graphed_session,
            s.callables.clone(),
            s.clone,
            s.mb,
            s.bucket_device,
        )
    };
    let mut st = graphed_session_stats_default();
    // SAFETY: a full stats struct.
    let r = unsafe { graphed_session_stats_get(h, &mut st) };
    expect(r, &[S::Ok], "graphed_session_stats_get", "after capture");
    assert_eq!(st.captured, 1);
    let mb = st.microbatches;
    assert!(mb >= 1);
    if mb_model != 0 {
        assert_eq!(mb, mb_model, "microbatches");
    }
    wd.sessions.borrow_mut()[k].mb = mb;
    let n = callables.len() as u32;
    assert_eq!(st.callables, n);
    // Every bucket is an instance of its own (a callable without buckets
    // is one); buckets need one microbatch.
    let bucketed = callables.iter().any(|c| !c.buckets.is_empty());
    if bucketed {
        assert_eq!(mb, 1, "microbatches of a session with buckets");
    }
    let per = |c: &Callable| c.buckets.len().max(1) as u32;
    let inst: u32 = callables.iter().map(per).sum();
    assert_eq!(st.instances, inst * mb, "instances");
    let graphs: u32 = callables
        .iter()
        .map(|c| (2 + c.wgrad as u32) * per(c))
        .sum();
    if bucketed && bucket_device {
        // Chosen on the device: choosing graphs besides (a count the model
        // does not follow).
        assert!(
            st.graph_count > graphs * mb,
            "graph count {} with device choice",
            st.graph_count
        );
    } else {
        assert_eq!(st.graph_count, graphs * mb, "graph count");
    }
    assert_eq!(st.step_graphs, step_graphs(k), "step graphs");
    for (c, cl) in callables.iter().enumerate() {
        let mut pol = vec![0xeeu32; cl.params.len()];
        // SAFETY: room for the stated count.
        let r = unsafe { graphed_session_param_policies(h, c as u32, pol.as_mut_ptr(), pol.len()) };
        expect(
            r,
            &[S::Ok],
            "graphed_session_param_policies",
            "after capture",
        );
        for (p, got) in cl.params.iter().zip(&pol) {
            assert_eq!(*got, p.resolved(clone), "frozen policy of {p:?}");
        }
        for m in 0..mb {
            for role in 0..5u32 {
                let (count, exists): (usize, Box<dyn Fn(usize) -> bool>) = match role {
                    0 => (cl.inputs.len(), Box::new(|_| true)),
                    1 => (cl.outputs.len(), Box::new(|_| true)),
                    2 => (cl.outputs.len(), Box::new(|j| cl.outputs[j].grad)),
                    3 => (cl.inputs.len(), Box::new(|j| cl.inputs[j].grad)),
                    _ => (cl.params.len(), Box::new(|j| cl.params[j].grad)),
                };
                let mut ptrs = vec![0x77usize; count];
                // SAFETY: room for `count` pointers.
                let r = unsafe {
                    graphed_session_buffers(h, c as u32, m, role, ptrs.as_mut_ptr().cast(), count)
                };
                expect(r, &[S::Ok], "graphed_session_buffers", "after capture");
                for (j, &p) in ptrs.iter().enumerate() {
                    assert_eq!(
                        p != 0,
                        exists(j),
                        "buffer {j} of role {role} of callable {c} mb {m}: 0x{p:x}"
                    );
                    let ext = match role {
                        1 => cl.outputs[j].external,
                        3 => cl.inputs[j].external && cl.inputs[j].grad,
                        4 => cl.params[j].external && cl.params[j].grad,
                        _ => false,
                    };
                    if ext {
                        // With buckets, microbatch 0 is the largest
                        // bucket's instance: the buffers its capture
                        // provided.
                        let bucket = cl.buckets.len().saturating_sub(1) as u32;
                        let e = wd
                            .ext
                            .borrow()
                            .get(&(
                                k,
                                c,
                                ext_key(m, bucket),
                                [0, ROLE_OUT, 0, ROLE_GIN, ROLE_PARAM][role as usize],
                                j,
                            ))
                            .copied();
                        assert_eq!(
                            Some(p),
                            e,
                            "external buffer returned is not the one provided"
                        );
                    } else if p != 0 {
                        assert_eq!(p % 256, 0, "static buffer 0x{p:x} is not 256-aligned");
                    }
                }
            }
        }
    }
    rebound_check(h, &callables, mb);
    plan_dump_check(h, true);
    params_after_capture(h, &callables, mb);
    answers_after_capture(h, &callables, mb);
}

/// The host backend rebinds nothing (its tasks are opaque): every input and
/// grad-output reads 0, other roles and wrong counts are refused.
pub fn rebound_check(h: *mut graphed_session, callables: &[Callable], mb: u32) {
    let i = &w().input;
    for (c, cl) in callables.iter().enumerate() {
        for m in 0..mb {
            let role = i.below(6) as u32;
            let count = match role {
                0 => cl.inputs.len(),
                2 => cl.outputs.len(),
                _ => i.below(4),
            };
            let wrong = i.below(8) == 0;
            let count = if wrong { count + 1 } else { count };
            let mut on = vec![0xeeu32; count + 1];
            // SAFETY: room for `count` values (and one more, to see past it).
            let r =
                unsafe { graphed_session_rebound(h, c as u32, m, role, on.as_mut_ptr(), count) };
            if role == 0 || role == 2 {
                if wrong {
                    expect(
                        r,
                        &[S::InvalidArgument],
                        "graphed_session_rebound",
                        "wrong count",
                    );
                } else {
                    expect(r, &[S::Ok], "graphed_session_rebound", "after capture");
                    assert!(on[..count].iter().all(|&v| v == 0), "host rebound: {on:?}");
                }
            } else {
                expect(
                    r,
                    &[S::InvalidArgument],
                    "graphed_session_rebound",
                    "role never rebound",
                );
            }
            if r != S::Ok {
                assert!(
                    on.iter().all(|&v| v == 0xee),
                    "a refused query wrote: {on:?}"
                );
            }
            assert_eq!(on[count], 0xee, "wrote past count");
        }
    }
}

pub fn plan_dump_check(h: *mut graphed_session, captured: bool) {
    let i = &w().input;
    let mut len = 0xdeadusize;
    // SAFETY: NULL buffer asks for the length.
    let r = unsafe { graphed_session_plan_dump(h, null_mut(), 0, &mut len) };
    post(r, "graphed_session_plan_dump");
    if !captured || r != S::Ok {
        assert_eq!(len, 0xdead);
        return;
    }
    let cap = match i.below(4) {
        0 => 1,
        1 => len / 2 + 1,
        _ => len + 1,
    };
    let mut buf = vec![0xa5u8; cap + 16];
    let mut len2 = 0;
    // SAFETY: buf has cap + 16 bytes.
    let r = unsafe { graphed_session_plan_dump(h, buf.as_mut_ptr().cast(), cap, &mut len2) };
    expect(r, &[S::Ok], "graphed_session_plan_dump", "dump");
    assert_eq!(len2, len);
    let n = len.min(cap - 1);
    assert_eq!(buf[n], 0, "plan dump not NUL-terminated");
    assert!(
        buf[cap..].iter().all(|&b| b == 0xa5),
        "plan dump wrote past its capacity"
    );
    assert!(!buf[..n].contains(&0));
}
