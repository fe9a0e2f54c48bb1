//! Capture, as one transaction in the order of its steps:
//! 1. place: plan the static buffers and place every instance (`place`,
//!    `leases`), allocate them (`statics`: each callable's own, and those
//!    callables share), copy the samples in;
//! 2. warm up (`warmup`): every pass runs eagerly on the capture stream, in
//!    capture order (`order`: the schedule's, or forwards in registration
//!    order, backwards in reverse, each weight-grad after its backward;
//!    bucket round by bucket round), `warmup_iterations` times; the first
//!    iteration measures the scratch arena;
//! 3. record (`record`): each pass is captured alone into its graph
//!    (`run`), the grad passes once more per clone slot (`slots`), the
//!    graphs that choose a bucket on the device, then the steps (`steps`);
//! 4. verify: the tensors asked to be rebound are planned and verified
//!    (`rebind`);
//! 5. build the `Captured` state whole from what the steps made.
//!
//! Everything is owned by the step that made it until the last one, so an
//! error anywhere releases all of it; the session stays open.

mod collective;
mod looped;
mod order;
mod record;
mod run;
mod slots;
mod step_io;
mod steps;
mod unrolled;
mod update;
mod warmup;

use super::buckets::{SizeBlock, Zeroed};
use super::captured::{Captured, PlanRecord, Resources, Stage};
use super::clock::{CaptureTimes, Span};
use super::context::Inputs;
use super::instance::{Instance, PassRef, Placed};
use super::rebind;
use super::scratch::Scratch;
use super::spec::{LogLevel, MemCounters};
use super::statics::Statics;
use super::{leases, place};
use crate::backend::{Event, Stream, StreamRef};
use crate::core::lease::Leases;
use crate::core::policy::{resolve_why, Decided, GradPolicy};
use crate::error::Result;
use order::order_of;
use record::{record, Recorded};
#[cfg(test)]
use run::Runner;
use std::cell::Cell;
use std::time::Instant;

/// Warmup and capture of every callable of `s`; see the module comment.
/// Returns the captured state and its lease table (for capture `epoch`).
/// A capture that fails still takes part in the collective exchange of
/// every step it did not reach, so that the other ranks fail instead of
/// waiting for it.
pub(crate) fn capture(s: &Inputs, epoch: u32) -> Result<(Captured, Leases)> {
    let exchanged = Cell::new(0);
    let out = capture_with(s, epoch, &exchanged);
    if out.is_err() {
        collective::abandon_exchanges(s, exchanged.get());
    }
    out
}

/// `capture`, counting in `exchanged` the steps whose exchanges this rank
/// took part in.
fn capture_with(s: &Inputs, epoch: u32, exchanged: &Cell<usize>) -> Result<(Captured, Leases)> {
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
    // Each callable's own buffers in an allocation of their own, the
    // buffers callables share (and the sizes) in one they share.
    let sizes_bytes = SizeBlock::bytes(s.callables)?;
    let bucketed: Vec<bool> = s.callables.iter().map(|c| !c.buckets.is_empty()).collect();
    let statics = Statics::allocate(backend, &planned.owned, sizes_bytes, &bucketed)?;
    let sizes = (sizes_bytes > 0).then(|| SizeBlock::at(statics.sizes_base(), s.callables));
    let mut placed = place::place_at(s, &planned, &statics.bases(), &order)?;
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
        (&mut times, exchanged),
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
    let instances = placed
        .into_iter()
        .zip(recorded.graphs)
        .map(|(placed, graphs)| Instance { placed, graphs })
        .collect();
    Captured {
        backend: s.backend.clone(),
        counters: s.counters.clone(),
        instances,
        by_callable: recorded.by_callable,
        order,
        steps: recorded.steps,
        switches: recorded.switches,
        plan: PlanRecord {
            plan: planned.plan,
            owned: planned.owned,
            buffers: planned.layout.buffers,
            lifetimes: planned.lifetimes,
        },
        times,
        stage: Stage::default(),
        param_moves: 0,
        sizes: None,
        last_forward: vec![None; s.callables.len()],
        zeroed: Zeroed::new(s.callables),
        released: vec![false; s.callables.len()],
        resources,
    }
}

/// Zeroes the static buffers, copies the samples into the static inputs,
/// and loads the kernels replays and verification will need.
fn fill_statics(s: &Inputs, placed: &[Placed], statics: &Statics, stream: StreamRef) -> Result<()> {
    let backend = s.backend;
    for (ptr, bytes) in statics.allocations() {
        backend.zero(ptr, bytes, stream)?;
    }
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
    use crate::core::PassKind;
    use crate::error::Error;
    use std::cell::Cell;

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
            exchanged: &Cell::new(0),
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

    /// A layer whose backward, under capture, synchronizes its stream (a
    /// host synchronisation) and carries on, as careless code does.
    struct Syncing;

    impl crate::orchestrate::PassCallbacks for Syncing {
        fn run(&self, v: &crate::orchestrate::PassView) -> std::result::Result<(), i32> {
            if v.pass == PassKind::Backward && v.phase == super::super::spec::Phase::Capture {
                let _ = crate::backend::host::synchronize(v.stream);
            }
            Ok(())
        }
        fn has_wgrad(&self) -> bool {
            false
        }
        fn hook(
            &self,
            _: crate::orchestrate::HookPoint,
            _: &crate::orchestrate::PassView,
        ) -> std::result::Result<(), i32> {
            Ok(())
        }
    }

    #[test]
    fn an_invalidated_capture_names_its_place_and_the_operation() {
        let mut f = host_inputs(&[("a", 1, false), ("b", 1, false)]);
        f.opts.name = "net".into();
        f.callables[1].callbacks = Box::new(Syncing);
        let err = match captured(&f) {
            Err(e) => e,
            Ok(_) => panic!("a synchronize under capture invalidates it"),
        };
        assert!(matches!(err, Error::CaptureInvalidated { .. }), "{err}");
        let msg = err.to_string();
        for part in [
            "capture of the backward pass of callable 'b' (index 1) in session 'net', microbatch 0, no buckets was invalidated",
            "not allowed under capture (a host synchronisation, an allocation outside the graph's pool, work on another stream)",
            "graphed_host_synchronize(host stream",
        ] {
            assert!(msg.contains(part), "{part} missing from: {msg}");
        }
        assert_eq!(MemCounters::get(&f.counters.static_bytes), 0);
        assert_eq!(f.pool.bytes(), 0);
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
