//! Step replays: one launch of the step's graph, or, with CLONE grads, of
//! the graph of a clone slot that is free in every callable that returns
//! clones; when there is none (every slot held by the caller, or no slots
//! at all), the same passes replayed one by one, with the same results.
//! Parameters given at new addresses point the step's graphs there where
//! capture verified they can; where only the callables' own graphs can
//! follow, the step replays pass by pass, each forward moving them. A step
//! whose graphs loop over microbatches or copy data in and out has no
//! pass-by-pass replay: it refuses instead, naming what stops it. In debug
//! mode a step replays pass by pass where it can, each pass checked; one
//! that cannot is checked around its graph (`debug::step`).

use super::super::captured::{Captured, CapturedStep};
use super::super::pool::Claim;
use super::super::returned::{CloneBlock, Returned};
use super::super::spec::{ReplayArgs, StepCall};
use super::super::update::StepUpdate;
use super::{check, run, stage, Parts, Replayed};
use crate::backend::{DevPtr, StreamRef};
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::sync::Arc;

/// Replays step `step` on `stream`, its callables' parameters at
/// `params` (None: where the graphs read them now); returns their grads,
/// in order, in `second`. Every refusal comes first (the step and the
/// count, the stream, strict leases, the parameters, the pool's order,
/// then, without a free clone slot, a step that cannot replay pass by
/// pass): a refused replay points no graph elsewhere, counts no move,
/// keeps no block and leaves the addresses a later replay given none
/// reads where the last successful replay had them. In debug mode (which
/// `Session::step` sends to `debug::step` first), it replays pass by pass
/// wherever it can.
pub(crate) fn step<'a>(mut p: Parts<'a>, call: &StepCall) -> Result<Replayed<'a>> {
    let StepCall {
        step,
        stream,
        params,
        microbatches,
        scalars,
    } = *call;
    let n = p.cap.steps.len();
    let st = p.cap.steps.get(step as usize).ok_or_else(|| {
        Error::invalid(format!("step {step} does not exist (the session has {n})"))
    })?;
    let who = || format!("the replay of step {step}");
    let count = count(st, step, microbatches)?;
    StepUpdate::check_scalars(st.update.as_ref(), step, scalars)?;
    let _ctx = p.backend.bind()?;
    check::streams(p.backend.as_ref(), stream, None, who)?;
    if p.opts.strict_leases {
        p.leases.lock().check_free(&st.overwritten, who)?;
    }
    let follows = follow(&p, step as usize, params)?;
    if !follows && st.looped {
        return Err(unfollowed(&p, step as usize, params));
    }
    // Its place in the pool's order, claimed: kept at the launch, given
    // back if the step is refused before (or replayed pass by pass, each
    // pass claiming its own).
    let pool = p.pool;
    let claim = match st.passes.first() {
        Some(first) => {
            let pos = p.cap.instances[first.instance].position[first.kind.index()].unwrap_or(0);
            Some(pool.claim(p.key, pos)?)
        }
        None => None,
    };
    // Only the callables' own graphs can read the parameters there; in
    // debug mode, each pass is checked on its own.
    if !follows || p.opts.debug && !st.looped {
        drop(claim);
        return by_pass(p, step as usize, stream, params);
    }
    // The slot blocks taken, in a vector the replays reuse (empty between
    // replays, so that the steady state allocates nothing).
    let mut taken = std::mem::take(&mut p.cap.stage.taken);
    let chosen = if st.graph.is_some() {
        None
    } else {
        match free_slot(&p, step as usize, stream, &mut taken) {
            Ok(Some(k)) => Some(k),
            Ok(None) if st.looped => {
                p.cap.stage.taken = taken;
                let what = match st.update.is_some() {
                    true => {
                        "runs its update in one graph with its passes and returns their CLONE \
                             grads from"
                    }
                    false => "runs its microbatches in one graph and sums their CLONE grads in",
                };
                return Err(Error::AliasHeld(format!(
                    "step {step} {what} a clone slot; all {} are held (grads of earlier replays not yet \
                     released): release them first; nothing was replayed",
                    st.slots.len()
                )));
            }
            Ok(None) => {
                p.cap.stage.taken = taken;
                drop(claim);
                return by_pass(p, step as usize, stream, params);
            }
            Err(e) => {
                p.cap.stage.taken = taken;
                return Err(e);
            }
        }
    };
    // Nothing refuses from here on: the step's graphs follow the moves.
    if let Err(e) = bind(
        &mut p.cap.steps[step as usize],
        params,
        &mut p.cap.param_moves,
    ) {
        put_back(&p, step as usize, &mut taken);
        p.cap.stage.taken = taken;
        return Err(e);
    }
    let at = (chosen, stream, count, scalars);
    if let Err(e) = launch(&mut p, step as usize, at, claim) {
        put_back(&p, step as usize, &mut taken);
        p.cap.stage.taken = taken;
        return Err(e);
    }
    stage_grads(p, step as usize, taken)
}

