//! graphed: capture the forward and backward passes of training layers into
//! CUDA graphs, replay them, and hand gradients back with safe lifetimes,
//! behind a C ABI (`include/graphed.h`).
//!
//! Layers, from the outside in:
//! - [`ffi`]: every `extern "C"` function; argument checks, the panic
//!   boundary, status codes and messages. No logic.
//! - `core`: pure logic with no CUDA: policies, leases, buffer layout,
//!   schedules, plans. Unit-tested anywhere.
//! - `orchestrate`: warmup, capture, replay and grad return over the
//!   backend interface.
//! - [`backend`]: the CUDA driver backend and the host emulation.

pub mod backend;
pub mod core;
pub mod error;
#[allow(non_camel_case_types)] // C names, as the header spells them.
pub mod ffi;
pub mod orchestrate;

pub use error::{Error, Result};
