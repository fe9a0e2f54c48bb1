//! Orchestration: registration, warmup, capture in order, replay and grad
//! return, over the [`Backend`](crate::backend::Backend) interface only.
//! Nothing here knows about C or about CUDA.

pub mod capture;
pub mod captured;
pub mod clock;
pub mod external;
pub mod pool;
pub mod rebind;
pub mod replay;
pub mod returned;
pub mod scratch;
pub mod session;
pub mod spec;

pub use captured::LeaseBook;
pub use clock::CaptureTimes;
pub use replay::Replayed;
pub use returned::{CloneBlock, RefKind, Returned};
pub use session::{Session, SessionCell, Stats};
pub use spec::*;
