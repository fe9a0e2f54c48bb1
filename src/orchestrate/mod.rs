//! Orchestration: registration, warmup, capture in order, replay and grad
//! return, over the [`Backend`](crate::backend::Backend) interface only.
//! Nothing here knows about C types or about CUDA.

pub mod capture;
pub mod external;
pub mod pool;
pub mod replay;
pub mod returned;
pub mod scratch;
pub mod session;
pub mod spec;

pub use returned::{RefKind, Returned};
pub use session::{Session, Stats};
pub use spec::*;
