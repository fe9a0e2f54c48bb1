//! The pure core: decisions and bookkeeping with no CUDA in them, so that
//! they are unit-tested on any machine. Element types, grad-return policies,
//! the static-buffer layout, alias leases and the scratch arena.

pub mod arena;
pub mod dtype;
pub mod layout;
pub mod lease;
pub mod plan;
pub mod policy;
pub mod schedule;

/// A pass of a callable. C name: `graphed_pass`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PassKind {
    Forward = 0,
    Backward = 1,
    /// The delayed weight-gradient pass.
    Wgrad = 2,
}

impl std::fmt::Display for PassKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PassKind::Forward => "forward",
            PassKind::Backward => "backward",
            PassKind::Wgrad => "weight-grad",
        })
    }
}

/// Alignment of every buffer the library places (static buffers, slab
/// slots, scratch): enough for any vector load and for the driver's own
/// allocation granularity of small buffers.
pub(crate) const ALIGN: usize = 256;

/// `n` rounded up to a multiple of `ALIGN`.
pub const fn align_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}
