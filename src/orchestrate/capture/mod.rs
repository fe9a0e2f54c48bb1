//! Capture, as one transaction in the order of its steps:
//! 1. place: plan the static buffers and place every instance (`place`,
//!    `leases`), allocate them, copy the samples in;
//! 2. warm up: every pass runs eagerly on the capture stream, in capture
//!    order (the schedule's, or forwards in registration order, backwards
//!    in reverse, each weight-grad after its backward), `warmup_iterations`
//!    times; the first iteration measures the scratch arena;
//! 3. record: each pass is captured alone into its graph (`run`), the grad
//!    passes once more per clone slot (`slots`), then the steps (`steps`);
//! 4. verify: the tensors asked to be rebound are planned and verified
//!    (`rebind`);
//! 5. build the `Captured` state whole from what the steps made.
//!
//! Everything is owned by the step that made it until the last one, so an
//! error anywhere releases all of it; the session stays open.

mod looped;
mod run;
mod slots;
mod step_io;
mod steps;
mod unrolled;

use super::buckets::{self, SizeBlock, Zeroed};
use super::captured::{Captured, CapturedStep, PlanRecord, Resources, Stage, Switches};
use super::clock::{CaptureTimes, Span};
use super::context::Inputs;
use super::instance::{Instance, PassGraphs, PassRef, Placed};
use super::pool::Arena;
use super::rebind;
use super::scratch::Scratch;
use super::spec::{HookPoint, LogLevel, MemCounters, Phase};
use super::{leases, place};
use crate::backend::{DeviceMemory, Event, Stream, StreamRef};
use crate::core::lease::Leases;
use crate::core::policy::{resolve_why, Decided, GradPolicy};
use crate::core::schedule::Schedule;
use crate::core::size;
use crate::core::PassKind;
use crate::error::{Error, Result};
use run::{Call, Runner};
use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

/// What recording made: the graphs of every instance and of every step,
/// and the scratch arena they use.
struct Recorded {
    graphs: Vec<PassGraphs>,
    steps: Vec<CapturedStep>,
    switches: Vec<Switches>,
    arena: Option<Arena>,
}

/// The order of the session's passes: the schedule's, or the default.
fn order_of(s: &Inputs) -> Result<(Schedule, Vec<PassRef>)> {
    let has_wgrad: Vec<bool> = s
        .callables
        .iter()
        .map(|c| c.callbacks.has_wgrad())
        .collect();
    let schedule = match &s.opts.schedule {
        Some(spec) => Schedule::derive(&spec.steps, spec.layers_per_chunk.as_deref(), &has_wgrad)?,
        None => Schedule::sequential(&has_wgrad),
    };
    let m = schedule.microbatches;
    check_buckets(s, m)?;
    // Bucket by bucket: each round runs the schedule's passes of every
    // callable that has that many buckets, so that the scratch a round's
    // forwards keep for its backwards is free again before the next round
    // (buckets share one scratch arena, sized for the largest).
    let first = place::first_instances(s, m);
    let rounds = s.callables.iter().map(|c| c.bucket_count()).max();
    let mut order = Vec::with_capacity(schedule.passes.len());
    for b in 0..rounds.unwrap_or(1) {
        for p in &schedule.passes {
            let buckets = s.callables[p.callable].bucket_count();
            if b < buckets {
                order.push(PassRef {
                    instance: first[p.callable] + p.microbatch * buckets + b,
                    kind: p.kind,
                });
            }
        }
    }
    Ok((schedule, order))
}

/// Refuses buckets where the session has what they do not work with yet:
/// a pipeline schedule, or a step over a callable with buckets.
fn check_buckets(s: &Inputs, microbatches: usize) -> Result<()> {
    let Some(c) = s.callables.iter().find(|c| !c.buckets.is_empty()) else {
        return Ok(());
    };
    if microbatches > 1 || s.opts.schedule.is_some() {
        return Err(Error::invalid(format!(
            "callable '{}' has buckets, and the session has a pipeline schedule: buckets need the \
             default order (one microbatch)",
            c.name
        )));
    }
    for (i, step) in s.steps.iter().enumerate() {
        if let Some(&k) = step
            .callables
            .iter()
            .find(|&&k| !s.callables[k as usize].buckets.is_empty())
        {
            return Err(Error::invalid(format!(
                "step {i} holds callable '{}', which has buckets: steps hold callables of one shape",
                s.callables[k as usize].name
            )));
        }
    }
    Ok(())
}

