//! Steps: declaration (graphed_session_add_step) and replay, against the
//! model of the step graphs a capture makes.

use super::*;

/// Whether a callable of a declared step has external buffers.
pub fn step_has_external(s: &Sess) -> bool {
    s.steps
        .iter()
        .flat_map(|st| &st.callables)
        .any(|&c| callable_is_external(&s.callables[c]))
}

pub fn callable_is_external(cl: &Callable) -> bool {
    cl.inputs.iter().chain(&cl.outputs).any(|t| t.external) || cl.params.iter().any(|p| p.external)
}

/// Whether a declared step of session `k` lacks a destination that a
/// parameter's frozen policy (COPY_INTO, ACCUMULATE_INTO) needs: capture
/// then fails with INVALID_ARGUMENT.
pub fn step_lacks_destination(k: usize) -> bool {
    let s = &w().sessions.borrow()[k];
    s.steps.iter().any(|st| {
        let pols = st
            .callables
            .iter()
            .flat_map(|&c| s.callables[c].params.iter().map(|p| p.resolved(s.clone)));
        pols.zip(&st.dsts)
            .any(|(p, &d)| (p == 3 || p == 4) && d == 0)
    })
}

/// The step graphs capture makes: one per step, or with CLONE grads one
/// per clone slot (none with a caller allocator or no slots: those steps
/// replay pass by pass).
pub fn step_graphs(k: usize) -> u32 {
    let s = &w().sessions.borrow()[k];
    s.steps
        .iter()
        .map(|st| {
            let cloned = st.callables.iter().any(|&c| {
                s.callables[c]
                    .params
                    .iter()
                    .any(|p| p.resolved(s.clone) == 1)
            });
            match (cloned, s.custom_alloc) {
                (false, _) => 1,
                (true, true) => 0,
                (true, false) => s.clone_slots,
            }
        })
        .sum()
}