/// Points the step's graphs at the parameters' addresses for this replay
/// (`given`), counting each move in `moves`; then records them as where
/// the last replay had them. A failure part way records nothing (the next
/// replay points the graphs again).
fn bind(st: &mut CapturedStep, params: Option<&[DevPtr]>, moves: &mut u64) -> Result<()> {
    for (k, q) in st.params.iter_mut().enumerate() {
        let to = given(params, k, st.at[k]);
        if to != q.bound() {
            q.bind(to)?;
            *moves += 1;
        }
    }
    for (k, at) in st.at.iter_mut().enumerate() {
        *at = given(params, k, *at);
    }
    Ok(())
}

/// Parameter `k`'s address for this replay: given (not NULL), else where
/// the last replay had it.
fn given(params: Option<&[DevPtr]>, k: usize, last: DevPtr) -> DevPtr {
    match params.and_then(|g| g.get(k).copied()) {
        Some(p) if p != 0 => p,
        _ => last,
    }
}

/// Whether the step's own graphs can read its parameters where this replay
/// has them (`given`); false where only its callables' graphs can follow
/// (the step then replays pass by pass). Refuses what neither can follow,
/// and a wrong count, before anything is enqueued.
fn follow(p: &Parts, step: usize, params: Option<&[DevPtr]>) -> Result<bool> {
    let st = &p.cap.steps[step];
    let n = st.params.len();
    if let Some(g) = params.filter(|g| g.len() != n) {
        return Err(Error::invalid(format!(
            "{} parameter addresses were passed to step {step}; its callables have {n} parameters",
            g.len()
        )));
    }
    let at = |k: usize| given(params, k, st.at[k]);
    if st
        .params
        .iter()
        .enumerate()
        .all(|(k, q)| q.refusal(at(k)).is_none())
    {
        return Ok(true);
    }
    let mut first = 0;
    for &i in &st.instances {
        let inst = &p.cap.instances[i];
        let name = &p.callables[inst.callable].name;
        let who = || {
            format!(
                "callable '{name}' (microbatch {}) in step {step}",
                inst.microbatch
            )
        };
        for q in &inst.params {
            check::movable(q, at(first + q.index), who)?;
        }
        first += inst.params.len();
    }
    Ok(false)
}

/// The refusal of a parameter that a looped step's graph cannot follow
/// (its callables' graphs could, but replaying them pass by pass would not
/// give the step's results).
fn unfollowed(p: &Parts, step: usize, params: Option<&[DevPtr]>) -> Error {
    let st = &p.cap.steps[step];
    let owners = st.instances.iter().flat_map(|&i| {
        let inst = &p.cap.instances[i];
        (0..inst.params.len()).map(move |j| (inst.callable, j))
    });
    for ((k, q), (c, j)) in st.params.iter().enumerate().zip(owners) {
        let to = given(params, k, st.at[k]);
        if let Some(why) = q.refusal(to) {
            return Error::ParamMoved(format!(
                "step {step}: param {j} of callable '{}' moved from 0x{:x} to 0x{to:x}; the step runs its \
                 {} in one graph, which cannot follow it ({why}), and replaying its callables pass by \
                 pass would not give the step's results",
                p.callables[c].name,
                q.bound(),
                match st.update.is_some() {
                    true => "passes and its update",
                    false => "microbatches",
                }
            ));
        }
    }
    Error::Internal(format!(
        "step {step}: a parameter the step cannot follow, not found"
    ))
}

