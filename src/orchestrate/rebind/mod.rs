//! Rebinding, the verification step of a capture: inputs and grad-outputs
//! asked to be rebound (`GRAPHED_TENSOR_FLAGS_REBIND`) are read by replays
//! where the caller's data is, instead of copied into the static buffer,
//! parameters asked to (`GRAPHED_PARAM_FLAGS_REBIND`) may move, and
//! COPY_INTO parameter grads asked to (`GRAPHED_PARAM_FLAGS_REBIND_GRAD`)
//! are written straight into their destination, where capture can verify
//! that this gives the same results. A parameter's verification writes a
//! pattern into the caller's memory for one replay and puts its bytes
//! back. Steps are verified the same way (`steps`).
//!
//! A grad is planned in the graph of the pass that writes it only: other
//! passes (an earlier capture's temporaries in the same memory, which a
//! framework's pool may hand out again) keep their references. Its
//! verification moves it to memory filled with a pattern, with a guard of
//! pattern after it: the rebound run must write the grad the copying run
//! wrote there, whole, and nothing past its end.
//!
//! Per instance: the backend plans where its graphs take each buffer's
//! address (`Graph::rebinder`); then one verification replays the
//! instance's graphs twice on the capture stream, first copying (grad-
//! outputs filled with a pattern), then with every planned buffer moved to
//! a copy of its data while the static buffer holds another pattern; the
//! device compares every output and grad of the two runs, and one flag
//! comes back. Equal: every plan is kept. Different: each buffer is
//! verified alone, and those that differ are copied, with the reason. A
//! buffer that cannot be planned (opaque work, no parameter information,
//! not floating-point data) is copied too. Patterns and copies stay on the
//! device: nothing the size of a tensor crosses to the host.
//!
//! Replays then point the graphs at the caller's buffer (one node update
//! per reference) instead of copying it; the caller keeps that buffer
//! unchanged until the instance's last pass that reads it has run.

use super::clock::{CaptureTimes, Span};
use super::context::Inputs;
use super::instance::{PassGraphs, Placed};
use super::spec::LogLevel;
use super::tensor::{Feed, ParamFeed, Rebinding, Return};
use crate::backend::{DevPtr, Graph, RebindPlan, StreamRef};
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::error::{Error, Result};
use verify::{Subject, Verifier, Workspace, VERIFIED};

#[cfg(test)]
mod grads_tests;
mod steps;
#[cfg(test)]
mod tests;
mod verify;

pub(crate) use steps::resolve_steps;

/// What is asked to be rebound: a tensor of the instance (an input or a
/// grad-output), one of its parameters, or a parameter's grad (written by
/// its pass straight into the destination).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum What {
    Tensor(Role, usize),
    Param(usize),
    Grad(usize),
}

impl What {
    /// How messages name it.
    fn describe(self, inst: &Placed) -> String {
        match self {
            What::Tensor(role, i) => inst.tensors(role)[i].describe(),
            What::Param(j) => format!("param {j}"),
            What::Grad(j) => inst.param_grads[j].describe(),
        }
    }

    /// Whether the graphs write it (a grad) rather than read it.
    fn written(self) -> bool {
        matches!(self, What::Grad(_))
    }

    /// Whether its memory is the caller's or the instance's own, where
    /// another candidate's could overlap it (a tensor's static buffer
    /// cannot).
    fn may_overlap(self) -> bool {
        !matches!(self, What::Tensor(..))
    }
}

/// A tensor or parameter asked to be rebound, with its plans.
struct Candidate {
    what: What,
    ptr: DevPtr,
    bytes: usize,
    dtype: DType,
    rebinding: Rebinding,
}

impl Candidate {
    /// The workspace bytes its verification copies take (a grad's moved
    /// copy has its guard after it).
    fn room(&self) -> usize {
        match self.what.written() {
            true => self.bytes + verify::CHUNK,
            false => self.bytes,
        }
    }
}

/// What planning decided for one tensor or parameter asked to be rebound.
enum Planned {
    Candidate(Candidate),
    Refused(What, String),
    /// Another callable's buffer, used in place: it keeps its feed.
    InPlace(What),
}

/// What verification decided: the plans kept, or why not.
type Decision = std::result::Result<Rebinding, String>;

