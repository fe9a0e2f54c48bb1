//! Where the static buffers live. Without reuse every buffer has its own
//! memory. With reuse (a pipeline schedule only), buffers whose lifetimes
//! do not overlap share memory, one slot per signature (size), following
//! Transformer Engine's reuse rules, as `core::release` states them for
//! every buffer of a schedule's instances (a later microbatch's inputs take
//! over an earlier one's once its backward ran; grad-outputs, used only
//! inside their backward, share memory by signature); a parameter-grad slab
//! with an ALIAS slot is kept for the whole session.
//!
//! Lifetimes are in pass positions of the capture order (inclusive); the
//! plan is a pure function of them and the buffer sizes. In steps of their
//! own: how long each buffer is needed and the most bytes live at once
//! (`lifetimes`), the sharing of memory between buffers whose lifetimes do
//! not overlap (`reuse`), and the split of a plan's memory by owner
//! (`owned`: each callable's slots that no other callable uses in an
//! allocation of its own, the others in one shared allocation). Here, the
//! plan itself and the plan without reuse.

mod lifetimes;
mod owned;
mod reuse;

pub use lifetimes::{lifetimes, peak_live};
pub use owned::{owned, Owned};
pub use reuse::reuse;

use super::layout::BufferDesc;
use super::size;
use crate::error::Result;

/// The passes (inclusive) during which a buffer's contents matter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub start: usize,
    pub end: usize,
}

impl Lifetime {
    pub fn overlaps(&self, o: &Lifetime) -> bool {
        self.start <= o.end && o.start <= self.end
    }
}

/// Where each buffer lives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Offset of each buffer in the static allocation.
    pub offsets: Vec<usize>,
    /// Physical slot of each buffer: buffers sharing memory share a slot.
    pub slot_of: Vec<usize>,
    /// Size of the static allocation.
    pub total_bytes: usize,
    /// What it would be without reuse.
    pub disjoint_bytes: usize,
    /// Lower bound of any plan: the most bytes live at one pass.
    pub peak_live_bytes: usize,
}

const WHAT: &str = "the static buffers";

/// The memory a buffer takes: its size rounded up to the alignment.
fn size(b: &BufferDesc) -> Result<usize> {
    size::aligned(b.bytes.max(1), WHAT)
}

/// Every buffer in its own memory.
pub fn disjoint(buffers: &[BufferDesc]) -> Result<Plan> {
    let mut offsets = Vec::with_capacity(buffers.len());
    let mut total = 0usize;
    for b in buffers {
        offsets.push(total);
        total = size::add(total, size(b)?, WHAT)?;
    }
    Ok(Plan {
        offsets,
        slot_of: (0..buffers.len()).collect(),
        total_bytes: total,
        disjoint_bytes: total,
        peak_live_bytes: total,
    })
}

#[cfg(test)]
mod tests {
    //! What the steps' tests share: a layout of identical layers under a
    //! schedule, a buffer of it by instance and role, and random valid
    //! schedules.
    use super::*;
    use crate::core::layout::{layout, InstanceShape, Layout, ParamShape, Role, TensorShape};
    use crate::core::policy::GradPolicy;
    use crate::core::schedule::tests::te;
    use crate::core::schedule::{Schedule, ScheduleStep};
    use crate::core::PassKind;

    const H: usize = 1024; // bytes of every activation in these tests

    /// A layout of `callables` x `mb` identical one-input one-output layers
    /// with one CLONE (or ALIAS) parameter, instance = callable * mb + m.
    pub(super) fn setup(
        s: &Schedule,
        first_input_grad: bool,
        policy: GradPolicy,
    ) -> (Layout, Vec<Lifetime>) {
        let callables = s.layers_per_chunk.iter().sum::<usize>();
        let shapes: Vec<InstanceShape> = (0..callables * s.microbatches)
            .map(|i| InstanceShape {
                inputs: vec![TensorShape {
                    bytes: H,
                    requires_grad: first_input_grad || i >= s.microbatches,
                    external: false,
                    chained: None,
                }],
                outputs: vec![TensorShape {
                    bytes: H,
                    requires_grad: true,
                    external: false,
                    chained: None,
                }],
                params: vec![Some(ParamShape {
                    bytes: 4 * H,
                    policy,
                    external: false,
                })],
            })
            .collect();
        let l = layout(&shapes).unwrap();
        let m = s.microbatches;
        let lt = lifetimes(s, &l, |c, mb| c * m + mb);
        (l, lt)
    }

