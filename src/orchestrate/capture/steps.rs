//! Steps: a step's callables are captured once more, back to back in one
//! stream capture, every grad pass followed by its COPY_INTO and
//! ACCUMULATE_INTO returns into destinations fixed at declaration; with
//! CLONE grads, once per clone slot, each instance's CLONE grads going
//! into its slot block k. A step over several microbatches holds them all,
//! each with its copies in and out (step_io.rs), the grads summed. A step
//! then replays with one launch. The passes see their external buffers
//! where their own captures provided them, and the step's capture hook
//! runs around each of its captures.

use super::super::captured::CapturedStep;
use super::super::external::Provided;
use super::super::grads::{enqueue_destinations, enqueue_sums};
use super::super::instance::{PassRef, Placed};
use super::super::spec::{CaptureHook, HookPoint, LogLevel, Looping, Phase};
use super::super::tensor::Param;
use super::run::{Call, Runner, ViewBuffers};
use super::step_io::{self, IoCopy};
use crate::backend::{DevPtr, DeviceMemory, Graph};
use crate::error::{Error, Result};

/// Why a step's graph cannot follow a parameter until verification says
/// it can.
pub(crate) const UNVERIFIED: &str = "the step's graph was not verified with it elsewhere";

/// Checks step `si`'s destinations (the parameters of `instances`, named
/// `names`, in order) against the instances' frozen return plans.
fn check_destinations(
    si: usize,
    instances: &[&Placed],
    names: &[&str],
    dsts: &[DevPtr],
) -> Result<()> {
    let mut at = 0;
    for (inst, name) in instances.iter().zip(names) {
        for (j, t) in inst.param_grads.iter().enumerate() {
            if let Some(problem) = t.ret.destination_problem(dsts[at + j]) {
                return Err(Error::invalid(format!(
                    "step {si}: param_dsts[{}] (param {j} of callable '{name}') {problem}",
                    at + j
                )));
            }
        }
        at += inst.param_grads.len();
    }
    Ok(())
}

/// The parameters of a step over `instances`, in order, as its graphs read
/// them until verification says they can move.
fn step_params(placed: &[Placed], instances: &[usize]) -> Vec<Param> {
    instances
        .iter()
        .flat_map(|&i| &placed[i].params)
        .enumerate()
        .map(|(k, q)| Param::fixed(k, q.ptr, q.bytes, q.dtype, UNVERIFIED))
        .collect()
}

/// The lease slots a replay of a step over `instances` overwrites.
fn overwritten(instances: &[&Placed]) -> Vec<usize> {
    let mut v: Vec<usize> = instances
        .iter()
        .flat_map(|i| i.overwritten.iter().flatten().copied())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// A step's passes with where each instance's destinations start, its
/// microbatch count and its copies in and out.
pub(super) struct Sequence<'a> {
    /// The step's index, for messages.
    pub step: usize,
    /// Called before and after each capture of the step's graph.
    pub hook: Option<&'a CaptureHook>,
    pub passes: &'a [PassRef],
    pub instances: &'a [usize],
    pub first: &'a [usize],
    pub dsts: &'a [DevPtr],
    pub microbatches: u32,
    pub io: &'a [IoCopy],
    /// Looping on the device: the loop's index and count.
    pub state: Option<DevPtr>,
}

impl Sequence<'_> {
    /// Where parameter j of `instance`'s grads go (its destinations).
    pub fn dsts_of(&self, instance: usize) -> impl Fn(usize) -> DevPtr + '_ {
        let k = self
            .instances
            .iter()
            .position(|&i| i == instance)
            .unwrap_or(0);
        let base = self.first[k];
        move |j| self.dsts[base + j]
    }
}

