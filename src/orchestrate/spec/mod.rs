//! What the caller registers and configures, by what it describes: a
//! callable (`callable`), a step (`step`), a session and its calls
//! (`session`). Everything is re-exported here.

mod callable;
mod session;
mod step;

pub use callable::*;
pub use session::*;
pub use step::*;
