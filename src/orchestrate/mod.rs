//! Orchestration: registration, capture in the order of its steps, replay
//! and grad return, over the [`Backend`](crate::backend::Backend) interface
//! only. Nothing here knows about C or about CUDA.
//!
//! | module | room |
//! |---|---|
//! | `spec`, `steps`, `context` | what callers register, declare and configure; what a capture reads of a session |
//! | `session`, `registration`, `lifecycle`, `cell`, `report`, `dot` | the session's states and replays' entry; what callers register; capture, releasing one callable, reset and drop; how callers reach it, what it reports; its graphs as DOT text |
//! | `tensor`, `instance` | one captured tensor with all its facts; a placed instance and its graphs |
//! | `place`, `leases`, `statics` | capture step 1: static buffers planned and placed, lease slots; the static allocations and their owners |
//! | `capture` | capture steps 2 and 3: warmup, the passes, clone slots, steps; the transaction |
//! | `rebind` | capture step 4: rebinding planned and verified on the device |
//! | `captured`, `released` | the captured state, built whole; one callable released from it, and what each holds |
//! | `replay` | replay: checks, feed, launch, grads, staging; step replays; debug mode's checks |
//! | `grads`, `returned` | parameter grads out of the static buffers; clone blocks and rings |
//! | `scratch`, `pool`, `external` | the scratch allocator, shared pools, buffers callbacks provide |
//! | `buckets` | the device's sizes of bucketed callables; the graphs that choose a bucket on the device |
//! | `clock` | where capture time goes |

mod buckets;
pub mod capture;
pub mod captured;
pub mod cell;
pub mod clock;
mod context;
mod dot;
pub mod external;
mod grads;
mod instance;
mod leases;
mod lifecycle;
mod place;
pub mod pool;
mod rebind;
pub mod registration;
pub mod released;
pub mod replay;
pub mod report;
pub mod returned;
pub mod scratch;
pub mod session;
pub mod spec;
mod statics;
pub mod steps;
mod tensor;
#[cfg(test)]
mod testing;
pub(crate) mod update;

pub use captured::LeaseBook;
pub use cell::SessionCell;
pub use clock::CaptureTimes;
pub use released::CallableMemory;
pub use replay::Replayed;
pub use report::Stats;
pub use returned::{CloneBlock, RefKind, Returned};
pub use session::Session;
pub use spec::*;
