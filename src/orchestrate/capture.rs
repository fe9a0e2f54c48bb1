//! Warmup and capture. Passes run in one order for warmup and capture (the
//! pipeline schedule's, or by default all forwards in registration order,
//! then all backwards in reverse, each weight-grad right after its
//! backward), eagerly on a side stream for the warmup iterations, then once
//! each under stream capture into its own graph. Per-callable hooks run
//! around every callback, outside capture.
//!
//! Before any of that, the static buffers are planned (layout, lifetimes,
//! reuse), placed in one allocation, and every instance gets its frozen
//! return plan and lease slots. Everything is owned by the `Captured` under
//! construction, so an error anywhere releases all of it.

use super::captured::{
    Buffers, Captured, CapturedStep, Instance, LeaseSlots, PassRef, PlanRecord, Stage,
};
use super::clock::{CaptureTimes, Span};
use super::external::Provided;
use super::pool::Pool;
use super::rebind::{self, Rebind};
use super::replay::enqueue_destinations;
use super::returned::CloneRing;
use super::scratch::Scratch;
use super::spec::{
    CallableSpec, HookPoint, LogLevel, MemCounters, PassView, Phase, SessionOptions, StepSpec,
    TensorSpec,
};
use crate::backend::{Backend, CaptureEnd, DevPtr, DeviceMemory, Event, Graph, Stream};
use crate::core::arena::Arena;
use crate::core::layout::{layout, InstanceShape, Layout, ParamShape, Role, TensorShape};
use crate::core::lease::Leases;
use crate::core::plan::{self, Lifetime, Plan};
use crate::core::policy::{snapshot, GradPolicy};
use crate::core::returns::{ParamReturn, ReturnPlan};
use crate::core::schedule::Schedule;
use crate::core::PassKind;
use crate::error::{Error, Result};
use std::cell::Cell;
use std::sync::Arc;

/// What capture reads of a session.
pub(crate) struct Inputs<'a> {
    pub backend: &'a Arc<dyn Backend>,
    pub pool: &'a Arc<Pool>,
    pub opts: &'a SessionOptions,
    pub callables: &'a [CallableSpec],
    pub steps: &'a [StepSpec],
    pub counters: &'a Arc<MemCounters>,
}

impl Inputs<'_> {
    fn log(&self, level: LogLevel, msg: impl FnOnce() -> String) {
        self.opts.log(level, msg)
    }
}

/// The static buffers of a session, planned but not yet placed.
struct Planned {
    shapes: Vec<InstanceShape>,
    /// (callable, microbatch) of each instance.
    owners: Vec<(usize, usize)>,
    layout: Layout,
    lifetimes: Vec<Lifetime>,
    plan: Plan,
}

/// Lays out the static buffers of every instance (callable x microbatch,
/// instance `callable * microbatches + microbatch`) with their frozen
/// policies, and places them (with reuse when the session asks for it).
fn plan_buffers(s: &Inputs, schedule: &Schedule) -> Result<Planned> {
    let m = schedule.microbatches;
    let mut shapes = Vec::new();
    let mut owners = Vec::new();
    for (c, spec) in s.callables.iter().enumerate() {
        let policies = snapshot(s.opts.clone_param_grads_on_return, &spec.params);
        let tensor = |t: &TensorSpec| TensorShape {
            bytes: t.bytes,
            requires_grad: t.requires_grad,
            external: t.external,
            chained: None,
        };
        let shape = InstanceShape {
            inputs: spec.inputs.iter().map(tensor).collect(),
            outputs: spec.outputs.iter().map(tensor).collect(),
            params: spec
                .params
                .iter()
                .zip(&policies)
                .map(|(p, pol)| {
                    pol.map(|policy| ParamShape {
                        bytes: p.bytes,
                        policy,
                        external: p.external_grad(),
                    })
                })
                .collect(),
        };
        for mb in 0..m {
            let mut shape = shape.clone();
            for (t, spec) in shape.inputs.iter_mut().zip(&spec.inputs) {
                t.chained = spec
                    .chained
                    .map(|(pc, j)| (pc as usize * m + mb, j as usize));
            }
            shapes.push(shape);
            owners.push((c, mb));
        }
    }
    let layout = layout(&shapes)?;
    let lifetimes = plan::lifetimes(schedule, &layout, |c, mb| c * m + mb);
    let plan = if s.opts.reuse_buffers {
        plan::reuse(&layout.buffers, &lifetimes)?
    } else {
        Plan {
            peak_live_bytes: plan::peak_live(&layout.buffers, &lifetimes)?,
            ..plan::disjoint(&layout.buffers)?
        }
    };
    Ok(Planned {
        shapes,
        owners,
        layout,
        lifetimes,
        plan,
    })
}

