//! Threads against the C ABI, on the host backend: a normal integration
//! test, and the test scripts/tsan.sh runs under ThreadSanitizer.
//!
//! Several threads at once create, capture, replay and destroy sessions of
//! their own; replay one shared session (a second caller gets BUSY and
//! retries); hand the returned clone blocks to a deleter thread that checks
//! and releases them (retaining some first); release strict-mode leases
//! from another thread than the one that replays; read stats; replay two
//! sessions that share a pool from two threads (whole iterations in turn);
//! destroy a session while another thread replays it, which must give
//! BUSY or USE_AFTER_DESTROY and never a crash; and replay with the
//! parameters' addresses given (moved ones refused) while other threads
//! read the stats, which parameters can move and where the graphs read
//! them; and release one callable
//! of a session while threads replay both of its callables and others read
//! the process's memory figures and the callables' memory; and replay a
//! session in debug mode while another thread writes its graphs as DOT
//! text and a third makes host kernels fault before its own debug
//! replays; and replay a step with an update stage, giving it scalars,
//! while other threads read its skip flag and the stats. Every status is
//! checked.

use graphed::ffi::*;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use graphed_status as S;

mod common;
use common::{create, empty_ref, host_config, memory_stats, msg, ok};

const N: usize = 64; // f32 elements of every tensor and parameter
const BYTES: usize = N * 4;

#[track_caller]
fn one_of(s: graphed_status, allowed: &[graphed_status]) -> graphed_status {
    assert!(allowed.contains(&s), "{s:?} not in {allowed:?}: {}", msg());
    assert!(s == S::Ok || !msg().is_empty());
    s
}

/// A session handle that can cross threads (it is an id, not an address).
#[derive(Clone, Copy, Debug, PartialEq)]
struct H(usize);

impl H {
    fn p(self) -> *mut graphed_session {
        self.0 as *mut graphed_session
    }
}

/// What a pass's host task needs: the static buffers of its instance,
/// fixed at capture, and optionally a flag it waits on while it runs (so
/// that another thread can act while a replay is certainly in progress).
/// Lives as long as the test (leaked).
struct Task {
    src: usize,
    dsts: Vec<usize>,
    hold: Option<&'static Hold>,
}

/// Holds the tasks of a session's replays until released.
struct Hold {
    on: AtomicBool,
    running: AtomicUsize,
}