/// Slot blocks taken for a replay that then fails go back to their rings
/// (the i-th block to the ring of the i-th cloned instance).
fn put_back(p: &Parts, step: usize, taken: &mut Vec<Arc<CloneBlock>>) {
    let cloned = &p.cap.steps[step].cloned;
    for (b, &j) in taken.drain(..).zip(cloned) {
        if let Some(r) = &p.cap.instances[j].ring {
            r.put_back(b);
        }
    }
}

/// A slot free in every callable of the step that returns clones, with its
/// blocks taken into `taken`; None when there is none.
fn free_slot(
    p: &Parts,
    step: usize,
    stream: StreamRef,
    taken: &mut Vec<Arc<CloneBlock>>,
) -> Result<Option<usize>> {
    let st = &p.cap.steps[step];
    'slots: for k in 0..st.slots.len() {
        for &i in &st.cloned {
            let ring = p.cap.instances[i].ring.as_ref();
            match ring.map(|r| r.take_slot(k, stream)).transpose() {
                Ok(Some(Some(b))) => taken.push(b),
                Ok(_) => {
                    put_back(p, step, taken);
                    continue 'slots;
                }
                Err(e) => {
                    put_back(p, step, taken);
                    return Err(e);
                }
            }
        }
        return Ok(Some(k));
    }
    Ok(None)
}

/// How many microbatches this replay runs (`asked`, 0: all), checked
/// against the step's declaration.
fn count(st: &CapturedStep, step: u32, asked: u32) -> Result<u32> {
    let n = st.microbatches;
    match asked {
        0 => Ok(n),
        a if a == n => Ok(n),
        a if st.loop_state.is_some() && a < n => Ok(a),
        a if st.loop_state.is_some() => Err(Error::invalid(format!(
            "step {step} was asked for {a} microbatches; it was declared with {n}, and its io regions \
             hold no more"
        ))),
        a => Err(Error::invalid(format!(
            "step {step} was asked for {a} microbatches; it was captured unrolled for {n} (a count per \
             replay needs GRAPHED_STEP_LOOP_WHILE)"
        ))),
    }
}

/// Launches the step's graph (or slot `chosen`'s) on `stream`, in the
/// pool's order; a loop on the device is told its `count` first, and an
/// update gets its `scalars` (then records the event its flag's read
/// waits for).
fn launch(
    p: &mut Parts,
    step: usize,
    (chosen, stream, count, scalars): (Option<usize>, StreamRef, u32, Option<&[u8]>),
    claim: Option<Claim>,
) -> Result<()> {
    let st = &mut p.cap.steps[step];
    let graph = match (&st.graph, chosen) {
        (Some(g), _) => g,
        (None, Some(k)) => &st.slots[k],
        (None, None) => return Err(Error::Internal("a step without a graph".into())),
    };
    match (&st.loop_state, &st.collectives) {
        // The loop runs all but the last microbatch (none at 1: skipped).
        (Some(state), Some(_)) => {
            let words = [count - 1, (count == 1) as u32, count];
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            p.backend.upload_async(state.ptr() + 4, &bytes, stream)?;
        }
        (Some(state), None) => p.backend.fill(state.ptr() + 4, count, 4, 1, stream)?,
        (None, _) => {}
    }
    if let Some(u) = &st.update {
        u.before_launch(p.backend.as_ref(), scalars, stream)?;
    }
    graph.launch(stream)?;
    if let Some(u) = &mut st.update {
        u.after_launch(p.backend.as_ref(), stream)?;
    }
    // Launched: the pool's order keeps it, and takes every pass.
    if let Some(c) = claim {
        c.keep();
    }
    for pp in &st.passes {
        let pos = p.cap.instances[pp.instance].position[pp.kind.index()].unwrap_or(0);
        p.pool.replayed(p.key, pos);
    }
    Ok(())
}

