//! Replay, in the order of its steps: check everything that can be refused
//! (`check`), so that a refused call enqueues nothing; take a clone block;
//! feed the data (rebound tensors are pointed at, the others copied into
//! their static buffers); launch the graph on the caller's stream (or on a
//! side stream joined by events); return the parameter grads (`grads`);
//! stage what the caller gets (`stage`). Results are staged in vectors the
//! session reuses, so the steady state makes no host allocation. Steps
//! replay in `step`.

mod check;
mod debug;
mod stage;
mod step;
#[cfg(test)]
mod tests;

pub(crate) use debug::{env_value as debug_env_value, step as debug_step, ENV as DEBUG_ENV};
pub(crate) use step::step;

use super::buckets::pad_rows;
use super::captured::{Captured, LeaseBook, Rows, Stage};
use super::grads::{copy_clones, enqueue_destinations};
use super::instance::Placed;
use super::pool::{Claim, Pool};
use super::returned::{CloneBlock, Returned};
use super::spec::{CallableSpec, MemCounters, ReplayArgs, SessionOptions};
use super::tensor::{alignment, Feed, REBIND_ALIGN};
use crate::backend::{Backend, StreamRef};
use crate::core::PassKind;
use crate::error::{Error, Result};
use stage::Taken;
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

impl<'a> Replayed<'a> {
    fn of(stage: &'a mut Stage) -> Replayed<'a> {
        Replayed {
            first: &stage.a,
            second: &stage.b,
            blocks: &mut stage.blocks,
        }
    }
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
    run(&mut p, a, kind)?;
    Ok(Replayed::of(&mut p.cap.stage))
}

/// Whether a replay of `kind` returns the instance's parameter grads.
fn returns_params(inst: &Placed, kind: PassKind) -> bool {
    kind != PassKind::Forward && kind == inst.grad_pass()
}

/// Everything a replay of `kind` of instance `idx` can be refused for (the
/// other buckets' parameters aside: `run_pass` checks them next), and last
/// its place in the pool's order, claimed: kept at the launch, given back
/// if the replay is refused before, so that a refusal changes nothing.
fn check_pass<'a>(p: &Parts<'a>, a: &ReplayArgs, kind: PassKind, idx: usize) -> Result<Claim<'a>> {
    let inst = &p.cap.instances[idx];
    let name = &p.callables[inst.callable].name;
    let who = || {
        format!(
            "the {kind} replay of callable '{name}' (microbatch {})",
            inst.microbatch
        )
    };
    match kind {
        PassKind::Forward => check::data(a.data, &inst.inputs, "inputs", name)?,
        PassKind::Backward => check::data(a.data, &inst.grad_outputs, "grad_outputs", name)?,
        PassKind::Wgrad => {
            if !inst.has_wgrad() {
                return Err(Error::invalid(format!(
                    "callable '{name}' has no weight-grad callback: its parameter grads are returned by backward"
                )));
            }
            if a.data.is_some() {
                return Err(Error::invalid(
                    "a weight-grad replay takes no data: pass NULL",
                ));
            }
        }
    }
    if returns_params(inst, kind) {
        check::destinations(a.param_dsts, inst, name)?;
    }
    let moves = kind == PassKind::Forward;
    check::params(a.params, &inst.params, moves, || {
        format!("callable '{name}' (microbatch {})", inst.microbatch)
    })?;
    check::streams(p.backend.as_ref(), a.stream, a.side_stream, who)?;
    // The lease book is locked only around the check and the staging,
    // never while the caller's code runs (its allocator, its free
    // function), which may release leases. Only replays acquire, and they
    // are serialised by the session: a release in between only frees more.
    if p.opts.strict_leases {
        p.leases
            .lock()
            .check_free(&inst.overwritten[kind.index()], who)?;
    }
    let pool: &'a Pool = p.pool;
    pool.claim(p.key, position(inst, kind, who)?)
}

/// The capture-order position of pass `kind` of `inst`.
fn position(inst: &Placed, kind: PassKind, who: impl Fn() -> String) -> Result<usize> {
    inst.position[kind.index()]
        .ok_or_else(|| Error::Internal(format!("{} was not captured", who())))
}

