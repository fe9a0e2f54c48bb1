//! Replaying a step (graphed_step_replay, after graphed_step_param_count):
//! the fuzzed arguments (a microbatch count too), the expected status in
//! graphed's order, the call, and a refusal for the parameters' addresses
//! changing nothing.

use super::*;

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
    let fault = i.below(16);
    match fault {
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
            a.struct_size = std::mem::offset_of!(graphed_step_args, params);
        }
    }
    // The microbatch count (after every other choice): always for a WHILE
    // step, for others when the fault above was 7 (so that the inputs
    // before WHILE steps read as they did).
    let device_loop = st_model.as_ref().is_some_and(|st| st.device_loop);
    let declared = st_model.as_ref().map_or(1, |st| st.microbatches);
    let mut asked = 0;
    if device_loop || fault == 7 {
        asked = fuzz_count(declared);
        let full = size_of::<graphed_step_args>();
        if a.struct_size == full && i.chance(24) {
            // The layout before the count: the library reads 0 (all).
            a.struct_size = std::mem::offset_of!(graphed_step_args, microbatches);
        }
        a.microbatches = asked;
        if a.struct_size < std::mem::offset_of!(graphed_step_args, microbatches) + 4 {
            asked = 0;
        }
    }
    let count_err = st_model
        .as_ref()
        .and_then(|st| count_refusal(step, st, asked));
    let count = if asked == 0 { declared } else { asked };
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
    let mut slot_err = None;
    // ALIAS_HELD would be for the clone slots (the message says so).
    let mut slot_says = false;
    // INVALID_ARGUMENT would be for the count.
    let mut count_says = false;
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
        // A step over a released callable is refused.
        if *st == St::Captured {
            let k = sess.unwrap();
            let gone = st_model
                .as_ref()
                .is_some_and(|s| s.callables.iter().any(|&c| released(k, c)));
            first(&mut want, gone.then_some(S::CallableReleased));
        }
        // The count's message only where nothing before it failed (an
        // earlier INVALID_ARGUMENT, a misaligned grads array say, wins).
        count_says = want.is_none() && count_err.is_some();
        first(&mut want, count_err.as_ref().map(|e| e.0));
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
        // A looped step has no pass-by-pass replay: without a free clone
        // slot it refuses.
        match st_model.as_ref().map(|st| slot_free(sess.unwrap(), st)) {
            Some(Some(false)) => slot_err = Some(S::AliasHeld),
            Some(None) => lenient.push(S::AliasHeld),
            _ => {}
        }
        slot_says =
            before_params.is_none() && (slot_err.is_some() || lenient.contains(&S::AliasHeld));
        first(&mut want, slot_err);
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
    // Fresh data in the copies in (the grads of a loop body mix it in),
    // and the blocks of the copies out that a shorter loop leaves alone.
    let kept_out = match (sess, &model, &st_model) {
        (Some(k), Some(m), Some(st)) if m.0 == St::Captured => {
            fresh_data(&m.1, st, epoch);
            copies_out_kept(k, st, count.min(st.microbatches))
        }
        _ => Vec::new(),
    };
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
        "step_replay {t:?} step {step} n {n}/{np} params {:?} count {asked}{} want {want:?}",
        pa.as_ref().map(|p| (p.mode, p.count, p.moved)),
        if device_loop { " WHILE" } else { "" }
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
        r = call(abuf.as_ptr().cast(), slot_err);
        let mut ok = vec![slot_err.unwrap_or(S::Ok)];
        if slot_err.is_none() {
            ok.extend(lenient.iter().copied());
        }
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
        if let (true, Some((e, t))) = (count_says, &count_err) {
            if r == *e {
                let m = msg();
                assert!(
                    m.contains(t.as_str()),
                    "graphed_step_replay refused the count: {m:?} does not say {t:?}"
                );
            }
        }
        if r == S::AliasHeld && slot_says {
            let m = msg();
            let n = wd.sessions.borrow()[sess.unwrap()].clone_slots;
            assert!(
                m.contains(&format!("all {n} are held")),
                "graphed_step_replay: ALIAS_HELD for its clone slots says {m:?}"
            );
        }
        return;
    }
    let k = sess.unwrap();
    let (_, _, _, strict, clone, _, _) = model.unwrap();
    let st_model = st_model.unwrap();
    let run = StepRun {
        epoch,
        count,
        before,
        kept: kept_out,
    };
    check_step_refs(k, strict, clone, &st_model, &params, &refs, stride, &run);
    forget_if_gone(k);
}

/// graphed_step_args.microbatches for a step of `n`: 0 (all of them), 1 to
/// n, past n, and the largest.
fn fuzz_count(n: u32) -> u32 {
    let i = &w().input;
    match i.below(8) {
        0 => 0,
        1 => 1,
        2 => n,
        3 => 1 + i.below(n as usize) as u32,
        4 => n - 1,
        5 => n + 1,
        6 => u32::MAX,
        _ => i.pick(&[2, 3, 4096, 4097]),
    }
}

/// What graphed_step_replay says of a replay of step `step` (`st`) asked
/// for `asked` microbatches (0: all): a WHILE step runs 1 to its count, an
/// unrolled one only its own.
fn count_refusal(step: u32, st: &StepModel, asked: u32) -> Option<Refusal> {
    let n = st.microbatches;
    let why = match asked {
        0 => return None,
        a if a == n || (st.device_loop && a < n) => return None,
        a if st.device_loop => format!(
            "step {step} was asked for {a} microbatches; it was declared with {n}, and its io \
             regions hold no more"
        ),
        a => format!(
            "step {step} was asked for {a} microbatches; it was captured unrolled for {n} (a \
             count per replay needs GRAPHED_STEP_LOOP_WHILE)"
        ),
    };
    Some((S::InvalidArgument, why))
}
