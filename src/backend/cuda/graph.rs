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