unsafe extern "C" fn copy_task(data: *mut c_void) {
    // SAFETY: a leaked Task whose buffers live while the session's graphs do.
    let t = unsafe { &*(data as *const Task) };
    for &d in &t.dsts {
        // SAFETY: static buffers of BYTES bytes each.
        unsafe { std::ptr::copy(t.src as *const u8, d as *mut u8, BYTES) };
    }
    if let Some(h) = t.hold {
        h.running.fetch_add(1, Ordering::SeqCst);
        let end = Instant::now() + Duration::from_millis(200);
        while h.on.load(Ordering::SeqCst) && Instant::now() < end {
            std::hint::spin_loop();
        }
        h.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Forward: output = input. Backward: input grad and every param grad =
/// grad output. So a backward replayed with grad output v returns v
/// everywhere. `hold`: a `Hold` for the tasks, or NULL.
unsafe extern "C" fn pass(ctx: *const graphed_pass_ctx, hold: *mut c_void) -> i32 {
    // SAFETY: valid during the call, arrays of the stated lengths.
    unsafe {
        let c = &*ctx;
        let (src, dsts) = if c.pass == 0 {
            (*c.inputs as usize, vec![*c.outputs as usize])
        } else {
            let mut d = vec![*c.grad_inputs as usize];
            d.extend((0..c.num_params).map(|i| *c.param_grads.add(i) as usize));
            (*c.grad_outputs as usize, d)
        };
        let hold = (hold as *const Hold).as_ref();
        let t: &'static Task = Box::leak(Box::new(Task { src, dsts, hold }));
        graphed_host_enqueue(c.stream, Some(copy_task), t as *const Task as *mut c_void) as i32
    }
}

/// Parameter memory: registered once, kept for the whole test.
fn param_mem() -> usize {
    Box::leak(vec![0f32; N].into_boxed_slice()).as_mut_ptr() as usize
}

struct Opts {
    strict: bool,
    share: Option<H>,
    clone: bool,
    hold: Option<&'static Hold>,
}

fn session(o: Opts) -> H {
    session_with(o, [0, 0]).0
}

/// A session as `session` makes it, its two parameters registered with
/// `flags`; also returns their addresses.
fn session_with(o: Opts, flags: [u32; 2]) -> (H, [usize; 2]) {
    let mut cfg = host_config();
    cfg.strict_leases = o.strict as u32;
    cfg.clone_param_grads_on_return = o.clone as u32;
    cfg.share_pool_with = o.share.map_or(null_mut(), H::p);
    let h = H(create(&cfg) as usize);
    let params = add_callable_with(h, o.hold, flags);
    ok(graphed_session_capture(h.p()));
    (h, params)
}

fn add_callable(h: H, hold: Option<&'static Hold>) {
    add_callable_with(h, hold, [0, 0]);
}

/// Registers the callable, its parameters with `flags`; returns their
/// addresses.
fn add_callable_with(h: H, hold: Option<&'static Hold>, flags: [u32; 2]) -> [usize; 2] {
    let tensor = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    let (inputs, outputs) = ([tensor], [tensor]);
    let params: Vec<graphed_param_desc> = flags
        .iter()
        .map(|&flags| graphed_param_desc {
            data: param_mem() as *mut c_void,
            bytes: BYTES,
            flags,
            ..graphed_param_desc_default()
        })
        .collect();
    let mut d = graphed_callable_desc_default();
    d.num_inputs = 1;
    d.inputs = inputs.as_ptr();
    d.num_outputs = 1;
    d.outputs = outputs.as_ptr();
    d.num_params = params.len();
    d.params = params.as_ptr();
    d.forward = Some(pass);
    d.backward = Some(pass);
    d.user_data = hold.map_or(null_mut(), |h| h as *const Hold as *mut c_void);
    let mut idx = 0;
    // SAFETY: the descriptor's arrays hold the stated counts.
    ok(unsafe { graphed_session_add_callable(h.p(), &d, &mut idx) });
    [params[0].data as usize, params[1].data as usize]
}

/// `call` given replay arguments for callable `c` with data `v` (every
/// element) and the parameters at `params` (None: a NULL array).
fn with_args<R>(
    c: u32,
    v: f32,
    params: Option<&[usize; 2]>,
    call: impl FnOnce(&graphed_replay_args) -> R,
) -> R {
    let data = vec![v; N];
    let ptrs = [data.as_ptr() as *const c_void];
    let mut a = graphed_replay_args_default();
    a.callable = c;
    a.data = ptrs.as_ptr();
    a.num_data = 1;
    if let Some(p) = params {
        a.params = p.as_ptr() as *const *const c_void;
        a.num_params = 2;
    }
    call(&a)
}

/// One forward with input `v` (every element).
fn forward(h: H, v: f32) -> (graphed_status, graphed_ref) {
    forward_at(h, 0, v, None)
}

/// One forward of callable `c` with input `v`, the parameters at `params`
/// (None: a NULL array).
fn forward_at(h: H, c: u32, v: f32, params: Option<&[usize; 2]>) -> (graphed_status, graphed_ref) {
    let mut out = [empty_ref()];
    // SAFETY: args and room for one ref.
    let s = with_args(c, v, params, |a| unsafe {
        graphed_forward(h.p(), a, out.as_mut_ptr(), 1)
    });
    (s, out[0])
}

/// One backward with grad output `v`: (status, input grad, param grads).
fn backward(h: H, v: f32) -> (graphed_status, graphed_ref, [graphed_ref; 2]) {
    backward_at(h, 0, v, None)
}

/// One backward of callable `c` with grad output `v`, the parameters at
/// `params`.
fn backward_at(
    h: H,
    c: u32,
    v: f32,
    params: Option<&[usize; 2]>,
) -> (graphed_status, graphed_ref, [graphed_ref; 2]) {
    let mut gin = [empty_ref()];
    let mut gp = [empty_ref(); 2];
    // SAFETY: args and room for the stated refs.
    let s = with_args(c, v, params, |a| unsafe {
        graphed_backward(h.p(), a, gin.as_mut_ptr(), 1, gp.as_mut_ptr(), 2)
    });
    (s, gin[0], gp)
}

fn holds(r: &graphed_ref, v: f32) -> bool {
    // SAFETY: a returned ref of BYTES bytes, still owned or valid.
    let xs = unsafe { std::slice::from_raw_parts(r.ptr as *const f32, N) };
    xs.iter().all(|&x| x == v)
}

fn stats(h: H) -> (graphed_status, graphed_session_stats) {
    let mut st = graphed_session_stats_default();
    // SAFETY: a full stats struct.
    let s = unsafe { graphed_session_stats_get(h.p(), &mut st) };
    (s, st)
}

/// A block of returned clones, sent to the deleter with what it must hold.
struct Returned {
    owner: usize,
    grads: Vec<(usize, f32)>,
}

impl Returned {
    /// Each clone still holds what its replay returned.
    #[track_caller]
    fn check_intact(&self) {
        for &(p, v) in &self.grads {
            let fake = graphed_ref {
                ptr: p as *mut c_void,
                bytes: BYTES,
                ..empty_ref()
            };
            assert!(holds(&fake, v), "a clone changed before its release");
        }
    }
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_millis(1500)
}

/// Replays `h` from several threads at once; every returned clone block
/// goes to a deleter thread, which checks it still holds its replay's
/// gradient and releases it (retaining and releasing some first).
fn shared_session_with_deleter(h: H, threads: usize, iters: usize) {
    let (tx, rx) = mpsc::channel::<Returned>();
    let busy = Arc::new(AtomicUsize::new(0));
    thread::scope(|sc| {
        sc.spawn(move || {
            for (n, r) in rx.into_iter().enumerate() {
                let owner = r.owner as *mut graphed_buffer;
                // Every other block is retained and released once first.
                if n % 2 == 0 {
                    ok(graphed_buffer_retain(owner));
                    ok(graphed_buffer_release(owner));
                }
                r.check_intact();
                // One reference per clone grad.
                for _ in &r.grads {
                    ok(graphed_buffer_release(owner));
                }
                one_of(graphed_buffer_release(owner), &[S::UseAfterDestroy]);
            }
        });
        for t in 0..threads {
            let tx = tx.clone();
            let busy = busy.clone();
            sc.spawn(move || {
                let end = deadline();
                let mut done = 0;
                while done < iters && Instant::now() < end {
                    let v = (t * 1000 + done) as f32;
                    // A whole step under the session's lock is not possible
                    // from outside: another thread may replay in between, so
                    // only what backward returns is checked.
                    let (s, _) = forward(h, v);
                    if one_of(s, &[S::Ok, S::Busy]) == S::Busy {
                        busy.fetch_add(1, Ordering::Relaxed);
                        thread::yield_now();
                        continue;
                    }
                    let (s, gin, gp) = backward(h, v);
                    if one_of(s, &[S::Ok, S::Busy]) == S::Busy {
                        busy.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    // The input grad is an alias another thread's backward
                    // may already be overwriting: only the clones are ours.
                    assert_eq!(gin.kind, graphed_ref_kind::Alias as u32);
                    assert!(gp.iter().all(|r| r.kind == graphed_ref_kind::Clone as u32));
                    assert_eq!(gp[0].owner, gp[1].owner);
                    tx.send(Returned {
                        owner: gp[0].owner as usize,
                        grads: gp.iter().map(|r| (r.ptr as usize, v)).collect(),
                    })
                    .unwrap();
                    done += 1;
                }
                assert!(
                    done > 0,
                    "thread {t}: no step got through before the deadline"
                );
            });
        }
        drop(tx);
        // Stats from yet another thread while they run.
        sc.spawn(move || {
            let end = Instant::now() + Duration::from_millis(200);
            let mut answered = 0;
            while Instant::now() < end {
                let (s, st) = stats(h);
                if one_of(s, &[S::Ok, S::Busy]) == S::Ok {
                    assert_eq!((st.captured, st.callables), (1, 1));
                    answered += 1;
                }
            }
            assert!(answered > 0, "stats never got through");
        });
    });
    let (s, st) = stats(h);
    ok(s);
    assert_eq!(st.clone_blocks_outstanding, 0, "every block was released");
    eprintln!(
        "{threads} threads x {iters} steps on one session: {} calls refused BUSY",
        busy.load(Ordering::Relaxed)
    );
}

#[test]
fn one_session_many_threads_and_a_deleter() {
    let h = session(Opts {
        strict: false,
        share: None,
        clone: true,
        hold: None,
    });
    shared_session_with_deleter(h, 4, 500);
    ok(graphed_session_destroy(h.p()));
}

/// A strict session replayed on one thread; its leases are released on
/// another (as a tensor deleter would); the replaying thread retries on
/// ALIAS_HELD until the lease it overwrites is gone.
#[test]
fn strict_leases_released_from_another_thread() {
    let h = session(Opts {
        strict: true,
        share: None,
        clone: false,
        hold: None,
    });
    let (tx, rx) = mpsc::channel::<(u64, usize, f32)>();
    thread::scope(|sc| {
        sc.spawn(move || {
            for (lease, ptr, v) in rx {
                let r = graphed_ref {
                    ptr: ptr as *mut c_void,
                    bytes: BYTES,
                    ..empty_ref()
                };
                assert!(holds(&r, v), "an alias under a held lease was overwritten");
                ok(graphed_lease_release(h.p(), lease));
                one_of(graphed_lease_release(h.p(), lease), &[S::InvalidArgument]);
            }
        });
        sc.spawn(move || {
            let end = deadline();
            // The other thread releases every lease: a wait past this is a
            // failure, not a hang.
            let stuck = || {
                assert!(
                    Instant::now() < end + Duration::from_secs(10),
                    "a held lease was never released"
                );
                thread::yield_now();
            };
            for k in 0..300 {
                if Instant::now() > end {
                    break;
                }
                let v = k as f32;
                loop {
                    let (s, out) = forward(h, v);
                    if one_of(s, &[S::Ok, S::AliasHeld]) == S::Ok {
                        assert_ne!(out.lease, 0);
                        assert!(holds(&out, v));
                        tx.send((out.lease, out.ptr as usize, v)).unwrap();
                        break;
                    }
                    stuck();
                }
                loop {
                    let (s, gin, gp) = backward(h, v);
                    if one_of(s, &[S::Ok, S::AliasHeld]) == S::Ok {
                        tx.send((gin.lease, gin.ptr as usize, v)).unwrap();
                        for r in gp {
                            assert_eq!(r.kind, graphed_ref_kind::Alias as u32);
                            tx.send((r.lease, r.ptr as usize, v)).unwrap();
                        }
                        break;
                    }
                    stuck();
                }
            }
            drop(tx);
        });
    });
    let (s, st) = stats(h);
    ok(s);
    assert_eq!(st.leases_held, 0);
    ok(graphed_session_destroy(h.p()));
}

/// Sessions created, captured, replayed and destroyed on several threads
/// at once, each thread with its own.
#[test]
fn separate_sessions_churn_in_parallel() {
    thread::scope(|sc| {
        for t in 0..4 {
            sc.spawn(move || {
                let end = deadline();
                let mut k = 0;
                while k < 25 && Instant::now() < end {
                    let h = session(Opts {
                        strict: t % 2 == 1,
                        share: None,
                        clone: true,
                        hold: None,
                    });
                    for i in 0..5 {
                        let v = (t * 100 + i) as f32;
                        let (s, out) = forward(h, v);
                        ok(s);
                        assert!(holds(&out, v));
                        if out.lease != 0 {
                            ok(graphed_lease_release(h.p(), out.lease));
                        }
                        let (s, gin, gp) = backward(h, v);
                        ok(s);
                        if gin.lease != 0 {
                            ok(graphed_lease_release(h.p(), gin.lease));
                        }
                        assert!(holds(&gp[0], v));
                        if i % 2 == 0 {
                            ok(graphed_buffer_release(gp[0].owner));
                            ok(graphed_buffer_release(gp[1].owner));
                        } else {
                            // Released after the session is gone: still valid.
                            ok(graphed_session_reset(h.p()));
                            assert!(holds(&gp[1], v));
                            ok(graphed_buffer_release(gp[0].owner));
                            ok(graphed_buffer_release(gp[1].owner));
                            break;
                        }
                    }
                    ok(graphed_session_destroy(h.p()));
                    one_of(graphed_session_destroy(h.p()), &[S::UseAfterDestroy]);
                    k += 1;
                }
            });
        }
    });
}

/// A destroy racing replays of the same session: called while a replay is
/// certainly in progress (its task waits until the destroy has been tried)
/// it gets BUSY; retried, it succeeds; the replays get BUSY or, once the
/// session is gone, USE_AFTER_DESTROY. Clones returned before the destroy
/// stay valid and are released after it, from another thread.
#[test]
fn destroy_races_replays() {
    for round in 0..16 {
        let hold: &'static Hold = Box::leak(Box::new(Hold {
            on: AtomicBool::new(false),
            running: AtomicUsize::new(0),
        }));
        let h = session(Opts {
            strict: round % 2 == 1,
            share: None,
            clone: true,
            hold: Some(hold),
        });
        hold.on.store(true, Ordering::SeqCst);
        let (tx, rx) = mpsc::channel::<(usize, usize, f32)>();
        thread::scope(|sc| {
            for t in 0..2 {
                let tx = tx.clone();
                sc.spawn(move || {
                    let mut i = 0;
                    loop {
                        let v = (t * 10000 + i) as f32;
                        i += 1;
                        let (s, out) = forward(h, v);
                        match one_of(s, &[S::Ok, S::Busy, S::UseAfterDestroy, S::AliasHeld]) {
                            S::UseAfterDestroy => break,
                            S::Ok if out.lease != 0 => {
                                // Released on this thread; the session may be
                                // gone already.
                                one_of(
                                    graphed_lease_release(h.p(), out.lease),
                                    &[S::Ok, S::UseAfterDestroy],
                                );
                            }
                            _ => {}
                        }
                        let (s, gin, gp) = backward(h, v);
                        match one_of(s, &[S::Ok, S::Busy, S::UseAfterDestroy, S::AliasHeld]) {
                            S::UseAfterDestroy => break,
                            S::Ok => {
                                if gin.lease != 0 {
                                    one_of(
                                        graphed_lease_release(h.p(), gin.lease),
                                        &[S::Ok, S::UseAfterDestroy],
                                    );
                                }
                                tx.send((gp[0].owner as usize, gp[0].ptr as usize, v))
                                    .unwrap();
                                tx.send((gp[1].owner as usize, gp[1].ptr as usize, v))
                                    .unwrap();
                            }
                            _ => {}
                        }
                        // Leave the destroying thread a window now and then
                        // (destroy retries on BUSY; nothing makes it fair).
                        if i % 16 == 0 {
                            thread::sleep(Duration::from_micros(20));
                        } else {
                            thread::yield_now();
                        }
                    }
                });
            }
            {
                sc.spawn(move || {
                    thread::sleep(Duration::from_micros(200 * round as u64));
                    // Into the middle of a replay: its task is running.
                    while hold.running.load(Ordering::SeqCst) == 0 {
                        thread::yield_now();
                    }
                    one_of(graphed_session_destroy(h.p()), &[S::Busy]);
                    hold.on.store(false, Ordering::SeqCst);
                    let end = Instant::now() + Duration::from_secs(20);
                    let mut busy = 1;
                    while one_of(graphed_session_destroy(h.p()), &[S::Ok, S::Busy]) == S::Busy {
                        assert!(Instant::now() < end, "destroy got BUSY for 20 s");
                        busy += 1;
                        thread::yield_now();
                    }
                    eprintln!(
                        "round {round}: destroy refused BUSY {busy} times before it went through"
                    );
                    one_of(graphed_session_destroy(h.p()), &[S::UseAfterDestroy]);
                    let (s, _) = stats(h);
                    one_of(s, &[S::UseAfterDestroy]);
                });
            }
            drop(tx);
            // The deleter: clones outlive their session.
            sc.spawn(move || {
                for (owner, ptr, v) in rx {
                    let r = graphed_ref {
                        ptr: ptr as *mut c_void,
                        bytes: BYTES,
                        ..empty_ref()
                    };
                    assert!(holds(&r, v), "a clone changed before its release");
                    ok(graphed_buffer_release(owner as *mut graphed_buffer));
                }
            });
        });
    }
}

