//! What the caller registers and configures: session options, callables
//! (tensors, parameters, callbacks), and the view a callback gets of the
//! static buffers of the pass it records.

use crate::backend::{CaptureMode, DevPtr, StreamRef};
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::core::padded::Collapsed;
use crate::core::policy::{GradPolicy, ParamSpec};
use crate::core::schedule::ScheduleStep;
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::external::Provided;
use super::scratch::Scratch;

/// A static input or output.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub bytes: usize,
    pub dtype: DType,
    pub shape: Vec<i64>,
    /// Inputs: a grad-input buffer is made. Outputs: a grad-output buffer is made.
    pub requires_grad: bool,
    /// Inputs: device pointer to sample data copied into the static input
    /// before warmup (0: the static input starts zeroed).
    pub sample: DevPtr,
    /// The buffer the callable writes for this tensor (an output, or an
    /// input's grad) is provided by its callback at capture.
    pub external: bool,
    /// Inputs only: this input is output `.1` of the earlier callable `.0`
    /// (same microbatch), read in place; its grad is that output's
    /// grad-output, written in place.
    pub chained: Option<(u32, u32)>,
    /// Inputs only: a replay with other data points the graphs at it
    /// instead of copying it (when capture could verify that).
    pub rebind: bool,
    /// It varies with the callable's bucket (`shape` and `bytes` are the
    /// largest bucket's); see [`CallableSpec::buckets`].
    pub dynamic: bool,
    /// DYNAMIC: the dimension of `shape` that follows the bucket's first
    /// size (None: only the second size varies it), and, with a grid of
    /// buckets, the one that follows the second size.
    pub dims: (Option<usize>, Option<usize>),
}

impl TensorSpec {
    /// How a DYNAMIC tensor's data lies in a bucket (checked at
    /// registration: None only for tensors that do not vary).
    pub fn collapsed(&self) -> Option<Collapsed> {
        if !self.dynamic {
            return None;
        }
        Collapsed::of(
            &self.shape,
            self.dtype.size() as u64,
            self.dims.0,
            self.dims.1,
        )
    }

    /// Its bytes in a bucket of sizes `bucket` (all of them when not
    /// dynamic).
    pub fn bytes_in(&self, bucket: (u64, u64)) -> usize {
        match self.collapsed() {
            Some(c) => c.at(bucket, bucket).bytes as usize,
            None => self.bytes,
        }
    }
}

/// Whether a callback runs eagerly in warmup or under stream capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Warmup,
    Capture,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Warmup => "warmup",
            Phase::Capture => "capture",
        }
    }
}

/// Before or after a callback (per-callable hooks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookPoint {
    Pre,
    Post,
}

/// What a callback (or hook) sees: the stream to enqueue on and the static
/// buffers of its instance. Arrays hold 0 where a buffer does not exist.
pub struct PassView<'a> {
    pub callable: u32,
    pub microbatch: u32,
    pub pass: PassKind,
    pub phase: Phase,
    pub iteration: u32,
    /// Under the capture of a step over several microbatches: which one
    /// this call records, of how many (0 of 1 otherwise).
    pub step_microbatch: u32,
    pub step_microbatches: u32,
    /// In the body of a loop on the device: the u32 the device holds the
    /// running microbatch in (0 elsewhere).
    pub step_index: DevPtr,
    /// Callables with buckets: which bucket this call records, of how many,
    /// its size, and the u64 the device holds the replay's actual size in
    /// (the bucket's size during warmup). (0, 0, 0, 0) otherwise.
    pub bucket: u32,
    pub buckets: u32,
    pub bucket_size: u64,
    pub actual_size: DevPtr,
    /// With a grid of buckets: the bucket's second size and the u64 the
    /// device holds the replay's actual second size in (0, 0 otherwise).
    pub bucket_size2: u64,
    pub actual_size2: DevPtr,
    /// The pass's position in the session's capture order (the same in
    /// every warmup iteration, in its own capture, its clone slots' and a
    /// step's), and the instance it belongs to (`Captured::instances`).
    pub position: u32,
    pub instance: u32,
    pub stream: StreamRef,
    pub inputs: &'a [DevPtr],
    pub params: &'a [DevPtr],
    pub outputs: &'a [DevPtr],
    pub grad_outputs: &'a [DevPtr],
    pub grad_inputs: &'a [DevPtr],
    pub param_grads: &'a [DevPtr],
    /// The frozen grad policy of each parameter (None: no gradient).
    pub param_policies: &'a [Option<GradPolicy>],
    /// One pointer-sized slot per instance, shared by its passes: forward
    /// may leave a pointer there for backward.
    pub tape: *mut *mut c_void,
    /// The scratch allocator (callbacks only; None for hooks).
    pub scratch: Option<&'a Arc<Scratch>>,
    /// Under capture, callbacks only: where the callback provides its
    /// external buffers.
    pub provided: Option<&'a Arc<Provided>>,
}

