//! Queries: stats, buffers, policies, rebound slots, the plan dump, device
//! memory, callable arity, the driver version, status names, the version.

use super::*;

pub fn op_stats() {
    let t = target();
    let mut out = Out::fuzzed(graphed_session_stats_default(), &[0], &[100]);
    let want = t.lock().or(out.err).unwrap_or(S::Ok);
    mark();
    // SAFETY: NULL or a stats struct with spare room.
    let r = unsafe { graphed_session_stats_get(t.ptr(), out.ptr()) };
    expect(r, &[want], "graphed_session_stats_get", "stats");
    let Some(got) = out.filled(r, "stats") else {
        return;
    };
    assert_eq!(
        got.struct_size, out.m.struct_size,
        "stats header overwritten"
    );
    let Target::Live(k) = t else { unreachable!() };
    check_stats(k, &got);
}

pub fn check_stats(k: usize, got: &graphed_session_stats) {
    let wd = w();
    let s = &wd.sessions.borrow()[k];
    assert_eq!(
        got.captured,
        (s.st == St::Captured) as u32,
        "stats.captured"
    );
    assert_eq!(got.callables as usize, s.callables.len(), "stats.callables");
    let blocks = wd.blocks.borrow().iter().filter(|b| b.sess == k).count() as u64;
    assert_eq!(
        got.clone_blocks_outstanding, blocks,
        "stats.clone_blocks_outstanding"
    );
    if s.strict {
        let held = wd.leases.borrow().iter().filter(|l| l.sess == k).count() as u32;
        assert_eq!(got.leases_held, held, "stats.leases_held");
    } else {
        assert_eq!(got.leases_held, 0);
    }
    assert_eq!(got.teardown_errors, 0, "stats.teardown_errors");
    // The host backend's user tasks are opaque: no parameter can move, each
    // one registered with REBIND is refused at capture, and no replay ever
    // follows a move. Counted per instance: every bucket of a bucketed
    // callable is one.
    // Released callables have no graphs left: they count for nothing.
    let flagged = if s.st == St::Captured {
        s.callables
            .iter()
            .enumerate()
            .filter(|(c, _)| !s.released.contains(c))
            .map(|(_, c)| {
                c.params.iter().filter(|p| p.rebind).count() as u32 * c.buckets.len().max(1) as u32
            })
            .sum::<u32>()
            * s.mb
    } else {
        0
    };
    assert_eq!(
        (got.params_movable, got.params_move_refused, got.param_moves),
        (0, flagged, 0),
        "stats.params_movable, params_move_refused, param_moves"
    );
    // Passes that chose on the device a size above every bucket.
    let overflows = if s.st == St::Captured { s.overflows } else { 0 };
    assert_eq!(got.bucket_overflows, overflows, "stats.bucket_overflows");
    if s.st != St::Captured {
        // Nothing of a failed capture, or of a reset one, stays behind.
        assert_eq!((got.graph_count, got.instances), (0, 0));
        assert_eq!(
            (got.static_bytes, got.scratch_bytes),
            (0, 0),
            "static or scratch bytes of a session that is not captured"
        );
    }
}

