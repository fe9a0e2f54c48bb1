//! The model: what the target knows of every session, callable, step,
//! clone block, lease and in-callback handle, and the harness memory the
//! callbacks write (seeded bytes, so that one replay's results can be told
//! from another's).

use super::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum St {
    Open,
    Captured,
    Reset,
}

#[derive(Clone, Debug)]
pub struct Tensor {
    pub bytes: usize,
    pub grad: bool,
    pub external: bool,
    /// GRAPHED_TENSOR_FLAGS_DYNAMIC.
    pub dynamic: bool,
}

#[derive(Clone, Debug)]
pub struct Param {
    pub bytes: usize,
    pub dtype: u32,
    pub grad: bool,
    pub delayed: bool,
    pub external: bool,
    pub policy: u32,
    /// GRAPHED_PARAM_FLAGS_REBIND: capture decides whether it can move
    /// (never on the host backend, whose user tasks are opaque).
    pub rebind: bool,
    /// Where it was registered: the address its graphs read.
    pub data: usize,
}

impl Param {
    /// The policy capture freezes (0: no gradient).
    pub fn resolved(&self, clone: bool) -> u32 {
        match (self.grad, self.policy) {
            (false, _) => 0,
            (true, 0) if self.delayed || !clone => 2,
            (true, 0) => 1,
            (true, p) => p,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Callable {
    pub inputs: Vec<Tensor>,
    pub outputs: Vec<Tensor>,
    pub params: Vec<Param>,
    pub wgrad: bool,
    /// Its bucket sizes (empty: none).
    pub buckets: Vec<u64>,
}

/// A schedule the model understands: all forwards, then all backwards
/// (each followed by its weight-grad when `wgrad`).
#[derive(Clone, Debug)]
pub struct Sched {
    pub chunks: usize,
    pub mb: usize,
    pub wgrad: bool,
    pub layers: Option<Vec<u32>>,
}

pub struct Sess {
    pub h: usize,
    pub alive: bool,
    pub st: St,
    pub strict: bool,
    pub clone: bool,
    pub reuse: bool,
    pub warmup: u32,
    /// None: a fuzzed schedule of unknown validity (or none: Some(default)).
    pub sched: Option<Option<Sched>>,
    pub mb: u32,
    pub pool: usize,
    pub callables: Vec<Callable>,
    pub custom_alloc: bool,
    pub clone_slots: u32,
    /// The capture attempt whose graphs (and side stream) are live.
    pub live_attempt: Option<u64>,
    /// Steps declared (graphed_session_add_step), in order.
    pub steps: Vec<StepModel>,
    /// bucket_choice_on_device (args.device_size accepted).
    pub bucket_device: bool,
    /// Per callable, the rows of its last successful forward replay since
    /// capture (bucketed callables only).
    pub last_fwd: Vec<Option<FRows>>,
    /// Callables released since capture (graphed_session_release_callable).
    pub released: Vec<usize>,
    /// Passes run since capture that chose on the device a size above the
    /// largest bucket (stats.bucket_overflows).
    pub overflows: u64,
    /// Debug mode (graphed_session_config.debug): replays check for an
    /// error before and after each pass; steps replay pass by pass where
    /// they can.
    pub debug: bool,
}

/// The rows a replay of a bucketed callable runs: chosen on the host (its
/// size) or on the device (true: a size above the largest bucket, for
/// which the pass writes zeros).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum FRows {
    Host(u64),
    Device(bool),
}

/// The bucket a replay of `cl` running `rows` runs: the smallest that holds
/// the rows the host chose (0 without buckets, and when the device chooses,
/// which it never does over external buffers).
pub fn bucket_run(cl: &Callable, rows: Option<FRows>) -> u32 {
    match rows {
        Some(FRows::Host(n)) => cl.buckets.iter().position(|&b| b >= n).unwrap_or(0) as u32,
        _ => 0,
    }
}

/// Bucket count of a callable as instances count them (1 without
/// buckets).
pub fn bucket_count(cl: &Callable) -> u32 {
    cl.buckets.len().max(1) as u32
}

/// The instance number of (callable `c`, microbatch `mb`, bucket `b`) in a
/// session of `callables` captured for `microbatches`: callable by
/// callable, microbatch by microbatch, bucket by bucket.
pub fn instance_number(callables: &[Callable], microbatches: u32, c: usize, mb: u32, b: u32) -> u32 {
    let first: u32 = callables[..c]
        .iter()
        .map(|cl| microbatches * bucket_count(cl))
        .sum();
    first + mb * bucket_count(&callables[c]) + b
}

/// The position of pass `pass` of (callable `c`, bucket `b`) in the default
/// order (no schedule): every forward in registration order, then every
/// backward in reverse, each weight-grad after its backward; bucket round
/// by bucket round, round r holding the callables with more than r
/// buckets. None: no such pass.
pub fn default_position(callables: &[Callable], c: usize, b: u32, pass: u32) -> Option<u32> {
    let n = callables.len();
    let rounds = callables.iter().map(bucket_count).max().unwrap_or(1);
    let forwards = (0..n).map(|k| (k, 0u32));
    let backwards = (0..n).rev().flat_map(|k| {
        let wgrad = callables[k].wgrad.then_some((k, 2u32));
        std::iter::once((k, 1u32)).chain(wgrad)
    });
    let one: Vec<(usize, u32)> = forwards.chain(backwards).collect();
    let mut pos = 0;
    for r in 0..rounds {
        for &(k, p) in &one {
            if r >= bucket_count(&callables[k]) {
                continue;
            }
            if (k, r, p) == (c, b, pass) {
                return Some(pos);
            }
            pos += 1;
        }
    }
    None
}

/// A declared step: its callables, one destination per parameter of
/// theirs, in order (0: none), its microbatch count, its copies in and
/// out (graphed_step_io, into memory of `mem`), and whether it loops on
/// the device (GRAPHED_STEP_LOOP_WHILE: `microbatches` is then the most a
/// replay runs).
#[derive(Clone, Debug)]
pub struct StepModel {
    pub callables: Vec<usize>,
    pub dsts: Vec<usize>,
    pub microbatches: u32,
    pub io: Vec<IoModel>,
    pub device_loop: bool,
    /// Its capture hook as the library read it: 0 none, 1 fine, 2 failing
    /// before a capture, 3 failing after (see `step_hook`).
    pub hook: usize,
}

impl StepModel {
    /// Whether its graph loops over microbatches or copies data (no
    /// pass-by-pass replay then).
    pub fn looped(&self) -> bool {
        self.microbatches > 1 || !self.io.is_empty() || self.device_loop
    }
}

/// A graphed_step_io entry as the library reads it.
#[derive(Clone, Debug)]
pub struct IoModel {
    pub callable: u32,
    pub role: u32,
    pub index: u32,
    pub ptr: usize,
    pub stride: usize,
}

/// A capture call in progress.
pub struct Frame {
    pub sess: usize,
    pub attempt: u64,
    pub stream: usize,
    /// A callback (not a hook) of the capture phase is running: the stream
    /// is capturing.
    pub capturing: bool,
    pub invalidated: bool,
    pub scratch_fail: bool,
    /// Something made this capture's scratch requests differ between
    /// iterations, or froze the tape: plain requests may then be refused.
    pub irregular: bool,
    pub first: Option<graphed_status>,
    /// What the callback that decided `first` said with
    /// graphed_callback_fail_message, when `first` is CALLBACK_FAILED.
    pub said: Option<String>,
    pub ran: bool,
    /// The stream of the loop body (a WHILE step's) whose callback runs
    /// now (0: none); it is capturing beside `stream`, and destroyed when
    /// the body's capture ends.
    pub body: usize,
    /// The running microbatch's index of each WHILE step whose body was
    /// captured, in order: the k-th is the k-th WHILE step's.
    pub loops: Vec<usize>,
    /// Captures broken by the running callback: 1 the one around the
    /// loop (`stream`), 2 the loop body's.
    pub broke: u8,
    /// A loop body's callback broke a capture, deciding `first`: the
    /// words the message must hold.
    pub named: Vec<String>,
    /// The passes (callable, microbatch, pass) whose callbacks ran under
    /// capture, and the last: each pass is captured alone first (its clone
    /// slots right after), then the steps, which repeat passes.
    /// (With buckets, the microbatch holds the bucket above bit 16.)
    pub captured: Vec<(usize, u32, u32)>,
    pub last: Option<(usize, u32, u32)>,
    /// The steps' captures have begun (a pass ran again after another).
    pub in_steps: bool,
    /// What each pass's calls said of its place, keyed as `captured`:
    /// (ctx.capture_position, ctx.instance), the same in every call.
    pub places: Vec<((usize, u32, u32), (u32, u32))>,
}

pub struct HeldBlock {
    pub owner: usize,
    pub refs: usize,
    pub sess: usize,
    /// Clones holding one byte value each: (ptr, bytes, value).
    pub grads: Vec<(usize, usize, u8)>,
    /// Clones holding one element value each (the f32, f16 or bf16 sums
    /// of a step over microbatches): (ptr, bytes, element bits, width).
    pub words: Vec<(usize, usize, u32, usize)>,
    /// The instance whose clone ring it came from: (callable, microbatch).
    pub inst: (usize, u32),
    /// Known to be a clone slot block (a looped step's replay took it).
    pub slot: bool,
}

pub struct Lease {
    pub sess: usize,
    pub token: u64,
    /// (callable, microbatch, what: 0 output, 1 grad input, 2 param, index)
    pub slot: (usize, u32, u8, usize),
    /// On an external buffer, the bucket whose capture provided it (only
    /// that bucket's replays overwrite it); None on a buffer the library
    /// placed, which every bucket of the callable shares.
    pub bucket: Option<u32>,
}

/// A handle a callback kept past its call.
pub struct Kept {
    pub h: usize,
    pub live: bool,
}

pub struct KeptStream {
    pub h: usize,
    pub sess: usize,
    pub attempt: u64,
    /// A loop body's stream: live only while that body is captured.
    pub body: bool,
}

/// The user data of a host task recorded by a callback: each target gets
/// its byte ^ EPOCH, the parameter grads (`targets[grads..]`) also ^
/// `grad_mix` of the step microbatch and of the data the task reads.
pub struct Fill {
    pub targets: Vec<(usize, usize, u8)>,
    pub sess: usize,
    pub action: u8,
    pub grads: usize,
    /// The step microbatch this pass records (unrolled; 0 otherwise).
    pub step_mb: u32,
    /// In a loop body: where the running microbatch's index is (0: none).
    pub index: usize,
    /// In a loop body: a static buffer the step copies each microbatch's
    /// data into, whose first byte the grads mix in (0: none).
    pub data: usize,
}

impl Fill {
    /// A task writing `targets` only.
    pub fn plain(targets: Vec<(usize, usize, u8)>, sess: usize, action: u8) -> Fill {
        let grads = targets.len();
        Fill {
            targets,
            sess,
            action,
            grads,
            step_mb: 0,
            index: 0,
            data: 0,
        }
    }
}

/// The user data of a callback or hook.
pub struct Cb {
    pub sess: usize,
    pub callable: usize,
    pub scratch: usize,
    pub hook: bool,
}

/// The user data of a session's allocator, log and warmup hook.
pub struct SessCtx {
    pub sess: usize,
    pub log_level: u32,
}

pub struct World {
    pub input: Input,
    pub sessions: RefCell<Vec<Sess>>,
    pub mem: RefCell<Vec<Box<[u64]>>>,
    pub fills: RefCell<Vec<Box<Fill>>>,
    pub cbs: RefCell<Vec<Box<Cb>>>,
    pub ctxs: RefCell<Vec<Box<SessCtx>>>,
    pub ext: RefCell<HashMap<(usize, usize, u32, u32, usize), usize>>,
    pub blocks: RefCell<Vec<HeldBlock>>,
    pub stale_blocks: RefCell<Vec<usize>>,
    pub leases: RefCell<Vec<Lease>>,
    pub stale_leases: RefCell<Vec<(usize, u64)>>,
    pub kept_scratch: RefCell<Vec<Kept>>,
    pub kept_capture: RefCell<Vec<Kept>>,
    pub kept_streams: RefCell<Vec<KeptStream>>,
    pub allocs: RefCell<HashMap<usize, (usize, usize, Box<[u64]>)>>,
    pub frames: RefCell<Vec<Frame>>,
    /// Sessions pinned by a call in progress (innermost last).
    pub pinned: RefCell<Vec<usize>>,
    pub attempts: Cell<u64>,
    pub depth: Cell<u32>,
    pub pools: Cell<usize>,
}

thread_local! {
    pub static WORLD: Cell<*const World> = const { Cell::new(null()) };
}

pub fn w() -> &'static World {
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
pub static EPOCH: AtomicU8 = AtomicU8::new(0);

pub fn waived(name: &str) -> bool {
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

pub const ROLE_OUT: u32 = 1;
pub const ROLE_GIN: u32 = 3;
pub const ROLE_PARAM: u32 = 4;
pub const ROLE_SCRATCH: u32 = 9;

pub fn seed(s: usize, c: usize, mb: u32, role: u32, i: usize) -> u8 {
    (s.wrapping_mul(131) + c * 31 + mb as usize * 17 + role as usize * 7 + i * 3 + 1) as u8
}

pub fn dtype_size(d: u32) -> usize {
    match d {
        0 | 6 => 4,
        1 | 2 => 2,
        3 | 7 => 8,
        _ => 1,
    }
}

/// Harness "device" memory: a fresh heap block (so that ASan sees its
/// bounds), kept until the end of the input. `off` bytes past 8-alignment.
pub fn mem(bytes: usize, off: usize) -> usize {
    let words = (bytes + off).div_ceil(8).max(1);
    let b = vec![0u64; words].into_boxed_slice();
    let p = b.as_ptr() as usize + off;
    w().mem.borrow_mut().push(b);
    p
}

/// Where external memory is kept for an instance: its microbatch, and with
/// buckets the bucket above bit 16 (each bucket's capture provides buffers
/// of its own, and a replay returns those of the bucket it ran).
pub fn ext_key(mb: u32, bucket: u32) -> u32 {
    mb | bucket << 16
}

/// The external memory of (session, callable, `ext_key`, role, index).
pub fn ext_mem(s: usize, c: usize, mb: u32, role: u32, i: usize, bytes: usize) -> usize {
    if let Some(&p) = w().ext.borrow().get(&(s, c, mb, role, i)) {
        return p;
    }
    let p = mem(bytes, 0);
    w().ext.borrow_mut().insert((s, c, mb, role, i), p);
    p
}

pub fn all_bytes(p: usize, n: usize, b: u8) -> bool {
    // SAFETY: callers pass buffers the library or the harness keeps alive
    // with at least `n` bytes.
    unsafe { std::slice::from_raw_parts(p as *const u8, n) }
        .iter()
        .all(|&x| x == b)
}

/// Whether every `width`-byte element (4 or 2) of `n` bytes at `p` holds
/// `v`.
pub fn all_words(p: usize, n: usize, v: u32, width: usize) -> bool {
    // SAFETY: as all_bytes.
    unsafe { std::slice::from_raw_parts(p as *const u8, n) }
        .chunks_exact(width)
        .all(|c| elem_bits(c) == v)
}

/// An element's bits (4 or 2 bytes, native order).
pub fn elem_bits(c: &[u8]) -> u32 {
    match c.len() {
        4 => u32::from_ne_bytes(c.try_into().unwrap()),
        _ => u16::from_ne_bytes(c[..2].try_into().unwrap()) as u32,
    }
}