/// The callbacks of one callable. Errors are the callback's own code.
pub trait PassCallbacks: Send {
    fn run(&self, view: &PassView) -> std::result::Result<(), i32>;
    fn has_wgrad(&self) -> bool;
    fn hook(&self, point: HookPoint, view: &PassView) -> std::result::Result<(), i32>;
    /// What the last failing callback (or hook) on this thread said about
    /// its failure, if it said anything.
    fn failure_message(&self) -> Option<String> {
        None
    }
}

/// A registered callable.
pub struct CallableSpec {
    pub name: String,
    pub inputs: Vec<TensorSpec>,
    pub params: Vec<ParamSpec>,
    pub outputs: Vec<TensorSpec>,
    pub callbacks: Box<dyn PassCallbacks>,
    /// Sizes of the dynamic dimension, ascending (empty: one shape). The
    /// callable is captured once per bucket; every bucket's static buffers
    /// are a prefix of the largest one's.
    pub buckets: Vec<u64>,
    /// A grid: the sizes of a second dynamic dimension, ascending (empty:
    /// none). The buckets are then every pair (size, size2), bucket
    /// `i * buckets2.len() + j` the pair (`buckets[i]`, `buckets2[j]`).
    pub buckets2: Vec<u64>,
}

impl CallableSpec {
    /// How many shapes it is captured in (1 without buckets).
    pub fn bucket_count(&self) -> usize {
        self.buckets.len().max(1) * self.buckets2.len().max(1)
    }

    /// The dynamic size of bucket `b` (0 without buckets).
    pub fn bucket_size(&self, b: usize) -> u64 {
        self.sizes(b).0
    }

    /// The two sizes of bucket `b` ((size, 0) without a grid, (0, 0)
    /// without buckets).
    pub fn sizes(&self, b: usize) -> (u64, u64) {
        let k = self.buckets2.len().max(1);
        (
            self.buckets.get(b / k).copied().unwrap_or(0),
            self.buckets2.get(b % k).copied().unwrap_or(0),
        )
    }

    /// How messages name the sizes of bucket `b`: "16 rows", "4 x 128"
    /// (None without buckets).
    pub fn describe_bucket(&self, b: usize) -> Option<String> {
        match self.sizes(b) {
            (0, _) => None,
            (n, 0) => Some(format!("{n} rows")),
            (n, m) => Some(format!("{n} x {m}")),
        }
    }

    /// The largest bucket's sizes.
    pub fn largest(&self) -> (u64, u64) {
        (
            self.buckets.last().copied().unwrap_or(0),
            self.buckets2.last().copied().unwrap_or(0),
        )
    }

    /// Whether a replay hands back a DYNAMIC tensor whose data is not
    /// contiguous in its buffer (rows of a pitch: `graphed_ref.rows`).
    pub fn strided(&self) -> bool {
        self.inputs
            .iter()
            .chain(&self.outputs)
            .filter_map(|t| t.collapsed())
            .any(|c| !c.rows_first())
    }

