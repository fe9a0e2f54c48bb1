//! Captured graphs: a capture ended, instantiated and uploaded into an
//! executable (`CudaGraph`) with the list of its nodes (`describe`),
//! launched, planned for rebinding while its template is kept, and
//! destroyed with failures reported as teardown errors; executables shared
//! by the graphs of one pass in every bucket (`Exec`: a graph loads its
//! parameters with cuGraphExecUpdate before it launches, when the
//! executable holds another's); and the capture status of a stream.

use super::describe;
use super::device::Inner;
use super::driver::{check, error_name};
use super::exec::{next_id, Exec, Target, Template};
use super::rebind;

use crate::backend::{CaptureEnd, DevPtr, Graph, Made, RebindPlan, StreamRef};
use crate::core::dot::Nodes;
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// An instantiated, uploaded graph and, until released, its template.
pub(super) struct CudaGraph {
    exec: Arc<Exec>,
    id: u64,
    /// With a shared executable made from another graph: that graph's
    /// template node for each node of this one.
    exec_nodes: Arc<HashMap<usize, usize>>,
    /// Launches that loaded its parameters into the shared executable.
    loads: AtomicU64,
    /// It launches another graph's executable.
    follows: bool,
    /// The captured template, while rebinding may need it (always, once
    /// the executable is shared: loading reads it).
    template: Option<Arc<Template>>,
    inner: Arc<Inner>,
    /// The kernel nodes rebinding plans patch, shared between the plans.
    rebound_nodes: rebind::NodeTable,
    made: Made,
    /// Its nodes as the template held them (for the DOT export).
    nodes: Nodes,
}

// SAFETY: the executable and the node handles may be used from any
// thread; see `Exec`.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Its captured template, while kept.
    pub(super) fn template(&self) -> Option<sys::CUgraph> {
        self.template.as_ref().map(|t| t.graph)
    }

    fn target(&self) -> Target {
        Target {
            exec: self.exec.clone(),
            id: self.id,
            exec_nodes: self.exec_nodes.clone(),
        }
    }

    /// Loads its template's parameters into the shared executable (the
    /// caller holds the executable's lock).
    fn load(&self, loaded: &mut u64) -> Result<()> {
        let template = self.template.as_ref().ok_or_else(rebind::no_template)?;
        update(&self.exec, template.graph).map_err(|why| {
            crate::error::Error::Internal(format!(
                "loading a bucket's graph into the executable it shares failed: {why}"
            ))
        })?;
        *loaded = self.id;
        self.loads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// `cuGraphExecUpdate_v2` of `exec` with `graph`; the driver's reason on
/// failure.
fn update(exec: &Exec, graph: sys::CUgraph) -> std::result::Result<(), String> {
    let _ctx = exec.bind().map_err(|e| e.to_string())?;
    // SAFETY: the struct holds an enum whose zero is SUCCESS and two
    // node handles, for which zero (NULL) is valid.
    let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
    // SAFETY: a live executable and a live graph of the same context;
    // the caller holds the executable's lock, so no launch or patch of it
    // runs meanwhile. Launches already enqueued are not affected.
    let r = unsafe { sys::cuGraphExecUpdate_v2(exec.raw, graph, &mut info) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        _ => Err(format!(
            "cuGraphExecUpdate returned {} ({:?})",
            error_name(r),
            info.result
        )),
    }
}

/// The nodes of `graph`, in the driver's order (the order of capture).
fn graph_nodes(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNode>> {
    let mut n = 0usize;
    // SAFETY: a live graph; NULL nodes asks for the count.
    check("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, null_mut(), &mut n)
    })?;
    let mut nodes = vec![null_mut(); n];
    if n > 0 {
        // SAFETY: room for `n` nodes.
        check("cuGraphGetNodes", unsafe {
            sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n)
        })?;
    }
    nodes.truncate(n);
    Ok(nodes)
}

