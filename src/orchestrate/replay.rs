//! Replay: copy new data into the static buffers (skipped where the caller
//! passes the static buffer itself), launch the graph on the caller's stream
//! (or on a side stream synced back by events), and return outputs and
//! grads by the instance's return plan. Everything that can be refused is
//! checked before anything is enqueued (arguments, destinations and their
//! alignment, strict leases, a stream that is capturing, the replay order of
//! sessions sharing a pool), and results are staged in vectors the session
//! reuses, so the steady-state path does no host allocation beyond one
//! clone block.

use super::captured::{Captured, Instance, LeaseBook, Stage};
use super::pool::Pool;
use super::rebind::REBIND_ALIGN;
use super::returned::{CloneBlock, RefKind, Returned};
use super::spec::{CallableSpec, MemCounters, ReplayArgs, SessionOptions};
use crate::backend::{AccItem, Backend, DevPtr, StreamRef};
use crate::core::lease::Leases;
use crate::core::returns::ParamReturn;
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::sync::Arc;

/// What one replay hands back. `first` holds the outputs (forward) or the
/// input grads (backward); `second` the parameter grads (backward,
/// weight-grad, step); `blocks` the clone blocks the CLONE grads live in
/// (`Returned::block` indexes it). The caller takes the blocks (drains the
/// vector); any left there are given back at the next replay.
pub struct Replayed<'a> {
    pub first: &'a [Returned],
    pub second: &'a [Returned],
    pub blocks: &'a mut Vec<Arc<CloneBlock>>,
}

/// What a replay uses of a captured session.
pub(crate) struct Parts<'a> {
    /// Identifies the session to its pool.
    pub key: u64,
    pub backend: &'a Arc<dyn Backend>,
    pub opts: &'a SessionOptions,
    pub callables: &'a [CallableSpec],
    pub cap: &'a mut Captured,
    pub counters: &'a Arc<MemCounters>,
    pub pool: &'a Pool,
    pub leases: &'a LeaseBook,
}

/// Replays one pass of (callable, microbatch): forward returns the static
/// outputs (aliases, valid until the next forward replay of the instance);
/// backward the input grads (aliases, valid until its next backward) and
/// the parameter grads per the return plan (all NONE when the callable has
/// a weight-grad graph, whose replay returns them).
pub(crate) fn pass<'a>(mut p: Parts<'a>, a: &ReplayArgs, kind: PassKind) -> Result<Replayed<'a>> {
    run_pass(&mut p, a, kind)?;
    let Stage {
        a: first,
        b: second,
        blocks,
        ..
    } = &mut p.cap.stage;
    Ok(Replayed {
        first,
        second,
        blocks,
    })
}

