//! Loops inside a graph: a conditional WHILE node (CUDA 12.4 and later)
//! whose body is captured once and runs while the microbatch index at
//! `state[0]` is below the count at `state[1]`; and buckets chosen inside
//! a graph: a kernel picks the bucket for a conditional SWITCH node (CUDA
//! 12.8 and later) whose bodies are copies of the buckets' graphs. The loop's kernels
//! (scripts/gen_ptx.py, loops.ptx) are loaded on first use, apart from the
//! others: the step kernel calls the device runtime's
//! `cudaGraphSetConditional`, which a driver before 12.4 cannot link. The
//! conditional-node entry points are newer than the bindings graphed builds
//! with (cudarc's CUDA 12.0 set), so they are looked up here by name.

use super::driver::{check, driver_version};
use crate::backend::{CaptureMode, Choice, DevPtr, StreamRef};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::ptr::null_mut;

/// The loop kernels, NUL-terminated for cuModuleLoadData.
static LOOPS_PTX: &str = concat!(include_str!("loops.ptx"), "\0");

/// `cuGraphConditionalHandleCreate`.
type HandleCreate =
    unsafe extern "C" fn(*mut u64, sys::CUgraph, sys::CUcontext, u32, u32) -> sys::CUresult;
/// `cuGraphAddNode` (the CUDA 12.2 signature, without edge data).
type AddNode = unsafe extern "C" fn(
    *mut sys::CUgraphNode,
    sys::CUgraph,
    *const sys::CUgraphNode,
    usize,
    *mut NodeParams,
) -> sys::CUresult;

/// `CUDA_CONDITIONAL_NODE_PARAMS`.
#[repr(C)]
struct ConditionalParams {
    handle: u64,
    kind: u32,
    size: u32,
    graphs_out: *mut sys::CUgraph,
    ctx: sys::CUcontext,
}

/// `CUgraphNodeParams` holding a conditional node's parameters: the type,
/// reserved words, the 232-byte union, a reserved word (256 bytes).
#[repr(C)]
struct NodeParams {
    kind: u32,
    reserved0: [i32; 3],
    conditional: ConditionalParams,
    rest_of_union: [i64; 25],
    reserved2: i64,
}

const NODE_TYPE_CONDITIONAL: u32 = 13;
/// CUgraphNodeType values of memory allocation and free nodes.
const NODE_MEM_ALLOC: u32 = 10;
const NODE_MEM_FREE: u32 = 11;
const CONDITIONAL_IF: u32 = 0;
const CONDITIONAL_WHILE: u32 = 1;
const CONDITIONAL_SWITCH: u32 = 2;
/// The first CUDA version with conditional SWITCH nodes.
pub(super) const NEEDS_SWITCH: i32 = 12080;
/// The handle's value is reset to its default at every launch.
const ASSIGN_DEFAULT: u32 = 1;
/// The first CUDA version with conditional WHILE nodes that kernels set.
const NEEDS: i32 = 12040;

/// The loop kernels and entry points of one device.
pub(super) struct Loops {
    pub module: sys::CUmodule,
    copy_indexed: sys::CUfunction,
    next: sys::CUfunction,
    select: sys::CUfunction,
    unless: sys::CUfunction,
    handle_create: HandleCreate,
    add_node: AddNode,
}

/// Looks an entry point up by name.
fn symbol<T: Copy>(name: &str) -> Result<T> {
    // SAFETY: the driver is loaded (a device is open); `get` only looks
    // the symbol up, and T is the function type its CUDA header declares.
    let lib = unsafe { sys::culib() };
    // SAFETY: as above.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|f| *f)
        .map_err(|_| Error::Unsupported(format!("the CUDA driver has no {name}")))
}