/// Two sessions sharing a pool, each replayed by its own thread: a whole
/// iteration (forward then backward) at a time. A forward may be refused
/// (WRONG_STATE) while the other session is mid-iteration; once a
/// session's forward went through, its backward never is.
#[test]
fn shared_pool_from_two_threads() {
    let a = session(Opts {
        strict: false,
        share: None,
        clone: true,
        hold: None,
    });
    let b = session(Opts {
        strict: false,
        share: Some(a),
        clone: true,
        hold: None,
    });
    thread::scope(|sc| {
        for (t, h) in [a, b].into_iter().enumerate() {
            sc.spawn(move || {
                let end = deadline();
                let mut done = 0;
                while done < 100 && Instant::now() < end {
                    let v = (t * 1000 + done) as f32;
                    let (s, out) = forward(h, v);
                    if one_of(s, &[S::Ok, S::WrongState]) == S::WrongState {
                        thread::yield_now();
                        continue;
                    }
                    assert!(holds(&out, v));
                    let (s, gin, gp) = backward(h, v);
                    ok(s);
                    assert!(holds(&gin, v) && holds(&gp[0], v) && holds(&gp[1], v));
                    ok(graphed_buffer_release(gp[0].owner));
                    ok(graphed_buffer_release(gp[1].owner));
                    done += 1;
                }
                assert!(done > 0, "session {t}: no step got through the shared pool");
            });
        }
        // A third session joins the pool while they replay, and leaves.
        sc.spawn(move || {
            for _ in 0..3 {
                let mut cfg = graphed_session_config_default();
                cfg.backend = graphed_backend::Host as u32;
                cfg.share_pool_with = a.p();
                ok(graphed_session_destroy(create(&cfg)));
            }
        });
    });
    ok(graphed_session_destroy(b.p()));
    ok(graphed_session_destroy(a.p()));
}