/// Enqueues one pass and leaves its results in the stage.
fn run_pass(p: &mut Parts, a: &ReplayArgs, kind: PassKind) -> Result<()> {
    let Parts {
        key,
        backend,
        opts,
        callables,
        counters,
        pool,
        leases,
        ..
    } = *p;
    {
        let cap: &mut Captured = p.cap;
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
            PassKind::Forward => check_data(
                a.data,
                &inst.buffers.inputs,
                |_| true,
                &inst.chained_inputs,
                "inputs",
                spec,
            )?,
            PassKind::Backward => {
                let gout = &inst.buffers.grad_outputs;
                check_data(
                    a.data,
                    gout,
                    |i| gout[i] != 0,
                    &inst.chained_grad_outputs,
                    "grad_outputs",
                    spec,
                )?
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
        // The context first: asking about a stream needs it current.
        let _ctx = backend.bind()?;
        check_streams(backend.as_ref(), a.stream, a.side_stream, who)?;
        // The lease book is locked only around the check and the staging,
        // never while the caller's code runs (its allocator, its free
        // function), which may release leases. Only replays acquire, and
        // they are serialised by the session: a release in between only
        // frees more.
        if opts.strict_leases {
            leases
                .lock()
                .check_free(&inst.leases.overwritten[kind.index()], who)?;
        }
        let pos = inst.position[kind.index()]
            .ok_or_else(|| Error::Internal(format!("{} was not captured", who())))?;
        pool.replaying(key, pos)?;

        // ---- enqueue ----------------------------------------------------------
        let inst = &cap.instances[idx];
        let s = match a.side_stream {
            Some(side) => {
                backend.join(a.stream, side, cap.ev_in.raw())?;
                side
            }
            None => a.stream,
        };
        let clone = &inst.returns.clone;
        let mut block = Taken(match (&opts.allocator, &inst.ring) {
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
        });
        // The data a forward (inputs) or backward (grad-outputs) is fed:
        // rebound entries are read where they are (the graphs are pointed at
        // the caller's aligned data, else back at the static buffer); the
        // others are copied into their static buffers (entries without one,
        // dst 0, take no data).
        let inst = &mut cap.instances[idx];
        let fed = match kind {
            PassKind::Forward => Some((&mut inst.rebind, &inst.buffers.inputs, &spec.inputs)),
            PassKind::Backward => Some((
                &mut inst.rebind_grad_outputs,
                &inst.buffers.grad_outputs,
                &spec.outputs,
            )),
            PassKind::Wgrad => None,
        };
        if let Some((rebind, dsts, tensors)) = fed {
            for (i, (rb, &dst)) in rebind.iter_mut().zip(dsts).enumerate() {
                // check_data made the data as long as the buffers.
                let src = a.data.and_then(|d| d.get(i).copied()).unwrap_or(0);
                let rebound = rb.is_on() && src != 0 && src % REBIND_ALIGN == 0;
                if rb.is_on() {
                    rb.bind(if rebound { src } else { dst })?;
                }
                if dst != 0 && src != 0 && !rebound {
                    backend.copy(dst, src, tensors[i].bytes, s)?;
                }
            }
        }
        let inst = &cap.instances[idx];
        let clone = &inst.returns.clone;
        // A slot block has its own capture of this pass, which writes the
        // CLONE grads into it: no copy.
        let slot_graph = match (&block.0, returns_params) {
            (Some(b), true) => b.slot.and_then(|k| inst.rotating.get(k)),
            _ => None,
        };
        match slot_graph {
            Some(g) => g.launch(s)?,
            None => inst.graph(kind)?.launch(s)?,
        }
        if returns_params {
            let b = &inst.buffers;
            if let (Some(blk), None) = (&block.0, slot_graph) {
                // The grads went to the slab: copy the CLONE ones out.
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
            enqueue_destinations(
                backend.as_ref(),
                inst,
                |i| a.param_dsts.map_or(0, |d| d[i]),
                &mut cap.stage.acc,
                s,
            )?;
        }
        if let Some(side) = a.side_stream {
            backend.join(side, a.stream, cap.ev_out.raw())?;
        }
        if let Some(b) = &block.0 {
            b.set_stream(a.stream);
        }

        // ---- results ------------------------------------------------------------
        let block_ptr = block.0.as_ref().map_or(0, |b| b.ptr);
        let Stage {
            a: first,
            b: second,
            blocks,
            ..
        } = &mut cap.stage;
        first.clear();
        second.clear();
        give_back(blocks);
        if let Some(b) = block.0.take() {
            blocks.push(b);
        }
        let mut book = opts.strict_leases.then(|| leases.lock());
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
                    stage_params(
                        inst,
                        a.param_dsts,
                        (block_ptr, 0),
                        book.as_deref_mut(),
                        second,
                    );
                } else {
                    second.resize(inst.returns.params.len(), Returned::default());
                }
            }
            PassKind::Wgrad => stage_params(inst, a.param_dsts, (block_ptr, 0), leases, second),
        }
    }
    Ok(())
}