    /// The bucket a forward replay given `size` rows (its `args.size`,
    /// named `what` in messages) and, with a grid, `size2` runs: the
    /// smallest bucket holding them (the smallest size at least `size`
    /// and the smallest second size at least `size2`); bucket 0, its one
    /// shape, for a callable without buckets given no size. Refused,
    /// naming the callable: a size without buckets, none (0) with buckets,
    /// a size above the largest bucket, a second size without a grid or
    /// none with one. Replays choose by it, and the bucket query answers
    /// by it.
    pub fn forward_bucket(&self, (size, size2): (u64, u64), what: &str) -> Result<usize> {
        let (name, buckets) = (&self.name, &self.buckets);
        let Some(&largest) = buckets.last() else {
            return match (size, size2) {
                (0, 0) => Ok(0),
                (n, 0) => Err(Error::invalid(format!(
                    "{what} is {n}, but callable '{name}' has no buckets: a replay of it names no size (0)"
                ))),
                (_, n) => Err(Error::invalid(format!(
                    "{what}2 is {n}, but callable '{name}' has no buckets: a replay of it names no size (0)"
                ))),
            };
        };
        if size == 0 {
            return Err(Error::invalid(format!(
                "callable '{name}' has buckets {buckets:?}: a forward replay names its actual size ({what})"
            )));
        }
        let i = buckets.iter().position(|&b| b >= size).ok_or_else(|| {
            Error::invalid(format!(
                "{what} {size} is above the largest bucket of callable '{name}' ({largest}; buckets {buckets:?})"
            ))
        })?;
        let b2 = &self.buckets2;
        let Some(&largest2) = b2.last() else {
            return match size2 {
                0 => Ok(i),
                n => Err(Error::invalid(format!(
                    "{what}2 is {n}, but callable '{name}' has one list of buckets ({buckets:?}): pass 0, or \
                     give it a second list (bucket_sizes2)"
                ))),
            };
        };
        if size2 == 0 {
            return Err(Error::invalid(format!(
                "callable '{name}' has a grid of buckets {buckets:?} x {b2:?}: a forward replay names both \
                 actual sizes ({what} and {what}2)"
            )));
        }
        let j = b2.iter().position(|&b| b >= size2).ok_or_else(|| {
            Error::invalid(format!(
                "{what}2 {size2} is above the largest second bucket size of callable '{name}' ({largest2}; \
                 second sizes {b2:?})"
            ))
        })?;
        Ok(i * b2.len() + j)
    }
}

/// Allocator for returned clones (the caller's, e.g. PyTorch's caching
/// allocator). Errors are the callback's code.
pub trait CloneAllocator: Send + Sync {
    fn alloc(&self, bytes: usize, stream: StreamRef) -> std::result::Result<DevPtr, i32>;
    fn free(&self, ptr: DevPtr, bytes: usize, stream: StreamRef);
}

/// Severity of a log message, most severe first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
}

pub type Logger = Box<dyn Fn(LogLevel, &str) + Send>;
pub type SessionHook = Box<dyn Fn(HookPoint) -> std::result::Result<(), i32> + Send>;

/// A step's capture hook: called before (`Pre`) and after (`Post`) each
/// capture of the step's graph, outside stream capture, so that a
/// framework can prepare its allocator and random-number state for the
/// callables' back-to-back captures (their own hooks do not run there).
/// Shared, so that a step's spec stays cloneable.
#[derive(Clone)]
pub struct CaptureHook(pub Arc<dyn Fn(HookPoint) -> std::result::Result<(), i32> + Send + Sync>);

impl std::fmt::Debug for CaptureHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CaptureHook")
    }
}

impl PartialEq for CaptureHook {
    /// The same hook: the same closure.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for CaptureHook {}

/// Which part of a step's update a call of its update callback records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdatePhase {
    /// Reads the grads and decides: writes the skip flag (non-zero: skip
    /// the apply part this replay). Recorded into the step's graph itself.
    Check,
    /// The parameter update. With a check, the body of a conditional node
    /// that runs it only when the flag is 0.
    Apply,
}

impl UpdatePhase {
    pub fn name(self) -> &'static str {
        match self {
            UpdatePhase::Check => "check",
            UpdatePhase::Apply => "apply",
        }
    }
}

/// What a step's update callback sees: the stream to enqueue on, each
/// parameter of the step's callables (in order) with where the step's
/// graph being captured puts its accumulated grad, and the step's device
/// scalars and skip flag.
pub struct UpdateView<'a> {
    pub step: u32,
    pub phase: UpdatePhase,
    pub stream: StreamRef,
    /// The clone slot whose graph is being captured (0 without slots).
    pub slot: u32,
    pub params: &'a [DevPtr],
    /// Where each grad is when the update runs (0: the parameter takes no
    /// gradient): COPY_INTO and ACCUMULATE_INTO destinations, CLONE grads
    /// in this graph's clone slot block, ALIAS grads in their static buffer.
    pub grads: &'a [DevPtr],
    pub bytes: &'a [usize],
    pub dtypes: &'a [DType],
    pub policies: &'a [Option<GradPolicy>],
    /// The step's scalar block (0 when it declared none) and its bytes.
    pub scalars: DevPtr,
    pub scalar_bytes: usize,
    /// The u32 the check writes (0 without a check).
    pub skip_flag: DevPtr,
    /// The microbatches the step was declared with, and, looping on the
    /// device, the u32 holding the count the replay runs (0 otherwise).
    pub microbatches: u32,
    pub microbatch_count: DevPtr,
}

