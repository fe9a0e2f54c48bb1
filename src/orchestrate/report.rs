//! What a session tells about itself: its figures (memory, graphs,
//! rebinding, capture time, teardown errors), its static buffers and their
//! plan, which tensors are rebound, its frozen grad policies.

use super::clock::CaptureTimes;
use super::instance::Placed;
use super::session::{Session, State};
use super::spec::{CallableSpec, MemCounters};
use super::tensor::{Feed, ParamFeed};
use crate::backend::DevPtr;
use crate::core::layout::Role;
use crate::core::plan::Lifetime;
use crate::core::policy::GradPolicy;
use crate::error::{Error, Result};

/// Memory and graph figures of a session, from the library's own accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub static_bytes: u64,
    /// The static bytes without reuse, and the least any plan could use.
    pub static_bytes_without_reuse: u64,
    pub peak_live_bytes: u64,
    pub microbatches: u32,
    pub scratch_bytes: u64,
    pub pool_bytes: u64,
    pub clone_bytes_outstanding: u64,
    pub clone_blocks_outstanding: u64,
    /// Released clone blocks kept for reuse by later replays.
    pub clone_bytes_cached: u64,
    /// Graphs of single passes; of clone slots; of steps.
    pub graph_count: u32,
    pub slot_graphs: u32,
    pub step_graphs: u32,
    pub callables: u32,
    pub instances: u32,
    pub leases_held: u32,
    pub captured: bool,
    /// Inputs and grad-outputs rebound at replay, and those asked to be
    /// rebound that are copied instead (the plan dump says why), over all
    /// instances.
    pub inputs_rebound: u32,
    pub inputs_rebind_refused: u32,
    /// Node updates one rebind of every rebound buffer costs.
    pub rebind_nodes: u32,
    /// Parameters (over all instances) whose graphs can follow a move, and
    /// those registered with the rebind flag that capture refused.
    pub params_movable: u32,
    pub params_move_refused: u32,
    /// Parameter moves replays followed (one per parameter per graph set
    /// pointed at a new address).
    pub param_moves: u64,
    /// Device-chosen replays whose size no bucket held (read from the
    /// device).
    pub bucket_overflows: u64,
    /// COPY_INTO grads (over all instances) their pass writes straight
    /// into the destination, and those registered with REBIND_GRAD that
    /// capture refused (copied; the plan dump says why).
    pub grads_in_place: u32,
    pub grads_in_place_refused: u32,
    /// Where the last capture's host time went.
    pub capture_times: CaptureTimes,
    /// Errors while releasing this session's resources (a reset, a failed
    /// capture, released clone blocks), each also sent to its log.
    pub teardown_errors: u64,
}

impl Session {
    pub fn stats(&self) -> Stats {
        let get = MemCounters::get;
        let mut st = Stats {
            static_bytes: get(&self.counters.static_bytes),
            scratch_bytes: get(&self.counters.scratch_bytes),
            pool_bytes: self.pool.bytes() as u64,
            clone_bytes_outstanding: get(&self.counters.clone_bytes),
            clone_blocks_outstanding: get(&self.counters.clone_blocks),
            clone_bytes_cached: get(&self.counters.clone_cached_bytes),
            teardown_errors: get(&self.counters.teardown_errors),
            callables: self.callables.len() as u32,
            leases_held: self.leases.held() as u32,
            ..Stats::default()
        };
        if let State::Captured(c) = &self.state {
            st.capture_times = c.times;
            let (passes, slots, steps) = c.graph_counts();
            st.static_bytes_without_reuse = c.plan.plan.disjoint_bytes as u64;
            st.peak_live_bytes = c.plan.plan.peak_live_bytes as u64;
            st.microbatches = c.by_callable.first().map_or(0, |v| {
                v.iter().filter(|&&n| c.instances[n].bucket == 0).count() as u32
            });
            st.bucket_overflows = c.bucket_overflows();
            st.graph_count = passes as u32;
            st.slot_graphs = slots as u32;
            st.step_graphs = steps as u32;
            st.instances = c.instances.len() as u32;
            st.captured = true;
            // Released callables have no graphs left to rebind.
            let live = || c.instances.iter().filter(|i| !c.is_released(i.callable));
            let fed = live().flat_map(|i| i.inputs.iter().chain(&i.grad_outputs));
            for t in fed {
                match &t.feed {
                    Feed::Rebound(r) => {
                        st.inputs_rebound += 1;
                        st.rebind_nodes += r.nodes() as u32;
                    }
                    Feed::Refused(_) => st.inputs_rebind_refused += 1,
                    _ => {}
                }
            }
            for inst in live() {
                for g in &inst.param_grads {
                    match &g.feed {
                        Feed::Rebound(_) => st.grads_in_place += 1,
                        Feed::Refused(_) => st.grads_in_place_refused += 1,
                        _ => {}
                    }
                }
                let specs = &self.callables[inst.callable].params;
                for (q, spec) in inst.params.iter().zip(specs) {
                    match (&q.feed, spec.flags.rebind) {
                        (ParamFeed::Rebound(_), _) => st.params_movable += 1,
                        (ParamFeed::Fixed(_), true) => st.params_move_refused += 1,
                        _ => {}
                    }
                }
            }
            st.param_moves = c.param_moves;
        }
        st
    }

