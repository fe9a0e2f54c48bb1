//! The pure core: decisions and bookkeeping with no CUDA and no C in them,
//! so that they are unit-tested on any machine. Element types, grad-return
//! policies and the return plan they freeze into, the static-buffer layout,
//! alias leases, the scratch arena, pipeline schedules, how long each
//! buffer of a schedule is needed, the static-buffer planner (`plan/`: its
//! lifetimes, reuse, and the split of its memory by owning callable),
//! checked size arithmetic, strided regions of caller memory, where a
//! DYNAMIC tensor's data lies in its bucket (`padded`), the handle
//! table and captured graphs as DOT text.

pub mod arena;
pub mod collective;
pub mod dot;
pub mod dtype;
pub mod handle;
pub mod layout;
pub mod lease;
pub mod padded;
pub mod plan;
pub mod policy;
pub mod release;
pub mod returns;
pub mod schedule;
pub mod size;
pub mod strided;

/// A pass of a callable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PassKind {
    Forward,
    Backward,
    /// The delayed weight-gradient pass.
    Wgrad,
}

impl PassKind {
    /// Index for per-pass tables: forward 0, backward 1, weight-grad 2.
    pub fn index(self) -> usize {
        match self {
            PassKind::Forward => 0,
            PassKind::Backward => 1,
            PassKind::Wgrad => 2,
        }
    }
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
pub const ALIGN: usize = 256;
