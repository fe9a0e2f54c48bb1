//! What a callable is registered with: its tensors and parameters, its
//! callbacks, and the view a callback (or hook) gets of the static buffers
//! of the pass it records; the allocator of returned clones.

use crate::backend::{DevPtr, StreamRef};
use crate::core::dtype::DType;
use crate::core::padded::Collapsed;
use crate::core::policy::{GradPolicy, ParamSpec};
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::Arc;

use super::super::external::Provided;
use super::super::scratch::Scratch;

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