/// Warmup and capture of every callable of `s`; see the module comment.
/// Returns the captured state and its lease table (for capture `epoch`).
pub(crate) fn capture(s: &Inputs, epoch: u32) -> Result<(Captured, Leases)> {
    let started = Instant::now();
    let mut times = CaptureTimes::default();
    let (schedule, order) = order_of(s)?;

    // 1. Place.
    let planned = place::plan(s, &schedule)?;
    let backend = s.backend;
    let side = match s.opts.capture_stream {
        Some(raw) => Stream::borrowed(backend, raw),
        None => Stream::new(backend)?,
    };
    let (ev_in, ev_out) = (Event::new(backend)?, Event::new(backend)?);
    // Past the planned buffers, where callables have buckets: the sizes
    // the device reads (`buckets::SizeBlock`).
    let sizes_bytes = SizeBlock::bytes(s.callables)?;
    let statics_bytes = size::add(planned.plan.total_bytes, sizes_bytes, "the static buffers")?;
    let statics = DeviceMemory::new(backend, statics_bytes)?;
    let sizes = (sizes_bytes > 0)
        .then(|| SizeBlock::at(statics.ptr() + planned.plan.total_bytes as u64, s.callables));
    let mut placed = place::place(s, &planned, statics.ptr(), &order)?;
    let mut leases = Leases::new(epoch);
    if s.opts.strict_leases {
        leases::assign(s, &planned, &mut placed, &mut leases)?;
    }
    fill_statics(s, &placed, &statics, side.raw())?;
    if let Some(block) = &sizes {
        block.write_tables(backend.as_ref(), s.callables, side.raw())?;
    }
    times.add(Span::Plan, started.elapsed());

    // 2, 3. Warm up and record.
    // With buckets, a region of the scratch arena per callable.
    let regions = match s.callables.iter().any(|c| !c.buckets.is_empty()) {
        true => s.callables.len(),
        false => 1,
    };
    let scratch = Scratch::measuring(backend.clone(), regions);
    let recorded = record(
        s,
        &mut placed,
        &scratch,
        (side.raw(), sizes.as_ref()),
        &order,
        &mut times,
    );
    // Whatever happened, nothing may still run on the side stream when the
    // scratch memory or the capture state is released.
    let synced = backend.synchronize(side.raw());
    drop(scratch);
    let mut recorded = recorded?;
    synced?;

    // 4. Verify the rebinds.
    times.templates_kept =
        rebind::resolve(s, &mut placed, &mut recorded.graphs, side.raw(), &mut times)?;
    times.templates_kept += rebind::resolve_steps(
        s,
        &placed,
        &recorded.graphs,
        &mut recorded.steps,
        side.raw(),
        &mut times,
    )?;
    warn_aliases(s);

    // 5. Build the captured state whole.
    let resources = Resources {
        statics,
        arena: recorded.arena.take(),
        _side: side,
        ev_in,
        ev_out,
    };
    times.set_total(started.elapsed());
    let mut captured = assemble(s, placed, recorded, planned, order, resources, times);
    captured.sizes = sizes;
    Ok((captured, leases))
}

/// The captured state, from what the steps of the capture made.
fn assemble(
    s: &Inputs,
    placed: Vec<Placed>,
    recorded: Recorded,
    planned: place::Planned,
    order: Vec<PassRef>,
    resources: Resources,
    times: CaptureTimes,
) -> Captured {
    MemCounters::add(&s.counters.static_bytes, resources.statics_bytes());
    MemCounters::add(&s.counters.scratch_bytes, resources.arena_bytes());
    let by_callable = by_callable(s, &placed);
    let instances = placed
        .into_iter()
        .zip(recorded.graphs)
        .map(|(placed, graphs)| Instance { placed, graphs })
        .collect();
    Captured {
        backend: s.backend.clone(),
        counters: s.counters.clone(),
        instances,
        by_callable,
        order,
        steps: recorded.steps,
        switches: recorded.switches,
        plan: PlanRecord {
            plan: planned.plan,
            buffers: planned.layout.buffers,
            lifetimes: planned.lifetimes,
        },
        times,
        stage: Stage::default(),
        param_moves: 0,
        sizes: None,
        last_forward: vec![None; s.callables.len()],
        size_held: vec![None; s.callables.len()],
        zeroed: Zeroed::new(s.callables),
        resources,
    }
}