/// Replays a step: one launch of its graph, or, with CLONE grads, of the
/// graph of a clone slot that is free in every callable that returns
/// clones; when there is none (every slot held by the caller, or no slots
/// at all), pass by pass. Returns the parameter grads of the step's
/// callables, in order, in `second`.
pub(crate) fn step<'a>(p: Parts<'a>, step: u32, stream: StreamRef) -> Result<Replayed<'a>> {
    let n = p.cap.steps.len();
    let st = p.cap.steps.get(step as usize).ok_or_else(|| {
        Error::invalid(format!("step {step} does not exist (the session has {n})"))
    })?;
    let who = || format!("the replay of step {step}");
    let _ctx = p.backend.bind()?;
    check_streams(p.backend.as_ref(), stream, None, who)?;
    if p.opts.strict_leases {
        p.leases.lock().check_free(&st.overwritten, who)?;
    }
    let cloned = &st.cloned;
    // The slot blocks taken, in a vector the replays reuse (empty between
    // replays, so that the steady state allocates nothing).
    let mut taken = std::mem::take(&mut p.cap.stage.taken);
    // Slot blocks taken for a replay that then fails go back to their
    // rings (the i-th block to the ring of the i-th cloned instance).
    let put_back = |taken: &mut Vec<Arc<CloneBlock>>| {
        for (b, &j) in taken.drain(..).zip(cloned) {
            if let Some(r) = &p.cap.instances[j].ring {
                r.put_back(b);
            }
        }
    };
    // A slot free in every callable that returns clones, with its blocks.
    let mut chosen = None;
    if st.graph.is_none() {
        'slots: for k in 0..st.slots.len() {
            for &i in cloned {
                let ring = p.cap.instances[i].ring.as_ref();
                match ring.map(|r| r.take_slot(k, stream)).transpose() {
                    Ok(Some(Some(b))) => taken.push(b),
                    Ok(_) => {
                        put_back(&mut taken);
                        continue 'slots;
                    }
                    Err(e) => {
                        put_back(&mut taken);
                        return Err(e);
                    }
                }
            }
            chosen = Some(k);
            break;
        }
        if chosen.is_none() {
            p.cap.stage.taken = taken;
            return step_by_pass(p, step as usize, stream);
        }
    }
    let graph = match (&st.graph, chosen) {
        (Some(g), _) => g,
        (None, Some(k)) => &st.slots[k],
        (None, None) => return Err(Error::Internal("a step without a graph".into())),
    };
    let launched = st
        .passes
        .iter()
        .try_for_each(|pp| {
            let pos = p.cap.instances[pp.instance].position[pp.kind.index()].unwrap_or(0);
            p.pool.replaying(p.key, pos)
        })
        .and_then(|_| graph.launch(stream));
    if let Err(e) = launched {
        put_back(&mut taken);
        p.cap.stage.taken = taken;
        return Err(e);
    }
    // Results: every parameter of the step's callables, in order.
    let Captured {
        instances,
        stage,
        steps,
        ..
    } = &mut *p.cap;
    let st = &steps[step as usize];
    let Stage {
        a: first,
        b: second,
        blocks,
        ..
    } = stage;
    first.clear();
    second.clear();
    give_back(blocks);
    // Locked after give_back, which may run the caller's free function.
    let mut book = p.opts.strict_leases.then(|| p.leases.lock());
    let mut at = 0;
    for &i in &st.instances {
        let inst = &instances[i];
        let np = inst.returns.params.len();
        let block = match st.cloned.iter().position(|&c| c == i) {
            Some(k) => (taken[k].ptr, k as u32),
            None => (0, 0),
        };
        stage_params(
            inst,
            Some(&st.dsts[at..at + np]),
            block,
            book.as_deref_mut(),
            second,
        );
        at += np;
    }
    blocks.append(&mut taken);
    stage.taken = taken;
    Ok(Replayed {
        first,
        second,
        blocks,
    })
}

/// A step replayed pass by pass (its graphs need a clone slot that is not
/// free): the same passes, each its own replay, the grads gathered.
fn step_by_pass<'a>(mut p: Parts<'a>, step: usize, stream: StreamRef) -> Result<Replayed<'a>> {
    let (passes, dsts, instances) = {
        let st = &p.cap.steps[step];
        (st.passes.clone(), st.dsts.clone(), st.instances.clone())
    };
    let mut first_param = Vec::with_capacity(instances.len());
    let mut at = 0;
    for &i in &instances {
        first_param.push(at);
        at += p.cap.instances[i].returns.params.len();
    }
    let mut grads: Vec<Vec<Returned>> = vec![Vec::new(); instances.len()];
    let mut blocks: Vec<Arc<CloneBlock>> = Vec::new();
    for pp in passes {
        let k = instances
            .iter()
            .position(|&i| i == pp.instance)
            .unwrap_or(0);
        let inst = &p.cap.instances[pp.instance];
        let grad_pass =
            pp.kind == PassKind::Wgrad || (pp.kind == PassKind::Backward && !inst.has_wgrad());
        let np = inst.returns.params.len();
        let a = ReplayArgs {
            callable: inst.callable as u32,
            microbatch: inst.microbatch,
            stream,
            side_stream: None,
            data: None,
            param_dsts: grad_pass.then(|| &dsts[first_param[k]..first_param[k] + np]),
        };
        if let Err(e) = run_pass(&mut p, &a, pp.kind) {
            // Nothing of a failed step reaches the caller: the leases and
            // blocks of the passes that ran go back.
            if p.opts.strict_leases {
                let mut l = p.leases.lock();
                for r in grads.iter().flatten().filter(|r| r.lease != 0) {
                    let _ = l.release(r.lease);
                }
            }
            give_back(&mut blocks);
            return Err(e);
        }
        let stage = &mut p.cap.stage;
        // The step hands out no aliases of outputs or input grads.
        if p.opts.strict_leases {
            let mut l = p.leases.lock();
            for r in stage.a.iter().filter(|r| r.lease != 0) {
                let _ = l.release(r.lease);
            }
        }
        if grad_pass {
            let base = blocks.len() as u32;
            grads[k] = stage
                .b
                .iter()
                .map(|r| Returned {
                    block: r.block + base,
                    ..*r
                })
                .collect();
            blocks.append(&mut stage.blocks);
        }
    }
    let Stage {
        a: first,
        b: second,
        blocks: staged,
        ..
    } = &mut p.cap.stage;
    first.clear();
    second.clear();
    give_back(staged);
    second.extend(grads.into_iter().flatten());
    staged.extend(blocks);
    Ok(Replayed {
        first,
        second,
        blocks: staged,
    })
}