/// Stages every parameter grad of the step's callables, in order; the
/// blocks in `taken` hold the CLONE ones.
fn stage_grads(p: Parts<'_>, step: usize, mut taken: Vec<Arc<CloneBlock>>) -> Result<Replayed<'_>> {
    let Captured {
        instances,
        stage,
        steps,
        ..
    } = &mut *p.cap;
    let st = &steps[step];
    stage.a.clear();
    stage.b.clear();
    stage::give_back(&mut stage.blocks);
    // Locked after give_back, which may run the caller's free function.
    let mut book = p.opts.strict_leases.then(|| p.leases.lock());
    let mut at = 0;
    for &i in &st.instances {
        let inst = &instances[i];
        let np = inst.param_grads.len();
        let block = match st.cloned.iter().position(|&c| c == i) {
            Some(k) => (taken[k].ptr, k as u32),
            None => (0, 0),
        };
        let dsts = Some(&st.dsts[at..at + np]);
        stage::params(inst, dsts, block, book.as_deref_mut(), &mut stage.b);
        at += np;
    }
    stage.blocks.append(&mut taken);
    stage.taken = taken;
    Ok(Replayed::of(stage))
}

/// A step replayed pass by pass (its graphs need a clone slot that is not
/// free, or cannot follow moved parameters): the same passes, each its own
/// replay (forwards given the parameters' addresses: `params`' entries,
/// else where the last step replay had them), the grads gathered. Those
/// addresses become where the last step replay had them once every pass
/// ran.
fn by_pass<'a>(
    mut p: Parts<'a>,
    step: usize,
    stream: StreamRef,
    params: Option<&[DevPtr]>,
) -> Result<Replayed<'a>> {
    let (passes, dsts, instances, at) = {
        let st = &p.cap.steps[step];
        let at: Vec<DevPtr> = (0..st.at.len())
            .map(|k| given(params, k, st.at[k]))
            .collect();
        (st.passes.clone(), st.dsts.clone(), st.instances.clone(), at)
    };
    let params = Some(at.as_slice());
    let first: Vec<usize> = instances
        .iter()
        .scan(0, |at, &i| {
            let start = *at;
            *at += p.cap.instances[i].param_grads.len();
            Some(start)
        })
        .collect();
    let mut grads: Vec<Vec<Returned>> = vec![Vec::new(); instances.len()];
    let mut blocks: Vec<Arc<CloneBlock>> = Vec::new();
    for pp in passes {
        let k = instances
            .iter()
            .position(|&i| i == pp.instance)
            .unwrap_or(0);
        let inst = &p.cap.instances[pp.instance];
        let grad_pass = pp.kind == inst.grad_pass();
        let np = inst.param_grads.len();
        let a = ReplayArgs {
            callable: inst.callable as u32,
            microbatch: inst.microbatch,
            stream,
            side_stream: None,
            data: None,
            param_dsts: grad_pass.then(|| &dsts[first[k]..first[k] + np]),
            params: params
                .filter(|_| pp.kind == PassKind::Forward)
                .map(|g| &g[first[k]..first[k] + np]),
            size: 0,
            size2: 0,
            device_size: 0,
        };
        if let Err(e) = run(&mut p, &a, pp.kind) {
            // Nothing of a failed step reaches the caller: the leases and
            // blocks of the passes that ran go back.
            release_leases(&p, grads.iter().flatten());
            stage::give_back(&mut blocks);
            return Err(in_step(e, step));
        }
        // The step hands out no aliases of outputs or input grads.
        release_leases(&p, p.cap.stage.a.iter());
        if grad_pass {
            let stage = &mut p.cap.stage;
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
    p.cap.steps[step].at.copy_from_slice(&at);
    let stage = &mut p.cap.stage;
    stage.a.clear();
    stage.b.clear();
    stage::give_back(&mut stage.blocks);
    stage.b.extend(grads.into_iter().flatten());
    stage.blocks.extend(blocks);
    Ok(Replayed::of(stage))
}

/// Releases the strict leases of `returned` (none without strict leases).
fn release_leases<'r>(p: &Parts, returned: impl Iterator<Item = &'r Returned>) {
    if !p.opts.strict_leases {
        return;
    }
    let mut l = p.leases.lock();
    for r in returned.filter(|r| r.lease != 0) {
        // A lease acquired by this call is held: releasing it cannot fail.
        let _ = l.release(r.lease);
    }
}

/// `e`, when debug mode found it, also saying that the pass ran in step
/// `step`, replayed pass by pass.
fn in_step(e: Error, step: usize) -> Error {
    match e {
        Error::Surfaced { place, cause } => Error::Surfaced {
            place: format!("{place}, in step {step} (replayed pass by pass in debug mode)"),
            cause,
        },
        e => e,
    }
}
