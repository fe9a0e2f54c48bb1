//! Fuzz target over call sequences of graphed's C ABI, on the host backend.
//!
//! The input bytes are a program: each op reads an opcode and its arguments
//! from the input (an exhausted input reads zeros, which pick the plain,
//! valid choice, so short inputs still reach capture and replays). Ops
//! create sessions from fuzzed configs (garbage magic and sizes, flags of 2,
//! schedules, shared pools, allocators, hooks), register callables with
//! fuzzed descriptors, capture, replay forward/backward/weight-grad with
//! fuzzed arguments, release and retain clone blocks and leases (live,
//! stale and forged), query stats, buffers, policies and the plan dump,
//! reset and destroy in any order. The callbacks read their behaviour from
//! the input too: return non-zero, allocate scratch of any size, free it
//! twice, synchronize under capture, keep their in-call handles, call back
//! into their own session, replay another session on their capturing
//! stream, capture another session, destroy sessions, hand over external
//! buffers or not.
//!
//! A model of every session runs beside the library, and every call's
//! status is checked against it: the exact status where the model knows it
//! (argument checks in the library's order, BUSY from callbacks,
//! STREAM_CAPTURING, USE_AFTER_DESTROY for stale handles, INVALID_ARGUMENT
//! for forged ones, the failure a capture must report), never INTERNAL, a
//! message naming the function on every failure, outputs untouched on
//! failure. Successful replays are checked for what they return: ref kinds
//! by frozen policy, aliases and clones holding what the captured graph
//! wrote, COPY_INTO and ACCUMULATE_INTO destinations updated, clones kept
//! intact until released, leases never handed out twice, stats agreeing
//! with the model. At the end of each input everything is released and the
//! handle table must be empty; LeakSanitizer checks the rest.
//!
//! Sizes are either small or impossible (at least 2^41 bytes, which no
//! allocator here grants), so that a run never needs real memory beyond a
//! few MiB. GRAPHED_FUZZ_WAIVE (comma-separated names, see `waived`) turns
//! off the checks of library bugs this target found (all fixed, each with a
//! reproducer in tests/abi_regressions.rs), to look past a regression of
//! one while hunting another.

#![no_main]

use graphed::core::handle::{self as table, Kind};
use graphed::ffi::*;
use libfuzzer_sys::fuzz_target;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::mem::size_of;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use graphed_status as S;

// ---------------------------------------------------------------- input --

struct Input {
    data: Vec<u8>,
    pos: Cell<usize>,
}

impl Input {
    fn byte(&self) -> u8 {
        let p = self.pos.get();
        self.pos.set(p + 1);
        self.data.get(p).copied().unwrap_or(0)
    }
    fn below(&self, n: usize) -> usize {
        if n <= 1 {
            return 0;
        }
        if n <= 256 {
            self.byte() as usize % n
        } else {
            (self.byte() as usize | (self.byte() as usize) << 8) % n
        }
    }
    /// True with probability k/256 (false on an exhausted input).
    fn chance(&self, k: u8) -> bool {
        self.byte() >= 255 - k.saturating_sub(1) && k > 0
    }
    fn pick<T: Copy>(&self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    fn u64(&self) -> u64 {
        (0..8).fold(0u64, |a, _| a << 8 | self.byte() as u64)
    }
    fn done(&self) -> bool {
        self.pos.get() >= self.data.len()
    }
}

// ---------------------------------------------------------------- model --

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum St {
    Open,
    Captured,
    Reset,
}

#[derive(Clone, Debug)]
struct Tensor {
    bytes: usize,
    grad: bool,
    external: bool,
}

#[derive(Clone, Debug)]
struct Param {
    bytes: usize,
    dtype: u32,
    grad: bool,
    delayed: bool,
    external: bool,
    policy: u32,
}

impl Param {
    /// The policy capture freezes (0: no gradient).
    fn resolved(&self, clone: bool) -> u32 {
        match (self.grad, self.policy) {
            (false, _) => 0,
            (true, 0) if self.delayed || !clone => 2,
            (true, 0) => 1,
            (true, p) => p,
        }
    }
}

#[derive(Clone, Debug)]
struct Callable {
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
    params: Vec<Param>,
    wgrad: bool,
}

/// A schedule the model understands: all forwards, then all backwards
/// (each followed by its weight-grad when `wgrad`).
#[derive(Clone, Debug)]
struct Sched {
    chunks: usize,
    mb: usize,
    wgrad: bool,
    layers: Option<Vec<u32>>,
}

struct Sess {
    h: usize,
    alive: bool,
    st: St,
    strict: bool,
    clone: bool,
    reuse: bool,
    warmup: u32,
    /// None: a fuzzed schedule of unknown validity (or none: Some(default)).
    sched: Option<Option<Sched>>,
    mb: u32,
    pool: usize,
    callables: Vec<Callable>,
    custom_alloc: bool,
    clone_slots: u32,
    /// The capture attempt whose graphs (and side stream) are live.
    live_attempt: Option<u64>,
    /// Steps declared (graphed_session_add_step), in order.
    steps: Vec<StepModel>,
}

/// A declared step: its callables, and one destination per parameter of
/// theirs, in order (0: none).
#[derive(Clone, Debug)]
struct StepModel {
    callables: Vec<usize>,
    dsts: Vec<usize>,
}

/// A capture call in progress.
struct Frame {
    sess: usize,
    attempt: u64,
    stream: usize,
    /// A callback (not a hook) of the capture phase is running: the stream
    /// is capturing.
    capturing: bool,
    invalidated: bool,
    scratch_fail: bool,
    /// Something made this capture's scratch requests differ between
    /// iterations, or froze the tape: plain requests may then be refused.
    irregular: bool,
    first: Option<graphed_status>,
    /// What the callback that decided `first` said with
    /// graphed_callback_fail_message, when `first` is CALLBACK_FAILED.
    said: Option<String>,
    ran: bool,
}

struct HeldBlock {
    owner: usize,
    refs: usize,
    sess: usize,
    grads: Vec<(usize, usize, u8)>,
}

struct Lease {
    sess: usize,
    token: u64,
    /// (callable, microbatch, what: 0 output, 1 grad input, 2 param, index)
    slot: (usize, u32, u8, usize),
}

/// A handle a callback kept past its call.
struct Kept {
    h: usize,
    live: bool,
}

struct KeptStream {
    h: usize,
    sess: usize,
    attempt: u64,
}

/// The user data of a host task recorded by a callback.
struct Fill {
    targets: Vec<(usize, usize, u8)>,
    sess: usize,
    action: u8,
}

/// The user data of a callback or hook.
struct Cb {
    sess: usize,
    callable: usize,
    scratch: usize,
    hook: bool,
}

/// The user data of a session's allocator, log and warmup hook.
struct SessCtx {
    sess: usize,
    log_level: u32,
}

struct World {
    input: Input,
    sessions: RefCell<Vec<Sess>>,
    mem: RefCell<Vec<Box<[u64]>>>,
    fills: RefCell<Vec<Box<Fill>>>,
    cbs: RefCell<Vec<Box<Cb>>>,
    ctxs: RefCell<Vec<Box<SessCtx>>>,
    ext: RefCell<HashMap<(usize, usize, u32, u32, usize), usize>>,
    blocks: RefCell<Vec<HeldBlock>>,
    stale_blocks: RefCell<Vec<usize>>,
    leases: RefCell<Vec<Lease>>,
    stale_leases: RefCell<Vec<(usize, u64)>>,
    kept_scratch: RefCell<Vec<Kept>>,
    kept_capture: RefCell<Vec<Kept>>,
    kept_streams: RefCell<Vec<KeptStream>>,
    allocs: RefCell<HashMap<usize, (usize, usize, Box<[u64]>)>>,
    frames: RefCell<Vec<Frame>>,
    /// Sessions pinned by a call in progress (innermost last).
    pinned: RefCell<Vec<usize>>,
    attempts: Cell<u64>,
    depth: Cell<u32>,
    pools: Cell<usize>,
}

thread_local! {
    static WORLD: Cell<*const World> = const { Cell::new(null()) };
}

fn w() -> &'static World {
    let p = WORLD.with(|c| c.get());
    assert!(
        !p.is_null(),
        "a graphed callback ran outside the fuzz input that registered it"
    );
    // SAFETY: set for the duration of one input; the World outlives every
    // session (all are destroyed before it drops).
    unsafe { &*p }
}