/// The clone block a replay of `kind` returns its CLONE grads in, if any.
fn take_block(p: &Parts, idx: usize, kind: PassKind, s: StreamRef) -> Result<Taken> {
    let inst = &p.cap.instances[idx];
    let clone = &inst.returns.clone;
    if !returns_params(inst, kind) || clone.count == 0 {
        return Ok(Taken(None));
    }
    Ok(Taken(Some(match (&p.opts.allocator, &inst.ring) {
        (Some(a), _) => CloneBlock::from_caller(p.backend, a, p.counters, clone.bytes, s)?,
        (None, Some(ring)) => ring.take(s)?,
        (None, None) => {
            return Err(Error::Internal(
                "a CLONE instance without a clone ring".into(),
            ))
        }
    })))
}

/// The instance a replay of `kind` runs and the rows it runs on: a
/// callable without buckets its instance whole; a forward of one with
/// buckets the smallest bucket holding `a.size` (or, given `device_size`,
/// the largest bucket's instance, the device choosing); backward and
/// weight-grad passes what the callable's last forward ran.
fn resolve(p: &Parts, a: &ReplayArgs, kind: PassKind) -> Result<(usize, Rows)> {
    let spec = p.callables.get(a.callable as usize);
    let Some(spec) = spec.filter(|c| !c.buckets.is_empty()) else {
        if a.size != 0 || a.device_size != 0 {
            let name = spec.map_or("?", |c| c.name.as_str());
            return Err(Error::invalid(format!(
                "args.size or args.device_size is set, but callable '{name}' has no buckets: leave both 0"
            )));
        }
        return Ok((p.cap.instance_index(a.callable, a.microbatch)?, Rows::All));
    };
    // Checks the callable and the microbatch; the largest bucket's.
    let largest = p.cap.instance_index(a.callable, a.microbatch)?;
    let name = &spec.name;
    if kind != PassKind::Forward {
        let last = p.cap.last_forward[a.callable as usize];
        return match last {
            None => Err(Error::WrongState(format!(
                "the {kind} replay of callable '{name}': it has buckets, and no forward ran since capture; a \
                 {kind} runs the bucket of the callable's last forward"
            ))),
            Some(_) if a.device_size != 0 => Err(Error::invalid(format!(
                "the {kind} replay of callable '{name}' was given args.device_size: a {kind} runs the bucket \
                 its forward ran; leave it NULL"
            ))),
            Some((_, Rows::Host(n, _))) if a.size != 0 && a.size != n => Err(Error::invalid(format!(
                "the {kind} replay of callable '{name}' was given args.size {}, but its last forward ran {n} \
                 rows: pass 0 or {n}",
                a.size
            ))),
            Some((_, Rows::Host(_, n2))) if a.size2 != 0 && a.size2 != n2 => Err(Error::invalid(format!(
                "the {kind} replay of callable '{name}' was given args.size2 {}, but its last forward ran a \
                 second size of {n2}: pass 0 or {n2}",
                a.size2
            ))),
            Some((_, Rows::Device)) if a.size != 0 || a.size2 != 0 => Err(Error::invalid(format!(
                "the {kind} replay of callable '{name}' was given args.size {}, but its last forward chose \
                 its bucket on the device: pass 0",
                a.size
            ))),
            Some(last) => Ok(last),
        };
    }
    chained_rows(p, spec, a)?;
    if a.device_size != 0 {
        if a.size != 0 {
            return Err(Error::invalid(format!(
                "callable '{name}': args.size ({}) and args.device_size are both set; give one",
                a.size
            )));
        }
        if p.cap
            .switches
            .get(a.callable as usize)
            .map_or(true, |s| s.passes[0].is_none())
        {
            return Err(Error::invalid(format!(
                "callable '{name}': args.device_size needs a session created with bucket_choice_on_device"
            )));
        }
        return Ok((largest, Rows::Device));
    }
    let b = spec
        .forward_bucket((a.size, a.size2), "args.size")
        .map_err(|e| match e {
            Error::InvalidArgument(m) => Error::invalid(format!("{m}: nothing was enqueued")),
            e => e,
        })?;
    Ok((
        p.cap.by_callable[a.callable as usize][b],
        Rows::Host(a.size, a.size2),
    ))
}

