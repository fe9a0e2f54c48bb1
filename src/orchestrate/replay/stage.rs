//! What a replay hands back, staged in vectors the session reuses: aliases
//! of static buffers (each under a new lease with strict leases), and
//! parameter grads by their return (clone block, destination, alias); and
//! the clone blocks that go back to their rings when nobody took them.

use super::super::instance::Placed;
use super::super::returned::{CloneBlock, RefKind, Returned};
use super::super::tensor::{Return, Tensor};
use crate::backend::DevPtr;
use crate::core::lease::Leases;
use std::sync::Arc;

fn returned(t: &Tensor, ptr: DevPtr, kind: RefKind, lease: u64, block: u32) -> Returned {
    Returned {
        ptr,
        bytes: t.bytes,
        kind,
        lease,
        block,
        rows: 0,
        pitch: 0,
    }
}

/// A new lease on tensor `t`'s slot, with strict leases (0 otherwise).
fn lease(leases: Option<&mut Leases>, t: &Tensor) -> u64 {
    match (leases, t.lease) {
        (Some(l), Some(slot)) => l.acquire(slot),
        _ => 0,
    }
}

/// Stages aliases of `tensors`' buffers (a default entry where there is
/// none); a DYNAMIC tensor's holds the data of the actual `sizes` (its
/// first rows, or rows of a pitch).
pub(super) fn aliases(
    out: &mut Vec<Returned>,
    tensors: &[Tensor],
    sizes: (u64, u64),
    mut leases: Option<&mut Leases>,
) {
    for t in tensors {
        out.push(if t.ptr == 0 {
            Returned::default()
        } else {
            let l = lease(leases.as_deref_mut(), t);
            let mut r = returned(t, t.ptr, RefKind::Alias, l, 0);
            if let (Some(v), true) = (t.varies, sizes.0 != 0 || sizes.1 != 0) {
                let at = v.at(sizes);
                r.bytes = at.data() as usize;
                if !at.contiguous() {
                    (r.rows, r.pitch) = (at.rows as usize, at.pitch as usize);
                }
            }
            r
        });
    }
}

/// Stages the parameter grads of a backward or weight-grad replay; CLONE
/// grads live in `block` = (its address, its index in the replay's blocks).
pub(super) fn params(
    inst: &Placed,
    dsts: Option<&[DevPtr]>,
    (block_ptr, block): (DevPtr, u32),
    mut leases: Option<&mut Leases>,
    out: &mut Vec<Returned>,
) {
    for (i, t) in inst.param_grads.iter().enumerate() {
        let dst = dsts.map_or(0, |d| d[i]);
        out.push(match t.ret {
            Return::None => Returned::default(),
            Return::Clone { offset } => {
                returned(t, block_ptr + offset as DevPtr, RefKind::Clone, 0, block)
            }
            Return::Alias => {
                let l = lease(leases.as_deref_mut(), t);
                returned(t, t.ptr, RefKind::Alias, l, 0)
            }
            Return::CopyInto => returned(t, dst, RefKind::CopyInto, 0, 0),
            Return::AccumulateInto { .. } => returned(t, dst, RefKind::AccumulateInto, 0, 0),
        });
    }
}

/// A clone block taken for a replay: given back if the replay fails before
/// its results are staged (else the block, and its ring slot, were lost).
pub(super) struct Taken(pub Option<Arc<CloneBlock>>);

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            crate::backend::teardown::check("giving back an unused clone block", b.release());
        }
    }
}

/// Gives back blocks a caller did not take from an earlier replay.
pub(super) fn give_back(blocks: &mut Vec<Arc<CloneBlock>>) {
    for b in blocks.drain(..) {
        crate::backend::teardown::check("giving back a clone block", b.release());
    }
}