/// Creating a session that shares the pool of one being destroyed on
/// another thread: OK or USE_AFTER_DESTROY, and the pool outlives whichever
/// goes first.
#[test]
fn share_pool_with_a_session_being_destroyed() {
    for _ in 0..20 {
        let a = session(Opts {
            strict: false,
            share: None,
            clone: true,
            hold: None,
        });
        let made = thread::scope(|sc| {
            let maker = sc.spawn(move || {
                let mut cfg = graphed_session_config_default();
                cfg.backend = graphed_backend::Host as u32;
                cfg.share_pool_with = a.p();
                let mut s = null_mut();
                // SAFETY: a valid config and out pointer.
                let st = unsafe { graphed_session_create(&cfg, &mut s) };
                one_of(st, &[S::Ok, S::UseAfterDestroy]);
                (st == S::Ok).then_some(H(s as usize))
            });
            loop {
                if one_of(graphed_session_destroy(a.p()), &[S::Ok, S::Busy]) == S::Ok {
                    break;
                }
                thread::yield_now();
            }
            maker.join().unwrap()
        });
        if let Some(b) = made {
            add_callable(b, None);
            ok(graphed_session_capture(b.p()));
            let (s, out) = forward(b, 3.0);
            ok(s);
            assert!(holds(&out, 3.0));
            let (s, _, gp) = backward(b, 3.0);
            ok(s);
            ok(graphed_buffer_release(gp[0].owner));
            ok(graphed_buffer_release(gp[1].owner));
            ok(graphed_session_destroy(b.p()));
        }
    }
}