/// The instances of a planned session whose static allocation starts at
/// `base`, with their return plans and (with strict leases) lease slots.
fn place(s: &Inputs, p: &Planned, base: DevPtr, leases: &mut Leases) -> Result<Vec<Instance>> {
    let at = |id: usize| base + p.plan.offsets[id] as DevPtr;
    let opt = |id: Option<usize>| id.map_or(0, at);
    let mut instances = Vec::with_capacity(p.shapes.len());
    for ((&(c, mb), ib), shape) in p.owners.iter().zip(&p.layout.instances).zip(&p.shapes) {
        let spec = &s.callables[c];
        let slab = opt(ib.slab);
        let policies: Vec<_> = shape.params.iter().map(|p| p.map(|p| p.policy)).collect();
        let dtypes: Vec<_> = spec.params.iter().map(|p| p.dtype).collect();
        let has_wgrad = spec.callbacks.has_wgrad();
        let returns = ReturnPlan::of(&policies, &shape.params, &dtypes, &ib.slab_layout)?;
        let ring = (returns.clone.count > 0 && s.opts.allocator.is_none())
            .then(|| CloneRing::new(s.backend, s.counters, returns.clone.bytes));
        instances.push(Instance {
            callable: c,
            microbatch: mb as u32,
            buffers: Buffers {
                inputs: ib.inputs.iter().map(|&b| at(b)).collect(),
                outputs: ib.outputs.iter().map(|&b| opt(b)).collect(),
                grad_outputs: ib.grad_outputs.iter().map(|&b| opt(b)).collect(),
                grad_inputs: ib.grad_inputs.iter().map(|&b| opt(b)).collect(),
                params: spec.params.iter().map(|p| p.data).collect(),
                param_grads: ib
                    .slab_layout
                    .slots
                    .iter()
                    .map(|sl| sl.map_or(0, |sl| slab + sl.offset as DevPtr))
                    .collect(),
                param_bytes: spec.params.iter().map(|p| p.bytes).collect(),
                slab,
            },
            chained_inputs: shape.inputs.iter().map(|t| t.chained.is_some()).collect(),
            chained_grad_outputs: ib
                .grad_outputs
                .iter()
                .map(|b| b.is_some_and(|b| p.layout.shared.iter().any(|u| u.buffer == b)))
                .collect(),
            returns,
            ring,
            rotating: Vec::new(),
            slot_blocks: Vec::new(),
            rebind: spec.inputs.iter().map(|_| Rebind::Off).collect(),
            rebind_grad_outputs: spec.outputs.iter().map(|_| Rebind::Off).collect(),
            external: external_buffers(shape, has_wgrad),
            graphs: [None, None, None],
            position: [None, None, None],
            leases: LeaseSlots::default(),
        });
    }
    if s.opts.strict_leases {
        lease_slots(s, p, &mut instances, leases)?;
    }
    Ok(instances)
}

/// Registers a lease slot for every alias an instance hands out, and which
/// slots each replay overwrites (with reuse, every buffer sharing memory
/// with the buffers it writes).
fn lease_slots(
    s: &Inputs,
    p: &Planned,
    instances: &mut [Instance],
    leases: &mut Leases,
) -> Result<()> {
    // Lease slots live in logical buffers; external buffers get ids of
    // their own past the layout's (nothing shares their memory).
    let nbuf = p.layout.buffers.len();
    let mut next = nbuf;
    let mut fresh = || {
        next += 1;
        next - 1
    };
    let chained: Vec<usize> = p.layout.shared.iter().map(|u| u.buffer).collect();
    let sharing = |written: &[usize]| -> Vec<usize> {
        let slots: Vec<usize> = written
            .iter()
            .filter(|&&b| b < nbuf)
            .map(|&b| p.plan.slot_of[b])
            .collect();
        let mut all: Vec<usize> = (0..nbuf)
            .filter(|&b| slots.contains(&p.plan.slot_of[b]))
            .collect();
        all.extend(written.iter().filter(|&&b| b >= nbuf));
        all
    };
    for ((inst, ib), shape) in instances.iter_mut().zip(&p.layout.instances).zip(&p.shapes) {
        let spec = &s.callables[inst.callable];
        let (name, mb) = (&spec.name, inst.microbatch);
        let who = |what: String| format!("{what} of callable '{name}' (microbatch {mb})");
        let out_ids: Vec<usize> = ib
            .outputs
            .iter()
            .map(|b| b.unwrap_or_else(&mut fresh))
            .collect();
        let gin_ids: Vec<Option<usize>> = ib
            .grad_inputs
            .iter()
            .zip(&shape.inputs)
            .map(|(b, t)| b.or_else(|| t.requires_grad.then(&mut fresh)))
            .collect();
        let param_ids: Vec<Option<usize>> = shape
            .params
            .iter()
            .map(|sp| {
                sp.map(|sp| {
                    if sp.external {
                        fresh()
                    } else {
                        ib.slab.unwrap_or(usize::MAX)
                    }
                })
            })
            .collect();
        let mut slots = LeaseSlots::default();
        for (i, &b) in out_ids.iter().enumerate() {
            slots
                .outputs
                .push(leases.add_slot(who(format!("output {i}")), b)?);
        }
        for (i, b) in gin_ids.iter().enumerate() {
            slots.grad_inputs.push(match b {
                Some(b) => Some(leases.add_slot(who(format!("the grad of input {i}")), *b)?),
                None => None,
            });
        }
        for (i, (b, pol)) in param_ids.iter().zip(&inst.returns.policies).enumerate() {
            slots.params.push(match (b, pol) {
                (Some(b), Some(GradPolicy::Alias)) => {
                    Some(leases.add_slot(who(format!("the grad of param {i}")), *b)?)
                }
                _ => None,
            });
        }
        let params: Vec<usize> = param_ids.iter().flatten().copied().collect();
        // Replays write by copy-in the inputs (forward) and grad-outputs
        // (backward), except chained ones, which take no data.
        let copied_in = |b: &usize| !chained.contains(b);
        let mut fwd: Vec<usize> = ib.inputs.iter().copied().filter(copied_in).collect();
        fwd.extend(&out_ids);
        let mut bwd: Vec<usize> = ib
            .grad_outputs
            .iter()
            .flatten()
            .copied()
            .filter(copied_in)
            .collect();
        bwd.extend(gin_ids.iter().flatten());
        if !spec.callbacks.has_wgrad() {
            bwd.extend(&params);
        }
        slots.overwritten = [
            leases.slots_in(&sharing(&fwd)),
            leases.slots_in(&sharing(&bwd)),
            leases.slots_in(&sharing(&params)),
        ];
        inst.leases = slots;
    }
    Ok(())
}