/// Refuses a forward of a bucketed callable whose chained DYNAMIC inputs
/// hold another number of rows than it names: each producer's last forward
/// must have run the same size (or, given `device_size`, chosen on the
/// device too, the caller's sizes then agreeing).
fn chained_rows(p: &Parts, spec: &CallableSpec, a: &ReplayArgs) -> Result<()> {
    for (i, t) in spec.inputs.iter().enumerate() {
        let Some((pc, _)) = t.chained.filter(|_| t.dynamic) else {
            continue;
        };
        let last = p.cap.last_forward.get(pc as usize).copied().flatten();
        let ran = match last {
            Some((_, Rows::Host(n, _))) if a.device_size == 0 && n == a.size => continue,
            Some((_, Rows::Device)) if a.device_size != 0 => continue,
            Some((_, Rows::Host(n, _))) => format!("ran {n} rows"),
            Some((_, Rows::Device)) => "chose its bucket on the device".to_string(),
            _ => "has not run since capture".to_string(),
        };
        let producer = &p.callables[pc as usize].name;
        return Err(Error::invalid(format!(
            "inputs[{i}] of callable '{}' is chained to callable '{producer}', whose last forward {ran}: \
             the forward of a chained callable runs the rows its producer ran (args.size {}{})",
            spec.name,
            a.size,
            if a.device_size != 0 { ", args.device_size set" } else { "" }
        )));
    }
    Ok(())
}

/// Refuses a replay choosing its bucket on the device where a parameter
/// is, or is given, anywhere but where capture read it (the choosing
/// graph holds copies of the buckets' graphs as captured).
fn check_device_params(p: &Parts, a: &ReplayArgs, idx: usize) -> Result<()> {
    let c = p.cap.instances[idx].callable;
    let name = &p.callables[c].name;
    for &n in &p.cap.by_callable[c] {
        for (j, q) in p.cap.instances[n].params.iter().enumerate() {
            let given = a.params.and_then(|g| g.get(j).copied()).unwrap_or(0);
            if q.bound() != q.ptr || (given != 0 && given != q.ptr) {
                return Err(Error::ParamMoved(format!(
                    "param {j} of callable '{name}' is read at 0x{:x} by its graphs (registered at 0x{:x}), \
                     and 0x{given:x} was given: a replay that chooses its bucket on the device reads the \
                     parameters where capture did",
                    q.bound(),
                    q.ptr
                )));
            }
        }
    }
    Ok(())
}

/// Feeds the data of a forward (inputs) or backward (grad-outputs):
/// rebound tensors are read where they are (the graphs are pointed at the
/// caller's aligned data, else back at the static buffer); the others are
/// copied into their static buffers (those without one take no data). A
/// DYNAMIC tensor takes the actual size's rows, the rest of its bucket
/// zeroed where it may not be zero already (`buckets::Zeroed`), so that
/// padding rows add nothing to the parameter grads; chosen on the device,
/// it takes the whole buffer (the choosing graph zeroes past the size), and
/// rebound tensors are copied (the choosing graph reads the static
/// buffers).
fn feed(
    p: &mut Parts,
    (idx, rows): (usize, Rows),
    kind: PassKind,
    a: &ReplayArgs,
    s: StreamRef,
) -> Result<()> {
    let Some(role) = Placed::fed_role(kind) else {
        return Ok(());
    };
    let backend = p.backend;
    let Captured {
        instances, zeroed, ..
    } = &mut *p.cap;
    let inst = &mut instances[idx];
    let c = inst.callable;
    let tensors = inst.tensors_mut(role);
    for (i, t) in tensors.iter_mut().enumerate() {
        // check::data made the data as long as the tensors.
        let src = a.data.and_then(|d| d.get(i).copied()).unwrap_or(0);
        // A chained buffer is its producer's: it takes no data and keeps
        // the producer's rows past the size (finite; their grads are zero).
        let varies = t
            .varies
            .filter(|_| t.ptr != 0 && !matches!(t.feed, Feed::Chained));
        let dynamic = varies.is_some();
        if let (Rows::Host(n, n2), Some(v)) = (rows, varies) {
            // Bounded by the bucket (resolve picked one holding the sizes).
            let copied = src != 0 && src != t.ptr;
            let at = v.at((n, n2));
            if at.contiguous() {
                if copied {
                    backend.copy(t.ptr, src, at.width as usize, s)?;
                }
                zeroed.pad(backend.as_ref(), (c, role, i), t, (at.width, copied), s)?;
            } else {
                // Rows of a pitch: their padding is zeroed at every replay.
                zeroed.forget((c, role, i));
                let src = if copied { src } else { 0 };
                pad_rows(backend.as_ref(), (t.ptr, src), at, s)?;
            }
            continue;
        }
        if dynamic {
            // Filled whole: nothing known zero.
            zeroed.forget((c, role, i));
        }
        if rows == Rows::Device {
            if let Feed::Rebound(r) = &mut t.feed {
                r.bind(t.ptr)?;
            }
            if src != 0 && src != t.ptr && t.ptr != 0 && !matches!(t.feed, Feed::Chained) {
                backend.copy(t.ptr, src, t.bytes, s)?;
            }
            continue;
        }
        if src == 0 || t.ptr == 0 {
            if let Feed::Rebound(r) = &mut t.feed {
                r.bind(t.ptr)?;
            }
            continue;
        }
        match &mut t.feed {
            Feed::Rebound(r) if src % REBIND_ALIGN == 0 => r.bind(src)?,
            Feed::Rebound(r) => {
                r.bind(t.ptr)?;
                backend.copy(t.ptr, src, t.bytes, s)?;
            }
            Feed::Copied | Feed::Refused(_) => backend.copy(t.ptr, src, t.bytes, s)?,
            Feed::Chained | Feed::NotFed => {}
        }
    }
    Ok(())
}

