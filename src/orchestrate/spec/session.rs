//! How a session is configured and called: its options, log and hooks, a
//! pipeline schedule, a replay's arguments, and the counters of the bytes
//! it holds.

use crate::backend::{CaptureMode, DevPtr, StreamRef};
use crate::core::schedule::ScheduleStep;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::callable::{CloneAllocator, HookPoint};

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

/// A pipeline schedule as configured (validated against the callables at
/// capture).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleSpec {
    pub steps: Vec<ScheduleStep>,
    pub layers_per_chunk: Option<Vec<u32>>,
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