/// A step's update callback: called once per phase under each capture of
/// the step's graph, never eagerly. Its error is the callback's code and
/// what it said about it ("": nothing).
pub type UpdateFn =
    Arc<dyn Fn(&UpdateView) -> std::result::Result<(), (i32, String)> + Send + Sync>;

/// A step's update stage, as declared: the callback, whether it has a
/// check part (then the apply part runs under a conditional node the check
/// drives), and the bytes of the step's device scalar block.
#[derive(Clone)]
pub struct UpdateSpec {
    pub callback: UpdateFn,
    pub check: bool,
    pub scalar_bytes: usize,
}

impl std::fmt::Debug for UpdateSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpdateSpec")
            .field("check", &self.check)
            .field("scalar_bytes", &self.scalar_bytes)
            .finish_non_exhaustive()
    }
}

impl PartialEq for UpdateSpec {
    /// The same update: the same closure, check and block.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.callback, &other.callback)
            && (self.check, self.scalar_bytes) == (other.check, other.scalar_bytes)
    }
}

impl Eq for UpdateSpec {}

/// A step replay's arguments: the step, the caller's stream, its
/// parameters' addresses (None: where the graphs read them now), the
/// microbatches to run (0: all), and new values for its scalar block
/// (None: it keeps what it holds).
#[derive(Clone, Copy, Debug, Default)]
pub struct StepCall<'a> {
    pub step: u32,
    pub stream: StreamRef,
    pub params: Option<&'a [DevPtr]>,
    pub microbatches: u32,
    pub scalars: Option<&'a [u8]>,
}

impl StepCall<'_> {
    /// Step `step` on `stream`, everything else as it is.
    pub fn of(step: u32, stream: StreamRef) -> Self {
        StepCall {
            step,
            stream,
            ..Default::default()
        }
    }
}

/// A pipeline schedule as configured (validated against the callables at
/// capture).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleSpec {
    pub steps: Vec<ScheduleStep>,
    pub layers_per_chunk: Option<Vec<u32>>,
}

/// A step declared before capture: callables (in registration order)
/// replayed as one graph, every forward then every backward, with the
/// COPY_INTO and ACCUMULATE_INTO grads of their parameters going to fixed
/// destinations (one entry per parameter of the step's callables, in
/// order; 0 where the policy needs none). With `microbatches` N above 1
/// the graph does that N times in turn, the parameter grads summed over
/// the microbatches; `io` copies each microbatch's data in and out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepSpec {
    pub callables: Vec<u32>,
    pub param_dsts: Vec<DevPtr>,
    pub microbatches: u32,
    pub io: Vec<StepIo>,
    pub looping: Looping,
    /// Called around each capture of the step's graph (None: nothing).
    pub capture_hook: Option<CaptureHook>,
    /// Captured once into each of the step's graphs after the last
    /// microbatch's grads are where the step puts them (None: no update).
    pub update: Option<UpdateSpec>,
}

/// How a step's graph holds its microbatches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Looping {
    /// Each microbatch captured in turn: the count is fixed at capture.
    Unrolled,
    /// One microbatch captured as the body of a loop on the device (a
    /// conditional WHILE node): a replay runs 1 to `microbatches` of them.
    Device,
}

impl StepSpec {
    /// A step of one microbatch with no copies in or out.
    pub fn plain(callables: Vec<u32>, param_dsts: Vec<DevPtr>) -> StepSpec {
        StepSpec {
            callables,
            param_dsts,
            microbatches: 1,
            io: Vec::new(),
            looping: Looping::Unrolled,
            capture_hook: None,
            update: None,
        }
    }

    /// Whether its graphs do more than the passes (several microbatches,
    /// copies, or an update): then no pass-by-pass replay gives the same
    /// results.
    pub fn looped(&self) -> bool {
        self.microbatches > 1
            || !self.io.is_empty()
            || self.looping == Looping::Device
            || self.update.is_some()
    }
}

/// A static buffer of a step's callable that its graph fills from caller
/// memory before the pass that reads it (an input before the forward, a
/// grad-output before the backward) or copies out after the pass that
/// writes it (an output after the forward, a grad-input after the
/// backward): microbatch i at `ptr + i * stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepIo {
    pub callable: u32,
    pub role: Role,
    pub index: usize,
    pub ptr: DevPtr,
    pub stride: usize,
}

impl StepIo {
    /// Whether the step's graph copies into the static buffer (else out).
    pub fn copied_in(&self) -> bool {
        matches!(self.role, Role::Input | Role::GradOutput)
    }
}

