//! Releasing one callable of a captured session while the others keep
//! replaying: every graph of its instances (microbatches, buckets, clone
//! slots, the graphs choosing its bucket on the device) and of every step
//! that includes it is destroyed, its clone rings go (blocks kept for reuse
//! are freed; blocks the caller holds stay valid and are freed when
//! released), its own static allocation is freed, and the shared one once
//! no captured callable uses it; with the last callable the scratch arena
//! goes too. Later replays of it, and of those steps, are refused naming
//! it. What one callable holds is reported here as well.

use super::captured::{Captured, Switches};
use super::instance::PassGraphs;
use super::spec::MemCounters;
use super::tensor::{Feed, ParamFeed};
use crate::error::Error;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What one callable of a captured session holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallableMemory {
    pub released: bool,
    /// Bytes of its own static allocation (buffers no other callable uses).
    pub own_static_bytes: u64,
    /// Bytes of the shared static allocation's buffers it uses (chained to
    /// another callable, or reusing memory with another's buffers).
    pub shared_static_bytes: u64,
    /// Graph executables of its instances (passes, clone slots, the graphs
    /// choosing its bucket on the device).
    pub graphs: u32,
    /// Graph executables of the steps that include it (releasing it
    /// destroys them too).
    pub step_graphs: u32,
    /// Bytes of its clone blocks from graphed's memory handed out and not
    /// yet released, and of those kept for reuse.
    pub clone_bytes_outstanding: u64,
    pub clone_bytes_cached: u64,
}

/// Why a replay of callable `name` is refused once it is released.
pub(crate) fn released_error(name: &str, what: &str) -> Error {
    Error::CallableReleased(format!(
        "callable '{name}' was released by graphed_session_release_callable: {what} is refused (its \
         graphs and the static memory only it used are gone); nothing was enqueued"
    ))
}

impl Captured {
    /// Whether callable `c` was released.
    pub fn is_released(&self, c: usize) -> bool {
        self.released.get(c).copied().unwrap_or(false)
    }

    /// The first released callable of step `step`, if any.
    pub fn step_released(&self, step: usize) -> Option<usize> {
        let st = self.steps.get(step)?;
        st.instances
            .iter()
            .map(|&i| self.instances[i].callable)
            .find(|&c| self.is_released(c))
    }

    /// The lease slots of the aliases callable `c`'s instances hand out.
    pub fn lease_slots(&self, c: usize) -> Vec<usize> {
        let per = self.by_callable.get(c).map_or(&[][..], Vec::as_slice);
        per.iter()
            .flat_map(|&n| {
                let i = &self.instances[n];
                i.outputs.iter().chain(&i.grad_inputs).chain(&i.param_grads)
            })
            .filter_map(|t| t.lease)
            .collect()
    }

    /// Releases callable `c` (see the module comment). The caller has
    /// waited for the device and checked the leases. Idempotent.
    pub fn release(&mut self, c: usize) {
        if self.is_released(c) || c >= self.released.len() {
            return;
        }
        self.released[c] = true;
        // The graphs first, then the memory they use.
        let steps: Vec<usize> = (0..self.steps.len())
            .filter(|&k| self.step_released(k).is_some())
            .collect();
        for k in steps {
            let st = &mut self.steps[k];
            st.graph = None;
            st.slots.clear();
            st.loop_state = None;
            st.update = None;
            for q in &mut st.params {
                q.feed = ParamFeed::Fixed("a callable of the step was released".into());
            }
        }
        if let Some(sw) = self.switches.get_mut(c) {
            *sw = Switches::default();
        }
        let per = self.by_callable.get(c).cloned().unwrap_or_default();
        for n in per {
            self.instances[n].graphs = PassGraphs::default();
            let inst = &mut self.instances[n].placed;
            // Blocks kept for reuse are freed with the ring; blocks the
            // caller holds are freed when released.
            inst.ring = None;
            for t in inst.inputs.iter_mut().chain(inst.grad_outputs.iter_mut()) {
                if t.feed.is_rebound() {
                    t.feed = Feed::Copied;
                }
            }
            for t in inst.param_grads.iter_mut() {
                if t.feed.is_rebound() {
                    t.feed = Feed::NotFed;
                }
            }
            for q in &mut inst.params {
                if q.movable() {
                    q.feed = ParamFeed::Fixed("its callable was released".into());
                }
            }
        }
        let freed = self.resources.statics.release(c);
        MemCounters::sub(&self.counters.static_bytes, freed);
        if !self.resources.statics.has_shared() {
            self.sizes = None;
        }
        if self.released.iter().all(|&r| r) {
            // No graph uses the scratch arena any more.
            if let Some(a) = self.resources.arena.take() {
                MemCounters::sub(&self.counters.scratch_bytes, a.bytes);
            }
        }
    }

    /// What callable `c` holds.
    pub fn callable_memory(&self, c: usize) -> CallableMemory {
        let per = self.by_callable.get(c).map_or(&[][..], Vec::as_slice);
        let graphs: usize = per
            .iter()
            .map(|&n| {
                let g = &self.instances[n].graphs;
                g.count() + g.slots.len()
            })
            .sum::<usize>()
            + self.switches.get(c).map_or(0, Switches::count);
        let step_graphs: usize = self
            .steps
            .iter()
            .filter(|st| {
                st.instances
                    .iter()
                    .any(|&i| self.instances[i].callable == c)
            })
            .map(|st| st.graph_count())
            .sum();
        let mut rings = Vec::new();
        for &n in per {
            if let Some(r) = &self.instances[n].ring {
                if !rings.iter().any(|x| Arc::ptr_eq(x, r)) {
                    rings.push(r.clone());
                }
            }
        }
        let cached: usize = rings.iter().map(|r| r.cached().1).sum();
        let outstanding = per
            .first()
            .map_or(0, |&n| self.instances[n].clone_out.load(Ordering::Relaxed));
        let st = &self.resources.statics;
        CallableMemory {
            released: self.is_released(c),
            own_static_bytes: st.own_bytes(c) as u64,
            shared_static_bytes: st.shared_bytes(c) as u64,
            graphs: graphs as u32,
            step_graphs: step_graphs as u32,
            clone_bytes_outstanding: outstanding,
            clone_bytes_cached: cached as u64,
        }
    }
}
