//! Warmup and capture. Passes run in one order for warmup and capture (the
//! pipeline schedule's, or by default all forwards in registration order,
//! then all backwards in reverse, each weight-grad right after its
//! backward), eagerly on a side stream for the warmup iterations, then once
//! each under stream capture into its own graph. Per-callable hooks run around every callback, outside capture.
//! Every device resource is owned by the `Captured` under construction, so
//! an error anywhere releases all of it.

use crate::backend::{CaptureEnd, DevPtr, MemCounters};
use crate::core::layout::{clone_layout, layout, InstanceShape, ParamShape, Role, TensorShape};
use crate::core::plan::{self, Plan};
use crate::core::policy::{snapshot, Destinations, GradPolicy};
use crate::core::schedule::Schedule;
use crate::error::{Error, PassKind, Result};
use std::cell::Cell;

use super::external::Provided;
use super::scratch::Scratch;
use super::session::{Captured, ExternalBuffers, Instance, Session};
use super::spec::{HookPoint, LogLevel, PassView, Phase, TensorSpec};

/// One pass of one instance, in warmup/capture order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PassRef {
    pub instance: usize,
    pub kind: PassKind,
}

/// Builds the instances (static buffers, frozen policies) of a session.
/// Instance `callable * microbatches + microbatch`; the static buffers are
/// placed by the reuse planner when the session asks for reuse.
fn build_instances(s: &Session, cap: &mut Captured, schedule: &Schedule) -> Result<Vec<Instance>> {
    let m = schedule.microbatches;
    let mut shapes = Vec::new();
    let mut owners = Vec::new();
    for (c, spec) in s.callables.iter().enumerate() {
        let policies = snapshot(s.opts.clone_param_grads_on_return, &spec.params);
        let tensor = |t: &TensorSpec| TensorShape {
            bytes: t.bytes,
            requires_grad: t.requires_grad,
            external: t.external,
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
            shapes.push(shape.clone());
            owners.push((c, mb));
        }
    }
    let layout = layout(&shapes);
    let lifetimes = plan::lifetimes(schedule, &layout, |c, mb| c * m + mb);
    let placement = if s.opts.reuse_buffers {
        plan::reuse(&layout.buffers, &lifetimes)
    } else {
        Plan {
            peak_live_bytes: plan::peak_live(&layout.buffers, &lifetimes),
            ..plan::disjoint(&layout.buffers)
        }
    };

    cap.statics = s.backend.alloc(placement.total_bytes)?;
    cap.statics_bytes = placement.total_bytes;
    MemCounters::add(&cap.counters.static_bytes, placement.total_bytes);
    let base = cap.statics;
    let at = |id: usize| base + placement.offsets[id] as DevPtr;
    let opt = |id: Option<usize>| id.map_or(0, at);

    let mut instances = Vec::with_capacity(shapes.len());
    cap.by_callable = vec![Vec::new(); s.callables.len()];
    for (n, (((c, mb), ib), shape)) in owners
        .into_iter()
        .zip(&layout.instances)
        .zip(&shapes)
        .enumerate()
    {
        let spec = &s.callables[c];
        let slab_base = opt(ib.slab);
        let policies: Vec<_> = shape.params.iter().map(|p| p.map(|p| p.policy)).collect();
        let dtypes: Vec<_> = spec.params.iter().map(|p| p.dtype).collect();
        let destinations = Destinations::of(&policies, &dtypes);
        instances.push(Instance {
            callable: c,
            microbatch: mb as u32,
            inputs: ib.inputs.iter().map(|&b| at(b)).collect(),
            outputs: ib.outputs.iter().map(|&b| opt(b)).collect(),
            grad_outputs: ib.grad_outputs.iter().map(|&b| opt(b)).collect(),
            grad_inputs: ib.grad_inputs.iter().map(|&b| opt(b)).collect(),
            params: spec.params.iter().map(|p| p.data).collect(),
            param_grads: ib
                .slab_layout
                .slots
                .iter()
                .map(|sl| sl.map_or(0, |sl| slab_base + sl.offset as DevPtr))
                .collect(),
            param_bytes: spec.params.iter().map(|p| p.bytes).collect(),
            policies,
            destinations,
            slab_base,
            clone: clone_layout(&ib.slab_layout, &shape.params),
            external: external_buffers(shape, spec.callbacks.has_wgrad()),
            fwd: None,
            bwd: None,
            wgrad: None,
            check_fwd: Vec::new(),
            check_bwd: Vec::new(),
            check_wgrad: Vec::new(),
            lease_out: Vec::new(),
            lease_gin: Vec::new(),
            lease_param: Vec::new(),
        });
        cap.by_callable[c].push(n);
    }

    if s.opts.strict_leases {
        // Lease slots live in logical buffers; external buffers get ids of
        // their own past the layout's (nothing shares their memory).
        let nbuf = layout.buffers.len();
        let mut next = nbuf;
        let mut fresh = || {
            next += 1;
            next - 1
        };
        // A replay overwrites the buffers it writes and, with reuse, every
        // buffer sharing their memory.
        let sharing = |written: &[usize]| -> Vec<usize> {
            let slots: Vec<usize> = written
                .iter()
                .filter(|&&b| b < nbuf)
                .map(|&b| placement.slot_of[b])
                .collect();
            let mut all: Vec<usize> = (0..nbuf)
                .filter(|&b| slots.contains(&placement.slot_of[b]))
                .collect();
            all.extend(written.iter().filter(|&&b| b >= nbuf));
            all
        };
        for ((inst, ib), shape) in instances.iter_mut().zip(&layout.instances).zip(&shapes) {
            let spec = &s.callables[inst.callable];
            let name = &spec.name;
            let mb = inst.microbatch;
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
                .map(|p| {
                    p.map(|p| {
                        if p.external {
                            fresh()
                        } else {
                            ib.slab.unwrap_or(usize::MAX)
                        }
                    })
                })
                .collect();
            inst.lease_out = out_ids
                .iter()
                .enumerate()
                .map(|(i, &b)| cap.leases.add_slot(who(format!("output {i}")), b))
                .collect();
            inst.lease_gin = gin_ids
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    b.map(|b| {
                        cap.leases
                            .add_slot(who(format!("the grad of input {i}")), b)
                    })
                })
                .collect();
            inst.lease_param = param_ids
                .iter()
                .zip(&inst.policies)
                .enumerate()
                .map(|(i, (b, pol))| match (b, pol) {
                    (Some(b), Some(GradPolicy::Alias)) => Some(
                        cap.leases
                            .add_slot(who(format!("the grad of param {i}")), *b),
                    ),
                    _ => None,
                })
                .collect();
            let params: Vec<usize> = param_ids.iter().flatten().copied().collect();
            let mut fwd: Vec<usize> = ib.inputs.clone();
            fwd.extend(&out_ids);
            let mut bwd: Vec<usize> = ib.grad_outputs.iter().flatten().copied().collect();
            bwd.extend(gin_ids.iter().flatten());
            if !spec.callbacks.has_wgrad() {
                bwd.extend(&params);
            }
            inst.check_fwd = cap.leases.slots_in(&sharing(&fwd));
            inst.check_bwd = cap.leases.slots_in(&sharing(&bwd));
            inst.check_wgrad = cap.leases.slots_in(&sharing(&params));
        }
    }
    cap.plan = placement;
    cap.lifetimes = lifetimes;
    cap.buffers = layout.buffers;
    Ok(instances)
}

