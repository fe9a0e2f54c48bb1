//! Steps (graphed_session_add_step): their declaration (with microbatches,
//! io copies and loops on the device), the model of the step graphs a
//! capture makes of them and of what it refuses, and their replay (with a
//! microbatch count), checked against that model, sums included; in
//! sessions of their own, a step's update stage (`update.rs`) and its
//! collective stage (`collective.rs`).

use super::*;

mod collective;
mod declare;
mod graphs;
mod io;
mod looped;
mod replay;
mod results;
mod sums;
mod update;

pub use collective::*;
pub use declare::*;
pub use graphs::*;
pub use io::*;
pub use looped::*;
pub use replay::*;
use results::*;
pub use sums::*;
pub use update::*;

/// A session destroyed when idle by code that ran inside the call that
/// just returned (a callback, a host task) is gone now: its leases go
/// stale with it.
pub fn forget_if_gone(k: usize) {
    if !w().sessions.borrow()[k].alive {
        drop_session_state(k);
    }
}