    /// The static buffers of one role of an instance (0 where absent);
    /// refused once its callable is released (its own buffers are freed).
    pub fn buffers(&self, callable: u32, microbatch: u32, role: Role) -> Result<Vec<DevPtr>> {
        let cap = self.captured()?;
        let inst = &cap.instances[cap.instance_index(callable, microbatch)?];
        self.check_live(callable, "asking for its static buffers")?;
        Ok(inst.tensors(role).iter().map(|t| t.ptr).collect())
    }

    /// How many static buffers one role of an instance has (released
    /// callables included: the count is the callable's shape).
    pub fn buffer_count(&self, callable: u32, microbatch: u32, role: Role) -> Result<usize> {
        let cap = self.captured()?;
        let inst = &cap.instances[cap.instance_index(callable, microbatch)?];
        Ok(inst.tensors(role).len())
    }

    /// Whether each input (`Role::Input`) or each output's grad-output
    /// (`Role::GradOutput`) of an instance is rebound at replay (false:
    /// copied, because it was not asked for or capture refused it).
    pub fn rebound(&self, callable: u32, microbatch: u32, role: Role) -> Result<Vec<bool>> {
        let cap = self.captured()?;
        let inst = &cap.instances[cap.instance_index(callable, microbatch)?];
        if !matches!(role, Role::Input | Role::GradOutput) {
            return Err(Error::invalid(format!(
                "only inputs and grad-outputs are rebound; role is {}",
                role.name()
            )));
        }
        Ok(inst
            .tensors(role)
            .iter()
            .map(|t| t.feed.is_rebound())
            .collect())
    }

    /// Whether replays can point the graphs of (callable, microbatch) at
    /// each parameter's new address (registered with the rebind flag and
    /// verified at capture).
    pub fn params_movable(&self, callable: u32, microbatch: u32) -> Result<Vec<bool>> {
        let cap = self.captured()?;
        let inst = &cap.instances[cap.instance_index(callable, microbatch)?];
        Ok(inst.params.iter().map(|q| q.movable()).collect())
    }

    /// Whether replays of callable `callable` may hand back refs whose
    /// data is rows of a pitch (false for one that does not exist).
    pub fn returns_rows(&self, callable: u32) -> bool {
        self.callables
            .get(callable as usize)
            .is_some_and(|c| c.strided())
    }

    /// The bucket a forward replay of callable `callable` given `size`
    /// (and, with a grid, the second size) runs, and that bucket's sizes:
    /// the rule replays choose by (`CallableSpec::forward_bucket`); (0,
    /// (0, 0)) for a callable without buckets given no size. Answered from
    /// registration, before capture too; refused once the session is
    /// reset.
    pub fn bucket_of(&self, callable: u32, size: (u64, u64)) -> Result<(u32, (u64, u64))> {
        if let State::Reset = self.state {
            return Err(Error::SessionReset(
                "its graphs were released by its reset; destroy it".into(),
            ));
        }
        let spec = self.callables.get(callable as usize).ok_or_else(|| {
            Error::invalid(format!(
                "callable {callable} does not exist (the session has {})",
                self.callables.len()
            ))
        })?;
        let b = spec.forward_bucket(size, "size")?;
        Ok((b as u32, spec.sizes(b)))
    }

    /// The instance number of (callable, microbatch, bucket) in a captured
    /// session, as callbacks saw it (`PassView::instance`); released
    /// callables keep theirs.
    pub fn instance_of(&self, callable: u32, microbatch: u32, bucket: u32) -> Result<u32> {
        Ok(self.captured()?.instance_of(callable, microbatch, bucket)? as u32)
    }

    /// Where the graphs of (callable, microbatch) read each parameter now:
    /// where it was registered until a forward replay given another
    /// address pointed them there (every bucket follows the same moves).
    /// 0 where its buckets' graphs do not agree on one known address (a
    /// rebind that failed part way: the next replay given an address
    /// points them all again). Refused once the callable is released (its
    /// graphs are gone).
    pub fn param_addresses(&self, callable: u32, microbatch: u32) -> Result<Vec<DevPtr>> {
        let cap = self.captured()?;
        let all = cap.bucket_instances(callable, microbatch)?;
        self.check_live(callable, "asking where its graphs read its parameters")?;
        let first = &cap.instances[all[0]].params;
        Ok((0..first.len())
            .map(|j| {
                let at = first[j].bound();
                let agree = all[1..]
                    .iter()
                    .all(|&n| cap.instances[n].params.get(j).map(|q| q.bound()) == Some(at));
                if agree {
                    at
                } else {
                    0
                }
            })
            .collect())
    }