/// The tensors, parameters and grads of `inst` whose registration asks for
/// rebinding (a grad only where its frozen return is COPY_INTO).
fn asked(s: &Inputs, inst: &Placed) -> Vec<What> {
    let spec = &s.callables[inst.callable];
    let inputs = spec.inputs.iter().enumerate();
    let outputs = spec.outputs.iter().enumerate();
    let params = spec.params.iter().enumerate();
    let grads = spec.params.iter().zip(&inst.param_grads).enumerate();
    inputs
        .filter(|(_, t)| t.rebind)
        .map(|(i, _)| What::Tensor(Role::Input, i))
        .chain(
            outputs
                .filter(|(_, t)| t.rebind)
                .map(|(o, _)| What::Tensor(Role::GradOutput, o)),
        )
        .chain(
            params
                .filter(|(_, p)| p.flags.rebind)
                .map(|(j, _)| What::Param(j)),
        )
        .chain(
            grads
                .filter(|(_, (p, g))| p.flags.rebind_grad && g.ret == Return::CopyInto)
                .map(|(j, _)| What::Grad(j)),
        )
        .collect()
}

/// Plans the rebinding of `what` in the instance's graphs.
fn plan(inst: &Placed, graphs: &PassGraphs, what: What) -> Result<Planned> {
    let (ptr, bytes, dtype) = match what {
        What::Tensor(role, index) => {
            let t = &inst.tensors(role)[index];
            match t.feed {
                Feed::Chained => return Ok(Planned::InPlace(what)),
                Feed::NotFed => {
                    return Ok(Planned::Refused(
                        what,
                        "it has no static buffer (no grad flows to this output)".into(),
                    ))
                }
                _ => {}
            }
            (t.ptr, t.bytes, t.dtype)
        }
        What::Param(j) => {
            let p = &inst.params[j];
            (p.ptr, p.bytes, p.dtype)
        }
        What::Grad(j) => {
            let g = &inst.param_grads[j];
            if g.ptr == 0 {
                return Ok(Planned::Refused(what, "it has no buffer".into()));
            }
            let pass = graphs.passes[inst.grad_pass().index()].as_deref();
            return plan_in(pass.into_iter(), what, g.ptr, g.bytes, g.dtype);
        }
    };
    plan_in(graphs.all(), what, ptr, bytes, dtype)
}

/// Plans the rebinding of `what`, at `ptr`, in `graphs`.
fn plan_in<'g>(
    graphs: impl Iterator<Item = &'g dyn Graph>,
    what: What,
    ptr: DevPtr,
    bytes: usize,
    dtype: DType,
) -> Result<Planned> {
    let refused = |why: &str| Ok(Planned::Refused(what, why.to_string()));
    if !VERIFIED.contains(&dtype) {
        let kept = match what {
            What::Tensor(..) => "tensors are copied",
            What::Param(_) => "parameters stay where they were registered",
            What::Grad(_) => "grads are copied into their destination",
        };
        return refused(&format!(
            "rebinding is verified with floating-point data; {} {kept}",
            dtype.name()
        ));
    }
    let mut plans = Vec::new();
    for g in graphs {
        match g.rebinder(ptr, bytes)? {
            RebindPlan::Plan(p) => plans.push(p),
            // A pass that does not read the buffer needs no plan (a forward
            // never reads a grad-output; a backward may not read the input).
            RebindPlan::Unreferenced => {}
            RebindPlan::Refused(why) => return refused(&why),
        }
    }
    // A parameter that no graph takes the address of may still be read
    // through memory: verification tells. A tensor is copied instead, and
    // a grad its pass writes through memory no plan can point elsewhere.
    if plans.is_empty() && !matches!(what, What::Param(_)) {
        return refused(match what {
            What::Grad(_) => "the pass that writes it does not take its address",
            _ => "no graph of the callable takes the buffer's address",
        });
    }
    Ok(Planned::Candidate(Candidate {
        what,
        ptr,
        bytes,
        dtype,
        rebinding: Rebinding::new(plans, ptr),
    }))
}

