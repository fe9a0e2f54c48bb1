//! The host backend: an emulation of the CUDA model for machines without a
//! GPU. "Device" memory is host memory; a stream is a task queue that runs
//! each task as it is enqueued, unless the stream is capturing, in which
//! case the task is recorded; a graph is the recorded list, and launching it
//! runs the tasks again on the same addresses. Static-buffer semantics are
//! the same as on a GPU, so the aliasing hazard and its fix show on a CPU.
//!
//! Streams are registered in the handle table (the ids callbacks see as
//! their stream). User work is enqueued with [`enqueue`]; [`synchronize`]
//! under capture invalidates the capture, as a device synchronize does
//! under CUDA's global capture mode.
//!
//! This file holds [`HostBackend`], which wires the [`Backend`] trait to the
//! parts: `task` (the unit of work and how it runs), `memory`
//! (allocations), `stream` (streams and capture state), `graph` (recorded
//! graphs and their launch) and `rebind` (moving a graph's references).

mod graph;
mod memory;
mod rebind;
mod stream;
mod task;

pub use memory::inject_free_failures;
pub use stream::{
    check_stream, enqueue, enqueue_kernel, invalidate, synchronize, take_fault, HostStream,
};
pub use task::{HostKernel, HostTask};

use super::{
    AccItem, Backend, BackendKind, CaptureEnd, CaptureMode, Choice, ContextGuard, DevPtr, EventRef,
    Graph, IndexedCopy, Rows2d, StreamRef, Tail,
};
use crate::core::dtype::DType;
use crate::error::{Error, Result};
use memory::HostMemory;
use std::sync::Arc;
use stream::submit;
use task::Task;

/// The host backend. One per session; allocations are tracked so that a
/// free of an unknown address is caught.
#[derive(Default)]
pub struct HostBackend {
    memory: HostMemory,
}

impl HostBackend {
    pub fn new() -> Arc<HostBackend> {
        Arc::new(HostBackend::default())
    }
}