/// Loads the loop kernels and entry points (the context is bound); an
/// Unsupported error says why a driver cannot loop.
pub(super) fn load_loops() -> Result<Loops> {
    let v = driver_version()?;
    if v < NEEDS {
        return Err(Error::Unsupported(format!(
            "looping over microbatches in one graph needs conditional graph nodes (CUDA 12.4 or newer); \
             this driver is CUDA {}.{}",
            v / 1000,
            (v % 1000) / 10
        )));
    }
    let handle_create = symbol::<HandleCreate>("cuGraphConditionalHandleCreate")?;
    let add_node = symbol::<AddNode>("cuGraphAddNode")?;
    let mut module: sys::CUmodule = null_mut();
    // SAFETY: the image is a NUL-terminated PTX string; the context is bound.
    check("cuModuleLoadData(loop kernels)", unsafe {
        sys::cuModuleLoadData(&mut module, LOOPS_PTX.as_ptr().cast())
    })?;
    let get = |name: &'static [u8]| -> Result<sys::CUfunction> {
        let mut f: sys::CUfunction = null_mut();
        // SAFETY: the module is loaded; `name` is NUL-terminated.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut f, module, name.as_ptr().cast())
        })?;
        Ok(f)
    };
    let found = get(b"graphed_copy_indexed\0").and_then(|copy_indexed| {
        Ok(Loops {
            module,
            copy_indexed,
            next: get(b"graphed_loop_next\0")?,
            select: get(b"graphed_bucket_select\0")?,
            unless: get(b"graphed_skip_select\0")?,
            handle_create,
            add_node,
        })
    });
    match found {
        Ok(l) => Ok(l),
        Err(e) => {
            // SAFETY: loaded above, not used after this.
            unsafe { sys::cuModuleUnload(module) };
            Err(e)
        }
    }
}

/// Launches `f` with `args` (u64 parameters, passed by address) on one
/// grid of `blocks` x 256 threads.
///
/// # Safety
/// `f` takes exactly these u64 parameters, and the memory they name holds
/// what the kernel reads and writes.
unsafe fn launch(
    f: sys::CUfunction,
    args: &mut [u64],
    blocks: u32,
    stream: StreamRef,
) -> Result<()> {
    let mut params: Vec<*mut c_void> = args.iter_mut().map(|a| (a as *mut u64).cast()).collect();
    // SAFETY: per this function's contract.
    check("cuLaunchKernel(loop kernel)", unsafe {
        sys::cuLaunchKernel(
            f,
            blocks,
            1,
            1,
            256,
            1,
            1,
            0,
            stream.0 as sys::CUstream,
            params.as_mut_ptr(),
            null_mut(),
        )
    })
}