/// Zeroes the static buffers, copies the samples into the static inputs,
/// and loads the kernels replays and verification will need.
fn fill_statics(
    s: &Inputs,
    placed: &[Placed],
    statics: &DeviceMemory,
    stream: StreamRef,
) -> Result<()> {
    let backend = s.backend;
    backend.zero(statics.ptr(), statics.bytes(), stream)?;
    for inst in placed {
        let specs = &s.callables[inst.callable].inputs;
        for (spec, t) in specs.iter().zip(&inst.inputs) {
            if spec.sample != 0 && t.ptr != 0 {
                backend.copy(t.ptr, spec.sample, t.bytes, stream)?;
            }
        }
    }
    let accumulates = placed.iter().any(|i| !i.returns.accumulate.is_empty());
    let rebinds = s
        .callables
        .iter()
        .any(|c| c.inputs.iter().chain(&c.outputs).any(|t| t.rebind));
    // Bucketed passes zero their padding with a kernel, under capture.
    let bucketed = s.callables.iter().any(|c| !c.buckets.is_empty());
    if accumulates || rebinds || bucketed {
        backend.prepare_kernels()?;
    }
    Ok(())
}

/// Warmup, then the capture of every pass (and its clone slots), then the
/// steps.
fn record(
    s: &Inputs,
    placed: &mut [Placed],
    scratch: &Arc<Scratch>,
    (stream, sizes): (StreamRef, Option<&SizeBlock>),
    order: &[PassRef],
    times: &mut CaptureTimes,
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
                    let graph = buckets::capture_switch(to, (largest, kind), bodies)?;
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
                per.slots
                    .push(buckets::capture_switch(to, (largest, grad_pass), bodies)?);
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

/// The warmup iterations, with the session's hooks around them; returns
/// the scratch arena measured in the first.
fn warmup(r: &mut Runner, order: &[PassRef]) -> Result<Option<Arena>> {
    let s = r.s;
    let hook = |point| -> Result<()> {
        let Some(h) = &s.opts.warmup_hook else {
            return Ok(());
        };
        h(point).map_err(|code| Error::CallbackFailed {
            said: String::new(),
            callable: "(session)".into(),
            pass: PassKind::Forward,
            microbatch: 0,
            phase: match point {
                HookPoint::Pre => "the pre-warmup hook",
                HookPoint::Post => "the post-warmup hook",
            },
            code,
        })
    };
    hook(HookPoint::Pre)?;
    let iterations = s.opts.warmup_iterations;
    let mut arena = None;
    for it in 0..iterations {
        if it > 0 {
            r.scratch.restart();
        }
        for &p in order {
            let call = Call {
                phase: Phase::Warmup,
                iteration: it,
                hooks: true,
                provide: false,
                param_grads: None,
                step_microbatch: (0, 1),
                step_index: 0,
            };
            r.call(p, call)?;
        }
        if it == 0 {
            arena = measured_arena(s, r.scratch, r.stream)?;
        }
    }
    if iterations == 0 {
        arena = measured_arena(s, r.scratch, r.stream)?;
    }
    hook(HookPoint::Post)?;
    s.backend.synchronize(r.stream)?;
    let bytes = arena.as_ref().map_or(0, |a| a.bytes);
    s.log(LogLevel::Debug, || {
        format!("warmup done: {iterations} iteration(s), scratch arena {bytes} bytes")
    });
    Ok(arena)
}

/// After the first warmup iteration: the real scratch allocations go, and
/// an arena of the measured size from the pool takes over.
fn measured_arena(s: &Inputs, scratch: &Scratch, stream: StreamRef) -> Result<Option<Arena>> {
    s.backend.synchronize(stream)?;
    let arena = s.pool.acquire(scratch.high_water())?;
    let (base, size) = arena.as_ref().map_or((0, 0), |a| (a.base, a.bytes));
    scratch.use_arena(base, size);
    Ok(arena)
}

/// Warns when parameter grads return aliases because the session opted
/// out of clones.
fn warn_aliases(s: &Inputs) {
    let clone = s.opts.clone_param_grads_on_return;
    let aliased = s
        .callables
        .iter()
        .flat_map(|c| &c.params)
        .filter(|p| resolve_why(clone, p) == Some((GradPolicy::Alias, Decided::Session)))
        .count();
    if aliased > 0 {
        s.log(LogLevel::Warn, || {
            format!(
                "{aliased} parameter grad slot(s) return aliases because clone_param_grads_on_return is false; \
                 each is overwritten by its callable's next backward replay"
            )
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{host_inputs, Fixture, BYTES};
    use super::*;

    fn captured(f: &Fixture) -> Result<Captured> {
        capture(&f.inputs(), 1).map(|(c, _)| c)
    }

    #[test]
    fn slot_graphs_write_the_clone_grads_into_their_blocks() {
        let mut f = host_inputs(&[("a", 2, false), ("b", 1, true)]);
        f.opts.clone_slots = 2;
        let cap = captured(&f).unwrap();
        let (passes, slots, steps) = cap.graph_counts();
        assert_eq!(
            (passes, slots, steps),
            (5, 4, 0),
            "a: fwd, bwd; b: fwd, bwd, wgrad"
        );
        let a = &cap.instances[0];
        assert_eq!(a.graphs.slots.len(), 2);
        // Slot graph 1 writes a's two CLONE grads into its block, the slab untouched.
        let backend = f.backend.as_ref();
        backend
            .upload(a.grad_outputs[0].ptr, &[5u8; BYTES])
            .unwrap();
        a.slot_graph(1).unwrap().launch(StreamRef(0)).unwrap();
        let block = a.graphs.slots[1].block;
        assert_ne!(block, a.slab);
        let mut got = [0u8; 2 * BYTES];
        backend.download(&mut got[..BYTES], block).unwrap();
        let second = match a.param_grads[1].ret {
            crate::core::returns::ParamReturn::Clone { offset } => block + offset as u64,
            _ => panic!("CLONE"),
        };
        backend.download(&mut got[BYTES..], second).unwrap();
        assert!(got.iter().all(|&b| b == 5));
        let mut slab = [0u8; BYTES];
        backend.download(&mut slab, a.slab).unwrap();
        assert!(
            slab.iter().all(|&b| b == 0),
            "the slot graph did not write the slab"
        );
        // b's grads come from its weight-grad pass: that pass has the slots.
        let b = &cap.instances[1];
        assert_eq!(b.graphs.slots.len(), 2);
        assert_eq!(b.grad_pass(), PassKind::Wgrad);
    }

    #[test]
    fn passes_that_provide_buffers_get_no_slots() {
        let mut f = host_inputs(&[("a", 1, false)]);
        f.callables[0].params[0].flags.external_grad = true;
        let s = f.inputs();
        let (_, order) = order_of(&s).unwrap();
        let mut placed = {
            let schedule = f.schedule();
            let p = place::plan(&s, &schedule).unwrap();
            place::place(&s, &p, 0x1000, &order).unwrap()
        };
        let scratch = Scratch::measuring(f.backend.clone(), 1);
        let mut times = CaptureTimes::default();
        let r = Runner {
            s: &s,
            placed: &mut placed,
            scratch: &scratch,
            tapes: vec![Cell::new(0)].into(),
            stream: StreamRef(0),
            sizes: None,
            times: &mut times,
        };
        let bwd = PassRef {
            instance: 0,
            kind: PassKind::Backward,
        };
        assert_eq!(
            r.slot_count(bwd),
            0,
            "its callback provides the grad's buffer"
        );
    }

    #[test]
    fn a_failed_capture_leaves_nothing_behind() {
        let mut f = host_inputs(&[("a", 1, false), ("b", 1, false)]);
        // A grad-output that the backward must provide but never does.
        f.callables[1].inputs[0].external = true;
        let err = match captured(&f) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("the backward did not provide the input's grad"),
        };
        assert!(err.contains("did not provide its buffer"), "{err}");
        let get = MemCounters::get;
        assert_eq!(get(&f.counters.static_bytes), 0);
        assert_eq!(get(&f.counters.scratch_bytes), 0);
        assert_eq!(
            get(&f.counters.clone_cached_bytes),
            0,
            "no clone slot was kept"
        );
        assert_eq!(f.pool.bytes(), 0);
        // The same callables capture once the flag is gone.
        f.callables[1].inputs[0].external = false;
        assert!(captured(&f).is_ok());
    }

    #[test]
    fn a_grad_output_alone_is_verified_with_the_data_it_is_fed() {
        // One tensor to verify: the copying and the rebound runs must read
        // the same pattern (the rebound one through the moved copy).
        let mut f = host_inputs(&[("a", 1, false)]);
        f.callables[0].outputs[0].rebind = true;
        let cap = captured(&f).unwrap();
        assert!(cap.instances[0].grad_outputs[0].feed.is_rebound());
    }

    #[test]
    fn rebinding_host_copies_is_verified_and_times_are_kept() {
        let mut f = host_inputs(&[("a", 1, false)]);
        f.callables[0].inputs[0].rebind = true;
        f.callables[0].outputs[0].rebind = true;
        let cap = captured(&f).unwrap();
        let a = &cap.instances[0];
        assert!(a.inputs[0].feed.is_rebound(), "the forward's copy reads it");
        assert!(
            a.grad_outputs[0].feed.is_rebound(),
            "the backward's copies read it"
        );
        assert!(cap.times.total >= cap.times.warmup + cap.times.capture);
        assert!(cap.times.rebind_verify > 0);
    }
}