impl Backend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn ordinal(&self) -> i32 {
        0
    }

    fn bind(&self) -> Result<ContextGuard> {
        Ok(ContextGuard::none())
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        self.memory.alloc(bytes)
    }

    fn free(&self, ptr: DevPtr) -> Result<()> {
        self.memory.free(ptr)
    }

    fn alloc_async(&self, bytes: usize, _stream: StreamRef) -> Result<DevPtr> {
        self.alloc(bytes)
    }

    fn free_async(&self, ptr: DevPtr, _stream: StreamRef) -> Result<()> {
        self.free(ptr)
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize, stream: StreamRef) -> Result<()> {
        submit(
            stream,
            Task::Copy {
                dst: dst as usize,
                src: src as usize,
                bytes,
            },
        )
    }

    fn fill(
        &self,
        dst: DevPtr,
        pattern: u32,
        elem: usize,
        count: usize,
        stream: StreamRef,
    ) -> Result<()> {
        if !matches!(elem, 1 | 2 | 4) {
            return Err(Error::Internal(format!("fill with {elem}-byte elements")));
        }
        let dst = dst as usize;
        submit(
            stream,
            Task::Fill {
                dst,
                pattern,
                elem,
                count,
            },
        )
    }

    fn loops(&self) -> Option<String> {
        None
    }

    fn capture_loop(
        &self,
        stream: StreamRef,
        state: DevPtr,
        skip: Option<(DevPtr, DevPtr)>,
        _mode: CaptureMode,
        body: &mut dyn FnMut(StreamRef) -> Result<()>,
    ) -> Result<()> {
        if !stream::is_capturing(stream)? {
            return Err(Error::state(
                "a loop is recorded only into an active capture",
            ));
        }
        // The body is recorded on a stream of its own, as on CUDA.
        let ls = stream::create();
        let ran = stream::begin_capture(ls).and_then(|_| body(ls));
        let ended = stream::end_capture(ls);
        stream::destroy(ls)?;
        ran?;
        let tasks = ended?.map_err(Error::IllegalUnderCapture)?;
        no_conditional_inside(&tasks, "a loop's body")?;
        let state = state as usize;
        submit(
            stream,
            Task::Loop {
                body: Arc::new(tasks),
                state,
                skip: skip.map(|(f, c)| (f as usize, c as usize)),
            },
        )
    }

    fn capture_unless(
        &self,
        stream: StreamRef,
        flag: DevPtr,
        counter: DevPtr,
        _mode: CaptureMode,
        body: &mut dyn FnMut(StreamRef) -> Result<()>,
    ) -> Result<()> {
        if !stream::is_capturing(stream)? {
            return Err(Error::state(
                "a condition is recorded only into an active capture",
            ));
        }
        // The body is recorded on a stream of its own, as on CUDA.
        let cs = stream::create();
        let ran = stream::begin_capture(cs).and_then(|_| body(cs));
        let ended = stream::end_capture(cs);
        stream::destroy(cs)?;
        ran?;
        let tasks = ended?.map_err(Error::IllegalUnderCapture)?;
        no_conditional_inside(&tasks, "a condition's body")?;
        submit(
            stream,
            Task::Unless {
                body: Arc::new(tasks),
                flag: flag as usize,
                counter: counter as usize,
            },
        )
    }

    fn upload_async(&self, dst: DevPtr, src: &[u8], stream: StreamRef) -> Result<()> {
        if stream::is_capturing(stream)? {
            return Err(Error::state("an upload is not recorded into a capture"));
        }
        // Stream work runs as it is enqueued.
        memory::upload(dst, src)
    }

    // Work has run when it was enqueued.
    fn event_synchronize(&self, _event: EventRef) -> Result<()> {
        Ok(())
    }

    fn switches(&self) -> Option<String> {
        None
    }

    fn capture_switch(
        &self,
        stream: StreamRef,
        choice: Choice,
        bodies: &[&dyn Graph],
        zeros: &[(DevPtr, usize)],
    ) -> Result<()> {
        if !stream::is_capturing(stream)? {
            return Err(Error::state(
                "a choice is recorded only into an active capture",
            ));
        }
        let bodies = bodies
            .iter()
            .map(|g| {
                g.as_any()
                    .downcast_ref::<graph::HostGraph>()
                    .map(graph::HostGraph::snapshot)
                    .ok_or_else(|| Error::Internal("a body of another backend".into()))
            })
            .collect::<Result<Vec<_>>>()?;
        submit(
            stream,
            Task::Switch {
                bodies: Arc::new(bodies),
                size: choice.size as usize,
                table: choice.table as usize,
                overflows: choice.overflows as usize,
                zeros: Arc::new(zeros.iter().map(|&(p, n)| (p as usize, n)).collect()),
            },
        )
    }

    fn zero_tail(&self, t: Tail, stream: StreamRef) -> Result<()> {
        submit(
            stream,
            Task::ZeroTail {
                dst: t.dst as usize,
                row: t.row,
                size: t.size as usize,
                bytes: t.bytes,
            },
        )
    }

    fn copy_indexed(&self, c: IndexedCopy, stream: StreamRef) -> Result<()> {
        let task = Task::CopyIndexed {
            dst: c.dst as usize,
            dst_stride: c.dst_stride,
            src: c.src as usize,
            src_stride: c.src_stride,
            bytes: c.bytes,
            index: c.index as usize,
        };
        submit(stream, task)
    }

    fn copy_2d(&self, r: Rows2d, stream: StreamRef) -> Result<()> {
        if r.src == 0 {
            return Err(Error::Internal("a 2d copy from NULL".into()));
        }
        submit(stream, rows_task(r, r.src as usize))
    }

    fn zero_2d(&self, r: Rows2d, stream: StreamRef) -> Result<()> {
        submit(stream, rows_task(r, 0))
    }

    fn zero(&self, dst: DevPtr, bytes: usize, stream: StreamRef) -> Result<()> {
        submit(
            stream,
            Task::Zero {
                dst: dst as usize,
                bytes,
            },
        )
    }

    fn accumulate(&self, items: &[AccItem], dtype: DType, stream: StreamRef) -> Result<()> {
        if !dtype.accumulable() {
            return Err(Error::invalid(format!(
                "cannot accumulate {}",
                dtype.name()
            )));
        }
        for it in items {
            submit(
                stream,
                Task::Accumulate {
                    dst: it.dst as usize,
                    src: it.src as usize,
                    count: it.count,
                    dtype,
                },
            )?;
        }
        Ok(())
    }

    fn differ(
        &self,
        a: DevPtr,
        b: DevPtr,
        bytes: usize,
        flag: DevPtr,
        stream: StreamRef,
    ) -> Result<()> {
        submit(
            stream,
            Task::Differ {
                a: a as usize,
                b: b as usize,
                bytes,
                flag: flag as usize,
            },
        )
    }

    fn prepare_kernels(&self) -> Result<()> {
        Ok(())
    }

    fn create_stream(&self) -> Result<StreamRef> {
        Ok(stream::create())
    }

    fn destroy_stream(&self, s: StreamRef) -> Result<()> {
        stream::destroy(s)
    }

    // Host work runs as it is enqueued: events and waits have nothing to order.
    fn create_event(&self) -> Result<EventRef> {
        Ok(EventRef(0))
    }

    fn destroy_event(&self, _e: EventRef) -> Result<()> {
        Ok(())
    }

    fn record(&self, _event: EventRef, _stream: StreamRef) -> Result<()> {
        Ok(())
    }

    fn wait(&self, _stream: StreamRef, _event: EventRef) -> Result<()> {
        Ok(())
    }

    // Work has run; a host kernel's fault is reported here, as CUDA's
    // stream synchronize reports a kernel's.
    fn synchronize(&self, s: StreamRef) -> Result<()> {
        stream::take_fault(s)
    }

    fn synchronize_all(&self) -> Result<()> {
        Ok(())
    }

    fn begin_capture(&self, s: StreamRef, _mode: CaptureMode) -> Result<()> {
        stream::begin_capture(s)
    }

    fn end_capture(&self, s: StreamRef) -> Result<CaptureEnd> {
        graph::end_capture(s)
    }

    fn is_capturing(&self, s: StreamRef) -> Result<bool> {
        stream::is_capturing(s)
    }

    fn capture_invalidated(&self, s: StreamRef) -> Result<bool> {
        stream::capture_invalidated(s)
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        Err(Error::Unsupported(
            "the host backend has no device memory figure".into(),
        ))
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        memory::upload(dst, src)
    }

    fn download(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        memory::download(dst, src)
    }
}

/// The task of a 2d copy from `src` (0: a zeroing).
fn rows_task(r: Rows2d, src: usize) -> Task {
    Task::Rows2d {
        dst: r.dst as usize,
        dst_pitch: r.dst_pitch,
        src,
        src_pitch: r.src_pitch,
        width: r.width,
        rows: r.rows,
    }
}

/// Refuses a conditional node (a loop, a condition, a choice) recorded
/// inside the body `what` of another, as CUDA does: graphed adds a body it
/// captured as a child graph, and `cuGraphAddChildGraphNode` refuses a
/// graph holding conditional nodes.
fn no_conditional_inside(tasks: &[Task], what: &str) -> Result<()> {
    let nested = tasks.iter().find_map(|t| match t {
        Task::Loop { .. } => Some("a loop"),
        Task::Unless { .. } => Some("a condition"),
        Task::Switch { .. } => Some("a choice of buckets"),
        _ => None,
    });
    match nested {
        Some(n) => Err(Error::Unsupported(format!(
            "{n} recorded inside {what}: a conditional node's body is added as a child graph, \
             and CUDA refuses a child graph holding conditional nodes"
        ))),
        None => Ok(()),
    }
}