/// Refuses parameters and grads whose memory overlaps another candidate's:
/// moved apart, one plan would point the other's references away.
fn apart(
    cands: Vec<Candidate>,
    out: &mut Vec<(What, Decision)>,
    name: &dyn Fn(What) -> String,
) -> Vec<Candidate> {
    let overlaps = |a: &Candidate, b: &Candidate| {
        a.ptr < b.ptr + b.bytes as DevPtr && b.ptr < a.ptr + a.bytes as DevPtr
    };
    let shared: Vec<Option<What>> = cands
        .iter()
        .enumerate()
        .map(|(i, c)| match c.what.may_overlap() {
            true => cands
                .iter()
                .enumerate()
                .find(|&(k, o)| k != i && overlaps(c, o))
                .map(|(_, o)| o.what),
            false => None,
        })
        .collect();
    let mut kept = Vec::with_capacity(cands.len());
    for (c, other) in cands.into_iter().zip(shared) {
        match other {
            Some(o) => out.push((
                c.what,
                Err(format!(
                    "its memory overlaps that of {} of the same callable: they cannot be \
                     pointed elsewhere apart",
                    name(o)
                )),
            )),
            None => kept.push(c),
        }
    }
    kept
}
/// Decides every tensor asked to be rebound, instance by instance (see the
/// module comment), and lets the graphs' templates go where no plan needs
/// them; returns how many a plan keeps. `stream` is idle.
pub(crate) fn resolve(
    s: &Inputs,
    placed: &mut [Placed],
    graphs: &mut [PassGraphs],
    stream: StreamRef,
    times: &mut CaptureTimes,
) -> Result<usize> {
    let mut kept = 0;
    let mut ws: Option<Workspace> = None;
    for (inst, g) in placed.iter_mut().zip(graphs.iter_mut()) {
        let wanted = asked(s, inst);
        if !wanted.is_empty() {
            let decided = decide(s, inst, g, &wanted, stream, times, &mut ws)?;
            for (what, decision) in decided {
                log(s, inst, what, &decision);
                match what {
                    What::Tensor(role, i) => {
                        inst.tensors_mut(role)[i].feed = match decision {
                            Ok(r) => Feed::Rebound(r),
                            Err(why) => Feed::Refused(why),
                        }
                    }
                    What::Param(j) => {
                        inst.params[j].feed = match decision {
                            Ok(r) => ParamFeed::Rebound(r),
                            Err(why) => ParamFeed::Fixed(why),
                        }
                    }
                    What::Grad(j) => {
                        inst.param_grads[j].feed = match decision {
                            Ok(r) => Feed::Rebound(r),
                            Err(why) => Feed::Refused(why),
                        }
                    }
                }
            }
        }
        let slots = g.slots.iter_mut().map(|s| &mut s.graph);
        for graph in g.passes.iter_mut().flatten().chain(slots) {
            kept += graph.release_template() as usize;
        }
    }
    Ok(kept)
}

const MOVED: &str = "a rebound replay at capture gave other results than a copying one, or wrote \
                     the data it was fed: some kernel reads the buffer through memory, writes it in \
                     place, or is not deterministic";

const WRITTEN: &str =
    "a replay at capture that wrote it elsewhere gave other results than one that \
                       wrote its buffer, left part of it unwritten, or wrote past its end: some \
                       kernel reaches it through memory, reads what it held, shares its memory \
                       with a temporary, or is not deterministic";

/// What verification decided for each of `wanted` (tensors read in place
/// keep their feed, with a message).
fn decide(
    s: &Inputs,
    inst: &Placed,
    graphs: &PassGraphs,
    wanted: &[What],
    stream: StreamRef,
    times: &mut CaptureTimes,
    ws: &mut Option<Workspace>,
) -> Result<Vec<(What, Decision)>> {
    let planned = times.time(Span::RebindPlan, |_| {
        wanted
            .iter()
            .map(|&what| plan(inst, graphs, what))
            .collect::<Result<Vec<_>>>()
    })?;
    settle(
        s,
        planned,
        &mut |what| log_in_place(s, inst, what),
        &|w: What| w.describe(inst),
        || Subject::instance(inst, graphs),
        (stream, times, ws),
    )
}

/// What verification decides for `planned`: refusals as they are, tensors
/// read in place to `in_place`, candidates kept apart (`name` names them),
/// then verified with the subject `subject` makes (only when any is left).
fn settle<'a>(
    s: &Inputs,
    planned: Vec<Planned>,
    in_place: &mut dyn FnMut(What),
    name: &dyn Fn(What) -> String,
    subject: impl FnOnce() -> Subject<'a>,
    (stream, times, ws): (StreamRef, &mut CaptureTimes, &mut Option<Workspace>),
) -> Result<Vec<(What, Decision)>> {
    let mut out = Vec::new();
    let mut cands = Vec::new();
    for p in planned {
        match p {
            Planned::Candidate(c) => cands.push(c),
            Planned::Refused(what, why) => out.push((what, Err(why))),
            Planned::InPlace(what) => in_place(what),
        }
    }
    let cands = apart(cands, &mut out, name);
    if !cands.is_empty() {
        out.extend(verified(s, &subject(), cands, stream, times, ws)?);
    }
    Ok(out)
}