pub fn op_query() {
    let wd = w();
    let i = &wd.input;
    let t = target();
    let model = if let Target::Live(k) = t {
        let s = &wd.sessions.borrow()[k];
        Some((s.st, s.callables.clone(), s.mb))
    } else {
        None
    };
    match i.below(5) {
        0 => {
            let role = i.pick(&[0u32, 1, 2, 3, 4, 5, 99]);
            let c = i.below(3) as u32;
            let m = i.below(3) as u32;
            let count = i.below(4);
            let mut ptrs = vec![0x99usize; count + 1];
            let mut p = ptrs.as_mut_ptr() as *mut *mut c_void;
            let fault = i.below(6);
            if fault == 0 {
                p = null_mut();
            } else if fault == 1 {
                // SAFETY: 1 byte into the array, which has a spare element.
                p = unsafe { (p as *mut u8).add(1) as *mut *mut c_void };
            }
            let mut want = t.lookup();
            if want.is_none() && role > 4 {
                want = Some(S::InvalidArgument);
            }
            want = want.or(t.lock());
            if want.is_none() {
                let (st, cls, mb) = model.clone().unwrap();
                want = state_err(st);
                if want.is_none() {
                    let gone = matches!(t, Target::Live(k) if released(k, c as usize));
                    match cls.get(c as usize) {
                        Some(_) if m < mb && gone => want = Some(S::CallableReleased),
                        Some(cl) if m < mb => {
                            let n = match role {
                                0 | 3 => cl.inputs.len(),
                                1 | 2 => cl.outputs.len(),
                                _ => cl.params.len(),
                            };
                            if n != count {
                                want = Some(S::InvalidArgument);
                            } else if n > 0 && fault == 0 {
                                want = Some(S::NullPointer);
                            } else if n > 0 && fault == 1 {
                                want = Some(S::InvalidArgument);
                            }
                        }
                        _ => want = Some(S::InvalidArgument),
                    }
                }
            }
            mark();
            // SAFETY: p has room for count pointers or is refused.
            let r = unsafe { graphed_session_buffers(t.ptr(), c, m, role, p, count) };
            expect(
                r,
                &[want.unwrap_or(S::Ok)],
                "graphed_session_buffers",
                "query",
            );
            if r != S::Ok && fault > 1 {
                assert!(
                    ptrs.iter().all(|&x| x == 0x99),
                    "buffers written on failure"
                );
            }
            buffer_count(t, c, m, role, model.clone());
        }
        1 => {
            let c = i.below(3) as u32;
            let count = i.below(4);
            let mut pol = vec![0xeeu32; count + 1];
            let mut want = t.lock();
            if want.is_none() {
                let (st, cls, _) = model.clone().unwrap();
                want = state_err(st);
                if want.is_none() {
                    want = match cls.get(c as usize) {
                        None => Some(S::InvalidArgument),
                        Some(cl) if cl.params.len() != count => Some(S::InvalidArgument),
                        _ => None,
                    };
                }
            }
            mark();
            // SAFETY: room for count values.
            let r = unsafe { graphed_session_param_policies(t.ptr(), c, pol.as_mut_ptr(), count) };
            expect(
                r,
                &[want.unwrap_or(S::Ok)],
                "graphed_session_param_policies",
                "query",
            );
            if r != S::Ok {
                assert!(pol.iter().all(|&x| x == 0xee));
            }
        }
        2 => {
            let null_len = i.chance(40);
            let mut want = t.lookup();
            if want.is_none() && null_len {
                want = Some(S::NullPointer);
            }
            want = want.or(t.lock());
            if want.is_none() {
                want = state_err(model.as_ref().unwrap().0);
            }
            if null_len || want.is_some() {
                let mut len = 0x77usize;
                mark();
                // SAFETY: NULL buffer.
                let r = unsafe {
                    graphed_session_plan_dump(
                        t.ptr(),
                        null_mut(),
                        0,
                        if null_len { null_mut() } else { &mut len },
                    )
                };
                expect(
                    r,
                    &[want.unwrap_or(S::Ok)],
                    "graphed_session_plan_dump",
                    "query",
                );
                assert_eq!(len, 0x77);
            } else {
                plan_dump_check(t.ptr(), true);
            }
        }
        3 => {
            // graphed_session_rebound on any target, in any state, with any
            // role, index, count and output pointer.
            let role = i.pick(&[0u32, 2, 0, 2, 1, 3, 4, 5, 99]);
            let c = i.below(3) as u32;
            let m = i.below(3) as u32;
            let count = i.below(4);
            let mut on = vec![0xeeu32; count + 1];
            let mut p = on.as_mut_ptr();
            let fault = i.below(6);
            if fault == 0 {
                p = null_mut();
            } else if fault == 1 {
                // SAFETY: 1 byte into the array, which has a spare element.
                p = unsafe { (p as *mut u8).add(1) as *mut u32 };
            }
            let mut want = t.lookup();
            if want.is_none() && role > 4 {
                want = Some(S::InvalidArgument);
            }
            want = want.or(t.lock());
            if want.is_none() {
                let (st, cls, mb) = model.clone().unwrap();
                want = state_err(st);
                if want.is_none() {
                    want = match (cls.get(c as usize), role) {
                        (Some(cl), 0 | 2) if m < mb => {
                            let n = if role == 0 {
                                cl.inputs.len()
                            } else {
                                cl.outputs.len()
                            };
                            if n != count {
                                Some(S::InvalidArgument)
                            } else if n > 0 && fault == 0 {
                                Some(S::NullPointer)
                            } else if n > 0 && fault == 1 {
                                Some(S::InvalidArgument)
                            } else {
                                None
                            }
                        }
                        // An unknown callable or microbatch, or a role that
                        // is never rebound.
                        _ => Some(S::InvalidArgument),
                    };
                }
            }
            mark();
            // SAFETY: p has room for count values, or is refused.
            let r = unsafe { graphed_session_rebound(t.ptr(), c, m, role, p, count) };
            expect(
                r,
                &[want.unwrap_or(S::Ok)],
                "graphed_session_rebound",
                "query",
            );
            if fault > 1 {
                // The host backend rebinds nothing: 0 on success, untouched
                // on failure; never past count.
                let v = if r == S::Ok { 0 } else { 0xee };
                assert!(on[..count].iter().all(|&x| x == v), "rebound: {on:?}");
                assert_eq!(on[count], 0xee, "wrote past count");
            }
        }
        _ => {
            let mut f = 0x11usize;
            let mut tot = 0x22usize;
            let null_f = i.chance(40);
            let want = t
                .lookup()
                .or(null_f.then_some(S::NullPointer))
                .or(t.lock())
                .unwrap_or(S::Unsupported);
            mark();
            // SAFETY: locals or NULL.
            let r = unsafe {
                graphed_session_device_memory(
                    t.ptr(),
                    if null_f { null_mut() } else { &mut f },
                    &mut tot,
                )
            };
            expect(r, &[want], "graphed_session_device_memory", "host");
            assert_eq!((f, tot), (0x11, 0x22));
        }
    }
}

