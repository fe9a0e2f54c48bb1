//! Steps: what a step's capture needs (its instances and passes, the
//! destinations checked against the frozen policies, the clone slots its
//! CLONE grads go into, its io copies, the loop's state) and the capture
//! of each of its graphs (one, or one per clone slot), with the step's
//! capture hook called around each. Recording a graph is unrolled.rs (one
//! microbatch after another) or looped.rs (one microbatch in a WHILE
//! node). A step then replays with one launch.

use super::super::captured::CapturedStep;
use super::super::instance::{PassRef, Placed};
use super::super::spec::{CaptureHook, CollectiveSpec, HookPoint, LogLevel, Looping, UpdateSpec};
use super::super::tensor::Param;
use super::super::update::StepUpdate;
use super::run::Runner;
use super::step_io::{self, IoCopy};
use crate::backend::{DevPtr, DeviceMemory, Graph};
use crate::core::collective::CollectiveEntry;
use crate::error::{Error, Result};
use std::cell::RefCell;

/// A step's graph, or its graphs of the clone slots.
type StepGraphs = (Option<Box<dyn Graph>>, Vec<Box<dyn Graph>>);

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

/// The loop's state of a step whose last microbatch follows the loop
/// (six u32): the index, the loop's count (the replay's less one), a flag
/// that skips the loop (a replay of one microbatch: a loop runs its body
/// at least once), the replay's count, and the u64 the skips are counted
/// in. The skip flag's offset in that state:
pub(crate) const PEELED_SKIP: DevPtr = 8;
/// The replay's count's offset in that state.
pub(crate) const PEELED_COUNT: DevPtr = 12;
/// The offset of the u64 that counts the replays that skipped the loop.
pub(crate) const PEELED_SKIPS: DevPtr = 16;

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
    /// The update stage, recorded after the last microbatch.
    pub update: Option<UpdateRef<'a>>,
    /// The collective stage, recorded in the last microbatch (looping on
    /// the device, that microbatch follows the loop: see looped.rs).
    pub collective: Option<&'a CollectiveSpec>,
    /// What the collective callback declared in the graph being captured.
    pub manifest: RefCell<Vec<CollectiveEntry>>,
}

/// A step's update as its capture records it: the callback and the
/// device memory of the step's update.
#[derive(Clone, Copy)]
pub(super) struct UpdateRef<'a> {
    pub spec: &'a UpdateSpec,
    pub flag: DevPtr,
    pub counter: DevPtr,
    pub scalars: DevPtr,
}

impl Sequence<'_> {
    /// Whether its last microbatch is recorded after the loop on the
    /// device (a looped step with collectives: they cannot run inside a
    /// conditional node).
    pub fn peeled(&self) -> bool {
        self.state.is_some() && self.collective.is_some()
    }

    /// Where in the loop's state the count a replay runs is (a u32).
    pub fn count_at(&self) -> DevPtr {
        match self.peeled() {
            true => PEELED_COUNT,
            false => 4,
        }
    }

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
        let n = step.microbatches;
        let loop_state = match step.looping {
            Looping::Unrolled => None,
            Looping::Device => {
                // The count until a replay sets it: verification replays run all.
                let words = match step.collective.is_some() {
                    true => vec![0u32, n - 1, (n == 1) as u32, n, 0, 0],
                    false => vec![0u32, n],
                };
                let m = DeviceMemory::new(self.s.backend, words.len() * 4)?;
                let init: Vec<u8> = words.iter().flat_map(|v| v.to_le_bytes()).collect();
                self.s.backend.upload(m.ptr(), &init)?;
                Some(m)
            }
        };
        let update = match &step.update {
            Some(spec) => Some(StepUpdate::new(self.s.backend, spec)?),
            None => None,
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
            update: step
                .update
                .as_ref()
                .zip(update.as_ref())
                .map(|(spec, u)| UpdateRef {
                    spec,
                    flag: u.flag(),
                    counter: u.counter(),
                    scalars: u.scalars(),
                }),
            collective: step.collective.as_ref(),
            manifest: RefCell::new(Vec::new()),
        };
        let looped = step.looped();
        let graphs = self.capture_graphs(&seq, (&cloned, slots, &no_slots), slot_blocks, iteration);
        let manifest = seq.manifest.take();
        if let Some(spec) = &step.collective {
            let compared = self.exchange(si, spec, graphs.is_ok(), &manifest);
            // A failed capture's own error stands (the exchange only told
            // the other ranks).
            if graphs.is_ok() {
                compared?;
            }
        }
        let (graph, slot_graphs) = graphs?;
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
            update,
            collectives: step.collective.as_ref().map(|_| manifest),
        })
    }

    /// Captures the graphs of a step: one, or one per clone slot (each
    /// recording the collectives of the first), or none (pass by pass).
    fn capture_graphs(
        &mut self,
        seq: &Sequence,
        (cloned, slots, no_slots): (&[usize], usize, &str),
        slot_blocks: &[Vec<DevPtr>],
        iteration: u32,
    ) -> Result<StepGraphs> {
        let si = seq.step;
        let step = &self.s.steps[si];
        let (mut graph, mut slot_graphs) = (None, Vec::new());
        if cloned.is_empty() {
            graph = Some(self.capture_sequence(seq, |_| None, 0, iteration)?);
        } else if slots == 0 && step.looped() {
            let what = match (step.update.is_some(), step.collective.is_some()) {
                (true, _) => "runs an update in its graph",
                (_, true) => "records collectives in its graph",
                _ => "copies data in or out",
            };
            return Err(Error::Incompatible(format!(
                "step {si} {what} and returns CLONE grads, which need a clone slot; it has none \
                 ({no_slots})"
            )));
        } else if slots == 0 {
            self.s.log(LogLevel::Warn, || {
                format!(
                    "step {si} returns CLONE grads but has no clone slots ({no_slots}): it replays pass \
                     by pass"
                )
            });
        } else {
            let mut first = Vec::new();
            for k in 0..slots {
                let block = |i: usize| slot_blocks[i].get(k).copied();
                slot_graphs.push(self.capture_sequence(seq, block, k as u32, iteration)?);
                match k {
                    0 => first = seq.manifest.take(),
                    _ => {
                        let this = seq.manifest.take();
                        self.same_in_every_graph(si, &first, &this, k)?;
                    }
                }
            }
            *seq.manifest.borrow_mut() = first;
        }
        Ok((graph, slot_graphs))
    }

    /// Captures a sequence into one graph (unrolled or looped), with the
    /// step's capture hook called before and after, outside the stream
    /// capture. The after-call comes also after a failed capture, whose
    /// error then stands; a failing hook fails the capture, its graph
    /// dropped.
    fn capture_sequence(
        &mut self,
        seq: &Sequence,
        block: impl Fn(usize) -> Option<DevPtr>,
        slot: u32,
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
        let captured = match seq.state {
            Some(state) => self.capture_looped(seq, state, &block, slot, iteration),
            None => self.record_unrolled(seq, &block, slot, iteration),
        };
        let after = hook(HookPoint::Post);
        let graph = captured?;
        after?;
        Ok(graph)
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::spec::{CaptureHook, HookPoint, Looping, MemCounters, StepSpec};
    use super::super::super::testing::{external_step, host_inputs, Fixture, BYTES};
    use super::super::capture;
    use crate::core::policy::GradPolicy;
    use crate::error::Error;
    use std::sync::{Arc, Mutex};

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
