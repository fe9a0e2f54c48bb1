//! Status codes and their names, and the library version: the conventions
//! every other export relies on. `boundary` turns errors into these codes,
//! and exports what a failing call leaves: its message and its code's name.

use crate::error::Error;
use std::ffi::c_char;

/// The result of every graphed call. Dense, starting at 0 = OK; codes are
/// never renumbered (a retired code stays reserved). The message of the last
/// failing call on a thread is in `graphed_last_error_message()`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum graphed_status {
    /// Success.
    Ok = 0,
    /// An argument has a value the call does not accept (out of range,
    /// inconsistent sizes, unknown enum value).
    InvalidArgument = 1,
    /// A required pointer argument is NULL.
    NullPointer = 2,
    /// A struct the caller passes was not set up by its _default()
    /// function: its magic field is wrong (uninitialised memory, or another
    /// struct), or its struct_size is below the first released layout.
    BadStruct = 3,
    /// The CUDA driver library (libcuda) is not installed on this machine.
    NoDriver = 4,
    /// The driver is present but there is no usable CUDA device.
    NoDevice = 5,
    /// A CUDA driver call failed; the message names the call and the error.
    /// Also an error work on a stream met, reported when the stream was
    /// synchronized (a debug replay's check names the callable, pass and
    /// graph; on the host backend, a host kernel that returned non-zero).
    CudaError = 6,
    /// A device or host allocation failed.
    OutOfMemory = 7,
    /// The call is not allowed in the session's current state (for example,
    /// registering a callable after capture, or replaying before it).
    WrongState = 8,
    /// The session was reset: it can no longer capture or replay; destroy it.
    SessionReset = 9,
    /// A user callback returned a non-zero code; the message carries it, and
    /// capture was abandoned with everything it made released.
    CallbackFailed = 10,
    /// Something illegal happened under stream capture (a device
    /// synchronize, a plain allocation, work on another stream); capture was
    /// abandoned with everything it made released.
    CaptureInvalidated = 11,
    /// Strict alias leases: a replay would overwrite an alias still held by
    /// the caller (the message names callable and slot); or a step over
    /// microbatches finds every clone slot held by grads not yet released.
    /// Nothing was replayed.
    AliasHeld = 12,
    /// The pipeline schedule breaks a rule; the message names the rule.
    InvalidSchedule = 13,
    /// A callback asked the scratch allocator for more under capture than
    /// it did during warmup.
    ScratchExhausted = 14,
    /// The operation is not available with this backend or build.
    Unsupported = 15,
    /// The session is in use by another call (a re-entrant call from a
    /// callback, or two threads at once, destroy included).
    Busy = 16,
    /// The handle was destroyed (or released, or belonged to a callback
    /// that has returned). Handles are never reused, so this is reported
    /// even when the memory behind the old object was reused.
    UseAfterDestroy = 17,
    /// A bug in graphed (a caught panic); please report the message.
    Internal = 18,
    /// A replay was asked on a stream that is capturing a graph: graphed
    /// replays cannot be recorded into another capture. Nothing was
    /// enqueued.
    StreamCapturing = 19,
    /// The call combines features that do not work together (for example,
    /// a step in a session with a pipeline schedule); the message names
    /// them. Nothing was changed.
    Incompatible = 20,
    /// A replay was given a parameter at another address than its graphs
    /// read, and they cannot be pointed there (registered without
    /// GRAPHED_PARAM_FLAGS_REBIND, refused at capture, or a less aligned
    /// address); the message names the callable, the parameter and both
    /// addresses. Nothing was enqueued.
    ParamMoved = 21,
    /// The call names a callable that was released by
    /// graphed_session_release_callable (a forward, backward or weight-grad
    /// replay of it, a step that includes it, its static buffers); the
    /// message names the callable. Nothing was enqueued or changed.
    CallableReleased = 22,
    /// The ranks of a step with collectives (graphed_step_desc.collective)
    /// record different collectives in their graphs, compared through
    /// graphed_step_desc.collective_exchange at the end of the step's
    /// capture; or another rank's capture of the step failed. The message
    /// names the first entry that differs, on both sides. The capture was
    /// abandoned with everything it made released.
    CollectiveMismatch = 23,
}

