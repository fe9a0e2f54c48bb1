//! The C ABI: every `extern "C"` function and every `#[repr(C)]` type of
//! the library, one file per concept. Each export checks its arguments,
//! calls one function of the layers below inside the panic boundary, and
//! turns the outcome into a `graphed_status` plus the thread's last error
//! message. No logic lives here, and nothing below this module knows C.
//!
//! | file | concept |
//! |---|---|
//! | `boundary` | the panic boundary, the thread-local message, the status names |
//! | `args` | C pointers, arrays and caller-filled structs into Rust values |
//! | `status` | status codes and their names, the version |
//! | `enums` | the C enums and their conversion to the Rust ones |
//! | `handles` | the opaque handle types; handles (ids from the handle table) to pinned objects |
//! | `config` | the session config and the callbacks it carries |
//! | `session` | create, destroy, capture, reset |
//! | `callable` | tensor, parameter and callable descriptors; registration |
//! | `callback` | what callbacks receive and the exports they call |
//! | `replay` | forward, backward, weight-grad replays and leases |
//! | `buffer` | returned clone blocks |
//! | `query` | stats, buffers, policies, the plan dump, device memory |
//! | `schedule` | schedule steps and the helpers that derive them |
//! | `step` | steps: callables replayed as one graph |
//! | `device`, `host` | device discovery; host-backend streams |

mod args;
mod boundary;
mod buffer;
mod callable;
mod callback;
mod config;
mod device;
mod enums;
mod handles;
mod host;
mod query;
mod replay;
mod schedule;
mod session;
mod status;
mod step;

pub use boundary::{graphed_last_error_message, graphed_status_name};
pub use buffer::*;
pub use callable::*;
pub use callback::*;
pub use config::*;
pub use device::*;
pub use enums::*;
pub use handles::*;
pub use host::*;
pub use query::*;
pub use replay::*;
pub use schedule::*;
pub use session::*;
pub use status::*;
pub use step::*;