/// Which external buffers each pass of an instance must provide.
fn external_buffers(shape: &InstanceShape, has_wgrad: bool) -> ExternalBuffers {
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
    ExternalBuffers {
        forward: outputs.collect(),
        backward,
        wgrad: if has_wgrad { params } else { Vec::new() },
    }
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
    s: &'a Session,
    cap: &'a mut Captured,
    scratch: &'a Scratch,
}

impl Runner<'_> {
    fn failed(&self, p: PassRef, phase: Phase, hook: Option<HookPoint>, code: i32) -> Error {
        let inst = &self.cap.instances[p.instance];
        Error::CallbackFailed {
            callable: self.s.callables[inst.callable].name.clone(),
            pass: p.kind,
            microbatch: inst.microbatch,
            phase: phase_label(phase, hook),
            code,
        }
    }

    /// Runs the hooks and the callback of one pass; under `Phase::Capture`
    /// the callback alone is captured into a graph.
    fn run(&mut self, p: PassRef, phase: Phase, iteration: u32) -> Result<()> {
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
            let ext = &self.cap.instances[p.instance].external;
            let expected = match p.kind {
                PassKind::Forward => &ext.forward,
                PassKind::Backward => &ext.backward,
                PassKind::Wgrad => &ext.wgrad,
            };
            Provided::new(expected.clone(), context.clone())
        });
        let graph = {
            let view = view(
                self.cap,
                self.scratch,
                provided.as_deref(),
                p,
                phase,
                iteration,
            );
            self.scratch.set_context(context);
            spec.callbacks
                .hook(HookPoint::Pre, &view)
                .map_err(|c| self.failed(p, phase, Some(HookPoint::Pre), c))?;
            if phase == Phase::Warmup {
                let ran = spec.callbacks.run(&view);
                if let Some(e) = self.scratch.take_failure() {
                    return Err(e);
                }
                ran.map_err(|c| self.failed(p, phase, None, c))?;
                None
            } else {
                let backend = &self.s.backend;
                backend.begin_capture(view.stream, self.s.opts.capture_mode)?;
                let ran = spec.callbacks.run(&view);
                let ended = backend.end_capture(view.stream);
                if let Some(e) = self.scratch.take_failure() {
                    return Err(e);
                }
                // An invalidated capture is the root cause even when the
                // callback also failed (its next launch fails because of it).
                match (ran, ended) {
                    (ran, Ok(CaptureEnd::Invalidated(mut detail))) => {
                        if let Err(code) = ran {
                            detail.push_str(&format!("; the callback then returned {code}"));
                        }
                        return Err(Error::CaptureInvalidated {
                            callable: spec.name.clone(),
                            pass: p.kind,
                            microbatch: view.microbatch,
                            detail,
                        });
                    }
                    (Err(code), _) => return Err(self.failed(p, phase, None, code)),
                    (Ok(()), Err(e)) => return Err(e),
                    (Ok(()), Ok(CaptureEnd::Graph(g))) => Some(g),
                }
            }
        };
        if let Some(g) = graph {
            let inst = &mut self.cap.instances[p.instance];
            if let Some(provided) = &provided {
                for (role, i, ptr) in provided.finish()? {
                    match role {
                        Role::Output => inst.outputs[i] = ptr,
                        Role::GradInput => inst.grad_inputs[i] = ptr,
                        _ => inst.param_grads[i] = ptr,
                    }
                }
            }
            match p.kind {
                PassKind::Forward => inst.fwd = Some(g),
                PassKind::Backward => inst.bwd = Some(g),
                PassKind::Wgrad => inst.wgrad = Some(g),
            }
            self.cap.graph_count += 1;
        }
        let view = view(self.cap, self.scratch, None, p, phase, iteration);
        spec.callbacks
            .hook(HookPoint::Post, &view)
            .map_err(|c| self.failed(p, phase, Some(HookPoint::Post), c))
    }
}