/// The type of `node`, as the integer the driver writes.
pub(super) fn node_type(node: sys::CUgraphNode) -> Result<u32> {
    let mut ty: u32 = 0;
    // SAFETY: a node of a live graph; the driver writes one
    // CUgraphNodeType, a 32-bit enum, read as a u32 so that types newer
    // than cudarc's enum stay defined values.
    check("cuGraphNodeGetType", unsafe {
        sys::cuGraphNodeGetType(node, (&mut ty as *mut u32).cast())
    })?;
    Ok(ty)
}

/// Whether two node lists are the same graph shape: node types and
/// dependencies, index by index.
fn same_shape(a: &Nodes, b: &Nodes) -> bool {
    a.note.is_none()
        && b.note.is_none()
        && a.edges == b.edges
        && a.nodes.len() == b.nodes.len()
        && a.nodes.iter().zip(&b.nodes).all(|(x, y)| x.kind == y.kind)
}

impl Graph for CudaGraph {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn launch(&self, stream: StreamRef) -> Result<()> {
        let launch = || {
            // SAFETY: a live instantiated graph; the stream is the caller's.
            check("cuGraphLaunch", unsafe {
                sys::cuGraphLaunch(self.exec.raw, stream.0 as sys::CUstream)
            })
        };
        if !self.exec.is_shared() {
            return launch();
        }
        // Loaded and launched under the lock: no other graph loads its
        // parameters between the two.
        let mut loaded = self.exec.lock();
        if *loaded != self.id {
            self.load(&mut loaded)?;
        }
        launch()
    }

    fn made(&self) -> Made {
        self.made
    }

    fn rebinder(&self, base: DevPtr, bytes: usize) -> Result<RebindPlan> {
        let template = self.template.as_ref().ok_or_else(rebind::no_template)?;
        rebind::plan(
            template,
            self.target(),
            &self.inner,
            &self.rebound_nodes,
            base,
            bytes,
        )
    }

    fn nodes(&self) -> Nodes {
        self.nodes.clone()
    }

    fn release_template(&mut self) -> bool {
        // A shared executable is loaded from the template of whichever
        // graph launches.
        if self.exec.is_shared() {
            return self.template.is_some();
        }
        self.template
            .take()
            .is_some_and(|t| Arc::strong_count(&t) > 1)
    }

    fn share_executable_of(&mut self, leader: &dyn Graph) -> Result<bool> {
        let Some(leader) = leader.as_any().downcast_ref::<CudaGraph>() else {
            return Ok(false);
        };
        if Arc::ptr_eq(&self.exec, &leader.exec) {
            return Ok(true);
        }
        // Only the owner of an executable leads (its nodes name the
        // executable's), and only a graph of the same shape follows:
        // the node lists pair index by index, as the driver pairs them.
        let (Some(mine), Some(theirs)) = (self.template.clone(), leader.template.clone()) else {
            return Ok(false);
        };
        if leader.follows || !same_shape(&self.nodes, &leader.nodes) {
            return Ok(false);
        }
        let (own, origin) = (graph_nodes(mine.graph)?, graph_nodes(theirs.graph)?);
        if own.len() != origin.len() {
            return Ok(false);
        }
        for (a, b) in own.iter().zip(&origin) {
            if node_type(*a)? != node_type(*b)? {
                return Ok(false);
            }
        }
        let exec = leader.exec.clone();
        let mut loaded = exec.lock();
        if update(&exec, mine.graph).is_err() {
            // The driver refused (a change it cannot make in place): the
            // executable is put back to what it held, or marked unknown
            // so that the next launch loads.
            *loaded = match *loaded == leader.id && update(&exec, theirs.graph).is_ok() {
                true => leader.id,
                false => 0,
            };
            if *loaded == 0 && !exec.is_shared() {
                return Err(crate::error::Error::Internal(
                    "an executable graph could not be put back after a refused update".into(),
                ));
            }
            return Ok(false);
        }
        *loaded = self.id;
        exec.share(theirs);
        drop(loaded);
        self.exec_nodes = Arc::new(
            own.iter()
                .zip(&origin)
                .map(|(&a, &b)| (a as usize, b as usize))
                .collect(),
        );
        // Its own executable goes with the last reference to it.
        self.exec = exec;
        self.follows = true;
        Ok(true)
    }