/// graphed_session_params_movable of the one instance.
fn params_movable(h: H) -> (graphed_status, [u32; 2]) {
    let mut on = [7u32; 2];
    // SAFETY: room for two values.
    let s = unsafe { graphed_session_params_movable(h.p(), 0, 0, on.as_mut_ptr(), 2) };
    (s, on)
}

/// Where the graphs read the parameters (graphed_session_param_addresses),
/// the instance number and the bucket a forward runs of the one instance
/// (of one size and of two: graphed_session_bucket_of2), into `at`: the
/// four statuses (BUSY while another call is inside the session).
fn answers(h: H, at: &mut [usize; 2]) -> [graphed_status; 4] {
    let (mut inst, mut bucket, mut rows) = (7u32, 7u32, 7u64);
    let (mut bucket2, mut rows2, mut second) = (7u32, 7u64, 7u64);
    // SAFETY: room for two addresses; locals.
    let got = unsafe {
        [
            graphed_session_param_addresses(h.p(), 0, 0, at.as_mut_ptr().cast(), 2),
            graphed_session_instance_of(h.p(), 0, 0, 0, &mut inst),
            graphed_session_bucket_of(h.p(), 0, 0, &mut bucket, &mut rows),
            graphed_session_bucket_of2(h.p(), 0, 0, 0, &mut bucket2, &mut rows2, &mut second),
        ]
    };
    let want2 = if got[3] == S::Ok {
        (0, 0, 0)
    } else {
        (7, 7, 7)
    };
    assert_eq!((bucket2, rows2, second), want2, "bucket_of2");
    // Instance 0; bucket 0, of size 0 (no buckets); untouched when refused.
    let inst_want = if got[1] == S::Ok { 0 } else { 7 };
    assert_eq!(inst, inst_want, "instance_of");
    let bucket_want = if got[2] == S::Ok { (0, 0) } else { (7, 7) };
    assert_eq!((bucket, rows), bucket_want, "bucket_of");
    got
}

/// Replays given the parameters' addresses from two threads (the
/// registered ones, NULL entries, a moved one the host backend refuses
/// with PARAM_MOVED, a backward at another address than its forward's)
/// while three others read the stats, graphed_session_params_movable and
/// where the graphs read the parameters (with the instance number and the
/// bucket a forward runs). Every refusal names what it refused on the
/// thread that got it; nothing a refused replay was given is ever counted
/// as a move, and the graphs read the parameters where they were
/// registered throughout.
#[test]
fn params_given_while_others_query() {
    // Param 0 asks to move; the host backend refuses it at capture.
    let (h, reg) = session_with(
        Opts {
            strict: false,
            share: None,
            clone: true,
            hold: None,
        },
        [graphed_param_flags::Rebind as u32, 0],
    );
    let moved = param_mem();
    thread::scope(|sc| {
        for t in 0..2 {
            sc.spawn(move || {
                let end = deadline();
                let (mut done, mut refused) = (0, 0);
                while done < 200 && Instant::now() < end {
                    let v = (t * 1000 + done) as f32;
                    let given = match done % 4 {
                        0 => reg,
                        1 => [0, reg[1]],
                        2 => [reg[0], 0],
                        _ => [0, 0],
                    };
                    // Moved: refused whatever else runs, and named.
                    let away = if done % 2 == 0 {
                        [moved, reg[1]]
                    } else {
                        [reg[0], moved]
                    };
                    let (s, out) = forward_at(h, 0, v, Some(&away));
                    if one_of(s, &[S::ParamMoved, S::Busy]) == S::ParamMoved {
                        let m = msg();
                        assert!(
                            m.starts_with("graphed_forward: ")
                                && m.contains(&format!("0x{moved:x}"))
                                && m.contains(&format!("0x{:x}", reg[done % 2])),
                            "{m}"
                        );
                        assert!(out.ptr.is_null(), "a ref written on refusal");
                        refused += 1;
                    }
                    let (s, _) = forward_at(h, 0, v, Some(&given));
                    if one_of(s, &[S::Ok, S::Busy]) == S::Busy {
                        thread::yield_now();
                        continue;
                    }
                    // Another thread's forward may come in between: the
                    // backward reads the parameters where forwards did.
                    let (s, ..) = backward_at(h, 0, v, Some(&[reg[0], moved]));
                    if one_of(s, &[S::InvalidArgument, S::Busy]) == S::InvalidArgument {
                        assert!(msg().contains("where its forward did"), "{}", msg());
                    }
                    let (s, _, gp) = backward_at(h, 0, v, Some(&given));
                    if one_of(s, &[S::Ok, S::Busy]) == S::Busy {
                        continue;
                    }
                    assert!(
                        holds(&gp[0], v) && holds(&gp[1], v),
                        "clones of this thread's backward"
                    );
                    ok(graphed_buffer_release(gp[0].owner));
                    ok(graphed_buffer_release(gp[1].owner));
                    done += 1;
                }
                assert!(done > 0, "thread {t}: no step got through");
                eprintln!("replayer {t}: {done} steps, {refused} moves refused");
            });
        }
        sc.spawn(move || {
            let end = Instant::now() + Duration::from_millis(300);
            let mut answered = 0;
            while Instant::now() < end {
                let (s, st) = stats(h);
                if one_of(s, &[S::Ok, S::Busy]) == S::Ok {
                    assert_eq!(
                        (st.params_movable, st.params_move_refused, st.param_moves),
                        (0, 1, 0)
                    );
                    answered += 1;
                }
            }
            assert!(answered > 0, "stats never got through");
        });
        sc.spawn(move || {
            let end = Instant::now() + Duration::from_millis(300);
            let mut answered = 0;
            while Instant::now() < end {
                let (s, on) = params_movable(h);
                if one_of(s, &[S::Ok, S::Busy]) == S::Ok {
                    assert_eq!(on, [0, 0], "nothing moves on the host backend");
                    answered += 1;
                }
            }
            assert!(answered > 0, "params_movable never got through");
        });
        sc.spawn(move || {
            let end = Instant::now() + Duration::from_millis(300);
            let mut answered = 0;
            while Instant::now() < end {
                let mut at = [0x77usize; 2];
                let got = answers(h, &mut at);
                for &s in &got {
                    one_of(s, &[S::Ok, S::Busy]);
                }
                if got[0] == S::Ok {
                    assert_eq!(at, reg, "the registered addresses: nothing moves");
                    answered += 1;
                } else {
                    assert_eq!(at, [0x77; 2], "addresses written while BUSY");
                }
            }
            assert!(answered > 0, "param_addresses never got through");
        });
    });
    let (s, st) = stats(h);
    ok(s);
    assert_eq!((st.param_moves, st.clone_blocks_outstanding), (0, 0));
    ok(graphed_session_destroy(h.p()));
    assert_eq!(params_movable(h).0, S::UseAfterDestroy);
    assert_eq!(answers(h, &mut [0; 2]), [S::UseAfterDestroy; 4]);
}

