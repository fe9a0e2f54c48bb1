//! Backends: the CUDA driver backend (the product) and the host emulation.
pub mod cuda;