/// Which external buffers each pass (forward, backward, weight-grad) of an
/// instance must provide.
fn external_buffers(shape: &InstanceShape, has_wgrad: bool) -> [Vec<(Role, usize)>; 3] {
    let outputs = (0..shape.outputs.len())
        .filter(|&i| shape.outputs[i].external)
        .map(|i| (Role::Output, i));
    let grads = (0..shape.inputs.len())
        .filter(|&i| shape.inputs[i].external && shape.inputs[i].requires_grad)
        .map(|i| (Role::GradInput, i));
    let params: Vec<(Role, usize)> = (0..shape.params.len())
        .filter(|&i| shape.params[i].is_some_and(|p| p.external))
        .map(|i| (Role::ParamGrads, i))
        .collect();
    let mut backward: Vec<(Role, usize)> = grads.collect();
    if !has_wgrad {
        backward.extend(&params);
    }
    [
        outputs.collect(),
        backward,
        if has_wgrad { params } else { Vec::new() },
    ]
}

fn phase_label(phase: Phase, hook: Option<HookPoint>) -> &'static str {
    match (phase, hook) {
        (Phase::Warmup, None) => "warmup",
        (Phase::Capture, None) => "capture",
        (Phase::Warmup, Some(HookPoint::Pre)) => "the pre-hook before a warmup pass",
        (Phase::Warmup, Some(HookPoint::Post)) => "the post-hook after a warmup pass",
        (Phase::Capture, Some(HookPoint::Pre)) => "the pre-hook before a capture",
        (Phase::Capture, Some(HookPoint::Post)) => "the post-hook after a capture",
    }
}

struct Runner<'a> {
    s: &'a Inputs<'a>,
    cap: &'a mut Captured,
    scratch: &'a Arc<Scratch>,
    times: &'a mut CaptureTimes,
}

impl Runner<'_> {
    /// Runs `f`, adding its time less the graphs it made to `span`.
    fn spent<T>(&mut self, span: Span, f: impl FnOnce(&mut Self) -> T) -> T {
        let made = |t: &CaptureTimes| t.instantiate + t.upload;
        let before = made(self.times);
        let t = std::time::Instant::now();
        let out = f(self);
        let inside = std::time::Duration::from_nanos(made(self.times) - before);
        self.times.add(span, t.elapsed().saturating_sub(inside));
        out
    }
}

