//! The one error type of the crate. Every layer returns `Result<T, Error>`;
//! the `ffi` layer maps each variant to a stable `graphed_status` code and
//! keeps the `Display` text as the thread's last error message.

use crate::core::PassKind;

/// Everything that can go wrong, in every layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} must not be NULL")]
    NullPointer { what: &'static str },

    #[error("{0}")]
    InvalidArgument(String),

    /// A struct the caller passes was not set up as its layer requires:
    /// `detail` says what is wrong with it and how to set it up.
    #[error("{what} {detail}")]
    BadStruct { what: String, detail: String },

    #[error("no CUDA driver: {0}")]
    NoDriver(String),

    #[error("no CUDA device: {0}")]
    NoDevice(String),

    #[error("{call} failed with {name}: {description}")]
    Cuda {
        call: &'static str,
        code: u32,
        name: String,
        description: String,
    },

    /// Work that ran on a stream failed, reported by the stream's next
    /// synchronization: the host backend's faulting kernel, the
    /// counterpart of a CUDA kernel's asynchronous error.
    #[error("{0}")]
    DeviceFault(String),

    /// An error and where it struck. Debug mode: an error that a replay's
    /// check found (after a graph ran, or before the replay enqueued
    /// anything, or after its copies). Capture: a driver error ending or
    /// beginning the capture of a pass (instantiating its graph, say).
    /// `place` names the session, callable, pass and graph, `cause` is the
    /// error. Its status is the cause's.
    #[error("{place}: {cause}")]
    Surfaced { place: String, cause: Box<Error> },

    #[error("out of memory: {0}")]
    OutOfMemory(String),

    #[error("{0}")]
    WrongState(String),

    #[error("the session was reset: {0}")]
    SessionReset(String),

    #[error("the {pass} callback of {place}, returned {code} during {phase}{said}")]
    CallbackFailed {
        place: Box<CapturePlace>,
        pass: PassKind,
        phase: &'static str,
        code: i32,
        /// What the callback said about it (the operation that failed,
        /// from `graphed_callback_fail_message`), then the first error
        /// graphed saw under the capture; "": nothing.
        said: String,
    },

    /// A hook of the caller's that is not a callable's (around a step's
    /// capture) returned non-zero: `hook` names it and when it ran.
    #[error("{hook} returned {code}")]
    HookFailed { hook: String, code: i32 },

    /// A step's update callback returned non-zero under capture.
    #[error("the update's {phase} callback of step {step} returned {code} during capture{said}")]
    UpdateFailed {
        step: usize,
        phase: &'static str,
        code: i32,
        /// What the callback said about it ("": nothing).
        said: String,
    },

    /// A step's collective callback, or its exchange of the collective
    /// manifests across ranks, returned non-zero under capture: `what`
    /// names it and the step.
    #[error("{what} returned {code} during capture{said}")]
    CollectiveFailed {
        what: String,
        code: i32,
        /// What the callback said about it ("": nothing).
        said: String,
    },

    /// The ranks of a step record different collectives (or a rank's
    /// capture of the step failed): the message names the first entry
    /// that differs on both sides.
    #[error("{0}")]
    CollectiveMismatch(String),

    /// The capture of a pass ended without a graph: `detail` says what
    /// the driver (or the host backend) returned, what that means, the
    /// first error graphed saw under the capture and what the callback
    /// said.
    #[error("capture of the {pass} pass of {place} was invalidated: {detail}")]
    CaptureInvalidated {
        place: Box<CapturePlace>,
        pass: PassKind,
        detail: String,
    },

    #[error("{0}")]
    IllegalUnderCapture(String),

    #[error("{0}")]
    AliasHeld(String),

    #[error("invalid schedule: {0}")]
    InvalidSchedule(String),

    #[error("{0}")]
    ScratchExhausted(String),

    #[error("{0}")]
    Unsupported(String),

    /// The call combines features that do not work together; the message
    /// names them.
    #[error("{0}")]
    Incompatible(String),

    /// A parameter given at another address than its graphs read, where
    /// they cannot be pointed; the message names it and both addresses.
    #[error("{0}")]
    ParamMoved(String),

    /// A replay (or a step, or a query of its buffers) of a callable that
    /// was released from its captured session; the message names it.
    #[error("{0}")]
    CallableReleased(String),

    #[error("{0}")]
    Busy(String),

    #[error("{0}")]
    StreamCapturing(String),

    #[error("{0}")]
    UseAfterDestroy(String),

    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where a capture failed: "callable 'fc' (index 0) in session 'net',
/// microbatch 0, bucket 1 (16 rows)", then the graph when it is not the
/// pass's own (", clone slot 1", ", in the capture of step 0 (its
/// microbatch 2)").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CapturePlace {
    pub session: String,
    pub callable: String,
    pub index: u32,
    pub microbatch: u32,
    /// The bucket's index and rows; None: the callable has no buckets.
    pub bucket: Option<(u32, u64)>,
    /// ", clone slot 1", ", in the capture of step 0"; "": the pass's own
    /// graph.
    pub graph: String,
}

impl std::fmt::Display for CapturePlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "callable '{}' (index {}) in session '{}', microbatch {}, ",
            self.callable, self.index, self.session, self.microbatch
        )?;
        match self.bucket {
            None => f.write_str("no buckets")?,
            Some((b, rows)) => write!(f, "bucket {b} ({rows} rows)")?,
        }
        f.write_str(&self.graph)
    }
}

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    pub fn state(msg: impl Into<String>) -> Self {
        Error::WrongState(msg.into())
    }
}
