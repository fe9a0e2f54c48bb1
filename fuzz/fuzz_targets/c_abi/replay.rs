//! Replays: forward, backward and weight-grad with fuzzed arguments and
//! faults, checked against the frozen policies (ref kinds, clone contents,
//! COPY_INTO and ACCUMULATE_INTO destinations, leases).

use super::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fault {
    None,
    ArgsNull,
    Magic,
    Small,
    BigSize,
    DataNull,
    DataCount,
    DataEntry,
    DstsMissing,
    DstNull,
    DstMisaligned,
    OutCount,
    OutNull,
    RefSmall,
    RefOdd,
    RefBig,
    Callable,
    Microbatch,
    OutMisaligned,
    DstCount,
}

pub const FAULTS: [Fault; 20] = [
    Fault::None,
    Fault::ArgsNull,
    Fault::Magic,
    Fault::Small,
    Fault::BigSize,
    Fault::DataNull,
    Fault::DataCount,
    Fault::DataEntry,
    Fault::DstsMissing,
    Fault::DstNull,
    Fault::DstMisaligned,
    Fault::OutCount,
    Fault::OutNull,
    Fault::RefSmall,
    Fault::RefOdd,
    Fault::RefBig,
    Fault::Callable,
    Fault::Microbatch,
    Fault::OutMisaligned,
    Fault::DstCount,
];

pub const REF: usize = size_of::<graphed_ref>();

pub struct RefView {
    pub ptr: usize,
    pub bytes: usize,
    pub kind: u32,
    pub owner: usize,
    pub lease: u64,
}

pub fn read_ref(buf: &[u8], at: usize) -> RefView {
    let u = |o: usize| usize::from_ne_bytes(buf[at + o..at + o + 8].try_into().unwrap());
    RefView {
        ptr: u(0),
        bytes: u(8),
        kind: u32::from_ne_bytes(buf[at + 16..at + 20].try_into().unwrap()),
        owner: u(24),
        lease: u(32) as u64,
    }
}

/// What a replay may also answer for reasons the model does not track: a
/// pool shared with another captured session replayed out of its order,
/// and a caller allocator refusing a clone block.
pub fn replay_lenient(pool: usize, custom: bool) -> Vec<graphed_status> {
    let sharing = w()
        .sessions
        .borrow()
        .iter()
        .filter(|s| s.alive && s.pool == pool && s.st == St::Captured)
        .count();
    let mut v = Vec::new();
    if sharing > 1 {
        v.push(S::WrongState);
    }
    if custom {
        v.push(S::OutOfMemory);
    }
    v
}

/// An f32 ACCUMULATE_INTO destination holds `before` plus the grad, every
/// element `b` repeated.
pub fn check_accumulated(before: &[u8], dst: usize, b: u8, what: &str) {
    // SAFETY: harness memory of before.len() bytes.
    let got = unsafe { std::slice::from_raw_parts(dst as *const u8, before.len()) };
    for e in 0..before.len() / 4 {
        let was = u32::from_ne_bytes(before[e * 4..e * 4 + 4].try_into().unwrap());
        let want = f32_add(was, u32::from_ne_bytes([b; 4]));
        let g = u32::from_ne_bytes(got[e * 4..e * 4 + 4].try_into().unwrap());
        assert!(
            g == want || (f32::from_bits(g).is_nan() && f32::from_bits(want).is_nan()),
            "{what}: ACCUMULATE_INTO element {e}: 0x{g:08x}, expected 0x{want:08x}"
        );
    }
}

pub fn f32_add(a: u32, b: u32) -> u32 {
    (f32::from_bits(a) + f32::from_bits(b)).to_bits()
}

/// A forward (0), backward (1) or weight-grad (2) replay. `streams`: the
/// (stream, side stream) a callback replays on.
pub fn op_replay(t: Target, kind: u32, streams: Option<(usize, usize)>) {
    replay_with(t, kind, streams, false)
}

/// A replay of a captured session (mostly) given the parameters' addresses
/// (see `params`).
pub fn op_replay_params(kind: u32) {
    replay_with(target_where(|s| s.st == St::Captured), kind, None, true)
}