/// What the callbacks of pass `p` see.
fn view<'a>(
    cap: &'a Captured,
    scratch: &'a Scratch,
    provided: Option<&'a Provided>,
    p: PassRef,
    phase: Phase,
    iteration: u32,
) -> PassView<'a> {
    let inst = &cap.instances[p.instance];
    PassView {
        callable: inst.callable as u32,
        microbatch: inst.microbatch,
        pass: p.kind,
        phase,
        iteration,
        stream: cap.side,
        inputs: &inst.inputs,
        params: &inst.params,
        outputs: &inst.outputs,
        grad_outputs: &inst.grad_outputs,
        grad_inputs: &inst.grad_inputs,
        param_grads: &inst.param_grads,
        tape: cap.tapes[p.instance].as_ptr().cast(),
        scratch,
        provided,
    }
}

/// Warmup and capture of every callable of `s`; see the module comment.
pub(crate) fn capture(s: &Session) -> Result<Captured> {
    let backend = &s.backend;
    let mut cap = Captured::empty(backend.clone(), s.pool.clone(), s.counters.clone());
    cap.side = backend.create_stream()?;
    cap.ev_in = backend.create_event()?;
    cap.ev_out = backend.create_event()?;
    let has_wgrad: Vec<bool> = s
        .callables
        .iter()
        .map(|c| c.callbacks.has_wgrad())
        .collect();
    let schedule = match &s.opts.schedule {
        Some(spec) => Schedule::derive(&spec.steps, spec.layers_per_chunk.as_deref(), &has_wgrad)?,
        None => Schedule::sequential(&has_wgrad),
    };
    let instances = build_instances(s, &mut cap, &schedule)?;
    cap.instances = instances;
    cap.tapes = (0..cap.instances.len()).map(|_| Cell::new(0)).collect();

    // Static buffers start zeroed; inputs start as the samples.
    backend.zero(cap.statics, cap.statics_bytes, cap.side)?;
    for inst in &cap.instances {
        for (t, &dst) in s.callables[inst.callable].inputs.iter().zip(&inst.inputs) {
            if t.sample != 0 {
                backend.copy(dst, t.sample, t.bytes, cap.side)?;
            }
        }
    }
    if cap
        .instances
        .iter()
        .flat_map(|i| i.policies.iter().flatten())
        .any(|&p| p == GradPolicy::AccumulateInto)
    {
        backend.prepare_accumulate()?;
    }

    let m = schedule.microbatches;
    let order: Vec<PassRef> = schedule
        .passes
        .iter()
        .map(|p| PassRef {
            instance: p.callable * m + p.microbatch,
            kind: p.kind,
        })
        .collect();

    let scratch = Scratch::measuring(backend.clone());
    let result = warmup_and_capture(s, &mut cap, &scratch, &order);
    // Whatever happened, nothing may still run on the side stream when the
    // scratch memory or the capture state is released.
    let synced = backend.synchronize(cap.side);
    drop(scratch);
    result?;
    synced?;

    if !s.opts.clone_param_grads_on_return {
        let aliased = cap
            .instances
            .iter()
            .map(|i| {
                let spec = &s.callables[i.callable];
                i.policies
                    .iter()
                    .zip(&spec.params)
                    .filter(|(pol, p)| {
                        **pol == Some(GradPolicy::Alias)
                            && p.policy == GradPolicy::Default
                            && !p.delayed_wgrad()
                    })
                    .count()
            })
            .sum::<usize>();
        if aliased > 0 {
            s.log(LogLevel::Warn, || {
                format!(
                    "{aliased} parameter grad slot(s) return aliases because clone_param_grads_on_return is false; \
                     each is overwritten by its callable's next backward replay"
                )
            });
        }
    }
    Ok(cap)
}

