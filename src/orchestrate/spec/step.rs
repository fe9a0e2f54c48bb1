//! What a step is declared with: its callables, microbatches, data copied
//! in and out, capture hooks and update stage (the callback and the view
//! it gets under capture), and a step replay's arguments.

use crate::backend::{DevPtr, StreamRef};
use crate::core::collective::CollectiveOp;
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::core::policy::GradPolicy;
use std::sync::Arc;

use super::callable::HookPoint;

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

/// Where a step's collective callback runs in its graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectiveAt {
    /// Once, after the last microbatch's backward, with every grad.
    AfterBackward,
    /// After each callable's grad pass in the last microbatch, with that
    /// callable's grads (in backward order).
    PerCallable,
}

/// What a step's collective callback sees: the stream to enqueue on, the
/// callable whose grads are ready (None: every callable of the step) and
/// its parameters with where this graph leaves each accumulated grad.
pub struct CollectiveView<'a> {
    pub step: u32,
    pub stream: StreamRef,
    /// The clone slot whose graph is being captured (0 without slots).
    pub slot: u32,
    /// The session's index of the callable whose grads are ready; None
    /// after the whole backward.
    pub callable: Option<u32>,
    pub params: &'a [DevPtr],
    pub grads: &'a [DevPtr],
    pub bytes: &'a [usize],
    pub dtypes: &'a [DType],
}

/// A step's collective callback: called under each capture of the step's
/// graph at its points, never eagerly; returns what it declared it
/// records, or its code and what it said about it.
pub type CollectiveFn = Arc<
    dyn Fn(&CollectiveView) -> std::result::Result<Vec<CollectiveRecord>, (i32, String)>
        + Send
        + Sync,
>;

/// The caller's all-gather of the ranks' manifests: each rank's `mine`
/// (the same length on every rank) into `all` (ranks * that, rank r's at
/// r * len); its code and what it said about it on failure.
pub type ExchangeFn =
    Arc<dyn Fn(&[u8], &mut [u8]) -> std::result::Result<(), (i32, String)> + Send + Sync>;

/// A collective as a callback declares it (the point is the step's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveRecord {
    pub communicator: u64,
    pub op: CollectiveOp,
    pub bytes: u64,
    pub dtype: DType,
}

/// A step's collective stage, as declared.
#[derive(Clone)]
pub struct CollectiveSpec {
    pub callback: CollectiveFn,
    pub at: CollectiveAt,
    /// None: the manifest is kept but not compared across ranks.
    pub exchange: Option<ExchangeFn>,
    /// This rank and how many there are (checked against the exchange).
    pub rank: u32,
    pub ranks: u32,
}

impl std::fmt::Debug for CollectiveSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectiveSpec")
            .field("at", &self.at)
            .field("exchange", &self.exchange.is_some())
            .field("rank", &self.rank)
            .field("ranks", &self.ranks)
            .finish_non_exhaustive()
    }
}

impl PartialEq for CollectiveSpec {
    /// The same stage: the same closures, point and ranks.
    fn eq(&self, other: &Self) -> bool {
        let same_exchange = match (&self.exchange, &other.exchange) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        Arc::ptr_eq(&self.callback, &other.callback)
            && same_exchange
            && (self.at, self.rank, self.ranks) == (other.at, other.rank, other.ranks)
    }
}

impl Eq for CollectiveSpec {}

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
    /// Collectives recorded into each of the step's graphs after the last
    /// microbatch's grads (or each callable's) are ready, before the
    /// update (None: none).
    pub collective: Option<CollectiveSpec>,
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
            collective: None,
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
            || self.collective.is_some()
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
