//! The C ABI: every `extern "C"` function and every `#[repr(C)]` type of
//! the library, one file per concept. Each export checks its arguments,
//! calls one function of the layers below inside the panic boundary, and
//! turns the outcome into a `graphed_status` plus the thread's last error
//! message. No logic lives here, and nothing below this module knows C.
//!
//! The modules are declared in the order a caller meets the API, which is
//! the order of the generated header (cbindgen reads them in this order):
//! its conventions first, then the session, callables, callbacks, replays
//! and steps, returned clone blocks, queries (stats, buffers and plan,
//! memory), and the helpers. The comments keep rustfmt from sorting them.

// Status codes and their names, the version.
mod status;
// The panic boundary, the thread-local message, the status names.
mod boundary;
// C pointers, arrays and caller-filled structs into Rust values.
mod args;
// The C enums and their conversion to the Rust ones.
mod enums;
// The opaque handle types; handles (ids from the handle table) to pinned
// objects.
mod handles;
// The session config and the callbacks it carries.
mod config;
// Create, destroy, capture, reset.
mod session;
// Tensor, parameter and callable descriptors; registration.
mod callable;
// What callbacks receive and the exports they call.
mod callback;
// Forward, backward, weight-grad replays; returned refs and leases.
mod replay;
// Steps: callables replayed as one graph.
mod step;
// A step's update stage: its callback's context, the skip flag's query.
mod update;
// A step's collective stage: its callback's context, the manifest's record
// and query.
mod collective;
// Returned clone blocks.
mod buffer;
// A session's figures (graphed_session_stats).
mod stats;
// A captured session's buffers, rebinding, policies, the plan dump.
mod query;
// Teardown errors; what graphed holds: the device's, the process's and one
// callable's memory.
mod memory;
// Schedule steps and the helpers that derive them.
mod schedule;
// Whether a backend can run; device discovery.
mod device;
// Host-backend streams.
mod host;

pub use boundary::{graphed_last_error_message, graphed_status_name};
pub use buffer::*;
pub use callable::*;
pub use callback::*;
pub use collective::*;
pub use config::*;
pub use device::*;
pub use enums::*;
pub use handles::*;
pub use host::*;
pub use memory::*;
pub use query::*;
pub use replay::*;
pub use schedule::*;
pub use session::*;
pub use stats::*;
pub use status::*;
pub use step::*;
pub use update::*;