impl Loops {
    /// Copies `bytes` from `src + i * src_stride` to `dst + i * dst_stride`,
    /// i the u32 at `index` when the copy runs.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_indexed(
        &self,
        sm_count: u32,
        dst: DevPtr,
        dst_stride: usize,
        src: DevPtr,
        src_stride: usize,
        bytes: usize,
        index: DevPtr,
        stream: StreamRef,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let blocks = (bytes / 16).div_ceil(256).clamp(1, sm_count as usize * 8) as u32;
        let mut args = [
            dst,
            dst_stride as u64,
            src,
            src_stride as u64,
            bytes as u64,
            index,
        ];
        // SAFETY: the kernel takes these six u64; the caller's regions hold
        // `bytes` at every index the loop reaches, and `index` a u32.
        unsafe { launch(self.copy_indexed, &mut args, blocks, stream) }
    }

    /// A conditional handle in the graph the capture on `stream` records
    /// into, set to `default` at each launch of that graph.
    fn handle(&self, ctx: sys::CUcontext, stream: StreamRef, default: u32) -> Result<u64> {
        let (graph, _, _) = capture_info(stream)?;
        let mut handle = 0u64;
        // SAFETY: the capture's graph, our bound context, a valid out pointer.
        check("cuGraphConditionalHandleCreate", unsafe {
            (self.handle_create)(&mut handle, graph, ctx, default, ASSIGN_DEFAULT)
        })?;
        Ok(handle)
    }

    /// Adds a conditional node of `kind` with `size` bodies on `handle` to
    /// the capture running on `stream`, after what it captured so far, and
    /// makes the capture go on after the node; returns its body graphs
    /// (owned by the node).
    fn add_conditional(
        &self,
        ctx: sys::CUcontext,
        stream: StreamRef,
        handle: u64,
        (kind, size): (u32, u32),
    ) -> Result<Vec<sys::CUgraph>> {
        let (graph, deps, ndeps) = capture_info(stream)?;
        let mut p = NodeParams {
            kind: NODE_TYPE_CONDITIONAL,
            reserved0: [0; 3],
            conditional: ConditionalParams {
                handle,
                kind,
                size,
                graphs_out: null_mut(),
                ctx,
            },
            rest_of_union: [0; 25],
            reserved2: 0,
        };
        let mut node: sys::CUgraphNode = null_mut();
        // SAFETY: the capture's graph and its current dependencies (read
        // just above, nothing captured since); params laid out as the
        // driver's CUgraphNodeParams.
        check("cuGraphAddNode(conditional)", unsafe {
            (self.add_node)(&mut node, graph, deps, ndeps, &mut p)
        })?;
        if p.conditional.graphs_out.is_null() {
            return Err(Error::Internal(
                "a conditional node came without body graphs".into(),
            ));
        }
        // SAFETY: the driver filled `size` body graphs.
        let bodies = unsafe { std::slice::from_raw_parts(p.conditional.graphs_out, size as usize) };
        let bodies = bodies.to_vec();
        // SAFETY: a node of the capture's graph.
        check("cuStreamUpdateCaptureDependencies", unsafe {
            sys::cuStreamUpdateCaptureDependencies(
                stream.0 as sys::CUstream,
                &mut node,
                1,
                sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES
                    as u32,
            )
        })?;
        Ok(bodies)
    }

    /// Records, into the capture running on `stream`, the bucket choice
    /// kernel and a SWITCH node after it whose body i is a copy of graph
    /// `bodies[i]`, and whose body n (the value the kernel sets when no
    /// bucket holds the size) zeroes the ranges of `zeros` with memset
    /// nodes (see `Backend::capture_switch`); the capture goes on after the
    /// node. `ctx` is the device's context, bound.
    pub fn capture_switch(
        &self,
        ctx: sys::CUcontext,
        stream: StreamRef,
        choice: Choice,
        bodies: &[sys::CUgraph],
        zeros: &[(DevPtr, usize)],
    ) -> Result<()> {
        let v = driver_version()?;
        if v < NEEDS_SWITCH {
            return Err(switch_unsupported(v));
        }
        let n = bodies.len() as u32;
        // The kernel sets n for a size no bucket holds: body n zeroes what
        // the bodies write (none without ranges to zero).
        let size = n + u32::from(!zeros.is_empty());
        let handle = self.handle(ctx, stream, n)?;
        let mut args = [
            choice.size,
            choice.table,
            n as u64,
            choice.overflows,
            handle,
        ];
        // SAFETY: the kernel takes these five u64; `size` and `overflows`
        // are u64s and `table` holds n of them; one thread acts.
        unsafe { launch(self.select, &mut args, 1, stream) }?;
        let targets = self.add_conditional(ctx, stream, handle, (CONDITIONAL_SWITCH, size))?;
        for (i, (&body, &target)) in bodies.iter().zip(&targets).enumerate() {
            let mut child: sys::CUgraphNode = null_mut();
            // SAFETY: a body graph of the node and a live template (cloned
            // into the child node).
            check("cuGraphAddChildGraphNode(switch body)", unsafe {
                sys::cuGraphAddChildGraphNode(&mut child, target, std::ptr::null(), 0, body)
            })
            .map_err(|e| {
                refused(
                    e,
                    &format!("bucket {i}'s graph as a SWITCH node's body"),
                    body,
                )
            })?;
        }
        if let Some(&none) = targets.get(n as usize) {
            for &(dst, bytes) in zeros {
                let p = sys::CUDA_MEMSET_NODE_PARAMS {
                    dst,
                    pitch: 0,
                    value: 0,
                    elementSize: 1,
                    width: bytes,
                    height: 1,
                };
                let mut node: sys::CUgraphNode = null_mut();
                // SAFETY: the SWITCH node's body graph for no bucket, a 1D
                // memset of `bytes` at `dst` (device memory of the
                // session's static allocation), our bound context.
                check("cuGraphAddMemsetNode(no bucket's zeros)", unsafe {
                    sys::cuGraphAddMemsetNode(&mut node, none, std::ptr::null(), 0, &p, ctx)
                })?;
            }
        }
        Ok(())
    }

    /// Records, into the capture running on `stream`, a WHILE node whose
    /// body `body` records (into the stream it is given) and ends with the
    /// loop's step kernel on `state`; the capture goes on after the node.
    /// The body always runs once: the node's value is 1 at each launch;
    /// with `skip` (flag, counter), the skip kernel before the node sets
    /// that value instead (0, and the counter incremented, when the u32 at
    /// flag is not 0), in the same graph, so that no conditional node is
    /// nested in another's body. `ctx` is the device's context, bound.
    pub fn capture(
        &self,
        ctx: sys::CUcontext,
        stream: StreamRef,
        (state, skip): (DevPtr, Option<(DevPtr, DevPtr)>),
        mode: CaptureMode,
        body: &mut dyn FnMut(StreamRef) -> Result<()>,
    ) -> Result<()> {
        let handle = self.handle(ctx, stream, u32::from(skip.is_none()))?;
        if let Some((flag, counter)) = skip {
            let mut args = [flag, counter, handle];
            // SAFETY: the kernel takes these three u64; `flag` is a u32 and
            // `counter` a u64 of device memory; one thread acts.
            unsafe { launch(self.unless, &mut args, 1, stream) }?;
        }
        let bodies = self.add_conditional(ctx, stream, handle, (CONDITIONAL_WHILE, 1))?;
        let body_graph = bodies[0];
        let next = self.next;
        let mut tail = move |ls: StreamRef| {
            let mut args = [state, handle];
            // SAFETY: the step kernel takes (state, handle); state holds two u32.
            unsafe { launch(next, &mut args, 1, ls) }
        };
        self.capture_body(
            body_graph,
            mode,
            body,
            &mut tail,
            "the loop's body as a WHILE node's body",
        )
    }

    /// Records, into the capture running on `stream`, the skip kernel and
    /// an IF node after it whose body `body` records (into the stream it is
    /// given): the body runs when the u32 at `flag` is 0; otherwise the
    /// kernel increments the u64 at `counter` (see
    /// `Backend::capture_unless`). The handle is 0 at each launch, so that
    /// nothing runs unless the kernel said so. `ctx` is the device's
    /// context, bound.
    pub fn capture_unless(
        &self,
        ctx: sys::CUcontext,
        stream: StreamRef,
        flag: DevPtr,
        counter: DevPtr,
        mode: CaptureMode,
        body: &mut dyn FnMut(StreamRef) -> Result<()>,
    ) -> Result<()> {
        let handle = self.handle(ctx, stream, 0)?;
        let mut args = [flag, counter, handle];
        // SAFETY: the kernel takes these three u64; `flag` is a u32 and
        // `counter` a u64 of device memory; one thread acts.
        unsafe { launch(self.unless, &mut args, 1, stream) }?;
        let bodies = self.add_conditional(ctx, stream, handle, (CONDITIONAL_IF, 1))?;
        let mut tail = |_: StreamRef| Ok(());
        let what = "the update's apply part as an IF node's body";
        self.capture_body(bodies[0], mode, body, &mut tail, what)
    }

    /// Captures the body, then `tail`, on a stream of its own into a graph,
    /// then adds that graph to a conditional node's body (`what`) as a
    /// child graph.
    fn capture_body(
        &self,
        body_graph: sys::CUgraph,
        mode: CaptureMode,
        body: &mut dyn FnMut(StreamRef) -> Result<()>,
        tail: &mut dyn FnMut(StreamRef) -> Result<()>,
        what: &str,
    ) -> Result<()> {
        let mut ls: sys::CUstream = null_mut();
        // SAFETY: valid out pointer, context bound.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut ls, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        let loop_stream = StreamRef(ls as usize);
        let mode = match mode {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            }
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: a fresh stream, not capturing.
        let begun = check("cuStreamBeginCapture(loop body)", unsafe {
            sys::cuStreamBeginCapture_v2(ls, mode)
        });
        let ran = begun
            .and_then(|_| body(loop_stream))
            .and_then(|_| tail(loop_stream));
        let mut captured: sys::CUgraph = null_mut();
        // SAFETY: ends the capture begun above (an error if it was not).
        let ended = check("cuStreamEndCapture(loop body)", unsafe {
            sys::cuStreamEndCapture(ls, &mut captured)
        });
        let added = match (&ran, &ended) {
            (Ok(()), Ok(())) if !captured.is_null() => {
                let mut child: sys::CUgraphNode = null_mut();
                // SAFETY: the WHILE node's body graph and a captured graph
                // (cloned into the child node).
                check("cuGraphAddChildGraphNode(loop body)", unsafe {
                    sys::cuGraphAddChildGraphNode(
                        &mut child,
                        body_graph,
                        std::ptr::null(),
                        0,
                        captured,
                    )
                })
                .map_err(|e| refused(e, what, captured))
            }
            _ => Ok(()),
        };
        if !captured.is_null() {
            // SAFETY: the captured graph was cloned into the child node (or
            // is not used); destroyed once.
            unsafe { sys::cuGraphDestroy(captured) };
        }
        // SAFETY: our stream; its capture has ended.
        unsafe { sys::cuStreamDestroy_v2(ls) };
        ran?;
        ended?;
        added
    }
}