/// graphed_session_buffer_count: the count graphed_session_buffers takes
/// for the role, refused as that call refuses a target, role, state,
/// callable or microbatch.
fn buffer_count(t: Target, c: u32, m: u32, role: u32, model: Option<(St, Vec<Callable>, u32)>) {
    let null = w().input.chance(30);
    let mut n = 0x77usize;
    let mut want = t.lookup();
    first(&mut want, null.then_some(S::NullPointer));
    first(&mut want, (role > 4).then_some(S::InvalidArgument));
    first(&mut want, t.lock());
    let mut expected = None;
    if want.is_none() {
        let (st, cls, mb) = model.unwrap();
        if let Some(cl) = instance_at(&mut want, st, &cls, mb, c, m) {
            expected = Some(match role {
                0 | 3 => cl.inputs.len(),
                1 | 2 => cl.outputs.len(),
                _ => cl.params.len(),
            });
        }
    }
    mark();
    // SAFETY: NULL or a local.
    let r = unsafe {
        graphed_session_buffer_count(t.ptr(), c, m, role, if null { null_mut() } else { &mut n })
    };
    expect_answer(
        r,
        want,
        "graphed_session_buffer_count",
        &format!("buffer count of role {role}"),
        (n, 0x77),
        expected,
    );
}

pub fn op_misc() {
    let i = &w().input;
    let code = i.pick(&[0u32, 3, 19, 20, 1000, u32::MAX]);
    let last = S::CollectiveMismatch as u32;
    // SAFETY: static string.
    let name = unsafe { CStr::from_ptr(graphed_status_name(code)) }
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(name == "GRAPHED_STATUS_UNKNOWN", code > last);
    // Every code has its own name (no input read: the decoding of the
    // choices above is unchanged).
    let mut names = std::collections::HashSet::new();
    for c in 0..=last + 1 {
        // SAFETY: static string.
        let n = unsafe { CStr::from_ptr(graphed_status_name(c)) }.to_bytes();
        assert!(n.starts_with(b"GRAPHED_STATUS_"), "status {c}: {n:?}");
        assert_eq!(
            n == b"GRAPHED_STATUS_UNKNOWN",
            c > last,
            "status {c}: {n:?}"
        );
        assert!(names.insert(n.to_vec()), "two codes named {n:?}");
    }
    // SAFETY: static string.
    let moved = unsafe { CStr::from_ptr(graphed_status_name(S::ParamMoved as u32)) };
    assert_eq!(moved.to_bytes(), b"GRAPHED_STATUS_PARAM_MOVED");
    // SAFETY: static string.
    let v = unsafe { CStr::from_ptr(graphed_version()) };
    assert!(!v.to_bytes().is_empty());
    let b = i.pick(&[0u32, 1, 2, u32::MAX]);
    let r = graphed_backend_available(b);
    post(r, "graphed_backend_available");
    match b {
        1 => assert_eq!(r, S::Ok),
        0 => assert!(matches!(r, S::Ok | S::NoDriver | S::NoDevice)),
        _ => assert_eq!(r, S::InvalidArgument),
    }
    let mut n = 0xffu32;
    // SAFETY: a local.
    let r = unsafe { graphed_device_count(&mut n) };
    post(r, "graphed_device_count");
    if r != S::Ok {
        assert_eq!(n, 0xff);
    }
    // Element sizes: every dtype code, unknown ones, a NULL output.
    let dtype = i.pick(&[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 255, u32::MAX]);
    let null = i.chance(30);
    let mut size = 0x77usize;
    mark();
    // SAFETY: NULL or a local.
    let r = unsafe { graphed_dtype_size(dtype, if null { null_mut() } else { &mut size }) };
    let sizes = [4usize, 2, 2, 8, 1, 1, 4, 8, 1];
    let want = match sizes.get(dtype as usize) {
        _ if null => S::NullPointer,
        Some(_) => S::Ok,
        None => S::InvalidArgument,
    };
    expect(r, &[want], "graphed_dtype_size", "dtype");
    let got = if r == S::Ok {
        sizes[dtype as usize]
    } else {
        0x77
    };
    assert_eq!(size, got, "dtype {dtype}");
    teardown_errors(code);
}

