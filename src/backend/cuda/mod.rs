//! The CUDA backend: the driver API through cudarc, with raw device pointers
//! and streams owned by the caller.
pub mod driver;
