//! Host graphs: a capture's recorded task list becomes a graph, and
//! launching it submits the tasks again, on the same addresses.

use super::rebind;
use super::stream::{self, submit};
use super::task::{self, lock, Task, TaskList};
use crate::backend::accounting::GraphMark;
use crate::backend::{CaptureEnd, DevPtr, Graph, RebindPlan, StreamRef};
use crate::core::dot::Nodes;
use crate::error::Result;
use std::sync::{Arc, Mutex, MutexGuard};

pub(super) struct HostGraph {
    tasks: TaskList,
    /// Counted as a graph executable of the process while it lives.
    _mark: GraphMark,
}

impl HostGraph {
    fn tasks(&self) -> MutexGuard<'_, Vec<Task>> {
        lock(&self.tasks)
    }

    /// A copy of its tasks as they are now (a body of another graph).
    pub(super) fn snapshot(&self) -> Arc<Vec<Task>> {
        Arc::new(self.tasks().clone())
    }
}

/// Ends the capture on `s`: what it recorded is a graph, unless the capture
/// was invalidated.
pub(super) fn end_capture(s: StreamRef) -> Result<CaptureEnd> {
    Ok(match stream::end_capture(s)? {
        Err(why) => CaptureEnd::Invalidated(why),
        Ok(tasks) => CaptureEnd::Graph(Box::new(HostGraph {
            tasks: Arc::new(Mutex::new(tasks)),
            _mark: GraphMark::new(),
        })),
    })
}

impl Graph for HostGraph {
    fn launch(&self, stream: StreamRef) -> Result<()> {
        // One task at a time, outside the lock: a user task may launch work.
        let n = self.tasks().len();
        for i in 0..n {
            let t = self.tasks()[i].clone();
            submit(stream, t)?;
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn rebinder(&self, base: DevPtr, bytes: usize) -> Result<RebindPlan> {
        rebind::plan(&self.tasks, base, bytes)
    }

    fn nodes(&self) -> Nodes {
        task::nodes(&self.tasks())
    }
}

#[cfg(test)]
mod tests {
    use super::super::task::counter_task;
    use crate::backend::host::{enqueue, HostBackend};
    use crate::backend::{Backend, CaptureEnd, CaptureMode, StreamRef};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[test]
    fn capture_records_and_replay_reruns_on_the_same_addresses() {
        let b = HostBackend::new();
        let s = b.create_stream().unwrap();
        let src = b.alloc(16).unwrap();
        let dst = b.alloc(16).unwrap();
        let counter = Arc::new(AtomicU32::new(0));
        b.begin_capture(s, CaptureMode::Global).unwrap();
        assert!(b.is_capturing(s).unwrap());
        enqueue(s, counter_task(&counter)).unwrap();
        b.copy(dst, src, 16, s).unwrap();
        assert_eq!(
            counter.load(Ordering::Relaxed),
            0,
            "nothing runs under capture"
        );
        let g = match b.end_capture(s).unwrap() {
            CaptureEnd::Graph(g) => g,
            CaptureEnd::Invalidated(why) => panic!("invalidated: {why}"),
        };
        assert!(!b.is_capturing(s).unwrap());
        // SAFETY: src is a live 16-byte allocation of this backend.
        unsafe { *(src as *mut u32) = 42 };
        g.launch(StreamRef(0)).unwrap();
        g.launch(s).unwrap();
        assert_eq!(counter.load(Ordering::Relaxed), 2);
        // SAFETY: dst is a live 16-byte allocation.
        assert_eq!(unsafe { *(dst as *const u32) }, 42);
        b.destroy_stream(s).unwrap();
    }
}
