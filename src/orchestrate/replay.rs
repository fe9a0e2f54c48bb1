//! Replay: copy new data into the static buffers (skipped where the caller
//! passes the static buffer itself), launch the graph on the caller's stream
//! (or on a side stream synced back by events), and return outputs and
//! grads by the instance's return plan. Everything that can be refused is
//! checked before anything is enqueued (arguments, destinations and their
//! alignment, strict leases, a stream that is capturing, the replay order of
//! sessions sharing a pool), and results are staged in vectors the session
//! reuses, so the steady-state path does no host allocation beyond one
//! clone block.

use super::captured::{Captured, Instance, Stage};
use super::returned::{CloneBlock, RefKind, Returned};
use super::session::{Session, State};
use super::spec::{CallableSpec, ReplayArgs};
use crate::backend::{AccItem, DevPtr};
use crate::core::lease::Leases;
use crate::core::returns::ParamReturn;
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::sync::Arc;

/// What one replay hands back. `first` holds the outputs (forward) or the
/// input grads (backward); `second` the parameter grads (backward,
/// weight-grad); `block` the clone block the CLONE grads live in.
pub struct Replayed<'a> {
    pub first: &'a [Returned],
    pub second: &'a [Returned],
    pub block: Option<Arc<CloneBlock>>,
}