impl Runner<'_> {
    fn failed(&self, p: PassRef, phase: Phase, hook: Option<HookPoint>, code: i32) -> Error {
        let inst = &self.cap.instances[p.instance];
        let spec = &self.s.callables[inst.callable];
        Error::CallbackFailed {
            callable: spec.name.clone(),
            pass: p.kind,
            microbatch: inst.microbatch,
            phase: phase_label(phase, hook),
            code,
            said: spec
                .callbacks
                .failure_message()
                .map_or(String::new(), |m| format!(": {m}")),
        }
    }

    /// Runs the hooks and the callback of one pass; under `Phase::Capture`
    /// the callback alone is captured into a graph, and, for the pass that
    /// writes an instance's CLONE grads, once more per clone slot.
    fn run(&mut self, p: PassRef, phase: Phase, iteration: u32) -> Result<()> {
        let slots = if phase == Phase::Capture {
            self.clone_slots(p)
        } else {
            0
        };
        // Each slot capture starts where this capture starts: the scratch
        // arena and the tape (which a grad pass may consume).
        let before =
            (slots > 0).then(|| (self.scratch.snapshot(), self.cap.tapes[p.instance].get()));
        let span = if phase == Phase::Capture {
            Span::Capture
        } else {
            Span::Warmup
        };
        let graph = self.spent(span, |r| r.call(p, phase, iteration, true, true))?;
        if let Some(g) = graph {
            let inst = &mut self.cap.instances[p.instance];
            inst.graphs[p.kind.index()] = Some(g);
            self.cap.graph_count += 1;
        }
        if let Some(before) = before {
            self.spent(Span::Slots, |r| {
                r.capture_slots(p, iteration, slots, before)
            })?;
        }
        Ok(())
    }

    /// How many clone slots pass `p` is captured for: the pass that writes
    /// the parameter grads of an instance with CLONE grads in a ring, when
    /// it neither provides external buffers nor returns external clones.
    fn clone_slots(&self, p: PassRef) -> usize {
        let inst = &self.cap.instances[p.instance];
        let grad_pass = if inst.has_wgrad() {
            PassKind::Wgrad
        } else {
            PassKind::Backward
        };
        let eligible = p.kind == grad_pass
            && inst.ring.is_some()
            && inst.external[p.kind.index()].is_empty()
            && inst.returns.clone.external.is_empty();
        if eligible {
            self.s.opts.clone_slots as usize
        } else {
            0
        }
    }

    /// Captures pass `p` again for each clone slot, from the same scratch
    /// state and tape, with its CLONE slots pointing into the slot's block.
    fn capture_slots(
        &mut self,
        p: PassRef,
        iteration: u32,
        n: usize,
        (before, tape_before): (Arena, usize),
    ) -> Result<()> {
        let Some(ring) = self.cap.instances[p.instance].ring.clone() else {
            return Ok(());
        };
        let after = self.scratch.snapshot();
        let tape_after = self.cap.tapes[p.instance].get();
        let blocks = ring.add_slots(n, self.cap.side.raw())?;
        self.cap.instances[p.instance].slot_blocks = blocks.clone();
        let slab = self.cap.instances[p.instance].buffers.param_grads.clone();
        for base in blocks {
            let inst = &mut self.cap.instances[p.instance];
            for (i, ret) in inst.returns.params.iter().enumerate() {
                if let ParamReturn::Clone { offset } = *ret {
                    inst.buffers.param_grads[i] = base + offset as DevPtr;
                }
            }
            self.scratch.restore(before.clone());
            self.cap.tapes[p.instance].set(tape_before);
            // The slot captures repeat one capture: no hooks around them.
            let graph = self.call(p, Phase::Capture, iteration, false, false);
            let inst = &mut self.cap.instances[p.instance];
            inst.buffers.param_grads.clone_from(&slab);
            if let Some(g) = graph? {
                inst.rotating.push(g);
                self.cap.slot_graphs += 1;
            }
        }
        self.scratch.restore(after);
        self.cap.tapes[p.instance].set(tape_after);
        Ok(())
    }

    /// The graph of a capture that ended with `ended`, whose last callback
    /// (of pass `p`) returned `ran`; or why there is none.
    fn finish(
        &mut self,
        p: PassRef,
        ran: std::result::Result<(), i32>,
        ended: Result<CaptureEnd>,
    ) -> Result<Box<dyn Graph>> {
        // A refused scratch request explains a failed callback better than
        // its code; a callback that carried on without it is fine.
        let refused = self.scratch.take_failure();
        let inst = &self.cap.instances[p.instance];
        // An invalidated capture is the root cause even when the callback
        // also failed (its next launch fails because of it).
        match (ran, ended) {
            (ran, Ok(CaptureEnd::Invalidated(mut detail))) => {
                if let Err(code) = ran {
                    detail.push_str(&format!("; the callback then returned {code}"));
                }
                Err(Error::CaptureInvalidated {
                    callable: self.s.callables[inst.callable].name.clone(),
                    pass: p.kind,
                    microbatch: inst.microbatch,
                    detail,
                })
            }
            (Err(code), _) => {
                Err(refused.unwrap_or_else(|| self.failed(p, Phase::Capture, None, code)))
            }
            (Ok(()), Err(e)) => Err(e),
            (Ok(()), Ok(CaptureEnd::Graph(g))) => {
                let made = g.made();
                let t = &mut *self.times;
                t.add(Span::Instantiate, made.instantiate);
                t.add(Span::Upload, made.upload);
                Ok(g)
            }
        }
    }

    /// Captures step `si` (see `CapturedStep`).
    fn capture_step(&mut self, si: usize, iteration: u32) -> Result<()> {
        let step = &self.s.steps[si];
        let cap = &*self.cap;
        let instances: Vec<usize> = step
            .callables
            .iter()
            .map(|&c| cap.by_callable[c as usize][0])
            .collect();
        let passes: Vec<PassRef> = cap
            .order
            .iter()
            .filter(|p| instances.contains(&p.instance))
            .copied()
            .collect();
        // The destinations, against the frozen return plans.
        let mut first = Vec::with_capacity(instances.len());
        let mut at = 0;
        for &i in &instances {
            let inst = &cap.instances[i];
            first.push(at);
            for (j, r) in inst.returns.params.iter().enumerate() {
                let d = step.param_dsts[at + j];
                let name = &self.s.callables[inst.callable].name;
                if r.needs_destination() && d == 0 {
                    return Err(Error::invalid(format!(
                        "step {si}: param_dsts[{}] (param {j} of callable '{name}') is NULL, but its grad \
                         policy ({}) needs a destination",
                        at + j,
                        inst.returns.policies[j].map_or("?", |p| p.name())
                    )));
                }
                if let ParamReturn::AccumulateInto { dtype } = r {
                    if d % dtype.size() as DevPtr != 0 {
                        return Err(Error::invalid(format!(
                            "step {si}: param_dsts[{}] (param {j} of callable '{name}') is not aligned to its \
                             {} element size",
                            at + j,
                            dtype.name()
                        )));
                    }
                }
            }
            at += inst.returns.params.len();
        }
        let cloned: Vec<usize> = instances
            .iter()
            .copied()
            .filter(|&i| cap.instances[i].returns.clone.count > 0)
            .collect();
        let slots = cloned
            .iter()
            .map(|&i| cap.instances[i].slot_blocks.len())
            .min()
            .unwrap_or(0);
        let overwritten = {
            let mut v: Vec<usize> = instances
                .iter()
                .flat_map(|&i| {
                    cap.instances[i]
                        .leases
                        .overwritten
                        .iter()
                        .flatten()
                        .copied()
                })
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let dsts = step.param_dsts.clone();
        let mut graph = None;
        let mut slot_graphs = Vec::new();
        if cloned.is_empty() {
            graph =
                Some(self.capture_sequence(&passes, &instances, &dsts, &first, None, iteration)?);
        } else if slots == 0 {
            self.s.log(LogLevel::Warn, || {
                format!(
                    "step {si} returns CLONE grads but has no clone slots (clone_slots is 0, or a caller \
                     allocator is set): it replays pass by pass"
                )
            });
        } else {
            for k in 0..slots {
                let g =
                    self.capture_sequence(&passes, &instances, &dsts, &first, Some(k), iteration)?;
                slot_graphs.push(g);
            }
        }
        self.cap.step_graphs += graph.is_some() as u32 + slot_graphs.len() as u32;
        self.cap.steps.push(CapturedStep {
            instances,
            cloned,
            passes,
            dsts,
            graph,
            slots: slot_graphs,
            overwritten,
        });
        Ok(())
    }

    /// Captures `passes` back to back into one graph, each grad pass
    /// followed by its COPY_INTO and ACCUMULATE_INTO returns into `dsts`
    /// (instance k's parameters from `first[k]`); with `slot`, the CLONE
    /// grads of every instance go into its slot block.
    fn capture_sequence(
        &mut self,
        passes: &[PassRef],
        instances: &[usize],
        dsts: &[DevPtr],
        first: &[usize],
        slot: Option<usize>,
        iteration: u32,
    ) -> Result<Box<dyn Graph>> {
        let saved: Vec<Vec<DevPtr>> = instances
            .iter()
            .map(|&i| self.cap.instances[i].buffers.param_grads.clone())
            .collect();
        if let Some(k) = slot {
            for &i in instances {
                let inst = &mut self.cap.instances[i];
                let Some(&base) = inst.slot_blocks.get(k) else {
                    continue;
                };
                for (j, r) in inst.returns.params.iter().enumerate() {
                    if let ParamReturn::Clone { offset } = *r {
                        inst.buffers.param_grads[j] = base + offset as DevPtr;
                    }
                }
            }
        }
        self.scratch.restart();
        let result = self.record_sequence(passes, instances, dsts, first, iteration);
        for (&i, pg) in instances.iter().zip(saved) {
            self.cap.instances[i].buffers.param_grads = pg;
        }
        result
    }

    fn record_sequence(
        &mut self,
        passes: &[PassRef],
        instances: &[usize],
        dsts: &[DevPtr],
        first: &[usize],
        iteration: u32,
    ) -> Result<Box<dyn Graph>> {
        let backend = self.s.backend.clone();
        let stream = self.cap.side.raw();
        backend.begin_capture(stream, self.s.opts.capture_mode)?;
        let mut ran = Ok(());
        let mut enqueued = Ok(());
        let mut last = passes[0];
        let mut acc = Vec::new();
        for &p in passes {
            last = p;
            let inst = &self.cap.instances[p.instance];
            let spec = &self.s.callables[inst.callable];
            let context = format!(
                "the {} callback of callable '{}' (microbatch {}) during the capture of a step",
                p.kind, spec.name, inst.microbatch
            );
            // Under capture every callback gets ctx->capture; a step's
            // callables have no external buffers, so it expects none.
            let provided = Provided::new(Vec::new(), context.clone());
            self.scratch.set_context(context);
            let view = view(
                self.cap,
                Some(self.scratch),
                Some(&provided),
                p,
                Phase::Capture,
                iteration,
            );
            ran = spec.callbacks.run(&view);
            // A failed callback, or an invalidated capture, ends the
            // sequence: the passes after it would only be discarded. (No
            // `?` before the capture ends: a failed query just goes on.)
            if ran.is_err() || matches!(backend.capture_invalidated(stream), Ok(true)) {
                break;
            }
            let grad_pass =
                p.kind == PassKind::Wgrad || (p.kind == PassKind::Backward && !inst.has_wgrad());
            if grad_pass {
                let k = instances.iter().position(|&i| i == p.instance).unwrap_or(0);
                let base = first[k];
                enqueued = enqueue_destinations(
                    backend.as_ref(),
                    inst,
                    |j| dsts[base + j],
                    &mut acc,
                    stream,
                );
                if enqueued.is_err() {
                    break;
                }
            }
        }
        let ended = backend.end_capture(stream);
        let g = self.finish(last, ran, ended)?;
        enqueued?;
        Ok(g)
    }

    /// Runs the hooks and the callback of one pass once (under capture,
    /// into a graph it returns). `provide`: record the external buffers
    /// the callback provides (the first capture of a pass); `hooks`: run
    /// the per-callable hooks around it.
    fn call(
        &mut self,
        p: PassRef,
        phase: Phase,
        iteration: u32,
        provide: bool,
        hooks: bool,
    ) -> Result<Option<Box<dyn Graph>>> {
        let spec = &self.s.callables[self.cap.instances[p.instance].callable];
        let context = format!(
            "the {} callback of callable '{}' (microbatch {}) during {}",
            p.kind,
            spec.name,
            self.cap.instances[p.instance].microbatch,
            phase.name()
        );
        // Under capture, the external buffers this pass must provide.
        let provided = (phase == Phase::Capture).then(|| {
            let expected = self.cap.instances[p.instance].external[p.kind.index()].clone();
            Provided::new(expected, context.clone())
        });
        if hooks {
            let hook_view = view(self.cap, None, None, p, phase, iteration);
            spec.callbacks
                .hook(HookPoint::Pre, &hook_view)
                .map_err(|c| self.failed(p, phase, Some(HookPoint::Pre), c))?;
        }
        self.scratch.set_context(context);
        let graph = {
            let view = view(
                self.cap,
                Some(self.scratch),
                provided.as_ref(),
                p,
                phase,
                iteration,
            );
            if phase == Phase::Warmup {
                let ran = spec.callbacks.run(&view);
                let refused = self.scratch.take_failure();
                ran.map_err(|c| refused.unwrap_or_else(|| self.failed(p, phase, None, c)))?;
                None
            } else {
                let backend = &self.s.backend;
                backend.begin_capture(view.stream, self.s.opts.capture_mode)?;
                let ran = spec.callbacks.run(&view);
                let ended = backend.end_capture(view.stream);
                Some(self.finish(p, ran, ended)?)
            }
        };
        if let (Some(provided), true) = (&provided, provide) {
            let inst = &mut self.cap.instances[p.instance];
            for (role, i, ptr) in provided.finish()? {
                inst.buffers.provide(role, i, ptr);
            }
        }
        if hooks {
            let hook_view = view(self.cap, None, None, p, phase, iteration);
            spec.callbacks
                .hook(HookPoint::Post, &hook_view)
                .map_err(|c| self.failed(p, phase, Some(HookPoint::Post), c))?;
        }
        Ok(graph)
    }
}