    fn shares_executable(&self) -> bool {
        self.follows
    }

    fn executable_loads(&self) -> u64 {
        self.loads.load(Ordering::Relaxed)
    }
}

/// The capture status of `s` (0: the legacy default stream).
pub(super) fn capture_status(s: StreamRef) -> Result<sys::CUstreamCaptureStatus> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's stream and a valid out pointer.
    check("cuStreamIsCapturing", unsafe {
        sys::cuStreamIsCapturing(s.0 as sys::CUstream, &mut status)
    })?;
    Ok(status)
}

/// What an error of `cuStreamEndCapture` means for the capture it ended.
fn why_invalidated(r: sys::CUresult) -> &'static str {
    use sys::CUresult as R;
    match r {
        R::CUDA_ERROR_STREAM_CAPTURE_UNJOINED => {
            "work forked from the capture onto another stream was not joined back into the capturing \
             stream (record an event on that stream and wait for it on the capturing stream before the \
             callback returns)"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => {
            "an operation that cannot be captured was called under capture (a synchronous copy or \
             allocation, a query of the stream, a library call that is not capturable)"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => {
            "work on the legacy default stream, which synchronizes implicitly with the capturing stream"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_ISOLATION => {
            "the capture waited for an event recorded outside it, or another stream waited for an \
             event recorded inside it"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD => {
            "the capture was ended on another thread than the one that began it"
        }
        R::CUDA_ERROR_CAPTURED_EVENT => {
            "an event recorded under capture was queried or synchronized"
        }
        _ => {
            "the capture was invalidated by an operation that is not allowed under capture (a host \
             synchronisation, an allocation outside the graph's pool, work on another stream)"
        }
    }
}

/// Ends the capture on `s`: a valid capture is instantiated and uploaded
/// (see `Backend::end_capture`).
pub(super) fn end_capture(inner: &Arc<Inner>, s: StreamRef) -> Result<CaptureEnd> {
    let mut graph: sys::CUgraph = null_mut();
    // SAFETY: the stream is capturing (begun by begin_capture).
    let r = unsafe { sys::cuStreamEndCapture(s.0 as sys::CUstream, &mut graph) };
    if r != sys::CUresult::CUDA_SUCCESS {
        if !graph.is_null() {
            // SAFETY: a graph returned with an error is still ours to destroy.
            unsafe { sys::cuGraphDestroy(graph) };
        }
        return Ok(CaptureEnd::Invalidated(format!(
            "cuStreamEndCapture returned {}: {}",
            error_name(r),
            why_invalidated(r)
        )));
    }
    let mut exec: sys::CUgraphExec = null_mut();
    let started = std::time::Instant::now();
    // SAFETY: graph is a valid captured graph; exec a valid out pointer.
    let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
    if let Err(e) = check("cuGraphInstantiateWithFlags", r) {
        // SAFETY: the template is ours and nothing refers to it.
        unsafe { sys::cuGraphDestroy(graph) };
        return Err(e);
    }
    let instantiated = std::time::Instant::now();
    // The template stays with the executable until the orchestration
    // knows that no rebinding plan needs it.
    let template = Arc::new(Template {
        graph,
        inner: inner.clone(),
    });
    let id = next_id();
    let mut g = CudaGraph {
        exec: Arc::new(Exec::new(exec, inner.clone(), id)),
        id,
        exec_nodes: Default::default(),
        loads: AtomicU64::new(0),
        follows: false,
        template: Some(template),
        inner: inner.clone(),
        rebound_nodes: Default::default(),
        made: Made::default(),
        nodes: Nodes::default(),
    };
    // SAFETY: exec is live; uploading prepares its first launch.
    check("cuGraphUpload", unsafe {
        sys::cuGraphUpload(exec, s.0 as sys::CUstream)
    })?;
    g.made = Made {
        instantiate: instantiated - started,
        upload: instantiated.elapsed(),
    };
    // Read while the template is sure to be there (it may be released
    // after capture).
    g.nodes = describe::describe(graph);
    Ok(CaptureEnd::Graph(Box::new(g)))
}