    /// The buffer of instance `inst` in `role` (the first, for inputs and
    /// outputs).
    pub(super) fn buffer(l: &Layout, inst: usize, role: Role) -> usize {
        l.buffers
            .iter()
            .position(|b| b.instance == inst && b.role == role)
            .unwrap()
    }

    /// Three chunks of 1, 2 and 1 layers, two microbatches, one after the
    /// other.
    pub(super) fn three_chunks() -> Schedule {
        Schedule::derive(
            &te(&[
                1.0, 2.0, 3.0, 1.0, 2.0, 3.0, -3.0, -2.0, -1.0, -3.0, -2.0, -1.0,
            ]),
            Some(&[1, 2, 1]),
            &[false; 4],
        )
        .unwrap()
    }

    /// Random valid interleaved schedules: chunks run in order per
    /// microbatch, forwards lead backwards by a random amount.
    fn random_schedule(seed: &mut u64) -> (Vec<ScheduleStep>, usize, usize) {
        let mut rnd = |n: usize| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 33) as usize) % n
        };
        let chunks = 1 + rnd(3);
        let mb = 1 + rnd(4);
        // Per microbatch a sequence F0..F(c-1), B(c-1)..B0; interleave the
        // microbatches' sequences randomly, keeping microbatch order per step kind.
        let mut next = vec![0usize; mb];
        let seq: Vec<ScheduleStep> = (0..chunks)
            .map(|c| ScheduleStep {
                kind: PassKind::Forward,
                chunk: c as u32,
            })
            .chain((0..chunks).rev().map(|c| ScheduleStep {
                kind: PassKind::Backward,
                chunk: c as u32,
            }))
            .collect();
        let mut steps = Vec::new();
        let mut started = 0;
        while steps.len() < 2 * chunks * mb {
            // Candidates: the earliest unfinished microbatch (keeps per-chunk
            // microbatch order) or the next one to start.
            let mut cands: Vec<usize> = (0..started)
                .filter(|&m| next[m] < seq.len())
                .take(1)
                .collect();
            if started < mb {
                cands.push(started);
            }
            let m = cands[rnd(cands.len())];
            if m == started {
                started += 1;
            }
            steps.push(seq[next[m]]);
            next[m] += 1;
        }
        (steps, chunks, mb)
    }

    /// 300 random valid schedules, each with its callable count and
    /// whether the first callable's input requires grad (for `setup`).
    pub(super) fn random_schedules() -> Vec<(Schedule, usize, bool)> {
        let mut seed = 42u64;
        (0..300)
            .map(|_| {
                let (steps, chunks, _) = random_schedule(&mut seed);
                let layers: Vec<u32> = (0..chunks)
                    .map(|c| 1 + (c as u32 + seed as u32) % 3)
                    .collect();
                let n: usize = layers.iter().map(|&x| x as usize).sum();
                let s = match Schedule::derive(&steps, Some(&layers), &vec![false; n]) {
                    Ok(s) => s,
                    Err(e) => panic!("generated an invalid schedule {steps:?}: {e}"),
                };
                (s, n, (seed & 1) == 0)
            })
            .collect()
    }

    #[test]
    fn disjoint_plan_gives_every_buffer_its_own_memory() {
        let bufs: Vec<BufferDesc> = (0..5)
            .map(|i| BufferDesc {
                instance: 0,
                role: Role::Input,
                index: i,
                bytes: 100 * (i + 1),
            })
            .collect();
        let p = disjoint(&bufs).unwrap();
        assert_eq!(p.slot_of, vec![0, 1, 2, 3, 4]);
        assert_eq!(p.total_bytes, 256 + 256 + 512 + 512 + 512);
    }
}