/// Launches the pass (the slot's own graph when the block is a slot
/// block) and returns the parameter grads it wrote.
fn launch(
    p: &mut Parts,
    (idx, rows): (usize, Rows),
    kind: PassKind,
    a: &ReplayArgs,
    block: &Taken,
    s: StreamRef,
    claim: Claim,
) -> Result<()> {
    let params = returns_params(&p.cap.instances[idx], kind);
    // A slot block has its own capture of this pass (and, chosen on the
    // device, its own choice among the buckets' slot captures), which
    // writes the CLONE grads into it: no copy.
    let slot = match (&block.0, params) {
        (Some(b), true) => b.slot,
        _ => None,
    };
    // Grads written in place, where the pass's own graph runs.
    let own_graph = slot.is_none() && rows != Rows::Device;
    let mut in_place = [false; IN_PLACE_MAX];
    if params {
        point_grads(
            &mut p.cap.instances[idx],
            a.param_dsts,
            own_graph,
            &mut in_place,
        )?;
    }
    let inst = &p.cap.instances[idx];
    let slot_graph = match rows {
        Rows::Device => slot.and_then(|k| p.cap.switches[inst.callable].slot(k)),
        _ => slot.and_then(|k| inst.slot_graph(k)),
    };
    match (slot_graph, rows) {
        (Some(g), _) => g.launch(s)?,
        (None, Rows::Device) => p.cap.switches[inst.callable].pass(kind)?.launch(s)?,
        (None, _) => inst.graph(kind)?.launch(s)?,
    }
    // Launched: the pool's order keeps it (check_pass claimed it).
    claim.keep();
    if !params {
        return Ok(());
    }
    if let (Some(b), None) = (&block.0, slot_graph) {
        copy_clones(p.backend.as_ref(), inst, b.ptr, s)?;
    }
    // check::destinations made sure these have destinations.
    let dst = |i: usize| a.param_dsts.map_or(0, |d| d[i]);
    let written = |i: usize| in_place.get(i).copied().unwrap_or(false);
    enqueue_destinations(
        p.backend.as_ref(),
        inst,
        dst,
        written,
        &mut p.cap.stage.acc,
        s,
    )
}

/// Parameters whose grads a replay can mark written in place (a fixed
/// array: the steady state makes no host allocation); a grad past it is
/// copied.
const IN_PLACE_MAX: usize = 256;

/// Points the grad pass's graph of `inst` at the destination of each
/// COPY_INTO grad rebound at capture (GRAPHED_PARAM_FLAGS_REBIND_GRAD),
/// where `own_graph` runs and the destination is aligned as the grad's
/// buffer, marking it in `in_place`; elsewhere back at the grad's buffer,
/// from which it is copied.
fn point_grads(
    inst: &mut Placed,
    dsts: Option<&[crate::backend::DevPtr]>,
    own_graph: bool,
    in_place: &mut [bool; IN_PLACE_MAX],
) -> Result<()> {
    for (i, t) in inst.param_grads.iter_mut().enumerate() {
        let Feed::Rebound(r) = &mut t.feed else {
            continue;
        };
        let dst = dsts.and_then(|d| d.get(i).copied()).unwrap_or(0);
        let direct =
            own_graph && i < IN_PLACE_MAX && dst != 0 && alignment(dst) >= alignment(t.ptr);
        r.bind(if direct { dst } else { t.ptr })?;
        if direct {
            in_place[i] = true;
        }
    }
    Ok(())
}

/// The other buckets of a forward's instance given parameter addresses
/// (indices into the callable's instances): they follow the same moves, so
/// that every bucket reads the parameters where the last forward did.
fn buckets_beside(p: &Parts, idx: usize, kind: PassKind, a: &ReplayArgs) -> std::ops::Range<usize> {
    let follows = kind == PassKind::Forward && a.params.is_some() && a.size != 0;
    match follows {
        true => 0..p.cap.by_callable[p.cap.instances[idx].callable].len(),
        false => 0..0,
    }
}

