//! Step 3 of capture, recording: the warmup iterations (`warmup`), then
//! each pass captured alone into its graph (`run`) and once more per clone
//! slot (`slots`), the graphs that choose a bucket on the device, and the
//! steps (`steps`).

use super::super::buckets::{self, SizeBlock};
use super::super::captured::{CapturedStep, Switches};
use super::super::clock::{CaptureTimes, Span};
use super::super::context::Inputs;
use super::super::instance::{PassGraphs, PassRef, Placed};
use super::super::pool::Arena;
use super::super::scratch::Scratch;
use super::super::spec::Phase;
use super::run::{Call, GraphOf, Runner};
use super::warmup::warmup;
use crate::backend::StreamRef;
use crate::core::PassKind;
use crate::error::Result;
use std::cell::Cell;
use std::sync::Arc;

/// What recording made: the graphs of every instance and of every step,
/// and the scratch arena they use.
pub(super) struct Recorded {
    pub graphs: Vec<PassGraphs>,
    pub steps: Vec<CapturedStep>,
    pub switches: Vec<Switches>,
    /// Instance indices by [callable][microbatch * buckets + bucket].
    pub by_callable: Vec<Vec<usize>>,
    pub arena: Option<Arena>,
}

/// Warmup, then the capture of every pass (and its clone slots), then the
/// steps.
pub(super) fn record(
    s: &Inputs,
    placed: &mut [Placed],
    scratch: &Arc<Scratch>,
    (stream, sizes): (StreamRef, Option<&SizeBlock>),
    order: &[PassRef],
    (times, exchanged): (&mut CaptureTimes, &Cell<usize>),
) -> Result<Recorded> {
    let tapes = (0..placed.len()).map(|_| Cell::new(0)).collect();
    let mut r = Runner {
        s,
        placed,
        scratch,
        tapes,
        stream,
        sizes,
        times,
        exchanged,
    };
    let arena = r.spent(Span::Warmup, |r| warmup(r, order))?;
    let iteration = s.opts.warmup_iterations;
    let mut graphs: Vec<PassGraphs> = (0..r.placed.len()).map(|_| PassGraphs::default()).collect();
    scratch.restart();
    for &p in order {
        let slots = r.slot_count(p);
        let start = r.start(p);
        let call = Call {
            phase: Phase::Capture,
            iteration,
            hooks: true,
            provide: true,
            param_grads: None,
            step_microbatch: (0, 1),
            step_index: 0,
            graph: GraphOf::Pass,
        };
        let graph = r.spent(Span::Capture, |r| r.call(p, call))?;
        graphs[p.instance].passes[p.kind.index()] = graph;
        if slots > 0 {
            let made = r.spent(Span::Slots, |r| r.capture_slots(p, iteration, slots, start))?;
            graphs[p.instance].slots = made;
        }
    }
    let by_callable = by_callable(s, r.placed);
    let switches = match (sizes, s.opts.device_buckets) {
        (Some(block), true) => r.spent(Span::Capture, |r| {
            switches(r.s, (r.stream, block), r.placed, &graphs, &by_callable)
        })?,
        _ => Vec::new(),
    };
    let slot_blocks: Vec<Vec<_>> = graphs
        .iter()
        .map(|g| g.slots.iter().map(|s| s.block).collect())
        .collect();
    let mut steps = Vec::with_capacity(s.steps.len());
    for si in 0..s.steps.len() {
        let step = r.spent(Span::Steps, |r| {
            r.capture_step(si, order, &by_callable, &slot_blocks, iteration)
        })?;
        steps.push(step);
    }
    Ok(Recorded {
        graphs,
        steps,
        switches,
        by_callable,
        arena,
    })
}

/// Per callable, the graphs that choose its bucket on the device, one per
/// pass (none for callables without buckets).
fn switches(
    s: &Inputs,
    (stream, block): (StreamRef, &SizeBlock),
    placed: &[Placed],
    graphs: &[PassGraphs],
    by_callable: &[Vec<usize>],
) -> Result<Vec<Switches>> {
    let mut out = Vec::with_capacity(s.callables.len());
    let to = (s.backend.as_ref(), (stream, s.opts.capture_mode), block);
    for (c, spec) in s.callables.iter().enumerate() {
        let mut per = Switches::default();
        if !spec.buckets.is_empty() {
            let buckets = &by_callable[c];
            let largest = &placed[buckets[buckets.len() - 1]];
            for kind in [PassKind::Forward, PassKind::Backward, PassKind::Wgrad] {
                if largest.position[kind.index()].is_some() {
                    let bodies = buckets
                        .iter()
                        .map(|&n| graphs[n].passes[kind.index()].as_deref())
                        .collect::<Option<Vec<_>>>();
                    let graph = buckets::capture_switch(to, (largest, kind, None), bodies)?;
                    per.passes[kind.index()] = Some(graph);
                }
            }
            // Every bucket has as many slots (one ring, one slot count).
            let grad_pass = largest.grad_pass();
            for k in 0..graphs[buckets[0]].slots.len() {
                let bodies = buckets
                    .iter()
                    .map(|&n| graphs[n].slots.get(k).map(|g| g.graph.as_ref()))
                    .collect::<Option<Vec<_>>>();
                // The buckets share the slot blocks.
                let slot = graphs[buckets[0]].slots[k].block;
                per.slots.push(buckets::capture_switch(
                    to,
                    (largest, grad_pass, Some(slot)),
                    bodies,
                )?);
            }
        }
        out.push(per);
    }
    Ok(out)
}

fn by_callable(s: &Inputs, placed: &[Placed]) -> Vec<Vec<usize>> {
    let mut v = vec![Vec::new(); s.callables.len()];
    for (n, inst) in placed.iter().enumerate() {
        v[inst.callable].push(n);
    }
    v
}