/// A replay; with `params`, given the parameters' addresses in one of the
/// ways `params_arg` reads (read after every other choice, so that replays
/// without them read their input as before).
fn replay_with(t: Target, kind: u32, streams: Option<(usize, usize)>, params: bool) {
    let wd = w();
    let i = &wd.input;
    let fault = if i.chance(70) {
        FAULTS[1 + i.below(FAULTS.len() - 1)]
    } else {
        Fault::None
    };
    // What the model knows of the session.
    let sess = match t {
        Target::Live(k) => Some(k),
        _ => None,
    };
    let model = sess.map(|k| {
        let s = &wd.sessions.borrow()[k];
        (
            s.st,
            s.callables.clone(),
            s.mb,
            s.strict,
            s.reuse,
            s.clone,
            s.pool,
            s.custom_alloc,
        )
    });
    let ncall = model.as_ref().map_or(1, |m| m.1.len().max(1));
    let mut c = i.below(ncall) as u32;
    let mut mb = if let Some(m) = &model {
        i.below(m.2.max(1) as usize) as u32
    } else {
        0
    };
    if fault == Fault::Callable {
        c = i.pick(&[ncall as u32, u32::MAX]);
    }
    if fault == Fault::Microbatch {
        mb = model.as_ref().map_or(1, |m| m.2.max(1));
    }
    let cl = model.as_ref().and_then(|m| m.1.get(c as usize).cloned());
    let (n_first, n_second) = match &cl {
        None => (0, 0),
        Some(cl) => match kind {
            0 => (cl.outputs.len(), 0),
            1 => (cl.inputs.len(), cl.params.len()),
            // The weight-grad replay's one array is its first.
            _ => (cl.params.len(), 0),
        },
    };
    let clone = model.as_ref().is_some_and(|m| m.5);
    let policies: Vec<u32> = cl.as_ref().map_or(Vec::new(), |cl| {
        cl.params.iter().map(|p| p.resolved(clone)).collect()
    });
    let returns_params = match (&cl, kind) {
        (Some(cl), 1) => !cl.wgrad,
        (Some(_), 2) => true,
        _ => false,
    };
    let needs_dst: Vec<bool> = policies
        .iter()
        .map(|&p| returns_params && (p == 3 || p == 4))
        .collect();

    let mut a = graphed_replay_args_default();
    a.callable = c;
    a.microbatch = mb;
    let (s0, s1, st0, st1) = match streams {
        Some((s, side)) => {
            let cap = |h: usize| (h != 0 && stream_capturing(h)).then_some(S::StreamCapturing);
            (s, side, cap(s), cap(side))
        }
        None => {
            let (s, e) = stream_arg(true);
            let (side, e2) = if i.chance(40) {
                stream_arg(false)
            } else {
                (0, None)
            };
            (s, side, e, e2)
        }
    };
    a.stream = s0 as graphed_stream;
    a.side_stream = s1 as graphed_stream;
    // Data: copies of new inputs / grad outputs.
    let data_n = match (&cl, kind) {
        (Some(cl), 0) => cl.inputs.len(),
        (Some(cl), 1) => cl.outputs.len(),
        _ => 0,
    };
    let mut data: Vec<usize> = Vec::new();
    let use_data = kind != 2 && i.chance(128);
    if use_data {
        if let Some(cl) = &cl {
            for j in 0..data_n {
                let bytes = if kind == 0 {
                    cl.inputs[j].bytes
                } else {
                    cl.outputs[j].bytes
                };
                data.push(if bytes <= 1 << 20 {
                    mem(bytes, i.below(8))
                } else {
                    0x40
                });
            }
        }
    }
    // Some entries: the static buffer itself (no copy), or another one of
    // the session's buffers of the same size (chaining).
    if !data.is_empty() && i.chance(100) {
        if let (Some(k), Some(St::Captured)) = (sess, model.as_ref().map(|m| m.0)) {
            let h = wd.sessions.borrow()[k].h as *mut graphed_session;
            let role = if kind == 0 { 0 } else { 2 };
            let mut ptrs = vec![0usize; data.len()];
            // SAFETY: room for the stated count.
            let r = unsafe {
                graphed_session_buffers(
                    h,
                    c,
                    mb.min(model.as_ref().unwrap().2.saturating_sub(1)),
                    role,
                    ptrs.as_mut_ptr().cast(),
                    ptrs.len(),
                )
            };
            if r == S::Ok {
                for (j, &p) in ptrs.iter().enumerate() {
                    if p != 0 && i.chance(160) {
                        data[j] = p;
                    }
                }
            }
        }
    }
    let mut data_entry_bad = false;
    match fault {
        Fault::DataNull => {}
        Fault::DataCount => data.push(mem(4096, 0)),
        Fault::DataEntry => {
            let need: Vec<usize> = match (&cl, kind) {
                (Some(cl), 0) => (0..cl.inputs.len()).collect(),
                (Some(cl), 1) => (0..cl.outputs.len())
                    .filter(|&j| cl.outputs[j].grad)
                    .collect(),
                _ => Vec::new(),
            };
            if !need.is_empty() {
                if data.len() < data_n {
                    data = (0..data_n).map(|_| mem(8, 0)).collect();
                }
                data[need[i.below(need.len())]] = 0;
                data_entry_bad = true;
            }
        }
        _ => {}
    }
    if fault == Fault::DataNull {
        a.data = null();
        a.num_data = 1 + i.below(3);
    } else if !data.is_empty() || (use_data && fault != Fault::DataCount) {
        a.data = if data.is_empty() {
            8 as *const *const c_void
        } else {
            data.as_ptr().cast()
        };
        a.num_data = data.len();
    }
    // Destinations.
    let np = policies.len();
    let mut dsts: Vec<usize> = vec![0; np];
    let mut acc_before: Vec<Vec<u8>> = vec![Vec::new(); np];
    let mut misaligned = false;
    if let Some(cl) = &cl {
        for j in 0..np {
            if needs_dst[j] || (i.chance(20) && returns_params) {
                let p = &cl.params[j];
                let off = if policies[j] == 4 && needs_dst[j] && fault == Fault::DstMisaligned {
                    misaligned = true;
                    1
                } else if policies[j] == 4 {
                    0
                } else {
                    i.below(8)
                };
                let q = if p.bytes <= 1 << 20 {
                    mem(p.bytes, off)
                } else {
                    0x1000 + off
                };
                if q > 0x10000 {
                    // Start from a known value for accumulation.
                    // SAFETY: fresh harness memory of p.bytes.
                    unsafe { std::ptr::write_bytes(q as *mut u8, i.byte(), p.bytes) };
                    acc_before[j] =
                        unsafe { std::slice::from_raw_parts(q as *const u8, p.bytes) }.to_vec();
                }
                dsts[j] = q;
            }
        }
    }
    let mut dst_null_bad = false;
    if fault == Fault::DstNull {
        if let Some(j) = (0..np).find(|&j| needs_dst[j]) {
            dsts[j] = 0;
            dst_null_bad = true;
        }
    }
    if fault == Fault::DstCount {
        dsts.push(0);
    }
    let dsts_given = fault == Fault::DstCount
        || (fault != Fault::DstsMissing && (needs_dst.iter().any(|&x| x) || i.chance(20)));
    if dsts_given {
        a.param_dsts = if dsts.is_empty() {
            8 as *const *mut c_void
        } else {
            dsts.as_ptr().cast()
        };
        a.num_param_dsts = dsts.len();
    }
    // The parameters' addresses.
    let registered: Vec<usize> = cl
        .as_ref()
        .map_or(Vec::new(), |cl| cl.params.iter().map(|p| p.data).collect());
    let mut pa = params.then(|| {
        let bytes: Vec<usize> = cl
            .as_ref()
            .map_or(Vec::new(), |cl| cl.params.iter().map(|p| p.bytes).collect());
        params_arg(&registered, &bytes)
    });
    // The ref arrays.
    let mut stride = REF;
    match fault {
        Fault::RefSmall => stride = i.pick(&[0, 8, 39]),
        Fault::RefOdd => stride = 44,
        Fault::RefBig => stride = REF + 8 * (1 + i.below(3)),
        _ => {}
    }
    a.ref_size = stride;
    let (mut n1, n2) = (n_first, n_second);
    if fault == Fault::OutCount {
        n1 += 1;
    }
    let mut buf1 = vec![0xabu8; (n1 * stride.max(REF)) + 16];
    let mut buf2 = vec![0xabu8; (n2 * stride.max(REF)) + 16];
    let mut p1 = buf1.as_mut_ptr();
    let p2 = buf2.as_mut_ptr();
    let mut p1_null = false;
    if fault == Fault::OutNull && n1 > 0 {
        p1 = null_mut();
        p1_null = true;
    }
    let mut out_misaligned = false;
    if fault == Fault::OutMisaligned && n1 > 0 {
        // SAFETY: 4 bytes into buf1, which has 16 spare bytes.
        p1 = unsafe { p1.add(4) };
        out_misaligned = true;
    }
    // The struct.
    let mut abuf = vec![0u64; size_of::<graphed_replay_args>() / 8 + 2];
    let mut struct_err = None;
    match fault {
        Fault::Magic => {
            a.magic = 0x6772_0006;
            struct_err = Some(S::BadStruct);
        }
        Fault::Small => {
            a.struct_size = 72;
            struct_err = Some(S::BadStruct);
        }
        Fault::BigSize => a.struct_size = usize::MAX,
        _ => {}
    }
    if let Some(pa) = &mut pa {
        if matches!(fault, Fault::Small | Fault::BigSize) {
            pa.neutral();
        }
        a.params = pa.ptr;
        a.num_params = pa.count;
        if pa.mode == PMode::OldLayout {
            // The layout before the parameters' addresses.
            a.struct_size = size_of::<graphed_replay_args>() - 16;
        }
    }
    // SAFETY: abuf holds the struct.
    unsafe { (abuf.as_mut_ptr() as *mut graphed_replay_args).write(a) };
    let args: *const graphed_replay_args = if fault == Fault::ArgsNull {
        null()
    } else {
        abuf.as_ptr().cast()
    };

    // ---- the expected status, in graphed's order ----
    let mut want: Option<graphed_status> = None;
    first(&mut want, t.lookup());
    first(&mut want, args.is_null().then_some(S::NullPointer));
    first(&mut want, struct_err);
    first(
        &mut want,
        (fault == Fault::DataNull).then_some(S::InvalidArgument),
    );
    first(&mut want, pa.as_ref().and_then(|p| p.pre_err));
    first(&mut want, t.lock());
    if cl.is_none() && sess.is_some() {
        first(&mut want, Some(S::InvalidArgument));
    }
    // check_out for each array.
    let check_out = |n: usize, expected: usize, null: bool, mis: bool| -> Option<graphed_status> {
        if n != expected {
            return Some(S::InvalidArgument);
        }
        if stride < 40 {
            return Some(S::InvalidArgument);
        }
        if n == 0 {
            return None;
        }
        if null {
            return Some(S::NullPointer);
        }
        if mis || stride % 8 != 0 {
            return Some(S::InvalidArgument);
        }
        None
    };
    first(&mut want, check_out(n1, n_first, p1_null, out_misaligned));
    first(&mut want, check_out(n2, n_second, false, false));
    let mut lenient: Vec<graphed_status> = Vec::new();
    // The status before the parameters' addresses are checked, what they
    // give, and what follows them (the stream and lease checks).
    let mut before_params = want;
    let mut params_err = None;
    let mut after_params: Option<graphed_status> = None;
    if let Some((st, _, mbs, strict, reuse, _, pool, custom)) = &model {
        match st {
            St::Open => first(&mut want, Some(S::WrongState)),
            St::Reset => first(&mut want, Some(S::SessionReset)),
            St::Captured => {}
        }
        if fault == Fault::Microbatch || mb >= *mbs {
            first(&mut want, Some(S::InvalidArgument));
        }
        let cl = cl.as_ref();
        match kind {
            0 | 1 => {
                if a.num_data > 0 || !a.data.is_null() {
                    if data.len() != data_n {
                        first(&mut want, Some(S::InvalidArgument));
                    }
                    if data_entry_bad {
                        first(&mut want, Some(S::InvalidArgument));
                    }
                }
            }
            _ => {
                if !cl.is_some_and(|c| c.wgrad) {
                    first(&mut want, Some(S::InvalidArgument));
                }
                if !a.data.is_null() {
                    first(&mut want, Some(S::InvalidArgument));
                }
            }
        }
        if returns_params {
            if !dsts_given {
                if needs_dst.iter().any(|&x| x) {
                    first(&mut want, Some(S::InvalidArgument));
                }
            } else if dst_null_bad || misaligned || dsts.len() != np {
                first(&mut want, Some(S::InvalidArgument));
            }
        }
        before_params = want;
        params_err = pa.as_ref().and_then(|p| p.check(&registered, kind == 0));
        first(&mut want, params_err);
        first(&mut after_params, st0);
        first(&mut after_params, st1);
        if *strict && !*reuse {
            // Without reuse, a replay overwrites its own instance's aliases.
            let held = wd.leases.borrow().iter().any(|l| {
                l.sess == sess.unwrap()
                    && l.slot.0 == c as usize
                    && l.slot.1 == mb
                    && match kind {
                        0 => l.slot.2 == 0,
                        1 => l.slot.2 == 1 || (l.slot.2 == 2 && !cl.is_some_and(|c| c.wgrad)),
                        _ => l.slot.2 == 2,
                    }
            });
            if held {
                first(&mut after_params, Some(S::AliasHeld));
            }
        } else if *strict {
            lenient.push(S::AliasHeld);
        }
        first(&mut want, after_params);
        lenient.extend(replay_lenient(*pool, *custom));
    }
    let func = [
        "graphed_forward",
        "graphed_backward",
        "graphed_backward_wgrad",
    ][kind as usize];
    let mut epoch = EPOCH
        .load(Ordering::Relaxed)
        .wrapping_add(1 + i.below(200) as u8);
    EPOCH.store(epoch, Ordering::Relaxed);
    // Refused for the parameters' addresses alone: the instance's buffers
    // are kept to see that the refusal changed nothing.
    let refused_for_params = before_params.is_none() && params_err.is_some();
    let kept = match (refused_for_params, sess, &cl) {
        (true, Some(k), Some(cl)) => {
            let h = wd.sessions.borrow()[k].h as *mut graphed_session;
            Some(instance_bytes(h, c, mb, cl))
        }
        _ => None,
    };
    let call = |args: *const graphed_replay_args, want: Option<graphed_status>| {
        let _pin = sess.filter(|_| want.is_none()).map(pin);
        mark();
        // SAFETY: every array has the room the call is told about (or is
        // one of the faults graphed must catch before writing).
        unsafe {
            match kind {
                0 => graphed_forward(t.ptr(), args, p1.cast(), n1),
                1 => graphed_backward(t.ptr(), args, p1.cast(), n1, p2.cast(), n2),
                _ => graphed_backward_wgrad(t.ptr(), args, p1.cast(), n1),
            }
        }
    };
    let stats_of = |k: usize| {
        let mut st = graphed_session_stats_default();
        let h = wd.sessions.borrow()[k].h as *mut graphed_session;
        // SAFETY: a full stats struct.
        let r = unsafe { graphed_session_stats_get(h, &mut st) };
        expect(r, &[S::Ok], "graphed_session_stats_get", "around a replay");
        st
    };
    let stats_before = kept.as_ref().map(|_| stats_of(sess.unwrap()));
    trace!("{func} {t:?} c {c} mb {mb} fault {fault:?} params {:?} streams {s0:x}/{s1:x} want {want:?}", pa.as_ref().map(|p| (p.mode, p.count, p.moved)));
    let mut r = call(args, want);
    let mut ok = vec![want.unwrap_or(S::Ok)];
    if want.is_none() {
        ok.extend(lenient.iter().copied());
    }
    trace!("{func} -> {r:?}");
    expect(r, &ok, func, &format!("{fault:?}"));
    if let (Some(kept), Some(pa)) = (&kept, &pa) {
        // Refused for the parameters: nothing was enqueued, nothing
        // written, nothing counted.
        pa.check_message(r, func, |j| j);
        assert!(
            buf1.iter().all(|&b| b == 0xab) && buf2.iter().all(|&b| b == 0xab),
            "{func} wrote refs on failure"
        );
        let k = sess.unwrap();
        let h = wd.sessions.borrow()[k].h as *mut graphed_session;
        assert!(
            instance_bytes(h, c, mb, cl.as_ref().unwrap()) == *kept,
            "{func} refused for its parameters' addresses ({r:?}) but changed the instance's buffers"
        );
        let after = stats_of(k);
        let before = stats_before.unwrap();
        assert_eq!(
            (
                after.param_moves,
                after.clone_blocks_outstanding,
                after.leases_held
            ),
            (
                before.param_moves,
                before.clone_blocks_outstanding,
                before.leases_held
            ),
            "{func} refused for its parameters' addresses but changed the stats"
        );
        // The same replay with the registered addresses goes through as
        // if the refused one had not been made.
        let again = ParamsArg::registered(&registered);
        let mut a2 = a;
        a2.params = again.ptr;
        a2.num_params = again.count;
        // SAFETY: abuf holds the struct.
        unsafe { (abuf.as_mut_ptr() as *mut graphed_replay_args).write(a2) };
        epoch = EPOCH
            .load(Ordering::Relaxed)
            .wrapping_add(1 + i.below(200) as u8);
        EPOCH.store(epoch, Ordering::Relaxed);
        trace!("{func} again with the registered addresses, want {after_params:?}");
        r = call(abuf.as_ptr().cast(), after_params);
        let mut ok = vec![after_params.unwrap_or(S::Ok)];
        if after_params.is_none() {
            ok.extend(lenient.iter().copied());
        }
        trace!("{func} -> {r:?}");
        expect(r, &ok, func, "again with the registered addresses");
        drop(again);
    }
    if r != S::Ok {
        assert!(
            buf1.iter().all(|&b| b == 0xab) && buf2.iter().all(|&b| b == 0xab),
            "{func} wrote refs on failure"
        );
        for (j, before) in acc_before.iter().enumerate() {
            if !before.is_empty() && dsts[j] != 0 {
                assert_eq!(
                    // SAFETY: harness memory of this size.
                    unsafe { std::slice::from_raw_parts(dsts[j] as *const u8, before.len()) },
                    &before[..],
                    "{func} changed a destination on failure"
                );
            }
        }
        return;
    }
    let k = sess.unwrap();
    let cl = cl.unwrap();
    let strict = model.as_ref().unwrap().3;
    // ---- results ----
    let refs1: Vec<RefView> = (0..n1).map(|j| read_ref(&buf1, j * stride)).collect();
    let refs2: Vec<RefView> = (0..n2).map(|j| read_ref(&buf2, j * stride)).collect();
    for buf in [&buf1, &buf2] {
        for j in 0..(buf.len() - 16) / stride.max(1) {
            assert!(
                buf[j * stride + REF..(j + 1) * stride]
                    .iter()
                    .all(|&b| b == 0xab),
                "a ref written past its {REF} bytes"
            );
        }
    }
    let mut new_leases = Vec::new();
    // Destroyed when idle from inside this replay: the session went when the
    // call returned, and its static buffers (the aliases) with it.
    let gone = !wd.sessions.borrow()[k].alive;
    let mut check_alias = |r: &RefView, bytes: usize, b: u8, what: u8, j: usize| {
        assert_eq!(r.kind, 1, "{func}: {what}/{j} is not an ALIAS");
        assert_ne!(r.ptr, 0);
        assert_eq!(r.bytes, bytes);
        assert_eq!(r.owner, 0);
        assert_eq!(r.lease != 0, strict, "{func}: lease on {what}/{j}");
        assert!(
            gone || all_bytes(r.ptr, bytes, b ^ epoch),
            "{func}: {what}/{j} does not hold what the graph wrote"
        );
        if r.lease != 0 {
            new_leases.push(Lease {
                sess: k,
                token: r.lease,
                slot: (c as usize, mb, what, j),
            });
        }
    };
    match kind {
        0 => {
            for (j, t) in cl.outputs.iter().enumerate() {
                check_alias(
                    &refs1[j],
                    t.bytes,
                    seed(k, c as usize, mb, ROLE_OUT, j),
                    0,
                    j,
                );
                if t.external {
                    assert_eq!(
                        Some(refs1[j].ptr),
                        wd.ext
                            .borrow()
                            .get(&(k, c as usize, mb, ROLE_OUT, j))
                            .copied()
                    );
                }
            }
        }
        1 => {
            for (j, t) in cl.inputs.iter().enumerate() {
                if t.grad {
                    check_alias(
                        &refs1[j],
                        t.bytes,
                        seed(k, c as usize, mb, ROLE_GIN, j),
                        1,
                        j,
                    );
                } else {
                    let r = &refs1[j];
                    assert_eq!(
                        (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                        (0, 0, 0, 0, 0),
                        "input {j} without grad"
                    );
                }
            }
        }
        _ => {}
    }
    let mut block: Option<HeldBlock> = None;
    let param_refs = if kind == 2 { &refs1 } else { &refs2 };
    if kind >= 1 {
        for (j, p) in cl.params.iter().enumerate() {
            let r = &param_refs[j];
            let pol = if returns_params { policies[j] } else { 0 };
            let b = seed(k, c as usize, mb, ROLE_PARAM, j) ^ epoch;
            match pol {
                0 => assert_eq!(
                    (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                    (0, 0, 0, 0, 0),
                    "param {j}: NONE"
                ),
                1 => {
                    assert_eq!(r.kind, 2, "param {j}: CLONE");
                    assert!(r.owner != 0 && r.ptr != 0 && r.bytes == p.bytes && r.lease == 0);
                    assert!(
                        all_bytes(r.ptr, p.bytes, b),
                        "param {j}: the clone does not hold the grad"
                    );
                    let blk = block.get_or_insert(HeldBlock {
                        owner: r.owner,
                        refs: 0,
                        sess: k,
                        grads: Vec::new(),
                    });
                    assert_eq!(
                        blk.owner, r.owner,
                        "the clones of one replay have different owners"
                    );
                    blk.refs += 1;
                    blk.grads.push((r.ptr, r.bytes, b));
                }
                2 => {
                    let pb = seed(k, c as usize, mb, ROLE_PARAM, j);
                    check_alias(r, p.bytes, pb, 2, j);
                }
                3 => {
                    assert_eq!(
                        (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                        (3, dsts[j], p.bytes, 0, 0),
                        "param {j}: COPY_INTO"
                    );
                    assert!(
                        all_bytes(r.ptr, p.bytes, b),
                        "param {j}: COPY_INTO destination"
                    );
                }
                _ => {
                    assert_eq!(
                        (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                        (4, dsts[j], p.bytes, 0, 0),
                        "param {j}: ACCUMULATE_INTO"
                    );
                    if p.dtype == 0 {
                        check_accumulated(&acc_before[j], dsts[j], b, &format!("param {j}"));
                    }
                }
            }
        }
    }
    // Leases: never one on a slot the caller still holds.
    for l in &new_leases {
        let held = wd
            .leases
            .borrow()
            .iter()
            .any(|h| h.sess == k && h.slot == l.slot);
        assert!(
            !held,
            "{func} handed out a second lease on {:?} while the first is held",
            l.slot
        );
        assert!(
            !wd.leases
                .borrow()
                .iter()
                .any(|h| h.sess == k && h.token == l.token),
            "a lease token was handed out twice"
        );
        if !waived("lease-cross-session") {
            let other = wd
                .leases
                .borrow()
                .iter()
                .find(|h| h.sess != k && h.token == l.token)
                .map(|h| h.sess);
            assert!(
                other.is_none(),
                "{func}: session {k} handed out lease 0x{:x}, a token session {} holds too: either session can release the other's lease",
                l.token,
                other.unwrap()
            );
        }
    }
    wd.leases.borrow_mut().extend(new_leases);
    if let Some(b) = block {
        assert!(
            !wd.blocks.borrow().iter().any(|x| x.owner == b.owner),
            "a clone block handle was reused"
        );
        wd.blocks.borrow_mut().push(b);
    }
    forget_if_gone(k);
    let _ = (abuf, data, dsts);
}