impl Session {
    /// Replays the forward graph of (callable, microbatch) and returns the
    /// static outputs: aliases, valid until the next forward replay of the
    /// same instance.
    pub fn forward(&mut self, a: &ReplayArgs) -> Result<Replayed<'_>> {
        self.replay(a, PassKind::Forward)
    }

    /// Replays the backward graph; returns the input grads (aliases, valid
    /// until the next backward replay of the same instance) and the
    /// parameter grads per the return plan (all NONE when the callable has
    /// a weight-grad graph: `wgrad` returns them).
    pub fn backward(&mut self, a: &ReplayArgs) -> Result<Replayed<'_>> {
        self.replay(a, PassKind::Backward)
    }

    /// Replays the weight-grad graph of a callable registered with a
    /// weight-grad callback; returns its parameter grads per the return plan.
    pub fn wgrad(&mut self, a: &ReplayArgs) -> Result<Replayed<'_>> {
        self.replay(a, PassKind::Wgrad)
    }

    fn replay(&mut self, a: &ReplayArgs, kind: PassKind) -> Result<Replayed<'_>> {
        self.captured()?;
        let key = self.key;
        let Session {
            backend,
            opts,
            callables,
            state,
            counters,
            pool,
            leases,
            ..
        } = self;
        let State::Captured(cap) = state else {
            return Err(Error::Internal("state changed".into()));
        };
        let cap: &mut Captured = cap;
        let idx = cap.instance_index(a.callable, a.microbatch)?;
        let inst = &cap.instances[idx];
        let spec = &callables[inst.callable];
        let who = || {
            format!(
                "the {kind} replay of callable '{}' (microbatch {})",
                spec.name, inst.microbatch
            )
        };

        // ---- checks: nothing is enqueued before they all pass ----------------
        let returns_params = match kind {
            PassKind::Forward => false,
            PassKind::Backward => !inst.has_wgrad(),
            PassKind::Wgrad => true,
        };
        match kind {
            PassKind::Forward => {
                check_data(a.data, inst.buffers.inputs.len(), |_| true, "inputs", spec)?
            }
            PassKind::Backward => {
                let gout = &inst.buffers.grad_outputs;
                check_data(a.data, gout.len(), |i| gout[i] != 0, "grad_outputs", spec)?
            }
            PassKind::Wgrad => {
                if !inst.has_wgrad() {
                    return Err(Error::invalid(format!(
                        "callable '{}' has no weight-grad callback: its parameter grads are returned by backward",
                        spec.name
                    )));
                }
                if a.data.is_some() {
                    return Err(Error::invalid(
                        "a weight-grad replay takes no data: pass NULL",
                    ));
                }
            }
        }
        if returns_params {
            check_dsts(a.param_dsts, inst, spec)?;
        }
        for (s, what) in [(Some(a.stream), "stream"), (a.side_stream, "side_stream")] {
            match s {
                Some(s) if backend.is_capturing(s)? => {
                    return Err(Error::StreamCapturing(format!(
                        "{}: args.{what} is capturing a graph. graphed replays cannot be recorded into another \
                         capture (their clones and copies would outlive what the outer graph can own); replay \
                         outside the capture, or capture the work directly. Nothing was enqueued",
                        who()
                    )))
                }
                _ => {}
            }
        }
        let strict = opts.strict_leases;
        let mut book = strict.then(|| leases.lock());
        if let Some(l) = &book {
            l.check_free(&inst.leases.overwritten[kind.index()], who)?;
        }
        let pos = inst.position[kind.index()]
            .ok_or_else(|| Error::Internal(format!("{} was not captured", who())))?;
        pool.replaying(key, pos, |k, p| describe_pass(cap, callables, k, key, p))?;

        // ---- enqueue ----------------------------------------------------------
        let _ctx = backend.bind()?;
        let s = match a.side_stream {
            Some(side) => {
                backend.join(a.stream, side, cap.ev_in.raw())?;
                side
            }
            None => a.stream,
        };
        let clone = &inst.returns.clone;
        let block = match (&opts.allocator, &inst.ring) {
            _ if !returns_params || clone.count == 0 => None,
            (Some(a), _) => Some(CloneBlock::from_caller(
                backend,
                a,
                counters,
                clone.bytes,
                s,
            )?),
            (None, Some(ring)) => Some(ring.take(s)?),
            (None, None) => {
                return Err(Error::Internal(
                    "a CLONE instance without a clone ring".into(),
                ))
            }
        };
        if let Some(data) = a.data {
            let (dsts, tensors) = match kind {
                PassKind::Forward => (&inst.buffers.inputs, &spec.inputs),
                _ => (&inst.buffers.grad_outputs, &spec.outputs),
            };
            let sizes = tensors.iter().map(|t| t.bytes);
            // Entries with no static buffer (dst 0) take no data.
            for ((&dst, bytes), &src) in dsts.iter().zip(sizes).zip(data) {
                if dst != 0 && src != 0 {
                    backend.copy(dst, src, bytes, s)?;
                }
            }
        }
        inst.graph(kind)?.launch(s)?;
        if returns_params {
            let b = &inst.buffers;
            if let Some(blk) = &block {
                // The slab's CLONE span in one copy, then any external CLONE slot.
                if let Some((start, end)) = clone.span {
                    backend.copy(blk.ptr, b.slab + start as DevPtr, end - start, s)?;
                }
                for &(i, offset) in &clone.external {
                    backend.copy(
                        blk.ptr + offset as DevPtr,
                        b.param_grads[i],
                        b.param_bytes[i],
                        s,
                    )?;
                }
            }
            // check_dsts made sure these have destinations.
            let dst = |i: usize| a.param_dsts.map_or(0, |d| d[i]);
            for &i in &inst.returns.copy_into {
                backend.copy(dst(i), b.param_grads[i], b.param_bytes[i], s)?;
            }
            // ACCUMULATE_INTO slots: one batched launch per dtype.
            for (dtype, params) in &inst.returns.accumulate {
                cap.stage.acc.clear();
                cap.stage.acc.extend(params.iter().map(|&i| AccItem {
                    dst: dst(i),
                    src: b.param_grads[i],
                    count: b.param_bytes[i] / dtype.size(),
                }));
                backend.accumulate(&cap.stage.acc, *dtype, s)?;
            }
        }
        if let Some(side) = a.side_stream {
            backend.join(side, a.stream, cap.ev_out.raw())?;
        }
        if let Some(b) = &block {
            b.set_stream(a.stream);
        }

        // ---- results ------------------------------------------------------------
        let block_ptr = block.as_ref().map_or(0, |b| b.ptr);
        let Stage {
            a: first,
            b: second,
            ..
        } = &mut cap.stage;
        first.clear();
        second.clear();
        let leases = book.as_deref_mut();
        match kind {
            PassKind::Forward => stage_aliases(
                first,
                &inst.buffers.outputs,
                spec.outputs.iter().map(|t| t.bytes),
                inst.leases.outputs.iter().map(|&l| Some(l)),
                leases,
            ),
            PassKind::Backward => {
                stage_aliases(
                    first,
                    &inst.buffers.grad_inputs,
                    spec.inputs.iter().map(|t| t.bytes),
                    inst.leases.grad_inputs.iter().copied(),
                    leases,
                );
                if returns_params {
                    stage_params(inst, a.param_dsts, block_ptr, book.as_deref_mut(), second);
                } else {
                    second.resize(inst.returns.params.len(), Returned::default());
                }
            }
            PassKind::Wgrad => stage_params(inst, a.param_dsts, block_ptr, leases, second),
        }
        Ok(Replayed {
            first,
            second,
            block,
        })
    }
}

/// "the backward of callable 'x' (microbatch 1)" for position `pos` of the
/// capture order of session `key` (this one) or another session's.
fn describe_pass(
    cap: &Captured,
    callables: &[CallableSpec],
    key: u64,
    me: u64,
    pos: usize,
) -> String {
    if key != me {
        return format!("its pass {pos}");
    }
    match cap.order.get(pos) {
        Some(p) => {
            let inst = &cap.instances[p.instance];
            format!(
                "the {} of callable '{}' (microbatch {})",
                p.kind, callables[inst.callable].name, inst.microbatch
            )
        }
        None => format!("pass {pos}"),
    }
}

