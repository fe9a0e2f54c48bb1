//! Sessions and their config: create from fuzzed configs (magics, sizes,
//! flags, schedules, shared pools, allocators, hooks, log, debug mode), the callbacks a
//! config carries, reset, destroy, destroy when idle.

use super::*;

pub fn steps_of(s: &Sched) -> Vec<graphed_schedule_step> {
    let mut v = Vec::new();
    for _ in 0..s.mb {
        for c in 0..s.chunks {
            v.push(graphed_schedule_step {
                pass: 0,
                chunk: c as u32,
            });
        }
    }
    for _ in 0..s.mb {
        for c in (0..s.chunks).rev() {
            v.push(graphed_schedule_step {
                pass: 1,
                chunk: c as u32,
            });
            if s.wgrad {
                v.push(graphed_schedule_step {
                    pass: 2,
                    chunk: c as u32,
                });
            }
        }
    }
    v
}

pub unsafe extern "C" fn log_cb(ctx: *mut c_void, level: u32, message: *const c_char) {
    // SAFETY: the log_ctx registered below.
    let c = unsafe { &*(ctx as *const SessCtx) };
    assert!(
        level <= c.log_level,
        "log level {level} above the configured {}",
        c.log_level
    );
    assert!(!message.is_null());
    // SAFETY: graphed passes a NUL-terminated message valid for the call.
    let m = unsafe { CStr::from_ptr(message) };
    assert!(m.to_str().is_ok(), "log message is not UTF-8");
}

pub unsafe extern "C" fn warmup_hook(when: u32, data: *mut c_void) -> i32 {
    assert!(when <= 1);
    // SAFETY: the warmup_hook_data registered below.
    let c = unsafe { &*(data as *const SessCtx) };
    let wd = w();
    let code = match wd.input.below(8) {
        0 => wd.input.pick(&[-1, 5, i32::MIN]),
        1 => {
            own_session_call(c.sess);
            0
        }
        2 => {
            sync_null();
            0
        }
        _ => 0,
    };
    if code != 0 {
        decide(c.sess, S::CallbackFailed);
    }
    code
}

pub unsafe extern "C" fn clone_alloc(
    ctx: *mut c_void,
    bytes: usize,
    _stream: graphed_stream,
    out: *mut *mut c_void,
) -> i32 {
    // SAFETY: the allocator_ctx registered below.
    let c = unsafe { &*(ctx as *const SessCtx) };
    assert!(
        bytes > 0 && bytes < 1 << 24,
        "clone_alloc asked for {bytes} bytes"
    );
    let wd = w();
    match wd.input.below(12) {
        0 => return wd.input.pick(&[-1, 3, i32::MAX]),
        1 => {
            // SAFETY: graphed passes a writable out pointer.
            unsafe { *out = null_mut() };
            return 0;
        }
        // A tensor deleter running inside the allocator: releases a lease of
        // this session (must not wait for the replay in progress).
        2 if !waived("lease-in-replay") => release_lease_of(c.sess),
        3 => own_session_call(c.sess),
        4 => release_some_block(),
        _ => {}
    }
    let b = vec![0u64; bytes.div_ceil(8)].into_boxed_slice();
    let p = b.as_ptr() as usize;
    wd.allocs.borrow_mut().insert(p, (bytes, c.sess, b));
    // SAFETY: as above.
    unsafe { *out = p as *mut c_void };
    0
}

pub unsafe extern "C" fn clone_free(
    ctx: *mut c_void,
    ptr: *mut c_void,
    bytes: usize,
    _s: graphed_stream,
) {
    // SAFETY: the allocator_ctx registered below.
    let c = unsafe { &*(ctx as *const SessCtx) };
    let got = w().allocs.borrow_mut().remove(&(ptr as usize));
    let (b, s, _mem) = got.unwrap_or_else(|| {
        panic!(
            "clone_free of 0x{:x}, which clone_alloc did not give",
            ptr as usize
        )
    });
    assert_eq!(
        (b, s),
        (bytes, c.sess),
        "clone_free with another size or session than its clone_alloc"
    );
}

