//! Returning parameter grads out of the static buffers, as replays and step
//! captures enqueue it: the CLONE grads copied into a clone block (the
//! slab's clone span in one copy, then each external CLONE slot), the
//! COPY_INTO grads copied to their destinations, and the ACCUMULATE_INTO
//! grads added into theirs (one batched launch per dtype); in a step over
//! microbatches, each later microbatch's grads added to those sums.

use super::instance::Placed;
use super::tensor::Tensor;
use crate::backend::{AccItem, Backend, DevPtr, StreamRef};
use crate::core::dtype::DType;
use crate::core::returns::ParamReturn;
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
/// dtype) of an instance's parameter grads, into `dst(i)` for parameter i;
/// not the copies of COPY_INTO grads the pass wrote there itself
/// (`written(i)`: rebound at capture, pointed at the destination).
pub(crate) fn enqueue_destinations(
    backend: &dyn Backend,
    inst: &Placed,
    dst: impl Fn(usize) -> DevPtr,
    written: impl Fn(usize) -> bool,
    acc: &mut Vec<AccItem>,
    s: StreamRef,
) -> Result<()> {
    for &i in &inst.returns.copy_into {
        if written(i) {
            continue;
        }
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

/// Adds an instance's parameter grads of one more microbatch to their sums
/// (a step over microbatches, after the first): COPY_INTO and
/// ACCUMULATE_INTO grads into `dst(i)`, CLONE grads into their place in
/// `block` (the step's clone slot block). One batched launch per dtype;
/// `acc` is reused.
pub(crate) fn enqueue_sums(
    backend: &dyn Backend,
    inst: &Placed,
    dst: impl Fn(usize) -> DevPtr,
    block: Option<DevPtr>,
    acc: &mut Vec<AccItem>,
    s: StreamRef,
) -> Result<()> {
    let into = |i: usize, t: &Tensor| match t.ret {
        ParamReturn::CopyInto | ParamReturn::AccumulateInto { .. } => Some(dst(i)),
        ParamReturn::Clone { offset } => block.map(|b| b + offset as DevPtr),
        ParamReturn::None | ParamReturn::Alias => None,
    };
    let mut dtypes: Vec<DType> = Vec::new();
    for t in &inst.param_grads {
        if !dtypes.contains(&t.dtype) {
            dtypes.push(t.dtype);
        }
    }
    for dtype in dtypes {
        acc.clear();
        acc.extend(
            inst.param_grads
                .iter()
                .enumerate()
                .filter(|(_, t)| t.dtype == dtype)
                .filter_map(|(i, t)| {
                    into(i, t).map(|d| AccItem {
                        dst: d,
                        src: t.ptr,
                        count: t.bytes / dtype.size(),
                    })
                }),
        );
        if !acc.is_empty() {
            backend.accumulate(acc, dtype, s)?;
        }
    }
    Ok(())
}