/// The error of a body graph the driver refused (`what`), saying what the
/// graph holds.
fn refused(e: Error, what: &str, graph: sys::CUgraph) -> Error {
    match e {
        Error::Cuda {
            call,
            code,
            name,
            description,
        } => Error::Cuda {
            call,
            code,
            name,
            description: format!(
                "{description}; the driver refused {what} ({})",
                describe(graph)
            ),
        },
        other => other,
    }
}

/// Why a driver of CUDA version `v` cannot choose buckets on the device.
pub(super) fn switch_unsupported(v: i32) -> Error {
    Error::Unsupported(format!(
        "choosing a bucket on the device needs conditional SWITCH nodes (CUDA 12.8 or newer); this \
         driver is CUDA {}.{}",
        v / 1000,
        (v % 1000) / 10
    ))
}

/// The graph a capture on `stream` records into and its current
/// dependencies (valid until the next capture call on the stream).
fn capture_info(stream: StreamRef) -> Result<(sys::CUgraph, *const sys::CUgraphNode, usize)> {
    let s = stream.0 as sys::CUstream;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut id, mut graph, mut deps, mut ndeps) = (0u64, null_mut(), std::ptr::null(), 0usize);
    // SAFETY: valid out pointers; `deps` points into driver memory valid
    // until the next capture call on `s`.
    check("cuStreamGetCaptureInfo_v2", unsafe {
        sys::cuStreamGetCaptureInfo_v2(s, &mut status, &mut id, &mut graph, &mut deps, &mut ndeps)
    })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || graph.is_null() {
        return Err(Error::state(
            "a conditional node is recorded only into an active capture",
        ));
    }
    Ok((graph, deps, ndeps))
}

