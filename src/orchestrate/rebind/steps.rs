//! Steps whose parameters may move: a step's graphs (its one graph, or one
//! per clone slot) are captured apart from its callables' graphs, so they
//! are planned and verified apart too, for every parameter its callables'
//! own graphs can follow. The verification replays the step's graphs with
//! its grad destinations put back between and after the runs (they are the
//! caller's memory, and ACCUMULATE_INTO reads them). A parameter the step
//! cannot follow still moves: the step then replays pass by pass.

use super::super::captured::CapturedStep;
use super::super::clock::{CaptureTimes, Span};
use super::super::context::Inputs;
use super::super::instance::{PassGraphs, Placed};
use super::super::spec::LogLevel;
use super::super::tensor::ParamFeed;
use super::verify::{fed, Subject, Workspace};
use super::{plan_in, settle, Decision, What};
use crate::backend::{DevPtr, Graph, StreamRef};
use crate::error::Result;

/// Decides, step by step, which parameters each step's graphs can follow,
/// and lets the step graphs' templates go where no plan needs them;
/// returns how many a plan keeps. `stream` is idle.
pub(crate) fn resolve_steps(
    s: &Inputs,
    placed: &[Placed],
    graphs: &[PassGraphs],
    steps: &mut [CapturedStep],
    stream: StreamRef,
    times: &mut CaptureTimes,
) -> Result<usize> {
    let mut kept = 0;
    let mut ws: Option<Workspace> = None;
    for (si, st) in steps.iter_mut().enumerate() {
        let owners = owners(st, placed);
        let wanted: Vec<usize> = owners
            .iter()
            .enumerate()
            .filter(|&(_, &(i, j))| {
                let inst = &placed[i];
                s.callables[inst.callable].params[j].flags.rebind && inst.params[j].movable()
            })
            .map(|(k, _)| k)
            .collect();
        if !wanted.is_empty() && st.update.is_some() {
            // Verifying would replay the update on the caller's weights
            // and optimizer state; the update writes the parameters where
            // capture had them, so they stay there.
            for &k in &wanted {
                st.params[k].feed = ParamFeed::Fixed(
                    "the step updates its parameters in its graph, where capture had them".into(),
                );
            }
        } else if !wanted.is_empty() && st.collectives.is_some() {
            // Verifying would replay the step's collectives at capture:
            // every rank would have to replay exactly as often as the
            // others (a rank whose verification went another way, or
            // found no workspace, leaves them waiting in a collective),
            // and a caller comparing the ranks' collectives after capture
            // (Python) would have run them before.
            for &k in &wanted {
                st.params[k].feed = ParamFeed::Fixed(
                    "the step records collectives in its graph: verifying a move would replay them \
                     at capture, on every rank alike or hanging"
                        .into(),
                );
            }
        } else if !wanted.is_empty() && st.graph_count() > 0 {
            let name = |w: What| match w {
                What::Param(k) => {
                    let (i, j) = owners[k];
                    format!(
                        "param {j} of callable '{}'",
                        s.callables[placed[i].callable].name
                    )
                }
                What::Tensor(..) | What::Grad(_) => String::new(),
            };
            let decided = decide(
                s, st, placed, graphs, &wanted, stream, times, &mut ws, &name,
            )?;
            for (what, decision) in decided {
                let What::Param(k) = what else { continue };
                log(s, si, &name(what), &decision);
                st.params[k].feed = match decision {
                    Ok(r) => ParamFeed::Rebound(r),
                    Err(why) => ParamFeed::Fixed(why),
                };
            }
        }
        let slots = st.slots.iter_mut();
        for g in st.graph.iter_mut().chain(slots) {
            kept += g.release_template() as usize;
        }
    }
    Ok(kept)
}

/// (instance, parameter index) of each parameter of the step, in order.
fn owners(st: &CapturedStep, placed: &[Placed]) -> Vec<(usize, usize)> {
    st.instances
        .iter()
        .flat_map(|&i| (0..placed[i].params.len()).map(move |j| (i, j)))
        .collect()
}

/// Plans and verifies parameters `wanted` (indices among the step's) in
/// the step's graphs.
#[allow(clippy::too_many_arguments)]
fn decide(
    s: &Inputs,
    st: &CapturedStep,
    placed: &[Placed],
    graphs: &[PassGraphs],
    wanted: &[usize],
    stream: StreamRef,
    times: &mut CaptureTimes,
    ws: &mut Option<Workspace>,
    name: &dyn Fn(What) -> String,
) -> Result<Vec<(What, Decision)>> {
    let step_graphs = || {
        let slots = st.slots.iter().map(|g| g.as_ref());
        st.graph.iter().map(|g| g.as_ref()).chain(slots)
    };
    let planned = times.time(Span::RebindPlan, |_| {
        wanted
            .iter()
            .map(|&k| {
                let p = &st.params[k];
                plan_in(step_graphs(), What::Param(k), p.ptr, p.bytes, p.dtype)
            })
            .collect::<Result<Vec<_>>>()
    })?;
    settle(
        s,
        planned,
        &mut |_| {},
        name,
        || subject(st, placed, graphs, step_graphs().collect()),
        (stream, times, ws),
    )
}

/// What verifying a step replays and compares: its graphs; every result of
/// its instances (their slots' blocks included) and its destinations,
/// which it also keeps.
fn subject<'a>(
    st: &CapturedStep,
    placed: &[Placed],
    graphs: &[PassGraphs],
    step_graphs: Vec<&'a dyn Graph>,
) -> Subject<'a> {
    let insts = || st.instances.iter().map(|&i| &placed[i]);
    let mut results: Vec<(DevPtr, usize)> = insts().flat_map(|i| i.results()).collect();
    for &i in &st.instances {
        let clone = placed[i].returns.clone.bytes;
        results.extend(graphs[i].slots.iter().map(|s| (s.block, clone)));
    }
    let grads = insts().flat_map(|i| &i.param_grads);
    let kept: Vec<(DevPtr, usize)> = st
        .dsts
        .iter()
        .zip(grads)
        .filter(|(&d, _)| d != 0)
        .map(|(&d, t)| (d, t.bytes))
        .collect();
    results.extend(kept.iter().copied());
    Subject {
        graphs: step_graphs,
        fed: fed(insts()),
        results,
        kept,
    }
}

fn log(s: &Inputs, si: usize, what: &str, decision: &Decision) {
    match decision {
        Ok(r) => s.log(LogLevel::Info, || {
            format!(
                "{what} can move in step {si}'s graphs: {} node(s)",
                r.nodes()
            )
        }),
        Err(why) => s.log(LogLevel::Warn, || {
            format!(
                "{what} cannot move in step {si}'s graphs (after a move the step replays pass by \
                 pass): {why}"
            )
        }),
    }
}