pub fn op_create() {
    let wd = w();
    let i = &wd.input;
    let idx = wd.sessions.borrow().len();
    let mut cfg = graphed_session_config_default();
    let mut want: Option<graphed_status> = None;
    cfg.backend = i.pick(&[1, 1, 1, 1, 1, 1, 1, 0, 7]);
    cfg.warmup_iterations = i.pick(&[1, 2, 3, 0, 1]);
    cfg.capture_mode = i.pick(&[0, 1, 2, 0, 3]);
    cfg.clone_param_grads_on_return = i.pick(&[1, 0, 1, 2]);
    cfg.strict_leases = i.pick(&[0, 1, 1, 2]);
    cfg.reuse_buffers = i.pick(&[0, 0, 1, 2]);
    cfg.log_level = i.pick(&[1, 0, 2, 3, 4]);
    cfg.clone_slots = i.pick(&[2, 2, 2, 0, 1, 16, 17, u32::MAX]);
    // Buckets chosen on the device (the host backend supports it); above
    // 1 refused as the config is read.
    cfg.bucket_choice_on_device = i.pick(&[0, 0, 0, 1, 1, 2]);
    let ctx = Box::new(SessCtx {
        sess: idx,
        log_level: cfg.log_level,
    });
    let ctxp = &*ctx as *const SessCtx as *mut c_void;
    wd.ctxs.borrow_mut().push(ctx);
    let extras = i.byte();
    let names: [&[u8]; 3] = [b"fuzz\0", b"\xff\xfe\0", b"s\0"];
    let name_pick = extras % 8;
    if name_pick < 3 {
        cfg.name = names[name_pick as usize].as_ptr().cast();
    }
    let alloc_pick = (extras >> 3) % 8;
    match alloc_pick {
        0 | 1 => {
            cfg.clone_alloc = Some(clone_alloc);
            cfg.clone_free = Some(clone_free);
        }
        2 => cfg.clone_alloc = Some(clone_alloc),
        3 => cfg.clone_free = Some(clone_free),
        _ => {}
    }
    cfg.allocator_ctx = ctxp;
    if extras & 0x40 != 0 {
        cfg.log = Some(log_cb);
        cfg.log_ctx = ctxp;
    }
    if extras & 0x80 != 0 {
        cfg.warmup_hook = Some(warmup_hook);
        cfg.warmup_hook_data = ctxp;
    }
    // Shared pool.
    let share = if i.chance(80) { Some(target()) } else { None };
    let mut pool = None;
    if let Some(t) = share {
        cfg.share_pool_with = t.ptr();
        if let Target::Live(k) = t {
            pool = Some(wd.sessions.borrow()[k].pool);
        }
    }
    // Schedule.
    let mut steps_buf: Vec<u32> = Vec::new();
    let mut lpc: Vec<u32> = Vec::new();
    let mut sched: Option<Option<Sched>> = Some(None);
    let mut sched_err: Option<graphed_status> = None;
    match i.below(10) {
        0..=5 => {}
        6 | 7 => {
            let s = Sched {
                chunks: 1 + i.below(2),
                mb: 1 + i.below(3),
                wgrad: i.chance(60),
                layers: None,
            };
            let mut s = s;
            if i.chance(60) {
                s.layers = Some((0..s.chunks).map(|_| 1 + i.below(2) as u32).collect());
                lpc = s.layers.clone().unwrap();
            }
            for st in steps_of(&s) {
                steps_buf.extend([st.pass, st.chunk]);
            }
            sched = Some(Some(s));
        }
        8 => {
            let n = 1 + i.below(10);
            for _ in 0..n {
                steps_buf.extend([i.pick(&[0, 1, 2, 0, 1, 3]), i.pick(&[0, 1, 0, 2, 4096])]);
            }
            sched = None;
            if i.chance(100) {
                lpc = (0..1 + i.below(3)).map(|_| i.below(3) as u32).collect();
            }
        }
        _ => {
            // Malformed schedule arguments.
            match i.below(4) {
                0 => {
                    cfg.num_schedule_steps = 2;
                    sched_err = Some(S::NullPointer);
                }
                1 => {
                    steps_buf = vec![0, 0, 1, 0];
                    cfg.schedule_step_size = i.pick(&[4, 7, 10]);
                    sched_err = Some(S::InvalidArgument);
                }
                2 => {
                    lpc = vec![1];
                    sched_err = Some(S::InvalidSchedule);
                }
                _ => {
                    steps_buf = vec![0, 0, 1, 0];
                    cfg.num_schedule_steps = usize::MAX / 2;
                    sched_err = Some(S::InvalidArgument);
                }
            }
            sched = None;
        }
    }
    if !steps_buf.is_empty() {
        cfg.schedule = steps_buf.as_ptr().cast();
        if cfg.num_schedule_steps == 0 {
            cfg.num_schedule_steps = steps_buf.len() / 2;
        }
    }
    if !lpc.is_empty() {
        cfg.layers_per_chunk = lpc.as_ptr();
        cfg.num_layers_per_chunk = lpc.len();
    }
    // The struct itself.
    let mut buf = vec![0u64; size_of::<graphed_session_config>() / 8 + 4];
    let mut cfg_ptr = buf.as_mut_ptr() as *mut u8;
    let shape = i.below(16);
    let mut struct_err = None;
    match shape {
        0 => cfg.magic = i.pick(&[0, 0x6772_0002, u32::MAX]),
        1 => cfg.struct_size = i.pick(&[0, 8, 12, 159]),
        2 => cfg.struct_size = usize::MAX,
        3 => cfg.struct_size = size_of::<graphed_session_config>() + 16,
        4 => {
            // SAFETY: 4 bytes past the start still leave room for the struct.
            cfg_ptr = unsafe { cfg_ptr.add(4) }
        }
        // CUDA's legacy and per-thread default streams as capture stream
        // (refused with the config, on every backend), and a stream of the
        // caller's (refused by the host backend, which makes its own).
        7 => cfg.capture_stream = 1 as graphed_stream,
        8 => cfg.capture_stream = 2 as graphed_stream,
        9 => {
            cfg.capture_stream =
                wd.kept_streams.borrow().first().map_or(0x1000, |k| k.h) as graphed_stream
        }
        // Debug mode; a flag of 2 (refused as the config is read); the
        // layout before it (184 bytes), whose padding held anything: off.
        10 => cfg.debug = 1,
        11 => cfg.debug = 2,
        12 => {
            cfg.struct_size = 184;
            cfg.reserved = 0xdead_beef;
            cfg.debug = 1;
        }
        _ => {}
    }
    if shape == 0 || shape == 1 {
        struct_err = Some(S::BadStruct);
    }
    // SAFETY: buf holds the struct plus 32 bytes; unaligned write.
    unsafe { (cfg_ptr as *mut graphed_session_config).write_unaligned(cfg) };
    let cfg_arg: *const graphed_session_config = if shape == 5 { null() } else { cfg_ptr.cast() };
    let out_null = shape == 6;

    // The expected status, in the order graphed checks.
    if out_null {
        first(&mut want, Some(S::NullPointer));
    }
    if cfg_arg.is_null() {
        first(&mut want, Some(S::NullPointer));
    }
    if let Some(e) = struct_err {
        first(&mut want, Some(e));
    }
    if matches!(alloc_pick, 2 | 3) {
        first(&mut want, Some(S::InvalidArgument));
    }
    if let Some(e) = sched_err {
        first(&mut want, Some(e));
    }
    if sched.is_none() && sched_err.is_none() {
        // A fuzzed schedule: an unknown pass value is reported at read.
        if steps_buf.chunks(2).any(|s| s[0] > 2) {
            first(&mut want, Some(S::InvalidSchedule));
        }
    }
    if name_pick == 1 {
        first(&mut want, Some(S::InvalidArgument));
    }
    if cfg.backend > 1
        || cfg.reuse_buffers > 1
        || cfg.clone_param_grads_on_return > 1
        || cfg.strict_leases > 1
        || cfg.capture_mode > 2
        || cfg.log_level > 3
        || cfg.clone_slots > 16
        || cfg.bucket_choice_on_device > 1
        || shape == 11
        || shape == 7
        || shape == 8
    {
        first(&mut want, Some(S::InvalidArgument));
    }
    if let Some(t) = share.filter(|t| !matches!(t, Target::Null)) {
        if let Some(e) = t.lookup() {
            first(&mut want, Some(e));
        }
    }
    let cuda = cfg.backend == 0;
    if cuda {
        first(&mut want, Some(S::NoDriver));
    }
    if shape == 9 {
        first(&mut want, Some(S::InvalidArgument));
    }
    if cfg.reuse_buffers == 1 && steps_buf.is_empty() && sched_err.is_none() {
        first(&mut want, Some(S::InvalidSchedule));
    }
    let fuzzed_steps = sched.is_none() && want.is_none();

    let mut out: *mut graphed_session = 0x5a5a as *mut _;
    trace!("create #{idx}: backend {} warmup {} clone {} strict {} reuse {} sched {sched:?} share {share:?} alloc {alloc_pick} want {want:?}", cfg.backend, cfg.warmup_iterations, cfg.clone_param_grads_on_return, cfg.strict_leases, cfg.reuse_buffers);
    mark();
    // SAFETY: cfg_arg points into buf (or is NULL); out is a local.
    let st =
        unsafe { graphed_session_create(cfg_arg, if out_null { null_mut() } else { &mut out }) };
    drop(buf);
    post(st, "graphed_session_create");
    if cuda && st != S::Ok {
        assert!(
            matches!(
                st,
                S::NoDriver
                    | S::NoDevice
                    | S::InvalidArgument
                    | S::NullPointer
                    | S::BadStruct
                    | S::InvalidSchedule
                    | S::UseAfterDestroy
            ),
            "{st:?} {}",
            msg()
        );
        assert_eq!(out as usize, 0x5a5a, "output written on failure");
        return;
    }
    match want {
        Some(e) => expect(st, &[e], "graphed_session_create", "config"),
        None if fuzzed_steps => expect(
            st,
            &[S::Ok, S::InvalidSchedule],
            "graphed_session_create",
            "fuzzed schedule",
        ),
        None => expect(st, &[S::Ok], "graphed_session_create", "valid config"),
    }
    if st != S::Ok {
        assert_eq!(out as usize, 0x5a5a, "output written on failure");
        return;
    }
    if cuda {
        // A machine with a GPU: not what this target explores.
        assert_eq!(graphed_session_destroy(out), S::Ok);
        return;
    }
    let h = out as usize;
    assert_eq!(h >> 56, 0x67, "session handle 0x{h:x} is not a tagged id");
    let pool = pool.unwrap_or_else(|| {
        let p = wd.pools.get() + 1;
        wd.pools.set(p);
        p
    });
    let mb = match &sched {
        Some(Some(s)) => s.mb as u32,
        Some(None) => 1,
        None => 0,
    };
    wd.sessions.borrow_mut().push(Sess {
        h,
        alive: true,
        st: St::Open,
        strict: cfg.strict_leases == 1,
        clone: cfg.clone_param_grads_on_return == 1,
        reuse: cfg.reuse_buffers == 1,
        warmup: cfg.warmup_iterations,
        sched,
        mb,
        pool,
        callables: Vec::new(),
        custom_alloc: alloc_pick < 2,
        clone_slots: cfg.clone_slots,
        live_attempt: None,
        steps: Vec::new(),
        bucket_device: cfg.bucket_choice_on_device == 1,
        last_fwd: Vec::new(),
        released: Vec::new(),
        overflows: 0,
        debug: shape == 10,
    });
}

