//! What a successful step replay returns: one ref per parameter of the
//! step's callables, by frozen policy (clones holding the grads, aliases
//! and their leases, COPY_INTO and ACCUMULATE_INTO destinations; over
//! several microbatches, or in a loop on the device, their f32, f16 or
//! bf16 sums over the microbatches it ran), what its copies out wrote, and
//! the clone blocks and leases the model then holds.

use super::*;

/// What a successful step replay ran with: its epoch, its microbatch
/// count, the accumulating destinations before it and the blocks of its
/// copies out it must leave alone.
pub(super) struct StepRun {
    pub epoch: u8,
    pub count: u32,
    pub before: Vec<Vec<u8>>,
    pub kept: Vec<Vec<u8>>,
}

/// Checks the refs a successful replay `run` of step `st_model` of
/// session `k` wrote and takes their blocks and leases into the model.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_step_refs(
    k: usize,
    strict: bool,
    clone: bool,
    st_model: &StepModel,
    params: &[(usize, usize, Param)],
    refs: &[u8],
    stride: usize,
    run: &StepRun,
) {
    let (epoch, before) = (run.epoch, &run.before);
    let wd = w();
    let mut blocks: Vec<HeldBlock> = Vec::new();
    let mut new_leases = Vec::new();
    // Destroyed when idle from inside this replay: its aliases went with it.
    let gone = !wd.sessions.borrow()[k].alive;
    // A step over microbatches returns their grads' sums (see sums.rs); a
    // loop on the device sums from -0.0, even one microbatch.
    let summed = st_model.microbatches > 1 || st_model.device_loop;
    let from_zero = st_model.device_loop;
    for (at, (c, j, p)) in params.iter().enumerate() {
        let r = read_ref(refs, at * stride);
        let gs = grads_of(k, st_model, *c, *j, epoch, run.count);
        let b = gs[gs.len() - 1];
        let what = format!(
            "step param {at} (dtype {}) over {} microbatches",
            p.dtype, run.count
        );
        let dst = st_model.dsts[at];
        trace!(
            "  step param {at}: policy {} grads {gs:02x?}",
            p.resolved(clone)
        );
        match p.resolved(clone) {
            0 => assert_eq!(
                (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                (0, 0, 0, 0, 0),
                "step param {at}: NONE"
            ),
            1 => {
                assert_eq!(r.kind, 2, "step param {at}: CLONE");
                assert!(r.owner != 0 && r.ptr != 0 && r.bytes == p.bytes && r.lease == 0);
                let x = match blocks.iter_mut().position(|x| x.owner == r.owner) {
                    Some(x) => x,
                    None => {
                        blocks.push(HeldBlock {
                            owner: r.owner,
                            refs: 0,
                            sess: k,
                            grads: Vec::new(),
                            words: Vec::new(),
                            inst: (*c, 0),
                            // A looped step's clones come from a slot.
                            slot: st_model.looped(),
                        });
                        blocks.len() - 1
                    }
                };
                let x = &mut blocks[x];
                assert_eq!(
                    x.inst,
                    (*c, 0),
                    "step param {at}: two callables' clones in one block"
                );
                x.refs += 1;
                if !summed {
                    assert!(all_bytes(r.ptr, p.bytes, b), "step param {at}: the clone");
                    x.grads.push((r.ptr, r.bytes, b));
                } else if let Some(width) = sum_width(p.dtype) {
                    let sum = sum_of(p.dtype, &gs, from_zero);
                    let what = format!("{what}: the clone of the sum");
                    let got = check_sum(r.ptr, p.bytes, p.dtype, sum, &what);
                    x.words.push((r.ptr, r.bytes, got, width));
                }
            }
            2 => {
                assert_eq!(
                    (r.kind, r.bytes, r.owner),
                    (1, p.bytes, 0),
                    "step param {at}: ALIAS"
                );
                assert!(
                    gone || all_bytes(r.ptr, p.bytes, b),
                    "step param {at}: the alias"
                );
                assert_eq!(r.lease != 0, strict, "step param {at}: lease");
                if r.lease != 0 {
                    new_leases.push(Lease {
                        sess: k,
                        token: r.lease,
                        slot: (*c, 0, 2, *j),
                        // Steps hold no callable with buckets.
                        bucket: None,
                    });
                }
            }
            3 => {
                assert_eq!(
                    (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                    (3, dst, p.bytes, 0, 0)
                );
                if !summed {
                    assert!(all_bytes(dst, p.bytes, b), "step param {at}: COPY_INTO");
                } else if sum_width(p.dtype).is_some() {
                    let sum = sum_of(p.dtype, &gs, from_zero);
                    check_sum(dst, p.bytes, p.dtype, sum, &format!("{what}: COPY_INTO"));
                }
            }
            _ => {
                assert_eq!(
                    (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                    (4, dst, p.bytes, 0, 0)
                );
                if sum_width(p.dtype).is_some() && !before[at].is_empty() {
                    check_accumulated_all(&before[at], dst, p.dtype, &gs, &what);
                }
            }
        }
    }
    for blk in &blocks {
        assert!(
            !wd.blocks.borrow().iter().any(|x| x.owner == blk.owner),
            "a clone block handle was reused"
        );
    }
    for l in &new_leases {
        assert!(
            !wd.leases.borrow().iter().any(|h| h.token == l.token),
            "a lease token was handed out twice"
        );
    }
    wd.blocks.borrow_mut().extend(blocks);
    wd.leases.borrow_mut().extend(new_leases);
    if !gone {
        check_copies_out(k, st_model, epoch, run.count, &run.kept);
    }
}