/// What the callbacks (with scratch and, under capture, the external-buffer
/// collector) or hooks (with neither) of pass `p` see.
fn view<'a>(
    cap: &'a Captured,
    scratch: Option<&'a Arc<Scratch>>,
    provided: Option<&'a Arc<Provided>>,
    p: PassRef,
    phase: Phase,
    iteration: u32,
) -> PassView<'a> {
    let inst = &cap.instances[p.instance];
    let b = &inst.buffers;
    PassView {
        callable: inst.callable as u32,
        microbatch: inst.microbatch,
        pass: p.kind,
        phase,
        iteration,
        stream: cap.side.raw(),
        inputs: &b.inputs,
        params: &b.params,
        outputs: &b.outputs,
        grad_outputs: &b.grad_outputs,
        grad_inputs: &b.grad_inputs,
        param_grads: &b.param_grads,
        param_policies: &inst.returns.policies,
        tape: cap.tapes[p.instance].as_ptr().cast(),
        scratch,
        provided,
    }
}

/// Warmup and capture of every callable of `s`; see the module comment.
/// Returns the captured state and its lease table (for capture `epoch`).
pub(crate) fn capture(s: &Inputs, epoch: u32) -> Result<(Captured, Leases)> {
    let started = std::time::Instant::now();
    let mut times = CaptureTimes::default();
    let backend = s.backend;
    // Parameter flags may have changed since a step was declared: checked
    // again here, where they freeze, before anything runs.
    for step in s.steps {
        for &c in &step.callables {
            let spec = &s.callables[c as usize];
            if spec.has_external_buffers() {
                return Err(spec.step_refusal());
            }
        }
    }
    let has_wgrad: Vec<bool> = s
        .callables
        .iter()
        .map(|c| c.callbacks.has_wgrad())
        .collect();
    let schedule = match &s.opts.schedule {
        Some(spec) => Schedule::derive(&spec.steps, spec.layers_per_chunk.as_deref(), &has_wgrad)?,
        None => Schedule::sequential(&has_wgrad),
    };
    let planned = plan_buffers(s, &schedule)?;
    let side = match s.opts.capture_stream {
        Some(raw) => Stream::borrowed(backend, raw),
        None => Stream::new(backend)?,
    };
    let (ev_in, ev_out) = (Event::new(backend)?, Event::new(backend)?);
    let statics = DeviceMemory::new(backend, planned.plan.total_bytes)?;
    MemCounters::add(&s.counters.static_bytes, statics.bytes());
    let mut leases = Leases::new(epoch);
    let m = schedule.microbatches;
    let mut cap = Captured {
        backend: backend.clone(),
        counters: s.counters.clone(),
        instances: Vec::new(),
        by_callable: vec![Vec::new(); s.callables.len()],
        order: schedule
            .passes
            .iter()
            .map(|p| PassRef {
                instance: p.callable * m + p.microbatch,
                kind: p.kind,
            })
            .collect(),
        tapes: Box::new([]),
        times: CaptureTimes::default(),
        graph_count: 0,
        slot_graphs: 0,
        step_graphs: 0,
        plan: PlanRecord::default(),
        steps: Vec::new(),
        stage: Stage::default(),
        arena: None,
        side,
        ev_in,
        ev_out,
        statics: None,
    };
    let base = statics.ptr();
    cap.statics = Some(statics);
    cap.instances = place(s, &planned, base, &mut leases)?;
    for (n, inst) in cap.instances.iter().enumerate() {
        cap.by_callable[inst.callable].push(n);
    }
    for (pos, p) in cap.order.iter().enumerate() {
        cap.instances[p.instance].position[p.kind.index()] = Some(pos);
    }
    cap.tapes = (0..cap.instances.len()).map(|_| Cell::new(0)).collect();
    cap.plan = PlanRecord {
        plan: planned.plan,
        buffers: planned.layout.buffers,
        lifetimes: planned.lifetimes,
    };

    // Static buffers start zeroed; inputs start as the samples.
    let stream = cap.side.raw();
    backend.zero(base, cap.statics_bytes(), stream)?;
    for inst in &cap.instances {
        let inputs = &s.callables[inst.callable].inputs;
        for (t, &dst) in inputs.iter().zip(&inst.buffers.inputs) {
            if t.sample != 0 {
                backend.copy(dst, t.sample, t.bytes, stream)?;
            }
        }
    }
    if cap
        .instances
        .iter()
        .any(|i| !i.returns.accumulate.is_empty())
    {
        backend.prepare_accumulate()?;
    }

    times.add(Span::Plan, started.elapsed());
    let scratch = Scratch::measuring(backend.clone());
    let result = warmup_and_capture(s, &mut cap, &scratch, &mut times);
    // Whatever happened, nothing may still run on the side stream when the
    // scratch memory or the capture state is released.
    let synced = backend.synchronize(stream);
    drop(scratch);
    result?;
    synced?;
    prepare_rebinds(s, &mut cap, &mut times)?;

    if !s.opts.clone_param_grads_on_return {
        let aliased: usize = cap
            .instances
            .iter()
            .map(|i| {
                let spec = &s.callables[i.callable];
                i.returns
                    .policies
                    .iter()
                    .zip(&spec.params)
                    .filter(|(pol, p)| {
                        **pol == Some(GradPolicy::Alias)
                            && p.policy == GradPolicy::Default
                            && !p.delayed_wgrad()
                    })
                    .count()
            })
            .sum();
        if aliased > 0 {
            s.log(LogLevel::Warn, || {
                format!(
                    "{aliased} parameter grad slot(s) return aliases because clone_param_grads_on_return is false; \
                     each is overwritten by its callable's next backward replay"
                )
            });
        }
    }
    times.set_total(started.elapsed());
    cap.times = times;
    Ok((cap, leases))
}