pub fn op_add_step() {
    let wd = w();
    let i = &wd.input;
    let t = target_where(|s| s.st == St::Open && !s.callables.is_empty());
    let model = match t {
        Target::Live(k) => {
            let s = &wd.sessions.borrow()[k];
            Some((s.st, s.callables.clone(), s.sched.clone()))
        }
        _ => None,
    };
    let calls = model.as_ref().map_or(Vec::new(), |m| m.1.clone());
    let n = calls.len();
    // Usually an increasing subset of the callables.
    let mut cs: Vec<u32> = (0..n as u32).filter(|_| i.below(3) != 0).collect();
    if cs.is_empty() && n > 0 {
        cs.push(i.below(n) as u32);
    }
    match i.below(16) {
        0 => cs.clear(),
        1 => cs.push(i.pick(&[n as u32, u32::MAX])),
        2 if !cs.is_empty() => cs.push(cs[cs.len() - 1]),
        3 if cs.len() > 1 => cs.reverse(),
        _ => {}
    }
    let known = cs.iter().all(|&c| (c as usize) < n);
    let params: Vec<Param> = if known {
        cs.iter()
            .flat_map(|&c| calls[c as usize].params.clone())
            .collect()
    } else {
        Vec::new()
    };
    // A destination for every parameter (the library ignores those whose
    // policy needs none), aligned for ACCUMULATE_INTO.
    let mut dsts: Vec<usize> = params
        .iter()
        .map(|p| {
            if p.bytes <= 1 << 20 {
                mem(p.bytes, 0)
            } else {
                0x1000
            }
        })
        .collect();
    let mut dst_array = true;
    let mut dst_count_null = false;
    match i.below(12) {
        0 if !dsts.is_empty() => {
            let j = i.below(dsts.len());
            dsts[j] = 0;
        }
        1 => dsts.push(mem(8, 0)),
        2 if !dsts.is_empty() => dsts.pop().map_or((), |_| ()),
        3 => dst_array = false,
        4 if !dsts.is_empty() => dst_count_null = true,
        _ => {}
    }
    let mut d = graphed_step_desc_default();
    d.callables = if cs.is_empty() && i.chance(60) {
        null()
    } else {
        cs.as_ptr()
    };
    d.num_callables = cs.len();
    let mut callables_null = false;
    if !cs.is_empty() && i.chance(10) {
        d.callables = null();
        callables_null = true;
    }
    if dst_array {
        d.param_dsts = if dst_count_null {
            null()
        } else {
            dsts.as_ptr().cast()
        };
        d.num_param_dsts = dsts.len();
    }
    let given = if dst_array {
        dsts.clone()
    } else {
        vec![0; params.len()]
    };
    let mut struct_err = None;
    match i.below(16) {
        0 => {
            d.magic = 0x6772_0008;
            struct_err = Some(S::BadStruct);
        }
        1 => {
            d.struct_size = 40;
            struct_err = Some(S::BadStruct);
        }
        2 => d.struct_size = size_of::<graphed_step_desc>() + 8,
        _ => {}
    }
    let mut buf = vec![0u64; size_of::<graphed_step_desc>() / 8 + 2];
    // SAFETY: buf holds the struct.
    unsafe { (buf.as_mut_ptr() as *mut graphed_step_desc).write(d) };
    let desc: *const graphed_step_desc = if i.chance(8) {
        null()
    } else {
        buf.as_ptr().cast()
    };
    let out_null = i.chance(8);

    // Expected, in graphed's order.
    let mut want = None;
    first(&mut want, t.lookup());
    first(&mut want, out_null.then_some(S::NullPointer));
    first(&mut want, desc.is_null().then_some(S::NullPointer));
    first(&mut want, struct_err);
    first(&mut want, callables_null.then_some(S::NullPointer));
    first(&mut want, dst_count_null.then_some(S::InvalidArgument));
    first(&mut want, t.lock());
    if let Some((st, calls, sched)) = &model {
        match st {
            St::Captured => first(&mut want, Some(S::WrongState)),
            St::Reset => first(&mut want, Some(S::SessionReset)),
            St::Open => {}
        }
        first(
            &mut want,
            (!matches!(sched, Some(None))).then_some(S::Incompatible),
        );
        first(&mut want, cs.is_empty().then_some(S::InvalidArgument));
        for (k, &c) in cs.iter().enumerate() {
            // Callables are checked in order: an unknown one ends the checks.
            if c as usize >= calls.len() {
                first(&mut want, Some(S::InvalidArgument));
                break;
            }
            if k > 0 && c <= cs[k - 1] {
                first(&mut want, Some(S::InvalidArgument));
            }
            let external = callable_is_external(&calls[c as usize]);
            first(&mut want, external.then_some(S::Incompatible));
        }
        first(
            &mut want,
            (given.len() != params.len()).then_some(S::InvalidArgument),
        );
    }
    let mut index = 0xabcd_u32;
    trace!("add_step {t:?} callables {cs:?} dsts {given:?} want {want:?}");
    mark();
    // SAFETY: every pointer is NULL or to a live local of the stated size.
    let r = unsafe {
        graphed_session_add_step(
            t.ptr(),
            desc,
            if out_null { null_mut() } else { &mut index },
        )
    };
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_add_step",
        "step",
    );
    if r != S::Ok {
        assert_eq!(index, 0xabcd, "step index written on failure");
        return;
    }
    let Target::Live(k) = t else { unreachable!() };
    let mut ss = wd.sessions.borrow_mut();
    assert_eq!(index as usize, ss[k].steps.len(), "step index");
    ss[k].steps.push(StepModel {
        callables: cs.iter().map(|&c| c as usize).collect(),
        dsts: given,
    });
}

/// graphed_step_param_count on any target: the refs a replay of `step`
/// writes (`want`: None without a live session; Some(None) for a step the
/// session does not have), in any state.
fn step_param_count(t: Target, step: u32, want_count: Option<Option<usize>>) {
    let null = w().input.chance(30);
    let mut n = 0x77usize;
    let mut want = t.lookup();
    first(&mut want, null.then_some(S::NullPointer));
    first(&mut want, t.lock());
    if let Some(None) = want_count {
        first(&mut want, Some(S::InvalidArgument));
    }
    mark();
    // SAFETY: NULL or a local.
    let r =
        unsafe { graphed_step_param_count(t.ptr(), step, if null { null_mut() } else { &mut n }) };
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_step_param_count",
        "step",
    );
    if r == S::Ok {
        assert_eq!(Some(Some(n)), want_count, "step {step}");
    } else {
        assert_eq!(n, 0x77, "step param count written on failure");
    }
}

