//! Rebinding a host graph: finding the tasks that take an address of a
//! range (a plan), and pointing them at the same offsets of another base.
//! Graphs with user tasks are refused: their data is opaque.

use super::task::{lock, Task, TaskList};
use crate::backend::{DevPtr, RebindPlan, Rebinder};
use crate::error::Result;

/// The plan for the references of `tasks` to `[base, base + bytes)`.
pub(super) fn plan(tasks: &TaskList, base: DevPtr, bytes: usize) -> Result<RebindPlan> {
    let (lo, hi) = (base as usize, base as usize + bytes);
    let inside = |a: usize| a >= lo && a < hi;
    let mut refs = Vec::new();
    for (i, t) in lock(tasks).iter().enumerate() {
        match *t {
            Task::User(_) | Task::Kernel { .. } => {
                return Ok(RebindPlan::Refused(
                    "the graph runs host tasks whose data is opaque: where they \
                     read the input cannot be seen"
                        .into(),
                ))
            }
            Task::Copy { dst, src, .. } | Task::Accumulate { dst, src, .. } => {
                for (field, a) in [(0, dst), (1, src)] {
                    if inside(a) {
                        refs.push((i, field, a - lo));
                    }
                }
            }
            Task::Zero { dst, .. } | Task::Fill { dst, .. } => {
                if inside(dst) {
                    refs.push((i, 0, dst - lo));
                }
            }
            Task::Loop { .. } | Task::CopyIndexed { .. } => {
                return Ok(RebindPlan::Refused(
                    "the graph loops over microbatches: its body is not looked into".into(),
                ))
            }
            Task::Rows2d { .. } => {
                return Ok(RebindPlan::Refused(
                    "the graph copies or zeroes rows of a pitch: they are not looked into".into(),
                ))
            }
            Task::ZeroTail { dst, size, .. } => {
                for (field, a) in [(0, dst), (1, size)] {
                    if inside(a) {
                        refs.push((i, field, a - lo));
                    }
                }
            }
            Task::Unless { .. } => {
                return Ok(RebindPlan::Refused(
                    "the graph runs an update under a condition: its body is not looked into"
                        .into(),
                ))
            }
            Task::Switch { .. } => {
                return Ok(RebindPlan::Refused(
                    "the graph chooses a bucket on the device: its bodies are not looked into"
                        .into(),
                ))
            }
            Task::Differ { a, b, .. } => {
                for (field, p) in [(0, a), (1, b)] {
                    if inside(p) {
                        refs.push((i, field, p - lo));
                    }
                }
            }
        }
    }
    if refs.is_empty() {
        return Ok(RebindPlan::Unreferenced);
    }
    Ok(RebindPlan::Plan(Box::new(HostRebinder {
        tasks: tasks.clone(),
        refs,
    })))
}

/// (task, which address: 0 dst / 1 src, offset from the base).
struct HostRebinder {
    tasks: TaskList,
    refs: Vec<(usize, u8, usize)>,
}

impl Rebinder for HostRebinder {
    fn nodes(&self) -> usize {
        self.refs.len()
    }

    fn rebind(&mut self, base: DevPtr) -> Result<()> {
        let mut tasks = lock(&self.tasks);
        for &(i, field, off) in &self.refs {
            let a = base as usize + off;
            match (&mut tasks[i], field) {
                (Task::Copy { dst, .. }, 0)
                | (Task::Accumulate { dst, .. }, 0)
                | (Task::Zero { dst, .. }, _)
                | (Task::Fill { dst, .. }, _) => *dst = a,
                (Task::Copy { src, .. }, _) | (Task::Accumulate { src, .. }, _) => *src = a,
                (Task::ZeroTail { dst, .. }, 0) => *dst = a,
                (Task::ZeroTail { size, .. }, _) => *size = a,
                (Task::Differ { a: x, .. }, 0) => *x = a,
                (Task::Differ { b: y, .. }, _) => *y = a,
                (
                    Task::User(_)
                    | Task::Kernel { .. }
                    | Task::Loop { .. }
                    | Task::CopyIndexed { .. }
                    | Task::Rows2d { .. }
                    | Task::Switch { .. }
                    | Task::Unless { .. },
                    _,
                ) => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::host::{enqueue, HostBackend};
    use crate::backend::{Backend, CaptureEnd, CaptureMode, RebindPlan};
    use std::sync::Arc;

    #[test]
    fn copies_are_rebound_and_opaque_tasks_are_refused() {
        let b = HostBackend::new();
        let s = b.create_stream().unwrap();
        let (x, y, z) = (
            b.alloc(16).unwrap(),
            b.alloc(16).unwrap(),
            b.alloc(16).unwrap(),
        );
        b.upload(x, &[1; 16]).unwrap();
        b.upload(y, &[2; 16]).unwrap();
        b.begin_capture(s, CaptureMode::Global).unwrap();
        b.copy(z, x + 8, 8, s).unwrap();
        let CaptureEnd::Graph(g) = b.end_capture(s).unwrap() else {
            panic!("invalidated")
        };
        let RebindPlan::Plan(mut r) = g.rebinder(x, 16).unwrap() else {
            panic!("the copy reads x + 8")
        };
        assert_eq!(r.nodes(), 1);
        r.rebind(y).unwrap();
        g.launch(s).unwrap();
        let mut out = [0u8; 16];
        b.download(&mut out, z).unwrap();
        assert_eq!(&out[..8], &[2; 8], "the copy reads y + 8 now");
        assert!(
            matches!(g.rebinder(z + 64, 16).unwrap(), RebindPlan::Unreferenced),
            "nothing references that range"
        );
        b.begin_capture(s, CaptureMode::Global).unwrap();
        enqueue(s, Arc::new(|| {})).unwrap();
        let CaptureEnd::Graph(g) = b.end_capture(s).unwrap() else {
            panic!("invalidated")
        };
        let RebindPlan::Refused(why) = g.rebinder(x, 16).unwrap() else {
            panic!("a host task is opaque")
        };
        assert!(why.contains("opaque"), "{why}");
        b.destroy_stream(s).unwrap();
    }
}