/// What the replays' host tasks write is `seed ^ EPOCH`, so that a replay's
/// results can be told from an earlier one's.
static EPOCH: AtomicU8 = AtomicU8::new(0);

/// GRAPHED_FUZZ_TRACE=1 prints each op, to read a crashing input.
fn tracing() -> bool {
    static T: OnceLock<bool> = OnceLock::new();
    *T.get_or_init(|| std::env::var_os("GRAPHED_FUZZ_TRACE").is_some())
}

macro_rules! trace {
    ($($a:tt)*) => {
        if tracing() {
            eprintln!($($a)*);
        }
    };
}

fn waived(name: &str) -> bool {
    static W: OnceLock<Vec<String>> = OnceLock::new();
    W.get_or_init(|| {
        std::env::var("GRAPHED_FUZZ_WAIVE")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_string())
            .collect()
    })
    .iter()
    .any(|s| s == name)
}

const ROLE_OUT: u32 = 1;
const ROLE_GIN: u32 = 3;
const ROLE_PARAM: u32 = 4;
const ROLE_SCRATCH: u32 = 9;

fn seed(s: usize, c: usize, mb: u32, role: u32, i: usize) -> u8 {
    (s.wrapping_mul(131) + c * 31 + mb as usize * 17 + role as usize * 7 + i * 3 + 1) as u8
}

fn dtype_size(d: u32) -> usize {
    match d {
        0 | 6 => 4,
        1 | 2 => 2,
        3 | 7 => 8,
        _ => 1,
    }
}

/// Harness "device" memory: a fresh heap block (so that ASan sees its
/// bounds), kept until the end of the input. `off` bytes past 8-alignment.
fn mem(bytes: usize, off: usize) -> usize {
    let words = (bytes + off).div_ceil(8).max(1);
    let b = vec![0u64; words].into_boxed_slice();
    let p = b.as_ptr() as usize + off;
    w().mem.borrow_mut().push(b);
    p
}

fn ext_mem(s: usize, c: usize, mb: u32, role: u32, i: usize, bytes: usize) -> usize {
    if let Some(&p) = w().ext.borrow().get(&(s, c, mb, role, i)) {
        return p;
    }
    let p = mem(bytes, 0);
    w().ext.borrow_mut().insert((s, c, mb, role, i), p);
    p
}

fn all_bytes(p: usize, n: usize, b: u8) -> bool {
    // SAFETY: callers pass buffers the library or the harness keeps alive
    // with at least `n` bytes.
    unsafe { std::slice::from_raw_parts(p as *const u8, n) }
        .iter()
        .all(|&x| x == b)
}

fn msg() -> String {
    // SAFETY: graphed returns a NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(graphed_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Marks the thread's last message, so that a failure that sets none shows.
fn mark() {
    let _ = graphed_buffer_retain(null_mut());
}

/// Every call's common checks: never INTERNAL, a known code, and a message
/// naming the function on failure.
fn post(st: graphed_status, func: &str) {
    let code = st as u32;
    assert!(
        code <= S::StreamCapturing as u32,
        "{func}: status {code} out of range"
    );
    assert!(st != S::Internal, "{func} returned INTERNAL: {}", msg());
    if st != S::Ok {
        let m = msg();
        assert!(
            m.starts_with(&format!("{func}: ")),
            "{func} failed with {st:?} but the message is {m:?}"
        );
        // SAFETY: a static NUL-terminated string.
        let name = unsafe { CStr::from_ptr(graphed_status_name(code)) };
        assert!(name.to_bytes().starts_with(b"GRAPHED_STATUS_"));
    }
}

/// Keeps the first error of a sequence of checks.
fn first(want: &mut Option<graphed_status>, e: Option<graphed_status>) {
    if want.is_none() {
        *want = e;
    }
}

fn expect(st: graphed_status, want: &[graphed_status], func: &str, what: &str) {
    post(st, func);
    assert!(
        want.contains(&st),
        "{func} ({what}) returned {st:?}, expected one of {want:?}; message: {}",
        msg()
    );
}

// --------------------------------------------------------------- handles --

/// A session handle as an op passes it, and what the model expects of it.
#[derive(Clone, Copy, Debug)]
enum Target {
    Null,
    Forged(usize),
    Dead(usize),
    Live(usize),
}

impl Target {
    fn ptr(self) -> *mut graphed_session {
        match self {
            Target::Null => null_mut(),
            Target::Forged(h) => h as *mut _,
            Target::Dead(i) | Target::Live(i) => w().sessions.borrow()[i].h as *mut _,
        }
    }
    /// The status of looking the session up (None: found).
    fn lookup(self) -> Option<graphed_status> {
        match self {
            Target::Null => Some(S::NullPointer),
            Target::Forged(_) => Some(S::InvalidArgument),
            Target::Dead(_) => Some(S::UseAfterDestroy),
            Target::Live(_) => None,
        }
    }
    /// The status of pinning and locking it (None: locked).
    fn lock(self) -> Option<graphed_status> {
        self.lookup().or_else(|| match self {
            Target::Live(i) if w().pinned.borrow().contains(&i) => Some(S::Busy),
            _ => None,
        })
    }
}

fn forged() -> usize {
    let i = &w().input;
    match i.below(6) {
        0 => 1,
        1 => 0x1000 + i.below(64) * 8,
        2 => usize::MAX,
        // A well-formed id that was never issued.
        3 => 0x67 << 56 | 1 << 48 | 0xFFFF_FFFF_FFF0,
        // A handle of another kind: a host stream's or a buffer's, if any.
        4 => w()
            .kept_streams
            .borrow()
            .first()
            .map_or(0x67 << 56 | 5 << 48 | 1, |k| k.h),
        _ => 0x67 << 56,
    }
}

/// A forged id that is no live handle of any kind.
fn forged_id() -> usize {
    let i = &w().input;
    i.pick(&[
        1,
        0x1000 + 8 * i.below(64),
        usize::MAX,
        0x67 << 56 | 1 << 48 | 0xFFFF_FFFF_FFF0,
        0x67 << 56,
    ])
}

fn target() -> Target {
    let i = &w().input;
    let n = w().sessions.borrow().len();
    let r = i.byte();
    if n == 0 || r >= 240 {
        return match r % 3 {
            0 if n > 0 => Target::Null,
            _ => Target::Forged(forged()),
        };
    }
    let k = i.below(n);
    if w().sessions.borrow()[k].alive {
        Target::Live(k)
    } else {
        Target::Dead(k)
    }
}

fn live_target() -> Option<usize> {
    let ss = w().sessions.borrow();
    let live: Vec<usize> = (0..ss.len()).filter(|&k| ss[k].alive).collect();
    drop(ss);
    if live.is_empty() {
        None
    } else {
        Some(live[w().input.below(live.len())])
    }
}

struct Pin(usize);

fn pin(i: usize) -> Pin {
    w().pinned.borrow_mut().push(i);
    Pin(i)
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut p = w().pinned.borrow_mut();
        let at = p.iter().rposition(|&x| x == self.0).expect("pinned");
        p.remove(at);
    }
}