    /// The frozen grad policy of each parameter of a callable (None where
    /// it takes no gradient).
    pub fn policies(&self, callable: u32) -> Result<&[Option<GradPolicy>]> {
        let cap = self.captured()?;
        let inst = &cap.instances[cap.instance_index(callable, 0)?];
        Ok(&inst.returns.policies)
    }

    /// The static-buffer plan as text (a callable's buckets share its
    /// buffers: one line each): one line per buffer with its
    /// instance, role, size, offset in its allocation, memory slot,
    /// lifetime (in pass positions of the capture order) and allocation
    /// (the callable's own, or the one callables share), then what replays
    /// do with each tensor asked to be rebound.
    pub fn plan_dump(&self) -> Result<String> {
        use std::fmt::Write;
        let cap = self.captured()?;
        let p = &cap.plan.plan;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "static bytes {} (without reuse {}, peak live {}), {} buffers in {} slots",
            p.total_bytes,
            p.disjoint_bytes,
            p.peak_live_bytes,
            cap.plan.buffers.len(),
            p.slot_of.iter().max().map_or(0, |m| m + 1)
        );
        let _ = writeln!(
            out,
            "callable  microbatch  role             index  bytes       offset      slot  lifetime  memory"
        );
        let owned = &cap.plan.owned;
        for (i, b) in cap.plan.buffers.iter().enumerate() {
            // The planned instance's first placed one (its buckets share
            // its buffers).
            let Some(inst) = cap.instances.iter().find(|inst| inst.site == b.instance) else {
                continue;
            };
            let lt = cap
                .plan
                .lifetimes
                .get(i)
                .copied()
                .unwrap_or(Lifetime { start: 0, end: 0 });
            let (owner, offset) = owned.place.get(i).copied().unwrap_or((None, p.offsets[i]));
            let memory = match owner {
                Some(_) if cap.is_released(inst.callable) => "own (released)",
                Some(_) => "own",
                None if !cap.resources.statics.has_shared() => "shared (released)",
                None => "shared",
            };
            let _ = writeln!(
                out,
                "{:<9} {:<11} {:<16} {:<6} {:<11} {:<11} {:<5} [{}, {}]  {memory}",
                self.callables[inst.callable].name,
                inst.microbatch,
                b.role.name(),
                b.index,
                b.bytes,
                offset,
                p.slot_of[i],
                lt.start,
                lt.end
            );
        }
        for inst in &cap.instances {
            let name = &self.callables[inst.callable].name;
            for t in inst.inputs.iter().chain(&inst.grad_outputs) {
                let what = match &t.feed {
                    Feed::Rebound(r) => format!("rebound at replay ({} node updates)", r.nodes()),
                    Feed::Refused(why) => format!("copied at replay: {why}"),
                    _ => continue,
                };
                let _ = writeln!(
                    out,
                    "{} of {name} (microbatch {}{}): {what}",
                    t.describe(),
                    inst.microbatch,
                    bucket_of(inst, &self.callables[inst.callable])
                );
            }
            let asked = inst
                .params
                .iter()
                .zip(&self.callables[inst.callable].params)
                .filter(|(_, spec)| spec.flags.rebind);
            for (q, _) in asked {
                let what = match &q.feed {
                    ParamFeed::Rebound(r) => {
                        format!("movable ({} node updates per move)", r.nodes())
                    }
                    ParamFeed::Fixed(why) => format!("fixed at its registered address: {why}"),
                };
                let _ = writeln!(
                    out,
                    "param {} of {name} (microbatch {}{}): {what}",
                    q.index,
                    inst.microbatch,
                    bucket_of(inst, &self.callables[inst.callable])
                );
            }
            for g in &inst.param_grads {
                let what = match &g.feed {
                    Feed::Rebound(r) => format!(
                        "written straight into its destination ({} node updates per new destination)",
                        r.nodes()
                    ),
                    Feed::Refused(why) => format!("copied into its destination: {why}"),
                    _ => continue,
                };
                let _ = writeln!(
                    out,
                    "{} of {name} (microbatch {}{}): {what}",
                    g.describe(),
                    inst.microbatch,
                    bucket_of(inst, &self.callables[inst.callable])
                );
            }
        }
        Ok(out)
    }

    /// (free, total) device memory as the driver reports it.
    pub fn device_memory(&self) -> Result<(usize, usize)> {
        let _ctx = self.backend.bind()?;
        self.backend.mem_info()
    }
}

/// ", bucket b (n rows)" for an instance of a callable with buckets.
fn bucket_of(inst: &Placed, spec: &CallableSpec) -> String {
    match spec.describe_bucket(inst.bucket as usize) {
        Some(n) => format!(", bucket {} ({n})", inst.bucket),
        None => String::new(),
    }
}
