//! Executable graphs and the templates they come from: `Template`, a
//! captured graph kept while rebinding or loading needs it; `Exec`, an
//! executable that one graph owns or that the graphs of one pass in every
//! bucket share (each loads its parameters before it launches); `Target`,
//! where a graph's rebinding patches go.

use super::device::Inner;
use super::driver::check;
use crate::backend::accounting::GraphMark;
use crate::backend::teardown;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A captured graph's template. Rebinding plans read its nodes and update
/// the executable through them, so it lives while the graph keeps it or a
/// plan needs it.
pub(super) struct Template {
    pub graph: sys::CUgraph,
    pub inner: Arc<Inner>,
}

// SAFETY: a CUgraph may be used and destroyed from any thread. After
// capture it is only read, except by the rebinding of a graph whose
// executable is shared, which patches it under that executable's lock.
unsafe impl Send for Template {}
// SAFETY: as above.
unsafe impl Sync for Template {}

impl Drop for Template {
    fn drop(&mut self) {
        let _g = self.inner.bind();
        // SAFETY: destroyed exactly once, when the last holder goes.
        let r = check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(self.graph) });
        teardown::check("destroying a graph template", r);
    }
}

/// An executable graph: one graph's own, or shared by the graphs of one
/// pass in every bucket of a callable (`CudaGraph::share_executable_of`).
/// Dropped with its last graph (and rebinding plan).
pub(super) struct Exec {
    pub raw: sys::CUgraphExec,
    inner: Arc<Inner>,
    /// Which graph's parameters it holds (`CudaGraph::id`; 0: unknown),
    /// and the lock under which graphs load, patch and launch it once it
    /// is shared.
    loaded: Mutex<u64>,
    /// Set when a second graph shares it: launches load first from then on.
    shared: AtomicBool,
    /// While shared: the template it was instantiated from, whose nodes
    /// name its nodes in `cuGraphExec*SetParams`.
    origin: Mutex<Option<Arc<Template>>>,
    /// Counted as a graph executable of the process while it lives.
    _mark: GraphMark,
}

// SAFETY: a CUgraphExec may be launched, updated and destroyed from any
// thread; every change of what it holds is made under `loaded`.
unsafe impl Send for Exec {}
// SAFETY: as above.
unsafe impl Sync for Exec {}

impl Exec {
    /// `raw`, owned by graph `id` (loaded with its parameters).
    pub fn new(raw: sys::CUgraphExec, inner: Arc<Inner>, id: u64) -> Exec {
        Exec {
            raw,
            inner,
            loaded: Mutex::new(id),
            shared: AtomicBool::new(false),
            origin: Mutex::new(None),
            _mark: GraphMark::new(),
        }
    }

    /// Binds the executable's context (for a load).
    pub fn bind(&self) -> crate::error::Result<crate::backend::ContextGuard> {
        self.inner.bind()
    }

    /// From now on shared: launches load first. `origin`: the template it
    /// was instantiated from, whose nodes name its nodes; kept with it.
    pub fn share(&self, origin: Arc<Template>) {
        self.origin
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(origin);
        self.shared.store(true, Ordering::Release);
    }

    pub fn is_shared(&self) -> bool {
        self.shared.load(Ordering::Acquire)
    }

    /// The lock under which it is loaded, patched and launched; what it
    /// guards is the id of the graph whose parameters it holds.
    pub fn lock(&self) -> MutexGuard<'_, u64> {
        // Every change under the lock is complete before it is released.
        self.loaded.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Exec {
    fn drop(&mut self) {
        let _g = self.inner.bind();
        // SAFETY: destroyed exactly once, with its last holder; callers
        // synchronize before dropping graphs.
        let r = unsafe { sys::cuGraphExecDestroy(self.raw) };
        teardown::check(
            "destroying an executable graph",
            check("cuGraphExecDestroy", r),
        );
    }
}

/// Ids of graphs, for `Exec::loaded` (0 is never one).
pub(super) fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Where a graph's rebinding patches go: the executable, the graph's id,
/// and, when the executable was instantiated from another graph's
/// template, that template's node for each of this graph's nodes.
#[derive(Clone)]
pub(super) struct Target {
    pub exec: Arc<Exec>,
    pub id: u64,
    pub exec_nodes: Arc<HashMap<usize, usize>>,
}

impl Target {
    /// The node of the executable's own template that stands for `node`
    /// of this graph.
    pub fn exec_node(&self, node: sys::CUgraphNode) -> sys::CUgraphNode {
        // Node handles are kept as addresses (usize), so that the map is
        // Send and Sync; they are the driver's handles of live templates.
        self.exec_nodes
            .get(&(node as usize))
            .map_or(node, |&n| n as sys::CUgraphNode)
    }
}