fn stream_live(k: &KeptStream) -> bool {
    if w().frames.borrow().iter().any(|f| f.attempt == k.attempt) {
        return true;
    }
    let s = &w().sessions.borrow()[k.sess];
    s.alive && s.live_attempt == Some(k.attempt)
}

fn stream_capturing(h: usize) -> bool {
    w().frames
        .borrow()
        .iter()
        .any(|f| f.capturing && f.stream == h)
}

/// A stream argument: (value, what looking it up gives: None = usable).
fn stream_arg(allow_null: bool) -> (usize, Option<graphed_status>) {
    let i = &w().input;
    let r = i.below(8);
    let kept = w().kept_streams.borrow();
    if r < 3 && !kept.is_empty() {
        let k = &kept[i.below(kept.len())];
        let st = if stream_live(k) {
            stream_capturing(k.h).then_some(S::StreamCapturing)
        } else {
            Some(S::UseAfterDestroy)
        };
        return (k.h, st);
    }
    drop(kept);
    if r == 3 || !allow_null {
        return (forged_id(), Some(S::InvalidArgument));
    }
    (0, None)
}

// ------------------------------------------------------------- sessions --

fn steps_of(s: &Sched) -> Vec<graphed_schedule_step> {
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

unsafe extern "C" fn log_cb(ctx: *mut c_void, level: u32, message: *const c_char) {
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

unsafe extern "C" fn warmup_hook(when: u32, data: *mut c_void) -> i32 {
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

unsafe extern "C" fn clone_alloc(
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

unsafe extern "C" fn clone_free(
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

fn op_create() {
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
    });
}

// ------------------------------------------------------------ callables --

const SMALL: [usize; 8] = [1, 2, 3, 4, 8, 16, 64, 256];

fn fuzz_bytes(dsize: usize) -> (usize, bool) {
    let i = &w().input;
    if i.chance(24) {
        let b = i.pick(&[
            0,
            3,
            1 << 48,
            (1 << 48) + 8,
            1 << 63,
            usize::MAX - 3,
            usize::MAX,
            1 << 41,
            1 << 47,
        ]);
        let ok = b != 0 && b <= 1 << 48 && b % dsize == 0;
        return (b, ok);
    }
    (SMALL[i.below(SMALL.len())] * dsize, true)
}

const T_SIZE: usize = size_of::<graphed_tensor_desc>();
const P_SIZE: usize = size_of::<graphed_param_desc>();

/// Writes `n` structs of type T at stride `stride` into a fresh buffer.
fn array_of<T: Copy>(items: &[T], stride: usize) -> Vec<u64> {
    let mut buf = vec![0u64; (items.len() * stride).div_ceil(8) + 1];
    for (k, t) in items.iter().enumerate() {
        // SAFETY: element k lies inside buf; stride >= size_of::<T>().
        unsafe {
            ((buf.as_mut_ptr() as *mut u8).add(k * stride) as *mut T).write_unaligned(*t);
            ((buf.as_mut_ptr() as *mut u8).add(k * stride) as *mut usize).write_unaligned(stride);
        }
    }
    buf
}

unsafe extern "C" fn cb_forward(ctx: *const graphed_pass_ctx, ud: *mut c_void) -> i32 {
    callback(ctx, ud, 0)
}
unsafe extern "C" fn cb_backward(ctx: *const graphed_pass_ctx, ud: *mut c_void) -> i32 {
    callback(ctx, ud, 1)
}
unsafe extern "C" fn cb_wgrad(ctx: *const graphed_pass_ctx, ud: *mut c_void) -> i32 {
    callback(ctx, ud, 2)
}
unsafe extern "C" fn cb_hook(ctx: *const graphed_pass_ctx, ud: *mut c_void) -> i32 {
    callback(ctx, ud, 9)
}

fn op_add_callable() {
    let wd = w();
    let i = &wd.input;
    let t = target();
    let mut tensors: Vec<Vec<graphed_tensor_desc>> = vec![Vec::new(), Vec::new()];
    let mut models: Vec<Vec<Tensor>> = vec![Vec::new(), Vec::new()];
    let mut conv_err: Option<graphed_status> = None;
    let mut check_err: Option<graphed_status> = None;
    let mut shapes: Vec<Vec<i64>> = Vec::new();
    for (side, list) in tensors.iter_mut().enumerate() {
        for _ in 0..i.pick(&[1, 1, 2, 0, 3]) {
            let mut d = graphed_tensor_desc_default();
            d.dtype = i.pick(&[0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
            let ds = dtype_size(d.dtype);
            let (bytes, ok) = fuzz_bytes(ds);
            d.bytes = bytes;
            d.requires_grad = i.pick(&[1, 0, 1, 2]);
            // 8: an unknown bit; 4: rebound (an input, or an output's
            // grad-output; the host backend refuses at capture and copies,
            // which the replay checks below see). Chained inputs (2) are
            // covered by tests/chain_and_steps.rs, not here.
            d.flags = i.pick(&[0, 0, 0, 1, 8, 4, 5]);
            if d.flags & 1 != 0 && bytes > 1 << 20 {
                // External memory must hold the buffer: keep those small.
                d.flags &= !1;
            }
            let mut shape_err = None;
            match i.below(8) {
                0 => {
                    // A shape that holds the bytes.
                    let elems = bytes / ds.max(1);
                    shapes.push(vec![1, elems as i64]);
                }
                1 => shapes.push(vec![2, 3, -1]),
                2 => shapes.push(vec![i64::MAX, i64::MAX]),
                3 => {
                    d.ndim = 2;
                    shape_err = Some(S::NullPointer);
                }
                _ => {}
            }
            // In the library's order: flags, shape, dtype, requires_grad.
            if d.flags & !5 != 0 {
                conv_err.get_or_insert(S::InvalidArgument);
            }
            if let Some(e) = shape_err {
                conv_err.get_or_insert(e);
            }
            if d.dtype > 8 || d.requires_grad > 1 {
                conv_err.get_or_insert(S::InvalidArgument);
            }
            let valid = ok && d.dtype <= 8 && bytes % ds == 0;
            if !valid {
                check_err.get_or_insert(S::InvalidArgument);
            }
            if side == 0 && i.chance(40) && valid && bytes <= 1 << 20 {
                d.sample = mem(bytes, 0) as *const c_void;
            }
            models[side].push(Tensor {
                bytes,
                grad: d.requires_grad == 1,
                external: d.flags & 1 != 0,
            });
            list.push(d);
        }
    }
    // Shapes: attach each fuzzed shape to a random tensor (its product is
    // checked against the bytes).
    let mut shape_store: Vec<Vec<i64>> = Vec::new();
    for s in shapes {
        let side = i.below(2);
        if tensors[side].is_empty() {
            continue;
        }
        let k = i.below(tensors[side].len());
        if tensors[side][k].ndim != 0 {
            continue;
        }
        let d = &mut tensors[side][k];
        let ds = dtype_size(d.dtype);
        let prod = s.iter().try_fold(
            1u64,
            |a, &x| if x < 0 { None } else { a.checked_mul(x as u64) },
        );
        let holds = prod.and_then(|p| p.checked_mul(ds as u64)) == Some(d.bytes as u64);
        d.ndim = s.len() as u32;
        d.shape = s.as_ptr();
        if !holds && d.dtype <= 8 {
            check_err.get_or_insert(S::InvalidArgument);
        }
        shape_store.push(s);
    }
    let mut params = Vec::new();
    let mut pmodels = Vec::new();
    let mut param_err: Option<graphed_status> = None;
    for _ in 0..i.pick(&[1, 2, 0, 3, 1]) {
        let mut p = graphed_param_desc_default();
        p.dtype = i.pick(&[0, 0, 1, 2, 3, 6, 9]);
        let ds = dtype_size(p.dtype);
        let (bytes, ok) = fuzz_bytes(ds);
        p.bytes = bytes;
        p.flags = i.pick(&[0, 0, 0, 1, 2, 3, 4]);
        if bytes > 1 << 20 {
            p.flags &= !2;
        }
        p.policy = i.pick(&[0, 0, 1, 2, 3, 4, 4, 5]);
        p.requires_grad = i.pick(&[1, 1, 0, 2]);
        if !i.chance(8) {
            p.data = mem(bytes.min(1 << 16), 0) as *mut c_void;
        }
        if p.dtype > 8 || p.requires_grad > 1 || p.flags > 3 || p.policy > 4 {
            conv_err.get_or_insert(S::InvalidArgument);
        }
        let valid = ok
            && bytes % ds == 0
            && !(p.policy == 4 && !matches!(p.dtype, 0..=2))
            && !(p.requires_grad == 0 && p.policy != 0);
        if !valid {
            param_err.get_or_insert(S::InvalidArgument);
        } else if p.data.is_null() {
            param_err.get_or_insert(S::NullPointer);
        }
        pmodels.push(Param {
            bytes,
            dtype: p.dtype,
            grad: p.requires_grad == 1,
            delayed: p.flags & 1 != 0,
            external: p.flags & 2 != 0,
            policy: p.policy,
        });
        params.push(p);
    }
    let wgrad = i.chance(50);
    let idx_sess = match t {
        Target::Live(k) | Target::Dead(k) => k,
        _ => usize::MAX,
    };
    let n_callables = if idx_sess != usize::MAX {
        wd.sessions.borrow()[idx_sess].callables.len()
    } else {
        0
    };
    let scratch = i.pick(&[0, 0, 64, 1000, 4096]);
    let mk = |hook: bool| {
        let b = Box::new(Cb {
            sess: idx_sess,
            callable: n_callables,
            scratch,
            hook,
        });
        let p = &*b as *const Cb as *mut c_void;
        wd.cbs.borrow_mut().push(b);
        p
    };
    let mut d = graphed_callable_desc_default();
    d.forward = Some(cb_forward);
    d.backward = Some(cb_backward);
    if wgrad {
        d.wgrad = Some(cb_wgrad);
    }
    d.user_data = mk(false);
    if i.chance(60) {
        d.pre_hook = Some(cb_hook);
        d.post_hook = Some(cb_hook);
        d.hook_data = mk(true);
    }
    let names: [&[u8]; 3] = [b"layer\0", b"\xc3\x28\0", b"\0"];
    let name_pick = i.below(8);
    if name_pick < 3 {
        d.name = names[name_pick].as_ptr().cast();
    }
    // Arrays, with their strides.
    let stride_t = T_SIZE + 8 * i.pick(&[0, 0, 0, 1, 2]);
    let stride_p = P_SIZE + 8 * i.pick(&[0, 0, 0, 1]);
    let tin = array_of(&tensors[0], stride_t);
    let tout = array_of(&tensors[1], stride_t);
    let mut tpar = array_of(&params, stride_p);
    d.num_inputs = tensors[0].len();
    d.inputs = tin.as_ptr().cast();
    d.num_outputs = tensors[1].len();
    d.outputs = tout.as_ptr().cast();
    d.num_params = params.len();
    d.params = tpar.as_ptr().cast();
    let mut array_err: Option<graphed_status> = None;
    match i.below(24) {
        0 => {
            d.inputs = null();
            d.num_inputs = d.num_inputs.max(1);
            array_err = Some(S::NullPointer);
        }
        1 if !params.is_empty() => {
            // SAFETY: the first element's magic, inside tpar.
            unsafe { ((tpar.as_mut_ptr() as *mut u8).add(8) as *mut u32).write_unaligned(0xdead) };
            array_err = Some(S::BadStruct);
        }
        2 if params.len() > 1 => {
            // SAFETY: the second element's struct_size, inside tpar.
            unsafe {
                ((tpar.as_mut_ptr() as *mut u8).add(stride_p) as *mut usize)
                    .write_unaligned(stride_p + 8)
            };
            array_err = Some(S::BadStruct);
        }
        3 if !params.is_empty() => {
            d.num_params = usize::MAX / 64;
            array_err = Some(S::InvalidArgument);
        }
        4 if !params.is_empty() => {
            // SAFETY: as in 1.
            unsafe { (tpar.as_mut_ptr() as *mut usize).write_unaligned(16) };
            array_err = Some(S::BadStruct);
        }
        _ => {}
    }
    let mut cb_err = None;
    match i.below(24) {
        0 => {
            d.forward = None;
            cb_err = Some(S::NullPointer);
        }
        1 => {
            d.backward = None;
            cb_err = Some(S::NullPointer);
        }
        _ => {}
    }
    let mut desc_buf = vec![0u64; size_of::<graphed_callable_desc>() / 8 + 2];
    let shape = i.below(20);
    let mut struct_err = None;
    match shape {
        0 => {
            d.magic = 0x6772_0001;
            struct_err = Some(S::BadStruct);
        }
        1 => {
            d.struct_size = 100;
            struct_err = Some(S::BadStruct);
        }
        2 => d.struct_size = usize::MAX,
        _ => {}
    }
    // shape 5: the descriptor at an address 4 bytes off its alignment.
    let off = if shape == 5 { 4 } else { 0 };
    // SAFETY: desc_buf holds the struct with 16 spare bytes.
    unsafe {
        ((desc_buf.as_mut_ptr() as *mut u8).add(off) as *mut graphed_callable_desc)
            .write_unaligned(d)
    };
    let desc_arg: *const graphed_callable_desc = if shape == 3 {
        null()
    } else {
        // SAFETY: inside desc_buf.
        unsafe { (desc_buf.as_ptr() as *const u8).add(off) }.cast()
    };
    let out_null = shape == 4;

    // Expected, in graphed's order.
    let mut want = None;
    first(&mut want, t.lookup());
    first(&mut want, out_null.then_some(S::NullPointer));
    first(&mut want, desc_arg.is_null().then_some(S::NullPointer));
    first(&mut want, struct_err);
    first(&mut want, (name_pick == 1).then_some(S::InvalidArgument));
    first(&mut want, array_err);
    first(&mut want, cb_err);
    first(&mut want, conv_err);
    first(&mut want, t.lock());
    let state = if let Target::Live(k) = t {
        Some(wd.sessions.borrow()[k].st)
    } else {
        None
    };
    match state {
        Some(St::Captured) => first(&mut want, Some(S::WrongState)),
        Some(St::Reset) => first(&mut want, Some(S::SessionReset)),
        _ => {}
    }
    first(&mut want, check_err);
    first(&mut want, param_err);
    if wgrad && !pmodels.iter().any(|p| p.grad) {
        first(&mut want, Some(S::InvalidArgument));
    }
    let mut index: u32 = 0xabcd;
    trace!("add_callable {t:?} inputs {:?} outputs {:?} params {pmodels:?} wgrad {wgrad} want {want:?}", models[0], models[1]);
    mark();
    // SAFETY: every pointer is to a live local buffer of the stated size.
    let st = unsafe {
        graphed_session_add_callable(
            t.ptr(),
            desc_arg,
            if out_null { null_mut() } else { &mut index },
        )
    };
    drop((tin, tout, tpar, desc_buf, shape_store));
    expect(
        st,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_add_callable",
        "descriptor",
    );
    if st != S::Ok {
        assert_eq!(index, 0xabcd, "index written on failure");
        return;
    }
    let Target::Live(k) = t else { unreachable!() };
    assert_eq!(index as usize, n_callables, "callable index");
    wd.sessions.borrow_mut()[k].callables.push(Callable {
        inputs: models[0].clone(),
        outputs: models[1].clone(),
        params: pmodels,
        wgrad,
    });
}

fn op_set_param_flags() {
    let wd = w();
    let i = &wd.input;
    let t = target();
    let c = i.below(4) as u32;
    let p = i.below(4) as u32;
    let mut flags = i.pick(&[0, 1, 2, 3, 4, 0x80]);
    if let Target::Live(k) = t {
        // External memory must hold the buffer: keep those small.
        let big = wd.sessions.borrow()[k]
            .callables
            .get(c as usize)
            .and_then(|cl| cl.params.get(p as usize))
            .is_some_and(|pm| pm.bytes > 1 << 20);
        if big {
            flags &= !2;
        }
    }
    let mut want = if flags > 3 {
        Some(S::InvalidArgument)
    } else {
        None
    };
    want = want.or(t.lock());
    let mut ok_model = None;
    if want.is_none() {
        let Target::Live(k) = t else { unreachable!() };
        let ss = wd.sessions.borrow();
        let s = &ss[k];
        want = match s.st {
            St::Captured => Some(S::WrongState),
            St::Reset => Some(S::SessionReset),
            St::Open => match s.callables.get(c as usize) {
                None => Some(S::InvalidArgument),
                Some(cl) if p as usize >= cl.params.len() => Some(S::InvalidArgument),
                Some(_) => {
                    ok_model = Some(k);
                    None
                }
            },
        };
    }
    mark();
    let st = graphed_session_set_param_flags(t.ptr(), c, p, flags);
    expect(
        st,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_set_param_flags",
        "flags",
    );
    if let (S::Ok, Some(k)) = (st, ok_model) {
        let mut ss = wd.sessions.borrow_mut();
        let pm = &mut ss[k].callables[c as usize].params[p as usize];
        pm.delayed = flags & 1 != 0;
        pm.external = flags & 2 != 0;
    }
}

// -------------------------------------------------------------- capture --

/// Whether the model knows the schedule fits the callables, and the
/// microbatches it gives.
fn schedule_fits(s: &Sess) -> Option<bool> {
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
fn huge(s: &Sess) -> bool {
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
fn decide(sess: usize, e: graphed_status) {
    let mut fs = w().frames.borrow_mut();
    if let Some(f) = fs.iter_mut().rev().find(|f| f.sess == sess) {
        f.first.get_or_insert(e);
    }
}

fn op_capture(t: Target) {
    let wd = w();
    let mut want = t.lock();
    let mut pre_only = false;
    let mut lenient_sched = false;
    if want.is_none() {
        let Target::Live(k) = t else { unreachable!() };
        let ss = wd.sessions.borrow();
        let s = &ss[k];
        want = match s.st {
            St::Captured => Some(S::WrongState),
            St::Reset => Some(S::SessionReset),
            St::Open if s.callables.is_empty() => Some(S::WrongState),
            // A flag set after the step was declared made a callable of it
            // external: refused before anything runs.
            St::Open if step_has_external(s) => Some(S::Unsupported),
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
        });
    }
    wd.depth.set(wd.depth.get() + 1);
    trace!("capture {t:?} want {want:?}");
    mark();
    let st = graphed_session_capture(t.ptr());
    trace!("capture {t:?} -> {st:?}");
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
        }
        (Some(f), None) => {
            let bad_step = k.is_some_and(step_lacks_destination);
            let mut ok: Vec<graphed_status> = match f.first {
                Some(e) => vec![e],
                // A step's destinations are checked when it is captured,
                // after every pass.
                None if bad_step => vec![S::InvalidArgument],
                // The measured scratch arena may be too large to allocate.
                None => vec![S::Ok, S::OutOfMemory],
            };
            if lenient_sched && !f.ran {
                ok.push(S::InvalidSchedule);
            }
            if waived("scratch-failed-request-sizes-arena") {
                ok.push(S::OutOfMemory);
            }
            expect(st, &ok, "graphed_session_capture", "capture outcome");
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
        }
        after_capture(k);
    }
    if let Some(k) = k {
        forget_if_gone(k);
    }
}

/// Queries a captured session and checks it against the model.
fn after_capture(k: usize) {
    let wd = w();
    let (h, callables, clone, mb_model) = {
        let s = &wd.sessions.borrow()[k];
        (
            s.h as *mut graphed_session,
            s.callables.clone(),
            s.clone,
            s.mb,
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
    assert_eq!(st.instances, n * mb);
    let wg = callables.iter().filter(|c| c.wgrad).count() as u32;
    assert_eq!(st.graph_count, (2 * n + wg) * mb, "graph count");
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
                        let e = wd
                            .ext
                            .borrow()
                            .get(&(
                                k,
                                c,
                                m,
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
}

/// The host backend rebinds nothing (its tasks are opaque): every input and
/// grad-output reads 0, other roles and wrong counts are refused.
fn rebound_check(h: *mut graphed_session, callables: &[Callable], mb: u32) {
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

fn plan_dump_check(h: *mut graphed_session, captured: bool) {
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

// ------------------------------------------------------------ callbacks --

unsafe extern "C" fn fill_task(data: *mut c_void) {
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
fn own_session_call(k: usize) {
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

fn sync_null() {
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

fn forget_lease(k: usize, token: u64) {
    let mut ls = w().leases.borrow_mut();
    if let Some(at) = ls.iter().position(|l| l.sess == k && l.token == token) {
        let l = ls.remove(at);
        w().stale_leases.borrow_mut().push((l.sess, l.token));
    }
}

/// Releases one lease the model holds for session `k` (from a deleter).
fn release_lease_of(k: usize) {
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

fn release_some_block() {
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
fn externals(cl: &Callable, pass: u32) -> Vec<(u32, usize, usize)> {
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

fn callback(ctx: *const graphed_pass_ctx, ud: *mut c_void, which: u32) -> i32 {
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
fn use_kept() {
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

// -------------------------------------------------------------- replays --

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
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

const FAULTS: [Fault; 20] = [
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

const REF: usize = size_of::<graphed_ref>();

struct RefView {
    ptr: usize,
    bytes: usize,
    kind: u32,
    owner: usize,
    lease: u64,
}

fn read_ref(buf: &[u8], at: usize) -> RefView {
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
fn replay_lenient(pool: usize, custom: bool) -> Vec<graphed_status> {
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
fn check_accumulated(before: &[u8], dst: usize, b: u8, what: &str) {
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

fn f32_add(a: u32, b: u32) -> u32 {
    (f32::from_bits(a) + f32::from_bits(b)).to_bits()
}

/// A forward (0), backward (1) or weight-grad (2) replay. `streams`: the
/// (stream, side stream) a callback replays on.
fn op_replay(t: Target, kind: u32, streams: Option<(usize, usize)>) {
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
        first(&mut want, st0);
        first(&mut want, st1);
        if *strict && !*reuse && want.is_none() {
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
                first(&mut want, Some(S::AliasHeld));
            }
        } else if *strict {
            lenient.push(S::AliasHeld);
        }
        lenient.extend(replay_lenient(*pool, *custom));
    }
    let func = [
        "graphed_forward",
        "graphed_backward",
        "graphed_backward_wgrad",
    ][kind as usize];
    let epoch = EPOCH
        .load(Ordering::Relaxed)
        .wrapping_add(1 + i.below(200) as u8);
    EPOCH.store(epoch, Ordering::Relaxed);
    let _pin = sess.filter(|_| want.is_none()).map(pin);
    trace!("{func} {t:?} c {c} mb {mb} fault {fault:?} streams {s0:x}/{s1:x} want {want:?}");
    mark();
    // SAFETY: every array has the room the call is told about (or is one of
    // the faults graphed must catch before writing).
    let r = unsafe {
        match kind {
            0 => graphed_forward(t.ptr(), args, p1.cast(), n1),
            1 => graphed_backward(t.ptr(), args, p1.cast(), n1, p2.cast(), n2),
            _ => graphed_backward_wgrad(t.ptr(), args, p1.cast(), n1),
        }
    };
    drop(_pin);
    let mut ok = vec![want.unwrap_or(S::Ok)];
    if want.is_none() {
        ok.extend(lenient);
    }
    trace!("{func} -> {r:?}");
    expect(r, &ok, func, &format!("{fault:?}"));
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

// ---------------------------------------------------- buffers and leases --

fn op_buffer() {
    let wd = w();
    let i = &wd.input;
    let retain = i.chance(80);
    let n = wd.blocks.borrow().len();
    let ns = wd.stale_blocks.borrow().len();
    let (h, want, at) = match i.below(8) {
        0 => (0, if retain { S::NullPointer } else { S::Ok }, None),
        1 if ns > 0 => (
            wd.stale_blocks.borrow()[i.below(ns)],
            S::UseAfterDestroy,
            None,
        ),
        2 => {
            // A session handle is not a buffer.
            let ss = wd.sessions.borrow();
            if ss.is_empty() {
                (forged(), S::InvalidArgument, None)
            } else {
                (ss[i.below(ss.len())].h, S::InvalidArgument, None)
            }
        }
        3 => (
            0x67 << 56 | 2 << 48 | 0xFFFF_FFFF_FF00,
            S::InvalidArgument,
            None,
        ),
        _ if n > 0 => {
            let at = i.below(n);
            (wd.blocks.borrow()[at].owner, S::Ok, Some(at))
        }
        _ => (forged(), S::InvalidArgument, None),
    };
    mark();
    let r = if retain {
        graphed_buffer_retain(h as *mut graphed_buffer)
    } else {
        graphed_buffer_release(h as *mut graphed_buffer)
    };
    let func = if retain {
        "graphed_buffer_retain"
    } else {
        "graphed_buffer_release"
    };
    // A stale id of kind "buffer" that was never issued reads as never issued.
    let ok: &[graphed_status] = if want == S::InvalidArgument {
        &[S::InvalidArgument, S::UseAfterDestroy]
    } else {
        &[want]
    };
    expect(r, ok, func, "block");
    if let (S::Ok, Some(at)) = (r, at) {
        let mut bs = wd.blocks.borrow_mut();
        if retain {
            bs[at].refs += 1;
        } else {
            bs[at].refs -= 1;
            if bs[at].refs == 0 {
                let b = bs.remove(at);
                wd.stale_blocks.borrow_mut().push(b.owner);
            }
        }
    }
}

fn op_lease() {
    let wd = w();
    let i = &wd.input;
    let n = wd.leases.borrow().len();
    let t = target();
    let (tok, owner) = match i.below(6) {
        0 | 1 | 2 if n > 0 => {
            let l = &wd.leases.borrow()[i.below(n)];
            (l.token, Some(l.sess))
        }
        3 => {
            let sl = wd.stale_leases.borrow();
            if sl.is_empty() {
                (i.u64(), None)
            } else {
                (sl[i.below(sl.len())].1, None)
            }
        }
        _ => (i.pick(&[0, u64::MAX, 1 << 48 | 1 << 24 | 1, i.u64()]), None),
    };
    // A token is a value: whoever passes the value of a lease the session
    // holds releases it (tokens are unique across sessions, checked where
    // they are handed out).
    let mine = match t {
        Target::Live(k) => wd
            .leases
            .borrow()
            .iter()
            .any(|l| l.sess == k && l.token == tok),
        _ => false,
    };
    let want = t
        .lookup()
        .unwrap_or(if mine { S::Ok } else { S::InvalidArgument });
    mark();
    let r = graphed_lease_release(t.ptr(), tok);
    expect(
        r,
        &[want],
        "graphed_lease_release",
        if owner.is_some() {
            "a token another session may hold"
        } else {
            "forged or stale"
        },
    );
    if r == S::Ok {
        if let Target::Live(k) = t {
            forget_lease(k, tok);
        }
    }
}

// -------------------------------------------------------------- queries --

fn op_stats() {
    let wd = w();
    let i = &wd.input;
    let t = target();
    let mut buf = vec![0u64; size_of::<graphed_session_stats>() / 8 + 4];
    let mut st = graphed_session_stats_default();
    let mut struct_err = None;
    match i.below(8) {
        0 => {
            st.magic = 0;
            struct_err = Some(S::BadStruct);
        }
        1 => {
            st.struct_size = 100;
            struct_err = Some(S::BadStruct);
        }
        2 => st.struct_size = size_of::<graphed_session_stats>() + 16,
        3 => struct_err = Some(S::NullPointer),
        _ => {}
    }
    // SAFETY: buf holds the struct.
    unsafe { (buf.as_mut_ptr() as *mut graphed_session_stats).write(st) };
    let p: *mut graphed_session_stats = if struct_err == Some(S::NullPointer) {
        null_mut()
    } else {
        buf.as_mut_ptr().cast()
    };
    let want = t.lock().or(struct_err).unwrap_or(S::Ok);
    let before = buf.clone();
    mark();
    // SAFETY: p is NULL or a stats struct with spare room.
    let r = unsafe { graphed_session_stats_get(t.ptr(), p) };
    expect(r, &[want], "graphed_session_stats_get", "stats");
    if r != S::Ok {
        assert_eq!(buf, before, "stats written on failure");
        return;
    }
    // SAFETY: the struct graphed filled.
    let got = unsafe { (buf.as_ptr() as *const graphed_session_stats).read() };
    assert_eq!(got.struct_size, st.struct_size, "stats header overwritten");
    assert!(
        buf[size_of::<graphed_session_stats>() / 8..]
            .iter()
            .all(|&x| x == 0),
        "stats written past the struct"
    );
    let Target::Live(k) = t else { unreachable!() };
    check_stats(k, &got);
}

fn check_stats(k: usize, got: &graphed_session_stats) {
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

fn op_query() {
    let wd = w();
    let i = &wd.input;
    let t = target();
    let model = if let Target::Live(k) = t {
        let s = &wd.sessions.borrow()[k];
        Some((s.st, s.callables.clone(), s.mb))
    } else {
        None
    };
    let state_err = |st: St| match st {
        St::Open => Some(S::WrongState),
        St::Reset => Some(S::SessionReset),
        St::Captured => None,
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
                    match cls.get(c as usize) {
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

// ---------------------------------------------------------- reset, destroy --

fn drop_session_state(k: usize) {
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

fn op_reset(t: Target) {
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

fn op_destroy(t: Target) {
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

// ------------------------------------------------------------ schedules --

fn op_schedule_helpers() {
    let i = &w().input;
    let n = i.below(12);
    let order: Vec<f64> = (0..n)
        .map(|_| {
            i.pick(&[
                1.0,
                2.0,
                -1.0,
                -2.0,
                -1.5,
                -2.5,
                0.0,
                0.5,
                -0.5,
                4096.0,
                -4096.5,
                4097.0,
                f64::NAN,
                f64::INFINITY,
                1e300,
                -3.0,
                3.0,
            ])
        })
        .collect();
    let stride = i.pick(&[8usize, 8, 12, 16, 4, 6]);
    let mut out = vec![0xabu8; n * stride.max(8) + 8];
    mark();
    // SAFETY: room for n steps of `stride` bytes (or refused).
    let r = unsafe {
        graphed_schedule_from_te_order(order.as_ptr(), n, out.as_mut_ptr().cast(), stride)
    };
    post(r, "graphed_schedule_from_te_order");
    let valid_stride = stride >= 8 && stride % 4 == 0;
    if !valid_stride {
        assert_eq!(r, S::InvalidArgument);
    }
    if r != S::Ok {
        assert!(out.iter().all(|&b| b == 0xab));
        return;
    }
    let mut chunks = 0u32;
    let mut mbs = 0u32;
    let mut layers = [0xeeu32; 8];
    let mut firsts = [0xeeu32; 8];
    let ncall = i.below(6) as u32;
    let cap = i.below(9);
    let want_arrays = i.chance(128);
    // SAFETY: the steps just written; outputs are locals.
    let r = unsafe {
        graphed_schedule_shape(
            out.as_ptr().cast(),
            n,
            stride,
            null(),
            0,
            ncall,
            &mut chunks,
            &mut mbs,
            if want_arrays {
                layers.as_mut_ptr()
            } else {
                null_mut()
            },
            if want_arrays {
                firsts.as_mut_ptr()
            } else {
                null_mut()
            },
            cap,
        )
    };
    post(r, "graphed_schedule_shape");
    if r == S::Ok {
        assert!(chunks >= 1 && mbs >= 1);
        if want_arrays {
            let sum: u32 = layers[..chunks as usize].iter().sum();
            assert_eq!(sum, ncall);
        }
    } else {
        assert_eq!((chunks, mbs), (0, 0));
    }
}

fn op_misc() {
    let i = &w().input;
    let code = i.pick(&[0u32, 3, 19, 20, 1000, u32::MAX]);
    // SAFETY: static string.
    let name = unsafe { CStr::from_ptr(graphed_status_name(code)) }
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(name == "GRAPHED_STATUS_UNKNOWN", code > 19);
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
}

// ---------------------------------------------------------------- steps --

/// Whether a callable of a declared step has external buffers.
fn step_has_external(s: &Sess) -> bool {
    s.steps
        .iter()
        .flat_map(|st| &st.callables)
        .any(|&c| callable_is_external(&s.callables[c]))
}

fn callable_is_external(cl: &Callable) -> bool {
    cl.inputs.iter().chain(&cl.outputs).any(|t| t.external) || cl.params.iter().any(|p| p.external)
}

/// Whether a declared step of session `k` lacks a destination that a
/// parameter's frozen policy (COPY_INTO, ACCUMULATE_INTO) needs: capture
/// then fails with INVALID_ARGUMENT.
fn step_lacks_destination(k: usize) -> bool {
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
fn step_graphs(k: usize) -> u32 {
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

/// Mostly a live session that `fits` (when there is one), else any target:
/// the step ops need sessions in particular states to get far.
fn target_where(fits: impl Fn(&Sess) -> bool) -> Target {
    let i = &w().input;
    let ss = w().sessions.borrow();
    let good: Vec<usize> = (0..ss.len())
        .filter(|&k| ss[k].alive && fits(&ss[k]))
        .collect();
    drop(ss);
    if !good.is_empty() && !i.chance(50) {
        Target::Live(good[i.below(good.len())])
    } else {
        target()
    }
}

fn op_add_step() {
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
            (!matches!(sched, Some(None))).then_some(S::Unsupported),
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
            first(&mut want, external.then_some(S::Unsupported));
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

fn op_step_replay() {
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
    let epoch = EPOCH
        .load(Ordering::Relaxed)
        .wrapping_add(1 + i.below(200) as u8);
    EPOCH.store(epoch, Ordering::Relaxed);
    let _pin = sess.filter(|_| want.is_none()).map(pin);
    trace!("step_replay {t:?} step {step} n {n}/{np} want {want:?}");
    mark();
    // SAFETY: args and room for n refs of `stride` bytes (or one of the
    // faults graphed must catch before writing).
    let r = unsafe { graphed_step_replay(t.ptr(), args, p.cast(), n) };
    drop(_pin);
    let mut ok = vec![want.unwrap_or(S::Ok)];
    if want.is_none() {
        ok.extend(lenient);
    }
    expect(r, &ok, "graphed_step_replay", "step");
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
fn forget_if_gone(k: usize) {
    if !w().sessions.borrow()[k].alive {
        drop_session_state(k);
    }
}

// ------------------------------------------------------- other exports --

fn op_destroy_when_idle(t: Target) {
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

fn op_arity() {
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

fn op_driver_version() {
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

/// graphed_buffer_release_on: the block given back ordered on another
/// stream (NULL: the default one, or a host stream a capture made).
fn op_release_on() {
    let wd = w();
    let i = &wd.input;
    let n = wd.blocks.borrow().len();
    let (stream, stream_err) = stream_arg(true);
    let (h, mut want, at) = match i.below(6) {
        0 => (0, S::Ok, None),
        1 => (forged(), S::InvalidArgument, None),
        2 if !wd.stale_blocks.borrow().is_empty() => {
            let sb = wd.stale_blocks.borrow();
            (sb[i.below(sb.len())], S::UseAfterDestroy, None)
        }
        _ if n > 0 => {
            let at = i.below(n);
            (wd.blocks.borrow()[at].owner, S::Ok, Some(at))
        }
        _ => (0, S::Ok, None),
    };
    // The stream is only used when the last reference goes.
    let last = at.is_some_and(|a| wd.blocks.borrow()[a].refs == 1);
    if last && want == S::Ok {
        if let Some(e) = stream_err {
            want = e;
        }
    }
    mark();
    let r = graphed_buffer_release_on(h as *mut graphed_buffer, stream as graphed_stream);
    let ok: &[graphed_status] = if want == S::InvalidArgument {
        &[S::InvalidArgument, S::UseAfterDestroy]
    } else {
        &[want]
    };
    trace!("release_on 0x{h:x} stream 0x{stream:x} last {last} want {want:?} -> {r:?}");
    expect(r, ok, "graphed_buffer_release_on", "block");
    if let (S::Ok, Some(at)) = (r, at) {
        let mut bs = wd.blocks.borrow_mut();
        bs[at].refs -= 1;
        if bs[at].refs == 0 {
            let b = bs.remove(at);
            wd.stale_blocks.borrow_mut().push(b.owner);
        }
    }
}

/// graphed_schedule_passes: the sequential expansion checked exactly, a
/// schedule's checked against its own count, and bad arguments.
fn op_schedule_passes() {
    let i = &w().input;
    // Sometimes a count whose passes could not be built.
    let huge = i.chance(10);
    let ncall = if huge { u32::MAX } else { i.below(5) as u32 };
    let wg: Vec<u32> = if huge {
        Vec::new()
    } else {
        (0..ncall).map(|_| i.pick(&[0, 0, 1, 2])).collect()
    };
    let wg_null = huge || i.chance(60);
    let sched = i.chance(100);
    let steps: Vec<u32> = if sched {
        (0..1 + i.below(8))
            .flat_map(|_| [i.pick(&[0, 1, 2, 0, 1, 5]), i.pick(&[0, 1, 0, 2])])
            .collect()
    } else {
        Vec::new()
    };
    let cap = i.below(12);
    let pass_size = i.pick(&[12usize, 12, 12, 16, 8, 13]);
    let passes_null = i.chance(40);
    let count_null = i.chance(8);
    // Sometimes a layer split: 1, NULL with a count (refused), 2, one
    // layer for one chunk (refused without a schedule).
    let split_pick = i.below(16);
    let split = [1u32];
    let (split_ptr, split_n) = match split_pick {
        1 => (null(), 2),
        2 => (split.as_ptr(), 1),
        _ => (null(), 0),
    };
    let mut out = vec![0xabu8; cap * pass_size.max(12) + 16];
    let mut count = 0x77usize;
    mark();
    // SAFETY: every array holds the stated count; `out` has room for `cap`
    // passes of `pass_size` bytes.
    let r = unsafe {
        graphed_schedule_passes(
            if sched { steps.as_ptr().cast() } else { null() },
            steps.len() / 2,
            8,
            split_ptr,
            split_n,
            if wg_null { null() } else { wg.as_ptr() },
            ncall,
            if passes_null {
                null_mut()
            } else {
                out.as_mut_ptr().cast()
            },
            cap,
            pass_size,
            if count_null { null_mut() } else { &mut count },
        )
    };
    post(r, "graphed_schedule_passes");
    let bad_flag = !wg_null && wg.iter().any(|&x| x > 1);
    let has = |c: u32| !wg_null && wg[c as usize] == 1;
    // The sequential expansion: every forward, then every backward in
    // reverse, each weight-grad right after its backward (none for a count
    // whose passes cannot be built: the call refuses it).
    let built = if huge { 0 } else { ncall };
    let mut want: Vec<(u32, u32)> = (0..built).map(|c| (c, 0)).collect();
    for c in (0..built).rev() {
        want.push((c, 1));
        if has(c) {
            want.push((c, 2));
        }
    }
    // The element size is checked whenever there is an array; its
    // alignment only when something is written.
    let bad_size =
        !passes_null && (pass_size < 12 || (pass_size % 4 != 0 && want.len().min(cap) > 0));
    if count_null {
        assert_eq!(r, S::NullPointer);
    } else if huge {
        assert_eq!(r, S::InvalidArgument);
    } else if bad_flag {
        assert_eq!(r, S::InvalidArgument);
    } else if split_pick == 1 {
        assert_eq!(r, S::InvalidArgument, "a NULL layer split with a count");
    } else if split_pick == 2 && !sched {
        assert_eq!(r, S::InvalidSchedule, "a layer split without a schedule");
    } else if !sched {
        assert_eq!(r, if bad_size { S::InvalidArgument } else { S::Ok });
    }
    if r != S::Ok {
        assert_eq!(count, 0x77, "count written on failure");
        assert!(out.iter().all(|&b| b == 0xab), "passes written on failure");
        return;
    }
    if !sched {
        assert_eq!(count, want.len(), "sequential pass count");
        if !passes_null {
            for (j, &(c, p)) in want.iter().take(cap).enumerate() {
                let at = j * pass_size;
                let word =
                    |o: usize| u32::from_ne_bytes(out[at + o..at + o + 4].try_into().unwrap());
                assert_eq!(
                    (word(0), word(4), word(8)),
                    (c, 0, p),
                    "sequential pass {j}"
                );
            }
        }
    }
    if !passes_null {
        let written = count.min(cap) * pass_size;
        assert!(
            out[written..].iter().all(|&b| b == 0xab),
            "passes written past min(count, capacity)"
        );
    }
}

// --------------------------------------------------------------- checks --

/// Clones stay what they were until released, whatever ran since.
fn check_clones() {
    for b in w().blocks.borrow().iter() {
        for &(p, n, v) in &b.grads {
            assert!(
                all_bytes(p, n, v),
                "a held clone changed before its release"
            );
        }
    }
}

fn check_all_stats() {
    let wd = w();
    let n = wd.sessions.borrow().len();
    for k in 0..n {
        let (alive, h) = {
            let s = &wd.sessions.borrow()[k];
            (s.alive, s.h)
        };
        if !alive {
            continue;
        }
        let mut st = graphed_session_stats_default();
        // SAFETY: a full struct.
        let r = unsafe { graphed_session_stats_get(h as *mut _, &mut st) };
        expect(r, &[S::Ok], "graphed_session_stats_get", "idle session");
        check_stats(k, &st);
    }
}

/// Releases everything, destroys every session, and checks that nothing of
/// graphed's is left.
fn teardown() {
    let wd = w();
    loop {
        let b = wd.blocks.borrow_mut().pop();
        let Some(b) = b else { break };
        for _ in 0..b.refs {
            assert_eq!(
                graphed_buffer_release(b.owner as *mut _),
                S::Ok,
                "{}",
                msg()
            );
        }
    }
    let n = wd.sessions.borrow().len();
    // Destroy in a fuzzed order.
    let mut order: Vec<usize> = (0..n).collect();
    for j in (1..n).rev() {
        order.swap(j, wd.input.below(j + 1));
    }
    for k in order {
        let (alive, h) = {
            let s = &wd.sessions.borrow()[k];
            (s.alive, s.h)
        };
        if alive {
            assert_eq!(
                graphed_session_destroy(h as *mut _),
                S::Ok,
                "teardown: {}",
                msg()
            );
            wd.sessions.borrow_mut()[k].alive = false;
        }
    }
    for kind in [
        Kind::Session,
        Kind::Buffer,
        Kind::Scratch,
        Kind::Capture,
        Kind::HostStream,
    ] {
        assert_eq!(
            table::count(kind),
            0,
            "{} handles left after every session was destroyed",
            kind.name()
        );
    }
    assert!(
        wd.allocs.borrow().is_empty(),
        "clone_alloc memory never given back through clone_free"
    );
}

fn run(data: &[u8]) {
    let world = World {
        input: Input {
            data: data.to_vec(),
            pos: Cell::new(0),
        },
        sessions: RefCell::default(),
        mem: RefCell::default(),
        fills: RefCell::default(),
        cbs: RefCell::default(),
        ctxs: RefCell::default(),
        ext: RefCell::default(),
        blocks: RefCell::default(),
        stale_blocks: RefCell::default(),
        leases: RefCell::default(),
        stale_leases: RefCell::default(),
        kept_scratch: RefCell::default(),
        kept_capture: RefCell::default(),
        kept_streams: RefCell::default(),
        allocs: RefCell::default(),
        frames: RefCell::default(),
        pinned: RefCell::default(),
        attempts: Cell::new(0),
        depth: Cell::new(0),
        pools: Cell::new(0),
    };
    WORLD.with(|c| c.set(&world));
    let i = &world.input;
    let mut ops = 0;
    while !i.done() && ops < 200 {
        ops += 1;
        let op = i.byte() % 24;
        trace!("op {op}");
        match op {
            0 | 1 => op_create(),
            2 | 3 | 4 => op_add_callable(),
            5 => op_set_param_flags(),
            // Sessions with steps are the rarest to capture: preferred.
            6 | 7 => op_capture(target_where(|s| s.st == St::Open && !s.steps.is_empty())),
            8 | 9 | 10 => op_replay(target(), 0, None),
            11 | 12 => op_replay(target(), 1, None),
            13 => op_replay(target(), 2, None),
            14 | 15 => op_buffer(),
            16 => op_lease(),
            17 => op_stats(),
            18 => op_query(),
            19 => op_reset(target()),
            20 => op_destroy(target()),
            21 => op_schedule_helpers(),
            22 => use_kept(),
            _ => match i.below(12) {
                0..=2 => op_add_step(),
                3..=5 => op_step_replay(),
                6 => op_destroy_when_idle(target()),
                7 => op_arity(),
                8 => op_driver_version(),
                9 => op_release_on(),
                10 => op_schedule_passes(),
                _ => op_misc(),
            },
        }
        assert!(world.frames.borrow().is_empty() && world.pinned.borrow().is_empty());
        check_clones();
        check_all_stats();
    }
    teardown();
    WORLD.with(|c| c.set(null()));
    drop(world);
}

fuzz_target!(|data: &[u8]| {
    run(data);
});