/// Refuses a replay on a stream that is capturing a graph.
fn check_streams(
    backend: &dyn Backend,
    stream: StreamRef,
    side: Option<StreamRef>,
    who: impl Fn() -> String,
) -> Result<()> {
    for (s, what) in [(Some(stream), "stream"), (side, "side_stream")] {
        match s {
            Some(s) if backend.is_capturing(s)? => {
                return Err(Error::StreamCapturing(format!(
                    "{}: args.{what} is capturing a graph. graphed replays cannot be recorded into another \
                     capture (their clones and copies would outlive what the outer graph can own); replay \
                     outside the capture, or capture the callables together as a step. Nothing was enqueued",
                    who()
                )))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Enqueues the COPY_INTO copies and the ACCUMULATE_INTO launches (one per
/// dtype) of an instance's parameter grads, into `dst(i)` for parameter i.
pub(crate) fn enqueue_destinations(
    backend: &dyn Backend,
    inst: &Instance,
    dst: impl Fn(usize) -> DevPtr,
    acc: &mut Vec<AccItem>,
    s: StreamRef,
) -> Result<()> {
    let b = &inst.buffers;
    for &i in &inst.returns.copy_into {
        backend.copy(dst(i), b.param_grads[i], b.param_bytes[i], s)?;
    }
    for (dtype, params) in &inst.returns.accumulate {
        acc.clear();
        acc.extend(params.iter().map(|&i| AccItem {
            dst: dst(i),
            src: b.param_grads[i],
            count: b.param_bytes[i] / dtype.size(),
        }));
        backend.accumulate(acc, *dtype, s)?;
    }
    Ok(())
}

/// A clone block taken for a replay: given back if the replay fails before
/// its results are staged (else the block, and its ring slot, were lost).
struct Taken(Option<Arc<CloneBlock>>);

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            let _ = b.release();
        }
    }
}

/// Gives back blocks a caller did not take from an earlier replay.
fn give_back(blocks: &mut Vec<Arc<CloneBlock>>) {
    for b in blocks.drain(..) {
        let _ = b.release();
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
                block: 0,
            }
        });
    }
}

/// Stages the parameter grads of a backward or weight-grad replay; CLONE
/// grads live in `block` = (its address, its index in the replay's blocks).
fn stage_params(
    inst: &Instance,
    dsts: Option<&[DevPtr]>,
    (block_ptr, block): (DevPtr, u32),
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
                block,
            }
        });
    }
}

/// Checks a copy-in array against the static buffers `statics`: the right
/// length, no NULL where a buffer needs data (`needed`), and nothing but
/// NULL or the buffer itself for a chained one (it is another callable's
/// buffer, read or written in place).
fn check_data(
    data: Option<&[DevPtr]>,
    statics: &[DevPtr],
    needed: impl Fn(usize) -> bool,
    chained: &[bool],
    what: &str,
    spec: &CallableSpec,
) -> Result<()> {
    let Some(d) = data else { return Ok(()) };
    let expected = statics.len();
    if let Some(i) = (0..d.len().min(expected))
        .find(|&i| chained.get(i).copied().unwrap_or(false) && d[i] != 0 && d[i] != statics[i])
    {
        return Err(Error::invalid(format!(
            "{what}[{i}] of callable '{}' is chained to another callable's buffer (0x{:x}); it takes no other \
             data: pass that buffer, NULL, or a NULL data array",
            spec.name, statics[i]
        )));
    }
    if d.len() != expected {
        return Err(Error::invalid(format!(
            "{} {what} were passed; callable '{}' has {expected}",
            d.len(),
            spec.name
        )));
    }
    if let Some(i) = (0..d.len()).find(|&i| d[i] == 0 && needed(i) && !chained[i]) {
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