fn warmup_and_capture(
    s: &Session,
    cap: &mut Captured,
    scratch: &Scratch,
    order: &[PassRef],
) -> Result<()> {
    let backend = s.backend.clone();
    let hook = |point| -> Result<()> {
        match &s.opts.warmup_hook {
            Some(h) => h(point).map_err(|code| Error::CallbackFailed {
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
    let mut runner = Runner { s, cap, scratch };
    hook(HookPoint::Pre)?;
    let iterations = s.opts.warmup_iterations;
    for it in 0..iterations {
        if it > 0 {
            scratch.restart();
        }
        for &p in order {
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
    backend.synchronize(runner.cap.side)?;
    s.log(LogLevel::Debug, || {
        format!(
            "warmup done: {iterations} iteration(s), scratch arena {} bytes",
            runner.cap.arena.1
        )
    });

    scratch.restart();
    for &p in order {
        runner.run(p, Phase::Capture, iterations)?;
    }
    Ok(())
}

/// After the first warmup iteration: the real scratch allocations go, and
/// an arena of the measured size from the pool takes over.
fn use_measured_arena(s: &Session, cap: &mut Captured, scratch: &Scratch) -> Result<()> {
    s.backend.synchronize(cap.side)?;
    let (base, size) = s.pool.acquire(scratch.high_water())?;
    cap.arena = (base, size);
    MemCounters::add(&cap.counters.scratch_bytes, size);
    scratch.use_arena(base, size);
    Ok(())
}