/// Plans and verifies the inputs and grad-outputs asked to be rebound (see
/// `rebind`).
fn prepare_rebinds(s: &Inputs, cap: &mut Captured, times: &mut CaptureTimes) -> Result<()> {
    let stream = cap.side.raw();
    for n in 0..cap.instances.len() {
        let spec = &s.callables[cap.instances[n].callable];
        let in_bytes: Vec<usize> = spec.inputs.iter().map(|t| t.bytes).collect();
        let out_bytes: Vec<usize> = spec.outputs.iter().map(|t| t.bytes).collect();
        let inputs = spec.inputs.iter().enumerate().map(|(i, t)| (false, i, t));
        let outputs = spec.outputs.iter().enumerate().map(|(o, t)| (true, o, t));
        for (grad_output, i, t) in inputs.chain(outputs) {
            if !t.rebind {
                continue;
            }
            let inst = &cap.instances[n];
            let stat = if grad_output {
                inst.buffers.grad_outputs[i]
            } else {
                inst.buffers.inputs[i]
            };
            let r = if stat == 0 {
                Rebind::Refused("it has no static buffer (no grad flows to this output)".into())
            } else {
                rebind::prepare(
                    s.backend, inst, stat, t.dtype, t.bytes, &in_bytes, &out_bytes, stream, times,
                )?
            };
            let what = if grad_output { "grad-output" } else { "input" };
            let (name, mb) = (&spec.name, inst.microbatch);
            match &r {
                Rebind::On { .. } => s.log(LogLevel::Info, || {
                    format!(
                        "{what} {i} of callable '{name}' (microbatch {mb}) is rebound at replay: {} node(s)",
                        r.nodes()
                    )
                }),
                Rebind::Refused(why) => s.log(LogLevel::Warn, || {
                    format!("{what} {i} of callable '{name}' (microbatch {mb}) is copied at replay: {why}")
                }),
                Rebind::Off => {}
            }
            let inst = &mut cap.instances[n];
            if grad_output {
                inst.rebind_grad_outputs[i] = r;
            } else {
                inst.rebind[i] = r;
            }
        }
    }
    Ok(())
}