/// One callable of a session released (graphed_session_release_callable)
/// while threads replay both of its callables, hand their clones to a
/// deleter thread, and read the process's figures
/// (graphed_memory_stats_get) and the callables' memory
/// (graphed_session_callable_memory): the release gets BUSY while another
/// call is inside the session and goes through once retried; afterwards
/// replays of the released callable are refused (CALLABLE_RELEASED), the
/// other's go on, and clones returned before the release stay intact
/// until the deleter releases them.
#[test]
fn release_callable_while_others_replay() {
    let h = H(create(&host_config()) as usize);
    add_callable(h, None);
    add_callable(h, None);
    ok(graphed_session_capture(h.p()));
    let released = AtomicBool::new(false);
    let (tx, rx) = mpsc::channel::<Returned>();
    thread::scope(|sc| {
        for c in 0..2u32 {
            let tx = tx.clone();
            let released = &released;
            sc.spawn(move || {
                let end = deadline();
                let mut done = 0;
                while Instant::now() < end && done < 300 {
                    let v = (c * 1000 + done) as f32;
                    let allowed: &[graphed_status] = match c {
                        0 => &[S::Ok, S::Busy, S::CallableReleased],
                        _ => &[S::Ok, S::Busy],
                    };
                    let (s, _) = forward_at(h, c, v, None);
                    match one_of(s, allowed) {
                        S::CallableReleased => {
                            assert!(released.load(Ordering::SeqCst));
                            assert!(
                                msg().contains("was released by graphed_session_release_callable")
                            );
                            break;
                        }
                        S::Busy => {
                            thread::yield_now();
                            continue;
                        }
                        _ => {}
                    }
                    let (s, _, gp) = backward_at(h, c, v, None);
                    match one_of(s, allowed) {
                        S::CallableReleased => break,
                        S::Busy => continue,
                        _ => {}
                    }
                    tx.send(Returned {
                        owner: gp[0].owner as usize,
                        grads: gp.iter().map(|r| (r.ptr as usize, v)).collect(),
                    })
                    .unwrap();
                    done += 1;
                }
                if c == 1 {
                    assert!(done > 0, "callable 1: no step got through");
                }
            });
        }
        drop(tx);
        // The deleter: clones of the released callable outlive its release.
        sc.spawn(move || {
            for r in rx {
                r.check_intact();
                for _ in &r.grads {
                    ok(graphed_buffer_release(r.owner as *mut graphed_buffer));
                }
            }
        });
        // The releaser.
        let released = &released;
        sc.spawn(move || {
            thread::sleep(Duration::from_millis(20));
            let end = Instant::now() + Duration::from_secs(20);
            loop {
                // Set first: a replay refused as released must see it.
                released.store(true, Ordering::SeqCst);
                match one_of(
                    graphed_session_release_callable(h.p(), 0),
                    &[S::Ok, S::Busy],
                ) {
                    S::Ok => break,
                    _ => {
                        assert!(Instant::now() < end, "release got BUSY for 20 s");
                        thread::yield_now();
                    }
                }
            }
            loop {
                if one_of(
                    graphed_session_release_callable(h.p(), 0),
                    &[S::Ok, S::Busy],
                ) == S::Ok
                {
                    break;
                }
                thread::yield_now();
            }
        });
        // The readers of the figures.
        sc.spawn(move || {
            let end = Instant::now() + Duration::from_millis(200);
            let mut answered = 0;
            while Instant::now() < end {
                let m = memory_stats();
                assert!(m.sessions >= 1 && m.allocations >= 1 && m.device_bytes > 0);
                let mut cm = graphed_callable_memory_default();
                // SAFETY: an initialised struct.
                let s = unsafe { graphed_session_callable_memory(h.p(), 1, &mut cm) };
                if one_of(s, &[S::Ok, S::Busy]) == S::Ok {
                    assert_eq!(cm.released, 0);
                    assert!(cm.own_static_bytes > 0);
                    answered += 1;
                }
                // Where the graphs read the parameters: refused once
                // callable 0 is released.
                let mut at = [0usize; 2];
                for (c, allowed) in [
                    (0, &[S::Ok, S::Busy, S::CallableReleased][..]),
                    (1, &[S::Ok, S::Busy]),
                ] {
                    // SAFETY: room for two addresses.
                    let s = unsafe {
                        graphed_session_param_addresses(h.p(), c, 0, at.as_mut_ptr().cast(), 2)
                    };
                    if one_of(s, allowed) == S::CallableReleased {
                        assert!(released.load(Ordering::SeqCst));
                    }
                }
            }
            assert!(answered > 0, "callable memory never got through");
        });
    });
    let mut cm = graphed_callable_memory_default();
    // SAFETY: an initialised struct.
    ok(unsafe { graphed_session_callable_memory(h.p(), 0, &mut cm) });
    assert_eq!((cm.released, cm.own_static_bytes, cm.graphs), (1, 0, 0));
    assert_eq!(
        cm.clone_bytes_outstanding, 0,
        "the deleter released every clone"
    );
    assert_eq!(forward_at(h, 0, 1.0, None).0, S::CallableReleased);
    let (s, out) = forward_at(h, 1, 5.0, None);
    ok(s);
    assert!(holds(&out, 5.0));
    ok(graphed_session_destroy(h.p()));
}

