//! Captured graphs: a capture ended, instantiated and uploaded into an
//! executable (`CudaGraph`) with the list of its nodes (`describe`),
//! launched, planned for rebinding while its template is kept, and
//! destroyed with failures reported as teardown errors; and the capture
//! status of a stream.

use super::describe;
use super::device::Inner;
use super::driver::{check, error_name};
use super::rebind::{self, Template};
use crate::backend::accounting::GraphMark;
use crate::backend::{teardown, CaptureEnd, DevPtr, Graph, Made, RebindPlan, StreamRef};
use crate::core::dot::Nodes;
use crate::error::Result;
use cudarc::driver::sys;
use std::ptr::null_mut;
use std::sync::Arc;

/// An instantiated, uploaded graph and, until released, its template.
pub(super) struct CudaGraph {
    exec: sys::CUgraphExec,
    /// The captured template, while rebinding may need it.
    template: Option<Arc<Template>>,
    inner: Arc<Inner>,
    /// The kernel nodes rebinding plans patch, shared between the plans.
    rebound_nodes: rebind::NodeTable,
    made: Made,
    /// Its nodes as the template held them (for the DOT export).
    nodes: Nodes,
    /// Counted as a graph executable of the process while it lives.
    _mark: GraphMark,
}

// SAFETY: a CUgraphExec may be launched and destroyed from any thread.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Its captured template, while kept.
    pub(super) fn template(&self) -> Option<sys::CUgraph> {
        self.template.as_ref().map(|t| t.graph)
    }
}

impl Graph for CudaGraph {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn launch(&self, stream: StreamRef) -> Result<()> {
        // SAFETY: exec is a live instantiated graph; the stream is the caller's.
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, stream.0 as sys::CUstream)
        })
    }

    fn made(&self) -> Made {
        self.made
    }

    fn rebinder(&self, base: DevPtr, bytes: usize) -> Result<RebindPlan> {
        let template = self.template.as_ref().ok_or_else(rebind::no_template)?;
        rebind::plan(
            template,
            self.exec,
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
        self.template
            .take()
            .is_some_and(|t| Arc::strong_count(&t) > 1)
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let _g = self.inner.bind();
        // SAFETY: destroyed exactly once; callers synchronize before dropping.
        let r = unsafe { sys::cuGraphExecDestroy(self.exec) };
        teardown::check(
            "destroying an executable graph",
            check("cuGraphExecDestroy", r),
        );
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
            "cuStreamEndCapture returned {} (something enqueued under capture was not capturable: \
             a synchronize, a plain allocation, or work on another stream that was not joined back)",
            error_name(r)
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
    let mut g = CudaGraph {
        exec,
        template: Some(template),
        inner: inner.clone(),
        rebound_nodes: Default::default(),
        made: Made::default(),
        nodes: Nodes::default(),
        _mark: GraphMark::new(),
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