impl Runner<'_> {
    /// Captures step `si` with the instances' clone slot blocks
    /// (`slot_blocks[instance][k]`).
    pub fn capture_step(
        &mut self,
        si: usize,
        order: &[PassRef],
        by_callable: &[Vec<usize>],
        slot_blocks: &[Vec<DevPtr>],
        iteration: u32,
    ) -> Result<CapturedStep> {
        let step = &self.s.steps[si];
        let instances: Vec<usize> = step
            .callables
            .iter()
            .map(|&c| by_callable[c as usize][0])
            .collect();
        let passes: Vec<PassRef> = order
            .iter()
            .filter(|p| instances.contains(&p.instance))
            .copied()
            .collect();
        let placed: Vec<&Placed> = instances.iter().map(|&i| &self.placed[i]).collect();
        let names: Vec<&str> = placed
            .iter()
            .map(|p| self.s.callables[p.callable].name.as_str())
            .collect();
        check_destinations(si, &placed, &names, &step.param_dsts)?;
        let first: Vec<usize> = placed
            .iter()
            .scan(0, |at, p| {
                let start = *at;
                *at += p.param_grads.len();
                Some(start)
            })
            .collect();
        let cloned: Vec<usize> = instances
            .iter()
            .copied()
            .filter(|&i| self.placed[i].returns.clone.count > 0)
            .collect();
        let slots = cloned
            .iter()
            .map(|&i| slot_blocks[i].len())
            .min()
            .unwrap_or(0);
        // Why a step with CLONE grads would have no clone slot.
        let no_slots = cloned
            .iter()
            .find(|&&i| {
                let inst = &self.placed[i];
                slot_blocks[i].is_empty()
                    && (!inst.provided_by(inst.grad_pass()).is_empty()
                        || !inst.returns.clone.external.is_empty())
            })
            .map_or_else(
                || "clone_slots is 0, or a caller allocator is set".to_string(),
                |&i| {
                    let name = &self.s.callables[self.placed[i].callable].name;
                    format!(
                        "callable '{name}' has external parameter or input grads, whose pass gets \
                         no clone slots"
                    )
                },
            );
        let overwritten = overwritten(&placed);
        let dsts = step.param_dsts.clone();
        step_io::check_sums(si, step.microbatches, &placed, &names, slots, &no_slots)?;
        let all: Vec<&Placed> = self.placed.iter().collect();
        let io = step_io::resolve(si, step, self.s.callables, &instances, &all)?;
        let loop_state = match step.looping {
            Looping::Unrolled => None,
            Looping::Device => {
                let m = DeviceMemory::new(self.s.backend, 8)?;
                // The count until a replay sets it: verification replays run all.
                let init: Vec<u8> = [0u32, step.microbatches]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                self.s.backend.upload(m.ptr(), &init)?;
                Some(m)
            }
        };
        let seq = Sequence {
            step: si,
            hook: step.capture_hook.as_ref(),
            passes: &passes,
            instances: &instances,
            first: &first,
            dsts: &dsts,
            microbatches: step.microbatches,
            io: &io,
            state: loop_state.as_ref().map(|m| m.ptr()),
        };
        let looped = step.looped();
        let (mut graph, mut slot_graphs) = (None, Vec::new());
        if cloned.is_empty() {
            graph = Some(self.capture_sequence(&seq, |_| None, iteration)?);
        } else if slots == 0 && looped {
            return Err(Error::Incompatible(format!(
                "step {si} copies data in or out and returns CLONE grads, which need a clone slot; it \
                 has none ({no_slots})"
            )));
        } else if slots == 0 {
            self.s.log(LogLevel::Warn, || {
                format!(
                    "step {si} returns CLONE grads but has no clone slots ({no_slots}): it replays pass \
                     by pass"
                )
            });
        } else {
            for k in 0..slots {
                let block = |i: usize| slot_blocks[i].get(k).copied();
                slot_graphs.push(self.capture_sequence(&seq, block, iteration)?);
            }
        }
        let params = step_params(self.placed, &instances);
        Ok(CapturedStep {
            instances,
            cloned,
            passes,
            dsts,
            graph,
            slots: slot_graphs,
            overwritten,
            at: params.iter().map(|q| q.ptr).collect(),
            params,
            looped,
            microbatches: step.microbatches,
            loop_state,
        })
    }

    /// Captures a sequence into one graph (`record_sequence`), with the
    /// step's capture hook called before and after, outside the stream
    /// capture. The after-call comes also after a failed capture, whose
    /// error then stands; a failing hook fails the capture, its graph
    /// dropped.
    fn capture_sequence(
        &mut self,
        seq: &Sequence,
        block: impl Fn(usize) -> Option<DevPtr>,
        iteration: u32,
    ) -> Result<Box<dyn Graph>> {
        let hook = |point: HookPoint| -> Result<()> {
            let Some(h) = seq.hook else {
                return Ok(());
            };
            (h.0)(point).map_err(|code| Error::HookFailed {
                hook: format!(
                    "the capture hook {} the capture of step {}",
                    match point {
                        HookPoint::Pre => "before",
                        HookPoint::Post => "after",
                    },
                    seq.step
                ),
                code,
            })
        };
        hook(HookPoint::Pre)?;
        let captured = self.record_sequence(seq, block, iteration);
        let after = hook(HookPoint::Post);
        let graph = captured?;
        after?;
        Ok(graph)
    }

    /// Captures a sequence of passes back to back into one graph, each grad
    /// pass followed by its COPY_INTO and ACCUMULATE_INTO returns; an
    /// instance with a block (`block(instance)`) writes its CLONE grads
    /// there. Over several microbatches, the passes run once per
    /// microbatch in turn (the scratch arena laid out again for each), with
    /// the copies in before the pass that reads them and the copies out
    /// after the pass that writes them; from the second microbatch on, the
    /// grads are added to the first's (`enqueue_sums`).
    fn record_sequence(
        &mut self,
        seq: &Sequence,
        block: impl Fn(usize) -> Option<DevPtr>,
        iteration: u32,
    ) -> Result<Box<dyn Graph>> {
        if let Some(state) = seq.state {
            return self.capture_looped(seq, state, &block, iteration);
        }
        self.scratch.restart();
        let backend = self.s.backend.clone();
        backend.begin_capture(self.stream, self.s.opts.capture_mode)?;
        let (mut ran, mut enqueued) = (Ok(()), Ok(()));
        let mut last = seq.passes[0];
        let mut acc = Vec::new();
        'microbatches: for mb in 0..seq.microbatches {
            if mb > 0 {
                self.scratch.restart();
            }
            let call = Call {
                phase: Phase::Capture,
                iteration,
                hooks: false,
                provide: false,
                param_grads: None,
                step_microbatch: (mb, seq.microbatches),
                step_index: 0,
            };
            for &p in seq.passes {
                last = p;
                let inst = &self.placed[p.instance];
                let copies = |before: bool| -> Result<()> {
                    for c in seq.io {
                        c.enqueue(backend.as_ref(), p, before, mb, self.stream)?;
                    }
                    Ok(())
                };
                enqueued = copies(true);
                if enqueued.is_err() {
                    break 'microbatches;
                }
                let context = self.context(p, "the capture of a step");
                // Under capture every callback gets ctx->capture; in a step
                // its external buffers are already provided (the view holds
                // them), so it refuses any.
                let provided = Provided::in_step(seq.step, context.clone());
                self.scratch.set_context(context);
                // The first microbatch writes CLONE grads straight into the
                // block; later ones into the static buffers, added after.
                let into = block(p.instance).filter(|_| mb == 0);
                let grads = into.map(|b| inst.param_grads_into(b));
                let bufs = ViewBuffers::of(inst, grads);
                let view = self.view(&bufs, p, &call, Some(self.scratch), Some(&provided));
                ran = self.s.callables[inst.callable].callbacks.run(&view);
                // A failed callback, or an invalidated capture, ends the
                // sequence: the passes after it would only be discarded. (No
                // `?` before the capture ends: a failed query just goes on.)
                if ran.is_err() || matches!(backend.capture_invalidated(self.stream), Ok(true)) {
                    break 'microbatches;
                }
                enqueued = copies(false);
                if enqueued.is_ok() && p.kind == inst.grad_pass() {
                    let dst = seq.dsts_of(p.instance);
                    enqueued = match mb {
                        0 => {
                            enqueue_destinations(backend.as_ref(), inst, dst, &mut acc, self.stream)
                        }
                        _ => {
                            let b = block(p.instance);
                            enqueue_sums(backend.as_ref(), inst, dst, b, &mut acc, self.stream)
                        }
                    };
                }
                if enqueued.is_err() {
                    break 'microbatches;
                }
            }
        }
        let ended = backend.end_capture(self.stream);
        let g = self.finish(last, ran, ended)?;
        enqueued?;
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::spec::StepSpec;
    use super::super::super::testing::{host_inputs, BYTES, N};
    use super::super::capture;
    use crate::core::layout::Role;
    use crate::core::policy::GradPolicy;

    #[test]
    fn destinations_are_checked_against_the_frozen_policies() {
        let mut f = host_inputs(&[("a", 1, false), ("b", 2, false)]);
        f.callables[1].params[1].policy = GradPolicy::AccumulateInto;
        f.steps = vec![StepSpec::plain(vec![0, 1], vec![0, 0, 0])];
        let err = capture(&f.inputs(), 1).err().map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(
            err.contains("param_dsts[2] (param 1 of callable 'b') is NULL"),
            "{err}"
        );
        f.steps[0].param_dsts[2] = 0x1001;
        let err = capture(&f.inputs(), 1).err().map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("not aligned"));
    }

    #[test]
    fn a_step_with_clone_grads_gets_one_graph_per_slot() {
        let mut f = host_inputs(&[("a", 1, false), ("b", 1, false)]);
        f.opts.clone_slots = 3;
        f.steps = vec![StepSpec::plain(vec![0, 1], vec![0, 0])];
        let (cap, _) = capture(&f.inputs(), 1).unwrap();
        let st = &cap.steps[0];
        assert!(st.graph.is_none());
        assert_eq!(st.slots.len(), 3);
        assert_eq!(st.cloned, vec![0, 1]);
        assert_eq!(st.passes.len(), 4);
        // Slot graph 2 writes each instance's grad into its slot block 2.
        let backend = f.backend.as_ref();
        for inst in &cap.instances {
            backend
                .upload(inst.grad_outputs[0].ptr, &[9u8; BYTES])
                .unwrap();
        }
        st.slots[2].launch(crate::backend::StreamRef(0)).unwrap();
        for inst in &cap.instances {
            let mut got = [0u8; BYTES];
            backend
                .download(&mut got, inst.graphs.slots[2].block)
                .unwrap();
            assert_eq!(got, [9u8; BYTES], "{}", inst.callable);
        }
    }

    use super::super::super::spec::{CaptureHook, HookPoint, Looping, MemCounters, StepIo};
    use super::super::super::testing::{floats, read_floats, Fixture};
    use crate::backend::{DevPtr, DeviceMemory, StreamRef};
    use crate::core::PassKind;
    use crate::error::Error;
    use std::sync::{Arc, Mutex};

    /// a (external output and parameter grad, COPY_INTO `dst`) then b
    /// (CLONE grads), in one step with two clone slots.
    fn external_step(provide_again: bool) -> (Fixture, DeviceMemory) {
        let mut f = host_inputs(&[("a", 1, false), ("b", 1, false)]);
        f.opts.clone_slots = 2;
        f.external(0, provide_again);
        f.callables[0].params[0].policy = GradPolicy::CopyInto;
        let dst = DeviceMemory::new(&f.backend, BYTES).unwrap();
        f.steps = vec![StepSpec::plain(vec![0, 1], vec![dst.ptr(), 0])];
        (f, dst)
    }

    #[test]
    fn a_step_writes_external_buffers_where_their_passes_provided_them() {
        let (mut f, dst) = external_step(false);
        let log = f.external(0, false);
        let (cap, _) = capture(&f.inputs(), 1).unwrap();
        let a = &cap.instances[0];
        let (out, grad) = (a.outputs[0].ptr, a.param_grads[0].ptr);
        let writes = log.lock().unwrap().writes.clone();
        // a's own forward and backward provided them; each slot graph of
        // the step was handed them and wrote there.
        let own = [
            (PassKind::Forward, out, false),
            (PassKind::Backward, grad, false),
        ];
        assert_eq!(writes[..2], own[..]);
        let step = [
            (PassKind::Forward, out, true),
            (PassKind::Backward, grad, true),
        ];
        assert_eq!(writes[2..], [step, step].concat()[..], "{writes:x?}");
        let st = &cap.steps[0];
        assert_eq!(st.slots.len(), 2, "b's CLONE grads take the slots");
        let backend = f.backend.as_ref();
        let s = StreamRef(0);
        backend.upload(a.inputs[0].ptr, &floats(1.0)).unwrap();
        // The per-pass replays.
        backend.upload(a.grad_outputs[0].ptr, &floats(2.0)).unwrap();
        a.graph(PassKind::Forward).unwrap().launch(s).unwrap();
        a.graph(PassKind::Backward).unwrap().launch(s).unwrap();
        let per_pass = (read_floats(backend, out), read_floats(backend, grad));
        assert_eq!(per_pass, (vec![1.0; N], vec![2.0; N]));
        // The step, after the buffers were cleared.
        for p in [out, grad] {
            backend.upload(p, &floats(0.0)).unwrap();
        }
        st.slots[1].launch(s).unwrap();
        assert_eq!(read_floats(backend, out), per_pass.0);
        assert_eq!(read_floats(backend, grad), per_pass.1);
        assert_eq!(
            read_floats(backend, dst.ptr()),
            per_pass.1,
            "COPY_INTO read it"
        );
    }

    #[test]
    fn step_io_reads_and_writes_external_buffers_unrolled_and_looped() {
        for looping in [Looping::Unrolled, Looping::Device] {
            let (mut f, dst) = external_step(false);
            let backend = f.backend.clone();
            let xs = DeviceMemory::new(&backend, 2 * BYTES).unwrap();
            let ys = DeviceMemory::new(&backend, 2 * BYTES).unwrap();
            let gs = DeviceMemory::new(&backend, 2 * BYTES).unwrap();
            backend
                .upload(xs.ptr(), &[floats(1.0), floats(3.0)].concat())
                .unwrap();
            backend
                .upload(gs.ptr(), &[floats(2.0), floats(5.0)].concat())
                .unwrap();
            let io = |role, ptr| StepIo {
                callable: 0,
                role,
                index: 0,
                ptr,
                stride: BYTES,
            };
            let st = &mut f.steps[0];
            st.microbatches = 2;
            st.looping = looping;
            st.io = vec![
                io(Role::Input, xs.ptr()),
                io(Role::Output, ys.ptr()),
                io(Role::GradOutput, gs.ptr()),
            ];
            let (cap, _) = capture(&f.inputs(), 1).unwrap();
            cap.steps[0].slots[0].launch(StreamRef(0)).unwrap();
            let b = backend.as_ref();
            let out = cap.instances[0].outputs[0].ptr;
            assert_eq!(read_floats(b, ys.ptr()), vec![1.0; N], "{looping:?}");
            assert_eq!(read_floats(b, ys.ptr() + BYTES as DevPtr), vec![3.0; N]);
            assert_eq!(read_floats(b, out), vec![3.0; N], "the external output");
            assert_eq!(
                read_floats(b, dst.ptr()),
                vec![7.0; N],
                "{looping:?}: 2 + 5"
            );
        }
    }

    #[test]
    fn a_step_without_slots_for_external_clone_grads_says_why() {
        // a's CLONE grad is external: its grad pass gets no clone slot, so
        // a step over microbatches has none to sum it in.
        let mut f = host_inputs(&[("a", 1, false)]);
        f.external(0, false);
        f.steps = vec![StepSpec::plain(vec![0], vec![0])];
        f.steps[0].microbatches = 2;
        let err = capture(&f.inputs(), 1).err().unwrap().to_string();
        assert!(
            err.contains("the step has none (callable 'a' has external parameter or input grads"),
            "{err}"
        );
        // One microbatch: it replays pass by pass (no step graph).
        f.steps[0].microbatches = 1;
        let (cap, _) = capture(&f.inputs(), 1).unwrap();
        assert!(cap.steps[0].graph.is_none() && cap.steps[0].slots.is_empty());
    }

    #[test]
    fn providing_a_buffer_again_in_a_step_is_refused_saying_where_it_is() {
        let (mut f, _dst) = external_step(true);
        let log = f.external(0, true);
        let err = capture(&f.inputs(), 1).err().unwrap();
        assert!(
            matches!(err, Error::CallbackFailed { code: 3, .. }),
            "{err}"
        );
        let refusals = log.lock().unwrap().refusals.clone();
        assert_eq!(refusals.len(), 1, "{refusals:?}");
        let r = &refusals[0];
        for words in [
            "the forward callback of callable 'a'",
            "output 0 cannot be provided in the capture of step 0",
            "where the pass's own capture provided them (ctx->outputs",
            "write the results there",
        ] {
            assert!(r.contains(words), "{r}");
        }
    }

    /// Sets step 0's capture hook; it records its calls and returns 7 at
    /// `fail`.
    fn hooked(f: &mut Fixture, fail: Option<HookPoint>) -> Arc<Mutex<Vec<HookPoint>>> {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let seen = calls.clone();
        f.steps[0].capture_hook = Some(CaptureHook(Arc::new(move |p| {
            seen.lock().unwrap().push(p);
            if Some(p) == fail {
                Err(7)
            } else {
                Ok(())
            }
        })));
        calls
    }

    fn nothing_kept(f: &Fixture) {
        let get = MemCounters::get;
        assert_eq!(get(&f.counters.static_bytes), 0);
        assert_eq!(get(&f.counters.scratch_bytes), 0);
        assert_eq!(get(&f.counters.clone_cached_bytes), 0);
        assert_eq!(f.pool.bytes(), 0);
    }

    #[test]
    fn the_capture_hook_runs_around_each_capture_of_the_step() {
        use HookPoint::{Post, Pre};
        // No CLONE grads: one graph, also looped.
        for looping in [Looping::Unrolled, Looping::Device] {
            let mut f = host_inputs(&[("a", 0, false), ("b", 0, false)]);
            f.steps = vec![StepSpec::plain(vec![0, 1], vec![])];
            f.steps[0].looping = looping;
            let calls = hooked(&mut f, None);
            let (cap, _) = capture(&f.inputs(), 1).unwrap();
            assert!(cap.steps[0].graph.is_some());
            assert_eq!(*calls.lock().unwrap(), [Pre, Post], "{looping:?}");
        }
        // CLONE grads with 3 slots: one graph per slot.
        let mut f = host_inputs(&[("a", 1, false)]);
        f.opts.clone_slots = 3;
        f.steps = vec![StepSpec::plain(vec![0], vec![0])];
        let calls = hooked(&mut f, None);
        let (cap, _) = capture(&f.inputs(), 1).unwrap();
        assert_eq!(cap.steps[0].slots.len(), 3);
        assert_eq!(*calls.lock().unwrap(), [Pre, Post].repeat(3));
    }

    #[test]
    fn a_failing_capture_hook_fails_the_capture_and_keeps_nothing() {
        use HookPoint::{Post, Pre};
        for (fail, calls_made, words) in [
            (
                Pre,
                vec![Pre],
                "the capture hook before the capture of step 0 returned 7",
            ),
            (
                Post,
                vec![Pre, Post],
                "the capture hook after the capture of step 0 returned 7",
            ),
        ] {
            let mut f = host_inputs(&[("a", 1, false)]);
            f.opts.clone_slots = 2;
            f.steps = vec![StepSpec::plain(vec![0], vec![0])];
            let calls = hooked(&mut f, Some(fail));
            let err = capture(&f.inputs(), 1).err().unwrap();
            assert!(matches!(err, Error::HookFailed { code: 7, .. }), "{err}");
            assert_eq!(err.to_string(), words);
            assert_eq!(
                *calls.lock().unwrap(),
                calls_made,
                "the first slot's capture stopped it"
            );
            nothing_kept(&f);
        }
    }

    #[test]
    fn the_after_call_follows_a_failed_capture_whose_error_stands() {
        let (mut f, _dst) = external_step(true);
        f.external(0, true);
        let calls = hooked(&mut f, Some(HookPoint::Post));
        let err = capture(&f.inputs(), 1).err().unwrap();
        assert!(
            matches!(err, Error::CallbackFailed { code: 3, .. }),
            "{err}"
        );
        assert_eq!(*calls.lock().unwrap(), [HookPoint::Pre, HookPoint::Post]);
        nothing_kept(&f);
    }
}