/// A host kernel that faults (returns 5).
unsafe extern "C" fn fault(_: *mut c_void) -> i32 {
    5
}

/// A session in debug mode replayed from two threads while a third writes
/// its graphs as DOT text (graphed_session_export_dot) and a fourth, in a
/// debug session of its own, makes a host kernel fault on its NULL stream
/// before each of its replays: that fault is its thread's, so its replay
/// names it as pending from earlier work and the others' debug checks
/// never see it; the export answers or is BUSY, and what it writes is
/// whole and the same every time.
#[test]
fn debug_replays_and_the_dot_export_while_a_thread_faults() {
    let debug_session = || {
        let mut cfg = host_config();
        cfg.debug = 1;
        let h = H(create(&cfg) as usize);
        add_callable(h, None);
        ok(graphed_session_capture(h.p()));
        h
    };
    let (h, own) = (debug_session(), debug_session());
    let dot = |h: H| -> (graphed_status, String) {
        let (mut len, mut buf) = (0usize, vec![0u8; 1 << 16]);
        // SAFETY: room for the buffer's bytes.
        let s = unsafe {
            graphed_session_export_dot(h.p(), buf.as_mut_ptr().cast(), buf.len(), &mut len)
        };
        let end = buf.iter().position(|&b| b == 0).unwrap_or(0);
        if s == S::Ok {
            assert_eq!(end, len, "the whole text, NUL-terminated");
        }
        (s, String::from_utf8_lossy(&buf[..end]).into_owned())
    };
    let (s, want) = dot(h);
    ok(s);
    assert!(
        want.contains("(index 0), forward, microbatch 0, no buckets, main graph"),
        "{want}"
    );
    thread::scope(|sc| {
        for t in 0..2 {
            sc.spawn(move || {
                let end = deadline();
                let mut done = 0;
                while done < 200 && Instant::now() < end {
                    let v = (t * 1000 + done) as f32;
                    // The output is an alias the other thread's forward
                    // may overwrite at once: only the owned grads are read.
                    let (s, _) = forward(h, v);
                    if one_of(s, &[S::Ok, S::Busy]) == S::Busy {
                        thread::yield_now();
                        continue;
                    }
                    let (s, _, gp) = backward(h, v);
                    if one_of(s, &[S::Ok, S::Busy]) == S::Busy {
                        continue;
                    }
                    assert!(holds(&gp[0], v) && holds(&gp[1], v));
                    ok(graphed_buffer_release(gp[0].owner));
                    ok(graphed_buffer_release(gp[1].owner));
                    done += 1;
                }
                assert!(done > 0, "thread {t}: no replay got through");
            });
        }
        let want = &want;
        sc.spawn(move || {
            let end = Instant::now() + Duration::from_millis(300);
            let mut answered = 0;
            while Instant::now() < end {
                let (s, text) = dot(h);
                if one_of(s, &[S::Ok, S::Busy]) == S::Ok {
                    assert_eq!(&text, want, "the same text every time");
                    answered += 1;
                } else {
                    assert!(text.is_empty(), "written while BUSY");
                }
            }
            assert!(answered > 0, "the export never got through");
        });
        sc.spawn(move || {
            for k in 0..50 {
                // SAFETY: a kernel that ignores its data; NULL runs it now.
                ok(unsafe {
                    graphed_host_enqueue_kernel(
                        null_mut(),
                        c"oops".as_ptr(),
                        Some(fault),
                        null_mut(),
                    )
                });
                let (s, _) = forward(own, k as f32);
                assert_eq!(s, S::CudaError, "{}", msg());
                let m = msg();
                assert!(
                    m.contains("pending before the forward replay")
                        && m.contains("host kernel 'oops' returned 5"),
                    "{m}"
                );
                let (s, out) = forward(own, k as f32);
                ok(s);
                assert!(holds(&out, k as f32));
            }
        });
    });
    ok(graphed_session_destroy(h.p()));
    ok(graphed_session_destroy(own.p()));
}