/// `cuGraphGetEdges_v2` (CUDA 12.3), which also reports each edge's type.
type GetEdges = unsafe extern "C" fn(
    sys::CUgraph,
    *mut sys::CUgraphNode,
    *mut sys::CUgraphNode,
    *mut [u8; 8],
    *mut usize,
) -> sys::CUresult;

/// What a captured body holds, for the message of a body the driver
/// refused: its nodes by type (CUgraphNodeType values) and its
/// programmatic edges (programmatic dependent launch), which conditional
/// bodies may not hold.
fn describe(graph: sys::CUgraph) -> String {
    let mut n = 0usize;
    // SAFETY: a live graph; NULL nodes asks for the count.
    if unsafe { sys::cuGraphGetNodes(graph, null_mut(), &mut n) } != sys::CUresult::CUDA_SUCCESS
        || n == 0
    {
        return "its nodes unknown".into();
    }
    let mut nodes = vec![null_mut(); n];
    // SAFETY: room for `n` nodes.
    if unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }
        != sys::CUresult::CUDA_SUCCESS
    {
        return "its nodes unknown".into();
    }
    nodes.truncate(n);
    let mut by_type = std::collections::BTreeMap::<u32, usize>::new();
    for node in &nodes {
        let mut ty = u32::MAX;
        // SAFETY: a node of the live graph; the driver writes one 32-bit
        // CUgraphNodeType, read as a u32 (types newer than the bindings).
        unsafe { sys::cuGraphNodeGetType(*node, (&mut ty as *mut u32).cast()) };
        *by_type.entry(ty).or_default() += 1;
    }
    let mut text = format!("{n} nodes; by CUgraphNodeType:");
    for (ty, count) in &by_type {
        text.push_str(&format!(" {ty}: {count}"));
    }
    if by_type.contains_key(&NODE_MEM_ALLOC) || by_type.contains_key(&NODE_MEM_FREE) {
        text.push_str(
            "; memory allocated or freed in the body (cudaMallocAsync, cudaFreeAsync; cuBLAS \
             allocates its workspace so after cublasSetStream unless cublasSetWorkspace \
             follows), which a conditional node's body may not hold",
        );
    }
    if let Ok(get) = symbol::<GetEdges>("cuGraphGetEdges_v2") {
        let mut e = 0usize;
        // SAFETY: a live graph; NULL arrays ask for the count.
        let r = unsafe { get(graph, null_mut(), null_mut(), null_mut(), &mut e) };
        if r == sys::CUresult::CUDA_SUCCESS && e > 0 {
            let (mut from, mut to) = (vec![null_mut(); e], vec![null_mut(); e]);
            let mut data = vec![[0u8; 8]; e];
            // SAFETY: room for `e` edges in each array (CUgraphEdgeData
            // is 8 bytes: from_port, to_port, type, 5 reserved).
            let r = unsafe {
                get(
                    graph,
                    from.as_mut_ptr(),
                    to.as_mut_ptr(),
                    data.as_mut_ptr(),
                    &mut e,
                )
            };
            if r == sys::CUresult::CUDA_SUCCESS {
                let special = data[..e.min(data.len())]
                    .iter()
                    .filter(|d| d[0] != 0 || d[1] != 0 || d[2] != 0)
                    .count();
                text.push_str(&format!("; {e} edges, {special} of them programmatic"));
            }
        }
    }
    text
}