/// `run_pass`, with debug mode's checks around it when the session has
/// it on (`debug::run_pass`, out of line: without it the replay runs
/// `run_pass` as it is).
fn run(p: &mut Parts, a: &ReplayArgs, kind: PassKind) -> Result<()> {
    if p.opts.debug {
        debug::run_pass(p, a, kind)
    } else {
        run_pass(p, a, kind)
    }
}

/// Enqueues one pass and leaves its results in the stage. Every refusal
/// (`resolve`, the device's choice, `check_pass`, the other buckets'
/// parameters) comes before anything changes: no parameter is pointed
/// elsewhere, no move counted, no block taken, nothing enqueued, and the
/// pool's order is recorded only once the pass is launched.
fn run_pass(p: &mut Parts, a: &ReplayArgs, kind: PassKind) -> Result<()> {
    let (idx, rows) = resolve(p, a, kind)?;
    // The context first: asking about a stream needs it current.
    let _ctx = p.backend.bind()?;
    if rows == Rows::Device {
        check_device_params(p, a, idx)?;
    }
    let claim = check_pass(p, a, kind, idx)?;
    let c = p.cap.instances[idx].callable;
    let siblings = buckets_beside(p, idx, kind, a);
    for k in siblings.clone() {
        let n = p.cap.by_callable[c][k];
        if n == idx {
            continue;
        }
        let inst = &p.cap.instances[n];
        let name = &p.callables[inst.callable].name;
        check::params(a.params, &inst.params, true, || {
            format!("callable '{name}' (bucket {})", inst.bucket)
        })?;
    }
    let s = match a.side_stream {
        Some(side) => {
            p.backend
                .join(a.stream, side, p.cap.resources.ev_in.raw())?;
            side
        }
        None => a.stream,
    };
    let mut block = take_block(p, idx, kind, s)?;
    p.cap.param_moves += check::bind_params(a.params, &mut p.cap.instances[idx].params)?;
    for k in siblings {
        let n = p.cap.by_callable[c][k];
        if n != idx {
            check::bind_params(a.params, &mut p.cap.instances[n].params)?;
        }
    }
    feed(p, (idx, rows), kind, a, s)?;
    if let (PassKind::Forward, Some(block), false) = (kind, &mut p.cap.sizes, rows == Rows::All) {
        block.put(
            p.backend.as_ref(),
            a.callable as usize,
            (a.size, a.size2, a.device_size),
            s,
        )?;
    }
    launch(p, (idx, rows), kind, a, &block, s, claim)?;
    if let Some(side) = a.side_stream {
        p.backend
            .join(side, a.stream, p.cap.resources.ev_out.raw())?;
    }
    if let Some(b) = &block.0 {
        b.set_stream(a.stream);
    }
    let Captured {
        instances,
        stage,
        last_forward,
        ..
    } = &mut *p.cap;
    let inst = &instances[idx];
    stage.a.clear();
    stage.b.clear();
    stage::give_back(&mut stage.blocks);
    let block_ptr = block.0.as_ref().map_or(0, |b| b.ptr);
    if let Some(b) = block.0.take() {
        stage.blocks.push(b);
    }
    let mut book = p.opts.strict_leases.then(|| p.leases.lock());
    if kind == PassKind::Forward && rows != Rows::All {
        last_forward[inst.callable] = Some((idx, rows));
    }
    // The sizes the refs of DYNAMIC tensors hold: chosen on the device,
    // the host does not know them (the largest bucket's instance: all).
    let size = match rows {
        Rows::Host(n, n2) => (n, n2),
        Rows::Device => p.callables[inst.callable].largest(),
        Rows::All => (0, 0),
    };
    match kind {
        PassKind::Forward => stage::aliases(&mut stage.a, &inst.outputs, size, book.as_deref_mut()),
        PassKind::Backward => {
            stage::aliases(&mut stage.a, &inst.grad_inputs, size, book.as_deref_mut());
            if returns_params(inst, kind) {
                stage::params(
                    inst,
                    a.param_dsts,
                    (block_ptr, 0),
                    book.as_deref_mut(),
                    &mut stage.b,
                );
            } else {
                stage.b.resize(inst.param_grads.len(), Returned::default());
            }
        }
        PassKind::Wgrad => stage::params(
            inst,
            a.param_dsts,
            (block_ptr, 0),
            book.as_deref_mut(),
            &mut stage.b,
        ),
    }
    Ok(())
}
