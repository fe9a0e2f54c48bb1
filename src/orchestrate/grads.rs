//! Returning parameter grads out of the static buffers, as replays and step
//! captures enqueue it: the CLONE grads copied into a clone block (the
//! slab's clone span in one copy, then each external CLONE slot), the
//! COPY_INTO grads copied to their destinations, and the ACCUMULATE_INTO
//! grads added into theirs (one batched launch per dtype).

use super::instance::Placed;
use crate::backend::{AccItem, Backend, DevPtr, StreamRef};
use crate::error::Result;

/// Copies an instance's CLONE grads from where its grad pass wrote them
/// into the block at `block`.
pub(crate) fn copy_clones(
    backend: &dyn Backend,
    inst: &Placed,
    block: DevPtr,
    s: StreamRef,
) -> Result<()> {
    let clone = &inst.returns.clone;
    if let Some((start, end)) = clone.span {
        backend.copy(block, inst.slab + start as DevPtr, end - start, s)?;
    }
    for &(i, offset) in &clone.external {
        let g = &inst.param_grads[i];
        backend.copy(block + offset as DevPtr, g.ptr, g.bytes, s)?;
    }
    Ok(())
}

/// Enqueues the COPY_INTO copies and the ACCUMULATE_INTO launches (one per
/// dtype) of an instance's parameter grads, into `dst(i)` for parameter i.
pub(crate) fn enqueue_destinations(
    backend: &dyn Backend,
    inst: &Placed,
    dst: impl Fn(usize) -> DevPtr,
    acc: &mut Vec<AccItem>,
    s: StreamRef,
) -> Result<()> {
    for &i in &inst.returns.copy_into {
        let g = &inst.param_grads[i];
        backend.copy(dst(i), g.ptr, g.bytes, s)?;
    }
    for (dtype, params) in &inst.returns.accumulate {
        acc.clear();
        acc.extend(params.iter().map(|&i| AccItem {
            dst: dst(i),
            src: inst.param_grads[i].ptr,
            count: inst.param_grads[i].bytes / dtype.size(),
        }));
        backend.accumulate(acc, *dtype, s)?;
    }
    Ok(())
}