/// Verifies `cands` with `subject`: each keeps its plans or is refused,
/// with the reason. The workspace is made (or grown) as needed; where its
/// memory cannot be had, every candidate is refused, saying so.
fn verified(
    s: &Inputs,
    subject: &Subject,
    mut cands: Vec<Candidate>,
    stream: StreamRef,
    times: &mut CaptureTimes,
    ws: &mut Option<Workspace>,
) -> Result<Vec<(What, Decision)>> {
    let kept = times.time(Span::RebindVerify, |_| -> Result<Result<Vec<bool>, String>> {
        let need = subject.room(cands.iter().map(Candidate::room))?;
        if !ws.as_ref().is_some_and(|w| w.room_bytes() >= need) {
            *ws = None;
            match Workspace::new(s.backend, need) {
                Ok(w) => *ws = Some(w),
                Err(e) => {
                    return Ok(Err(format!(
                        "verifying it needs {need} bytes of device memory, which could not be had: {e}"
                    )))
                }
            }
        }
        let Some(ws) = ws.as_ref() else {
            return Err(Error::Internal("no verification workspace".into()));
        };
        let v = Verifier {
            backend: s.backend.as_ref(),
            stream,
            ws,
            subject,
        };
        verify(&v, &mut cands).map(Ok)
    })?;
    Ok(cands
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let decision = match &kept {
                Ok(k) if k[i] => Ok(c.rebinding),
                Ok(_) if c.what.written() => Err(WRITTEN.into()),
                Ok(_) => Err(MOVED.into()),
                Err(why) => Err(why.clone()),
            };
            (c.what, decision)
        })
        .collect())
}

/// Which candidates to keep: all when they agree together; else each is
/// tried alone, and those that agree alone are tried together again (what
/// replays bind together must agree together), all refused when they do not.
fn verify(v: &Verifier, cands: &mut [Candidate]) -> Result<Vec<bool>> {
    let mut all: Vec<&mut Candidate> = cands.iter_mut().collect();
    if v.same(&mut all)? {
        return Ok(vec![true; cands.len()]);
    }
    if cands.len() == 1 {
        return Ok(vec![false]);
    }
    let mut keep = Vec::with_capacity(cands.len());
    for c in cands.iter_mut() {
        keep.push(v.same(&mut [c])?);
    }
    let n = keep.iter().filter(|&&k| k).count();
    if n >= 2 && n < cands.len() {
        let mut kept: Vec<&mut Candidate> = cands
            .iter_mut()
            .zip(&keep)
            .filter(|(_, &k)| k)
            .map(|(c, _)| c)
            .collect();
        if !v.same(&mut kept)? {
            keep.iter_mut().for_each(|k| *k = false);
        }
    }
    Ok(keep)
}

fn log_in_place(s: &Inputs, inst: &Placed, what: What) {
    let (name, mb) = (&s.callables[inst.callable].name, inst.microbatch);
    let what = what.describe(inst);
    s.log(LogLevel::Info, || {
        format!(
            "{what} of callable '{name}' (microbatch {mb}) is another callable's buffer, used in place: \
             it is never copied, so rebinding does not apply"
        )
    });
}

fn log(s: &Inputs, inst: &Placed, what: What, decision: &Decision) {
    let (name, mb) = (&s.callables[inst.callable].name, inst.microbatch);
    let (moved, kept) = match what {
        What::Tensor(..) => ("is rebound at replay", "is copied at replay"),
        What::Param(_) => (
            "can move: replays point its graphs at its new address",
            "cannot move: a replay at another address is refused",
        ),
        What::Grad(_) => (
            "is written straight into its destination at replay",
            "is copied into its destination at replay",
        ),
    };
    let what = what.describe(inst);
    match decision {
        Ok(r) => s.log(LogLevel::Info, || {
            format!(
                "{what} of callable '{name}' (microbatch {mb}) {moved}: {} node(s)",
                r.nodes()
            )
        }),
        Err(why) => s.log(LogLevel::Warn, || {
            format!("{what} of callable '{name}' (microbatch {mb}) {kept}: {why}")
        }),
    }
}