/// Stages aliases of static buffers (0 where a buffer does not exist), each
/// under a new lease when the session has strict leases.
fn stage_aliases(
    out: &mut Vec<Returned>,
    ptrs: &[DevPtr],
    bytes: impl Iterator<Item = usize>,
    slots: impl Iterator<Item = Option<usize>>,
    mut leases: Option<&mut Leases>,
) {
    let mut slots = slots;
    for (&ptr, bytes) in ptrs.iter().zip(bytes) {
        let slot = slots.next().flatten();
        out.push(if ptr == 0 {
            Returned::default()
        } else {
            let lease = match (leases.as_deref_mut(), slot) {
                (Some(l), Some(slot)) => l.acquire(slot),
                _ => 0,
            };
            Returned {
                ptr,
                bytes,
                kind: RefKind::Alias,
                lease,
            }
        });
    }
}

/// Stages the parameter grads of a backward or weight-grad replay.
fn stage_params(
    inst: &Instance,
    dsts: Option<&[DevPtr]>,
    block_ptr: DevPtr,
    mut leases: Option<&mut Leases>,
    out: &mut Vec<Returned>,
) {
    let b = &inst.buffers;
    for (i, ret) in inst.returns.params.iter().enumerate() {
        let bytes = b.param_bytes[i];
        let dst = dsts.map_or(0, |d| d[i]);
        let (ptr, kind, lease) = match *ret {
            ParamReturn::None => (0, RefKind::None, 0),
            ParamReturn::Clone { offset } => (block_ptr + offset as DevPtr, RefKind::Clone, 0),
            ParamReturn::Alias => {
                let lease = match (leases.as_deref_mut(), inst.leases.params.get(i)) {
                    (Some(l), Some(Some(slot))) => l.acquire(*slot),
                    _ => 0,
                };
                (b.param_grads[i], RefKind::Alias, lease)
            }
            ParamReturn::CopyInto => (dst, RefKind::CopyInto, 0),
            ParamReturn::AccumulateInto { .. } => (dst, RefKind::AccumulateInto, 0),
        };
        out.push(if kind == RefKind::None {
            Returned::default()
        } else {
            Returned {
                ptr,
                bytes,
                kind,
                lease,
            }
        });
    }
}

/// Checks a copy-in array: the right length, and no NULL where a buffer
/// needs data (`needed`).
fn check_data(
    data: Option<&[DevPtr]>,
    expected: usize,
    needed: impl Fn(usize) -> bool,
    what: &str,
    spec: &CallableSpec,
) -> Result<()> {
    let Some(d) = data else { return Ok(()) };
    if d.len() != expected {
        return Err(Error::invalid(format!(
            "{} {what} were passed; callable '{}' has {expected}",
            d.len(),
            spec.name
        )));
    }
    if let Some(i) = (0..d.len()).find(|&i| d[i] == 0 && needed(i)) {
        return Err(Error::invalid(format!(
            "{what}[{i}] of callable '{}' is NULL (pass the whole {what} array as NULL to replay on what the \
             static buffers hold)",
            spec.name
        )));
    }
    Ok(())
}

/// Checks the destinations of COPY_INTO / ACCUMULATE_INTO slots: one per
/// parameter, non-NULL where needed, and ACCUMULATE_INTO destinations
/// aligned to their element size (the kernels read and write whole
/// elements).
fn check_dsts(dsts: Option<&[DevPtr]>, inst: &Instance, spec: &CallableSpec) -> Result<()> {
    let params = &inst.returns.params;
    let n = params.len();
    let Some(d) = dsts else {
        return match (0..n).find(|&i| params[i].needs_destination()) {
            Some(i) => Err(Error::invalid(format!(
                "callable '{}' has parameters returned by COPY_INTO or ACCUMULATE_INTO (param {i}): pass param_dsts",
                spec.name
            ))),
            None => Ok(()),
        };
    };
    if d.len() != n {
        return Err(Error::invalid(format!(
            "{} param destinations were passed; callable '{}' has {n} parameters",
            d.len(),
            spec.name
        )));
    }
    for (i, (&p, &dst)) in params.iter().zip(d).enumerate() {
        if p.needs_destination() && dst == 0 {
            return Err(Error::invalid(format!(
                "param_dsts[{i}] of callable '{}' is NULL, but that parameter's grad policy ({}) needs a destination",
                spec.name,
                inst.returns.policies[i].map_or("?", |p| p.name())
            )));
        }
        if let ParamReturn::AccumulateInto { dtype } = p {
            if dst % dtype.size() as DevPtr != 0 {
                return Err(Error::invalid(format!(
                    "param_dsts[{i}] of callable '{}' (0x{dst:x}) is not aligned to its {} element size ({} \
                     bytes): ACCUMULATE_INTO destinations must be element-aligned",
                    spec.name,
                    dtype.name(),
                    dtype.size()
                )));
            }
        }
    }
    Ok(())
}