/// Session options, fixed at creation.
pub struct SessionOptions {
    /// Names the session in messages (for example, about shared pools).
    pub name: String,
    pub warmup_iterations: u32,
    pub clone_param_grads_on_return: bool,
    pub strict_leases: bool,
    pub capture_mode: CaptureMode,
    pub allocator: Option<Arc<dyn CloneAllocator>>,
    pub log: Option<Logger>,
    pub log_level: LogLevel,
    /// Runs before the first and after the last warmup iteration.
    pub warmup_hook: Option<SessionHook>,
    /// A pipeline schedule (None: one microbatch in the default order).
    pub schedule: Option<ScheduleSpec>,
    /// Share memory between static buffers whose lifetimes do not overlap
    /// (needs a schedule).
    pub reuse_buffers: bool,
    /// Warmup and capture run on this stream of the caller's (None: one the
    /// session makes).
    pub capture_stream: Option<StreamRef>,
    /// Clone slots per instance: the pass that writes parameter grads is
    /// also captured once per slot, writing its CLONE grads straight into
    /// that slot's block, so a replay hands a block out without copying.
    pub clone_slots: u32,
    /// Callables with buckets can also choose them on the device (a
    /// SWITCH graph per pass; replays given `device_size`).
    pub device_buckets: bool,
    /// Debug mode: every replay synchronizes its stream around each graph
    /// it runs and names the callable, pass and graph where an error
    /// surfaces (`replay::debug`). Also turned on by GRAPHED_DEBUG=1 when
    /// the session is created.
    pub debug: bool,
}

impl SessionOptions {
    /// Sends a message to the log callback, if there is one and `level` is
    /// within the configured verbosity.
    pub fn log(&self, level: LogLevel, msg: impl FnOnce() -> String) {
        if let Some(log) = &self.log {
            if level <= self.log_level {
                log(level, &msg());
            }
        }
    }
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            name: "session".into(),
            warmup_iterations: 3,
            clone_param_grads_on_return: true,
            strict_leases: false,
            capture_mode: CaptureMode::Global,
            allocator: None,
            log: None,
            log_level: LogLevel::Warn,
            warmup_hook: None,
            schedule: None,
            reuse_buffers: false,
            clone_slots: 2,
            capture_stream: None,
            device_buckets: false,
            debug: false,
        }
    }
}

/// Arguments of a replay call.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReplayArgs<'a> {
    pub callable: u32,
    pub microbatch: u32,
    /// The caller's stream: the replay is ordered on it.
    pub stream: StreamRef,
    /// Optional: launch there instead, synced with `stream` by events.
    pub side_stream: Option<StreamRef>,
    /// New data for the static inputs (forward) or grad-outputs (backward);
    /// None: they are already in the static buffers.
    pub data: Option<&'a [DevPtr]>,
    /// Destinations of COPY_INTO and ACCUMULATE_INTO parameter slots, one
    /// per parameter (0 where the slot has another policy).
    pub param_dsts: Option<&'a [DevPtr]>,
    /// The parameters' current addresses, one per parameter (0: where the
    /// graphs read it now); None: all where they read them now.
    pub params: Option<&'a [DevPtr]>,
    /// Callables with buckets: the actual size of the dynamic dimension
    /// (forward: required; backward and weight-grad: 0 or the forward's).
    pub size: u64,
    /// Callables with a grid of buckets: the actual second size (as
    /// `size`); 0 otherwise.
    pub size2: u64,
    /// Callables with buckets, instead of `size`: device memory holding
    /// the size as a u64, the bucket chosen on the device (forward only).
    pub device_size: DevPtr,
}

/// Bytes the library holds, by kind; shared by a session with the buffers
/// it hands out, so that the accounting outlives the session.
#[derive(Debug, Default)]
pub struct MemCounters {
    pub static_bytes: AtomicU64,
    pub scratch_bytes: AtomicU64,
    /// Clone blocks handed out and not yet released.
    pub clone_bytes: AtomicU64,
    pub clone_blocks: AtomicU64,
    /// Released clone blocks kept for reuse.
    pub clone_cached_bytes: AtomicU64,
    /// Errors while releasing the session's resources.
    pub teardown_errors: AtomicU64,
}

impl MemCounters {
    pub fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn sub(c: &AtomicU64, n: usize) {
        c.fetch_sub(n as u64, Ordering::Relaxed);
    }

    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}