pub fn drop_session_state(k: usize) {
    let wd = w();
    // Its leases die with its capture; tokens turn stale.
    let mut ls = wd.leases.borrow_mut();
    let gone: Vec<Lease> = ls.extract_if(.., |l| l.sess == k).collect();
    wd.stale_leases
        .borrow_mut()
        .extend(gone.into_iter().map(|l| (l.sess, l.token)));
    drop(ls);
    wd.sessions.borrow_mut()[k].live_attempt = None;
}

pub fn op_reset(t: Target) {
    let wd = w();
    let want = t.lock().unwrap_or(S::Ok);
    mark();
    let r = graphed_session_reset(t.ptr());
    expect(r, &[want], "graphed_session_reset", "reset");
    if let (S::Ok, Target::Live(k)) = (r, t) {
        drop_session_state(k);
        wd.sessions.borrow_mut()[k].st = St::Reset;
    }
}

pub fn op_destroy(t: Target) {
    let wd = w();
    let want = match t {
        Target::Null => S::Ok,
        Target::Live(k) if wd.pinned.borrow().contains(&k) => S::Busy,
        _ => t.lookup().unwrap_or(S::Ok),
    };
    mark();
    let r = graphed_session_destroy(t.ptr());
    expect(r, &[want], "graphed_session_destroy", "destroy");
    if let (S::Ok, Target::Live(k)) = (r, t) {
        drop_session_state(k);
        let mut ss = wd.sessions.borrow_mut();
        ss[k].alive = false;
    }
}

pub fn op_destroy_when_idle(t: Target) {
    let wd = w();
    let want = match t {
        Target::Null => S::Ok,
        _ => t.lookup().unwrap_or(S::Ok),
    };
    mark();
    let r = graphed_session_destroy_when_idle(t.ptr());
    expect(
        r,
        &[want],
        "graphed_session_destroy_when_idle",
        "outside calls",
    );
    if let (S::Ok, Target::Live(k)) = (r, t) {
        wd.sessions.borrow_mut()[k].alive = false;
        drop_session_state(k);
    }
}