/// A step's update task: the check (`flag` set when the grad's first
/// element is negative) or the apply (`w -= lr * g`, lr at `scalars`).
struct UpdateTask {
    w: usize,
    g: usize,
    flag: usize,
    scalars: usize,
}

unsafe extern "C" fn update_check_task(data: *mut c_void) {
    // SAFETY: a leaked UpdateTask over the step's memory.
    unsafe {
        let t = &*(data as *const UpdateTask);
        if *(t.g as *const f32) < 0.0 {
            *(t.flag as *mut u32) = 1;
        }
    }
}

unsafe extern "C" fn update_apply_task(data: *mut c_void) {
    // SAFETY: as above; N floats at w and g.
    unsafe {
        let t = &*(data as *const UpdateTask);
        let lr = *(t.scalars as *const f32);
        for k in 0..N {
            *(t.w as *mut f32).add(k) -= lr * *(t.g as *const f32).add(k);
        }
    }
}

/// The update callbacks: one task per parameter (check: the first only).
unsafe extern "C" fn update_cb(ctx: *const graphed_update_ctx, _: *mut c_void) -> i32 {
    // SAFETY: valid during the call, arrays of num_params.
    let c = unsafe { &*ctx };
    let (check, n) = (c.phase == graphed_update_phase::Check as u32, c.num_params);
    for p in 0..if check { 1 } else { n } {
        // SAFETY: p < num_params.
        let (w, g) = unsafe { (*c.params.add(p) as usize, *c.grads.add(p) as usize) };
        let t = Box::leak(Box::new(UpdateTask {
            w,
            g,
            flag: c.skip_flag as usize,
            scalars: c.scalars as usize,
        }));
        let f = if check {
            update_check_task
        } else {
            update_apply_task
        };
        // SAFETY: the leaked task lives for the test.
        let st = unsafe { graphed_host_enqueue(c.stream, Some(f), (t as *mut UpdateTask).cast()) };
        if st != S::Ok {
            return st as i32;
        }
    }
    0
}

/// One thread replays a step with an update, giving it new scalars each
/// time and reading its skip flag after each replay (which must answer for
/// that replay); another reads the flag's count at the same time (BUSY or
/// a count that never goes down), a third the stats.
#[test]
fn a_step_update_replayed_while_others_read_its_flag() {
    let mut cfg = host_config();
    cfg.clone_param_grads_on_return = 0;
    let h = H(create(&cfg) as usize);
    let params = add_callable_with(h, None, [0, 0]);
    let gy: &'static mut [f32] = Box::leak(vec![0f32; N].into_boxed_slice());
    let gy_at = gy.as_mut_ptr() as usize;
    let io = [graphed_step_io {
        role: graphed_buffer_role::GradOutput as u32,
        ptr: gy_at as *mut c_void,
        stride: BYTES,
        ..graphed_step_io_default()
    }];
    let callables = [0u32];
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = 1;
    d.io = io.as_ptr();
    d.num_io = 1;
    d.update_check = Some(update_cb);
    d.update_apply = Some(update_cb);
    d.scalar_bytes = 4;
    let mut step = 0;
    // SAFETY: the descriptor's arrays hold the stated counts.
    ok(unsafe { graphed_session_add_step(h.p(), &d, &mut step) });
    ok(graphed_session_capture(h.p()));
    let done = Arc::new(AtomicBool::new(false));
    let query = move || {
        let (mut last, mut total) = (0u32, 0u64);
        // SAFETY: valid out pointers.
        let st = unsafe { graphed_step_skipped(h.p(), 0, &mut last, &mut total) };
        (one_of(st, &[S::Ok, S::Busy]), last, total)
    };
    let reader = {
        let done = done.clone();
        thread::spawn(move || {
            let mut seen = 0u64;
            while !done.load(Ordering::SeqCst) {
                let (st, _, total) = query();
                if st == S::Ok {
                    assert!(total >= seen, "the count went down: {total} < {seen}");
                    seen = total;
                }
                one_of(stats(h).0, &[S::Ok, S::Busy]);
            }
        })
    };
    let (mut w, mut skips, lr) = (0f32, 0u64, 0.001f32);
    let end = deadline();
    for it in 0..200 {
        let v = if it % 5 == 0 { -1.0 } else { 0.5 };
        // SAFETY: the io buffer, read only by this thread's replays.
        unsafe { std::slice::from_raw_parts_mut(gy_at as *mut f32, N) }.fill(v);
        let scalars = [lr];
        let mut a = graphed_step_args_default();
        a.scalars = scalars.as_ptr().cast();
        a.scalar_bytes = 4;
        let mut refs = [empty_ref(), empty_ref()];
        // SAFETY: valid args and room for two refs.
        while one_of(
            unsafe { graphed_step_replay(h.p(), &a, refs.as_mut_ptr(), 2) },
            &[S::Ok, S::Busy],
        ) == S::Busy
        {
            assert!(Instant::now() < end, "BUSY for too long");
        }
        if v < 0.0 {
            skips += 1;
        } else {
            w -= lr * v;
        }
        let (last, total) = loop {
            if let (S::Ok, last, total) = query() {
                break (last, total);
            }
            assert!(Instant::now() < end, "BUSY for too long");
        };
        assert_eq!((last, total), ((v < 0.0) as u32, skips), "replay {it}");
    }
    done.store(true, Ordering::SeqCst);
    reader.join().unwrap();
    for p in params {
        // SAFETY: the registered parameter memory (N floats).
        let got = unsafe { std::slice::from_raw_parts(p as *const f32, N) };
        assert!(got.iter().all(|&x| x == w), "{} vs {w}", got[0]);
    }
    ok(graphed_session_destroy(h.p()));
}
