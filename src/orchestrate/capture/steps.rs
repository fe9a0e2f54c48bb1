//! Steps: a step's callables are captured once more, back to back in one
//! stream capture, every grad pass followed by its COPY_INTO and
//! ACCUMULATE_INTO returns into destinations fixed at declaration; with
//! CLONE grads, once per clone slot, each instance's CLONE grads going
//! into its slot block k. A step over several microbatches holds them all,
//! each with its copies in and out (step_io.rs), the grads summed. A step
//! then replays with one launch.

use super::super::captured::CapturedStep;
use super::super::external::Provided;
use super::super::grads::{enqueue_destinations, enqueue_sums};
use super::super::instance::{PassRef, Placed};
use super::super::spec::{LogLevel, Looping, Phase};
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
        let overwritten = overwritten(&placed);
        let dsts = step.param_dsts.clone();
        step_io::check_sums(si, step.microbatches, &placed, &names, slots)?;
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
                "step {si} copies data in or out and returns CLONE grads, which need a clone slot; the \
                 session has none (clone_slots is 0, or a caller allocator is set)"
            )));
        } else if slots == 0 {
            self.s.log(LogLevel::Warn, || {
                format!(
                    "step {si} returns CLONE grads but has no clone slots (clone_slots is 0, or a caller \
                     allocator is set): it replays pass by pass"
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

    /// Captures a sequence of passes back to back into one graph, each grad
    /// pass followed by its COPY_INTO and ACCUMULATE_INTO returns; an
    /// instance with a block (`block(instance)`) writes its CLONE grads
    /// there. Over several microbatches, the passes run once per
    /// microbatch in turn (the scratch arena laid out again for each), with
    /// the copies in before the pass that reads them and the copies out
    /// after the pass that writes them; from the second microbatch on, the
    /// grads are added to the first's (`enqueue_sums`).
    fn capture_sequence(
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
                // Under capture every callback gets ctx->capture; a step's
                // callables have no external buffers, so it expects none.
                let provided = Provided::new(Vec::new(), context.clone());
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
    use super::super::super::testing::{host_inputs, BYTES};
    use super::super::capture;
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
}