pub fn op_step_replay() {
    step_replay_with(false)
}

/// A step replay given the parameters' addresses (see `params`).
pub fn op_step_replay_params() {
    step_replay_with(true)
}

/// A step replay; with `with_params`, given the parameters' addresses in
/// one of the ways `params_arg` reads (after every other choice).
fn step_replay_with(with_params: bool) {
    let wd = w();
    let i = &wd.input;
    let t = target_where(|s| s.st == St::Captured && !s.steps.is_empty());
    let sess = match t {
        Target::Live(k) => Some(k),
        _ => None,
    };
    let model = sess.map(|k| {
        let s = &wd.sessions.borrow()[k];
        (
            s.st,
            s.callables.clone(),
            s.steps.clone(),
            s.strict,
            s.clone,
            s.pool,
            s.custom_alloc,
        )
    });
    let nsteps = model.as_ref().map_or(0, |m| m.2.len());
    let step = if nsteps > 0 && !i.chance(30) {
        i.below(nsteps) as u32
    } else {
        i.pick(&[nsteps as u32, u32::MAX])
    };
    let st_model = model.as_ref().and_then(|m| m.2.get(step as usize).cloned());
    let params: Vec<(usize, usize, Param)> = match (&model, &st_model) {
        (Some(m), Some(st)) => st
            .callables
            .iter()
            .flat_map(|&c| {
                m.1[c]
                    .params
                    .iter()
                    .enumerate()
                    .map(move |(j, p)| (c, j, p.clone()))
            })
            .collect(),
        _ => Vec::new(),
    };
    let np = params.len();
    step_param_count(
        t,
        step,
        model.as_ref().map(|_| st_model.as_ref().map(|_| np)),
    );
    let (stream, stream_err) = stream_arg(true);
    let mut a = graphed_step_args_default();
    a.step = step;
    a.stream = stream as graphed_stream;
    let mut n = np;
    let mut out_null = false;
    let mut out_mis = false;
    let mut struct_err = None;
    let mut args_null = false;
    match i.below(16) {
        0 => args_null = true,
        1 => {
            a.magic = 0x6772_0007;
            struct_err = Some(S::BadStruct);
        }
        2 => {
            a.struct_size = 16;
            struct_err = Some(S::BadStruct);
        }
        3 => n += 1,
        4 if np > 0 => out_null = true,
        5 => a.ref_size = i.pick(&[0, 8, 39, 44]),
        6 if np > 0 => out_mis = true,
        _ => {}
    }
    // The parameters' addresses, registered at these.
    let registered: Vec<usize> = params.iter().map(|(_, _, p)| p.data).collect();
    let mut pa = with_params.then(|| {
        let bytes: Vec<usize> = params.iter().map(|(_, _, p)| p.bytes).collect();
        params_arg(&registered, &bytes)
    });
    if let Some(pa) = &mut pa {
        if a.struct_size != size_of::<graphed_step_args>() {
            pa.neutral();
        }
        a.params = pa.ptr;
        a.num_params = pa.count;
        if pa.mode == PMode::OldLayout {
            // The layout before the parameters' addresses.
            a.struct_size = size_of::<graphed_step_args>() - 16;
        }
    }
    let stride = a.ref_size;
    let mut refs = vec![0xabu8; n * stride.max(REF) + 16];
    let mut p = refs.as_mut_ptr();
    if out_null {
        p = null_mut();
    }
    if out_mis {
        // SAFETY: 4 bytes into `refs`, which has 16 spare bytes.
        p = unsafe { p.add(4) };
    }
    let mut abuf = vec![0u64; size_of::<graphed_step_args>() / 8 + 2];
    // SAFETY: abuf holds the struct.
    unsafe { (abuf.as_mut_ptr() as *mut graphed_step_args).write(a) };
    let args: *const graphed_step_args = if args_null {
        null()
    } else {
        abuf.as_ptr().cast()
    };

    // Expected, in graphed's order.
    let mut want = None;
    let mut lenient = Vec::new();
    first(&mut want, t.lookup());
    first(&mut want, args_null.then_some(S::NullPointer));
    first(&mut want, struct_err);
    first(&mut want, t.lock());
    let mut before_params = want;
    let mut params_err = None;
    if let Some((st, _, _, strict, _, pool, custom)) = &model {
        first(&mut want, st_model.is_none().then_some(S::InvalidArgument));
        first(&mut want, (n != np).then_some(S::InvalidArgument));
        first(&mut want, (stride < REF).then_some(S::InvalidArgument));
        if n > 0 {
            first(&mut want, out_null.then_some(S::NullPointer));
            first(
                &mut want,
                (out_mis || stride % 8 != 0).then_some(S::InvalidArgument),
            );
        }
        first(&mut want, pa.as_ref().and_then(|p| p.pre_err));
        match st {
            St::Open => first(&mut want, Some(S::WrongState)),
            St::Reset => first(&mut want, Some(S::SessionReset)),
            St::Captured => {}
        }
        first(&mut want, stream_err);
        if *strict {
            let k = sess.unwrap();
            let cs = st_model
                .as_ref()
                .map_or(Vec::new(), |s| s.callables.clone());
            let held = wd
                .leases
                .borrow()
                .iter()
                .any(|l| l.sess == k && cs.contains(&l.slot.0));
            first(&mut want, held.then_some(S::AliasHeld));
        }
        // A step follows moves as its callables' forwards do.
        before_params = want;
        params_err = pa.as_ref().and_then(|p| p.check(&registered, true));
        first(&mut want, params_err);
        lenient.extend(replay_lenient(*pool, *custom));
    }
    // Accumulating destinations before the replay.
    let before: Vec<Vec<u8>> = st_model.as_ref().map_or(Vec::new(), |st| {
        st.dsts
            .iter()
            .zip(&params)
            .map(|(&d, (_, _, p))| {
                if d > 0x10000 {
                    // SAFETY: harness memory of p.bytes.
                    unsafe { std::slice::from_raw_parts(d as *const u8, p.bytes) }.to_vec()
                } else {
                    Vec::new()
                }
            })
            .collect()
    });
    let mut epoch = EPOCH
        .load(Ordering::Relaxed)
        .wrapping_add(1 + i.below(200) as u8);
    EPOCH.store(epoch, Ordering::Relaxed);
    // Refused for the parameters' addresses alone: the step's instances'
    // buffers are kept to see that the refusal changed nothing.
    let refused_for_params = before_params.is_none() && params_err.is_some();
    let snapshot = |k: usize| -> Vec<Vec<u8>> {
        let (h, cls) = {
            let s = &wd.sessions.borrow()[k];
            (s.h as *mut graphed_session, s.callables.clone())
        };
        let cs = st_model
            .as_ref()
            .map_or(Vec::new(), |st| st.callables.clone());
        cs.iter()
            .flat_map(|&c| instance_bytes(h, c as u32, 0, &cls[c]))
            .collect()
    };
    let kept = sess.filter(|_| refused_for_params).map(snapshot);
    let call = |args: *const graphed_step_args, want: Option<graphed_status>| {
        let _pin = sess.filter(|_| want.is_none()).map(pin);
        mark();
        // SAFETY: args and room for n refs of `stride` bytes (or one of
        // the faults graphed must catch before writing).
        unsafe { graphed_step_replay(t.ptr(), args, p.cast(), n) }
    };
    trace!(
        "step_replay {t:?} step {step} n {n}/{np} params {:?} want {want:?}",
        pa.as_ref().map(|p| (p.mode, p.count, p.moved))
    );
    let mut r = call(args, want);
    let mut ok = vec![want.unwrap_or(S::Ok)];
    if want.is_none() {
        ok.extend(lenient.iter().copied());
    }
    expect(r, &ok, "graphed_step_replay", "step");
    if let (Some(kept), Some(pa)) = (&kept, &pa) {
        // Refused for the parameters: nothing was enqueued or written, and
        // the same step with the registered addresses goes through as if
        // the refused one had not been made.
        let k = sess.unwrap();
        let first_of: Vec<usize> = params.iter().map(|&(_, j, _)| j).collect();
        pa.check_message(r, "graphed_step_replay", |at| first_of[at]);
        assert!(
            refs.iter().all(|&b| b == 0xab),
            "graphed_step_replay wrote refs on failure"
        );
        assert!(
            snapshot(k) == *kept,
            "graphed_step_replay refused for its parameters' addresses ({r:?}) but changed buffers"
        );
        let again = ParamsArg::registered(&registered);
        let mut a2 = a;
        a2.params = again.ptr;
        a2.num_params = again.count;
        // SAFETY: abuf holds the struct.
        unsafe { (abuf.as_mut_ptr() as *mut graphed_step_args).write(a2) };
        epoch = EPOCH
            .load(Ordering::Relaxed)
            .wrapping_add(1 + i.below(200) as u8);
        EPOCH.store(epoch, Ordering::Relaxed);
        r = call(abuf.as_ptr().cast(), None);
        let mut ok = vec![S::Ok];
        ok.extend(lenient.iter().copied());
        expect(
            r,
            &ok,
            "graphed_step_replay",
            "again with the registered addresses",
        );
        drop(again);
    }
    if r != S::Ok {
        assert!(
            refs.iter().all(|&b| b == 0xab),
            "graphed_step_replay wrote refs on failure"
        );
        return;
    }
    let k = sess.unwrap();
    let (_, _, _, strict, clone, _, _) = model.unwrap();
    let st_model = st_model.unwrap();
    let mut blocks: Vec<HeldBlock> = Vec::new();
    let mut new_leases = Vec::new();
    // Destroyed when idle from inside this replay: its aliases went with it.
    let gone = !wd.sessions.borrow()[k].alive;
    for (at, (c, j, p)) in params.iter().enumerate() {
        let r = read_ref(&refs, at * stride);
        let b = seed(k, *c, 0, ROLE_PARAM, *j) ^ epoch;
        let dst = st_model.dsts[at];
        match p.resolved(clone) {
            0 => assert_eq!(
                (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                (0, 0, 0, 0, 0),
                "step param {at}: NONE"
            ),
            1 => {
                assert_eq!(r.kind, 2, "step param {at}: CLONE");
                assert!(r.owner != 0 && r.ptr != 0 && r.bytes == p.bytes && r.lease == 0);
                assert!(all_bytes(r.ptr, p.bytes, b), "step param {at}: the clone");
                match blocks.iter_mut().find(|x| x.owner == r.owner) {
                    Some(x) => {
                        x.refs += 1;
                        x.grads.push((r.ptr, r.bytes, b));
                    }
                    None => blocks.push(HeldBlock {
                        owner: r.owner,
                        refs: 1,
                        sess: k,
                        grads: vec![(r.ptr, r.bytes, b)],
                    }),
                }
            }
            2 => {
                assert_eq!(
                    (r.kind, r.bytes, r.owner),
                    (1, p.bytes, 0),
                    "step param {at}: ALIAS"
                );
                assert!(
                    gone || all_bytes(r.ptr, p.bytes, b),
                    "step param {at}: the alias"
                );
                assert_eq!(r.lease != 0, strict, "step param {at}: lease");
                if r.lease != 0 {
                    new_leases.push(Lease {
                        sess: k,
                        token: r.lease,
                        slot: (*c, 0, 2, *j),
                    });
                }
            }
            3 => {
                assert_eq!(
                    (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                    (3, dst, p.bytes, 0, 0)
                );
                assert!(all_bytes(dst, p.bytes, b), "step param {at}: COPY_INTO");
            }
            _ => {
                assert_eq!(
                    (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                    (4, dst, p.bytes, 0, 0)
                );
                if p.dtype == 0 && !before[at].is_empty() {
                    check_accumulated(&before[at], dst, b, &format!("step param {at}"));
                }
            }
        }
    }
    for blk in &blocks {
        assert!(
            !wd.blocks.borrow().iter().any(|x| x.owner == blk.owner),
            "a clone block handle was reused"
        );
    }
    for l in &new_leases {
        assert!(
            !wd.leases.borrow().iter().any(|h| h.token == l.token),
            "a lease token was handed out twice"
        );
    }
    wd.blocks.borrow_mut().extend(blocks);
    wd.leases.borrow_mut().extend(new_leases);
    forget_if_gone(k);
}

/// A session destroyed when idle by code that ran inside the call that
/// just returned (a callback, a host task) is gone now: its leases go
/// stale with it.
pub fn forget_if_gone(k: usize) {
    if !w().sessions.borrow()[k].alive {
        drop_session_state(k);
    }
}