/// Every status, in code order. Kept next to the enum so that a new code
/// cannot be added without a name.
pub(crate) const ALL_STATUSES: [(graphed_status, &str); 24] = [
    (graphed_status::Ok, "GRAPHED_STATUS_OK\0"),
    (
        graphed_status::InvalidArgument,
        "GRAPHED_STATUS_INVALID_ARGUMENT\0",
    ),
    (graphed_status::NullPointer, "GRAPHED_STATUS_NULL_POINTER\0"),
    (graphed_status::BadStruct, "GRAPHED_STATUS_BAD_STRUCT\0"),
    (graphed_status::NoDriver, "GRAPHED_STATUS_NO_DRIVER\0"),
    (graphed_status::NoDevice, "GRAPHED_STATUS_NO_DEVICE\0"),
    (graphed_status::CudaError, "GRAPHED_STATUS_CUDA_ERROR\0"),
    (
        graphed_status::OutOfMemory,
        "GRAPHED_STATUS_OUT_OF_MEMORY\0",
    ),
    (graphed_status::WrongState, "GRAPHED_STATUS_WRONG_STATE\0"),
    (
        graphed_status::SessionReset,
        "GRAPHED_STATUS_SESSION_RESET\0",
    ),
    (
        graphed_status::CallbackFailed,
        "GRAPHED_STATUS_CALLBACK_FAILED\0",
    ),
    (
        graphed_status::CaptureInvalidated,
        "GRAPHED_STATUS_CAPTURE_INVALIDATED\0",
    ),
    (graphed_status::AliasHeld, "GRAPHED_STATUS_ALIAS_HELD\0"),
    (
        graphed_status::InvalidSchedule,
        "GRAPHED_STATUS_INVALID_SCHEDULE\0",
    ),
    (
        graphed_status::ScratchExhausted,
        "GRAPHED_STATUS_SCRATCH_EXHAUSTED\0",
    ),
    (graphed_status::Unsupported, "GRAPHED_STATUS_UNSUPPORTED\0"),
    (graphed_status::Busy, "GRAPHED_STATUS_BUSY\0"),
    (
        graphed_status::UseAfterDestroy,
        "GRAPHED_STATUS_USE_AFTER_DESTROY\0",
    ),
    (graphed_status::Internal, "GRAPHED_STATUS_INTERNAL\0"),
    (
        graphed_status::StreamCapturing,
        "GRAPHED_STATUS_STREAM_CAPTURING\0",
    ),
    (
        graphed_status::Incompatible,
        "GRAPHED_STATUS_INCOMPATIBLE\0",
    ),
    (graphed_status::ParamMoved, "GRAPHED_STATUS_PARAM_MOVED\0"),
    (
        graphed_status::CallableReleased,
        "GRAPHED_STATUS_CALLABLE_RELEASED\0",
    ),
    (
        graphed_status::CollectiveMismatch,
        "GRAPHED_STATUS_COLLECTIVE_MISMATCH\0",
    ),
];

/// The name of every code the table does not hold.
pub(crate) const UNKNOWN_STATUS: &str = "GRAPHED_STATUS_UNKNOWN\0";

impl From<&Error> for graphed_status {
    fn from(e: &Error) -> Self {
        match e {
            Error::NullPointer { .. } => graphed_status::NullPointer,
            Error::InvalidArgument(_) => graphed_status::InvalidArgument,
            Error::BadStruct { .. } => graphed_status::BadStruct,
            Error::NoDriver(_) => graphed_status::NoDriver,
            Error::NoDevice(_) => graphed_status::NoDevice,
            Error::Cuda { .. } | Error::DeviceFault(_) => graphed_status::CudaError,
            Error::Surfaced { cause, .. } => graphed_status::from(&**cause),
            Error::OutOfMemory(_) => graphed_status::OutOfMemory,
            Error::WrongState(_) => graphed_status::WrongState,
            Error::SessionReset(_) => graphed_status::SessionReset,
            Error::CallbackFailed { .. }
            | Error::HookFailed { .. }
            | Error::UpdateFailed { .. }
            | Error::CollectiveFailed { .. } => graphed_status::CallbackFailed,
            Error::CollectiveMismatch(_) => graphed_status::CollectiveMismatch,
            Error::CaptureInvalidated { .. } | Error::IllegalUnderCapture(_) => {
                graphed_status::CaptureInvalidated
            }
            Error::AliasHeld(_) => graphed_status::AliasHeld,
            Error::InvalidSchedule(_) => graphed_status::InvalidSchedule,
            Error::ScratchExhausted(_) => graphed_status::ScratchExhausted,
            Error::Unsupported(_) => graphed_status::Unsupported,
            Error::Incompatible(_) => graphed_status::Incompatible,
            Error::ParamMoved(_) => graphed_status::ParamMoved,
            Error::CallableReleased(_) => graphed_status::CallableReleased,
            Error::Busy(_) => graphed_status::Busy,
            Error::UseAfterDestroy(_) => graphed_status::UseAfterDestroy,
            Error::Internal(_) => graphed_status::Internal,
            Error::StreamCapturing(_) => graphed_status::StreamCapturing,
        }
    }
}

/// The NUL-terminated name of a status code as the header spells it; an
/// unknown code gives "GRAPHED_STATUS_UNKNOWN".
pub(crate) fn name(code: u32) -> &'static str {
    ALL_STATUSES
        .get(code as usize)
        .map(|(_, n)| *n)
        .unwrap_or(UNKNOWN_STATUS)
}

/// The library's version as "MAJOR.MINOR.PATCH"; it matches the
/// GRAPHED_VERSION_* macros of the header the library was built with. Static.
#[no_mangle]
pub extern "C" fn graphed_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn names_are_dense_and_match_codes() {
        for (i, (status, n)) in ALL_STATUSES.iter().enumerate() {
            assert_eq!(*status as u32, i as u32, "{n} is out of order");
            assert_eq!(name(i as u32), *n);
        }
        assert_eq!(name(ALL_STATUSES.len() as u32), UNKNOWN_STATUS);
        assert_eq!(name(u32::MAX), UNKNOWN_STATUS);
    }

    #[test]
    fn version_matches_cargo() {
        // SAFETY: static NUL-terminated string.
        let v = unsafe { CStr::from_ptr(graphed_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