fn warmup_and_capture(
    s: &Inputs,
    cap: &mut Captured,
    scratch: &Arc<Scratch>,
    times: &mut CaptureTimes,
) -> Result<()> {
    let hook = |point| -> Result<()> {
        match &s.opts.warmup_hook {
            Some(h) => h(point).map_err(|code| Error::CallbackFailed {
                said: String::new(),
                callable: "(session)".into(),
                pass: PassKind::Forward,
                microbatch: 0,
                phase: if point == HookPoint::Pre {
                    "the pre-warmup hook"
                } else {
                    "the post-warmup hook"
                },
                code,
            }),
            None => Ok(()),
        }
    };
    let order = cap.order.clone();
    let mut runner = Runner {
        s,
        cap,
        scratch,
        times,
    };
    hook(HookPoint::Pre)?;
    let iterations = s.opts.warmup_iterations;
    for it in 0..iterations {
        if it > 0 {
            scratch.restart();
        }
        for &p in &order {
            runner.run(p, Phase::Warmup, it)?;
        }
        if it == 0 {
            use_measured_arena(s, runner.cap, scratch)?;
        }
    }
    if iterations == 0 {
        use_measured_arena(s, runner.cap, scratch)?;
    }
    hook(HookPoint::Post)?;
    s.backend.synchronize(runner.cap.side.raw())?;
    s.log(LogLevel::Debug, || {
        format!(
            "warmup done: {iterations} iteration(s), scratch arena {} bytes",
            runner.cap.arena_bytes()
        )
    });

    scratch.restart();
    for &p in &order {
        runner.run(p, Phase::Capture, iterations)?;
    }
    for si in 0..s.steps.len() {
        runner.spent(Span::Steps, |r| r.capture_step(si, iterations))?;
    }
    Ok(())
}

/// After the first warmup iteration: the real scratch allocations go, and
/// an arena of the measured size from the pool takes over.
fn use_measured_arena(s: &Inputs, cap: &mut Captured, scratch: &Scratch) -> Result<()> {
    s.backend.synchronize(cap.side.raw())?;
    let arena = s.pool.acquire(scratch.high_water())?;
    let (base, size) = arena.as_ref().map_or((0, 0), |a| (a.base, a.bytes));
    MemCounters::add(&cap.counters.scratch_bytes, size);
    cap.arena = arena;
    scratch.use_arena(base, size);
    Ok(())
}