/// The process's teardown errors, asked in the way `variant` picks (no
/// input bytes of its own): nothing the fuzzed calls do may fail while it
/// is released, so the count stays 0 and the text empty.
fn teardown_errors(variant: u32) {
    let (null_count, null_len, capacity) = match variant {
        3 => (false, false, None),
        19 => (true, false, Some(16)),
        20 => (false, true, Some(16)),
        1000 => (false, false, Some(1)),
        u32::MAX => (false, false, Some(0)),
        _ => (false, false, Some(64)),
    };
    let (mut count, mut len) = (0x77u64, 0x77usize);
    let mut buf = [0x55 as c_char; 64];
    mark();
    // SAFETY: NULL or locals; the buffer has 64 bytes, at least `capacity`.
    let r = unsafe {
        graphed_teardown_errors(
            if null_count { null_mut() } else { &mut count },
            capacity.map_or(null_mut(), |_| buf.as_mut_ptr()),
            capacity.unwrap_or(0),
            if null_len { null_mut() } else { &mut len },
        )
    };
    post(r, "graphed_teardown_errors");
    if null_count || null_len {
        assert_eq!(r, S::NullPointer);
        assert_eq!(
            (count, len),
            (0x77, 0x77),
            "teardown errors written on failure"
        );
        assert!(buf.iter().all(|&b| b == 0x55));
        return;
    }
    assert_eq!(r, S::Ok);
    assert_eq!(
        (count, len),
        (0, 0),
        "a teardown error in a fuzzed sequence"
    );
    match capacity {
        Some(c) if c > 0 => assert_eq!(buf[0], 0, "the empty text is NUL-terminated"),
        _ => assert!(
            buf.iter().all(|&b| b == 0x55),
            "nothing written without room"
        ),
    }
}

pub fn op_arity() {
    let wd = w();
    let i = &wd.input;
    let t = target();
    let calls = match t {
        Target::Live(k) => Some(wd.sessions.borrow()[k].callables.clone()),
        _ => None,
    };
    let n = calls.as_ref().map_or(0, |c| c.len());
    let c = if n > 0 && !i.chance(40) {
        i.below(n) as u32
    } else {
        i.pick(&[n as u32, u32::MAX])
    };
    let null_at = if i.chance(30) { Some(i.below(3)) } else { None };
    let mut outs = [0x77usize; 3];
    let ptrs: Vec<*mut usize> = (0..3)
        .map(|j| {
            if null_at == Some(j) {
                null_mut()
            } else {
                &mut outs[j] as *mut usize
            }
        })
        .collect();
    let mut want = None;
    first(&mut want, t.lookup());
    first(&mut want, null_at.map(|_| S::NullPointer));
    first(&mut want, t.lock());
    if calls.is_some() {
        first(&mut want, ((c as usize) >= n).then_some(S::InvalidArgument));
    }
    mark();
    // SAFETY: each pointer is NULL or a local.
    let r = unsafe { graphed_session_callable_arity(t.ptr(), c, ptrs[0], ptrs[1], ptrs[2]) };
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_callable_arity",
        "arity",
    );
    if r == S::Ok {
        let cl = &calls.unwrap()[c as usize];
        assert_eq!(outs, [cl.inputs.len(), cl.params.len(), cl.outputs.len()]);
    } else {
        assert!(
            (0..3).all(|j| null_at == Some(j) || outs[j] == 0x77),
            "arity written on failure"
        );
    }
}

pub fn op_driver_version() {
    let null = w().input.chance(60);
    let mut v = 0x5a5a_i32;
    mark();
    // SAFETY: NULL or a local.
    let r = unsafe { graphed_driver_version(if null { null_mut() } else { &mut v }) };
    post(r, "graphed_driver_version");
    if null {
        assert_eq!(r, S::NullPointer);
    } else {
        assert!(matches!(r, S::Ok | S::NoDriver), "{r:?}");
    }
    if r == S::Ok {
        assert!(v >= 1000, "driver version {v}");
    } else {
        assert_eq!(v, 0x5a5a, "driver version written on failure");
    }
}
