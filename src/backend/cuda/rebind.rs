//! Rebinding a captured graph's references to one device range: find every
//! kernel argument word, copy operand and set destination that holds an
//! address in the range (kernel argument layouts come from
//! `cuFuncGetParamInfo`, CUDA 12.4 drivers and newer; kernels launched with
//! one packed argument buffer, as cuBLAS launches its own, are read word by
//! word), and update those nodes of the executable graph in place when the
//! range moves. Graphs with nodes whose addresses cannot be seen (host
//! nodes, child graphs) are refused with the reason; a word that only looks
//! like an address is caught by capture's verification replay.

use super::device::Inner;
use super::driver::check;
use crate::backend::teardown;
use crate::backend::{DevPtr, RebindPlan, Rebinder};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr::{addr_of, null_mut};
use std::sync::{Arc, Mutex, OnceLock};

type ParamInfoFn =
    unsafe extern "C" fn(sys::CUfunction, usize, *mut usize, *mut usize) -> sys::CUresult;
type ParamCountFn = unsafe extern "C" fn(sys::CUfunction, *mut usize) -> sys::CUresult;

/// `cuFuncGetParamInfo` (CUDA 12.4 drivers and newer), and
/// `cuFuncGetParamCount` where the driver exports it.
fn param_fns() -> Option<(ParamInfoFn, Option<ParamCountFn>)> {
    static F: OnceLock<Option<(ParamInfoFn, Option<ParamCountFn>)>> = OnceLock::new();
    *F.get_or_init(|| {
        // SAFETY: the driver library is loaded (a graph exists); looking a
        // symbol up does not call it, and the types are the documented ones.
        unsafe {
            let lib = sys::culib();
            let info = lib
                .get::<ParamInfoFn>(b"cuFuncGetParamInfo\0")
                .ok()
                .map(|s| *s)?;
            let count = lib
                .get::<ParamCountFn>(b"cuFuncGetParamCount\0")
                .ok()
                .map(|s| *s);
            Some((info, count))
        }
    })
}

/// A captured graph's template. Rebinding plans read its nodes and update
/// the executable through them, so it lives while the graph keeps it or a
/// plan needs it.
pub(super) struct Template {
    pub graph: sys::CUgraph,
    pub inner: Arc<Inner>,
}

// SAFETY: a CUgraph may be used and destroyed from any thread; it is only
// read after capture.
unsafe impl Send for Template {}
// SAFETY: as above: nothing writes the template after capture.
unsafe impl Sync for Template {}

impl Drop for Template {
    fn drop(&mut self) {
        let _g = self.inner.bind();
        // SAFETY: destroyed exactly once, when the last holder goes.
        let r = check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(self.graph) });
        teardown::check("destroying a graph template", r);
    }
}

/// One kernel node's arguments as the executable graph has them now. One
/// per node, shared by every plan that patches the node (an input's and a
/// grad-output's, say), so that rebinding one buffer sets the node's
/// arguments with the others' current addresses, not their captured ones.
pub(super) struct NodeArgs {
    node: sys::CUgraphNode,
    params: sys::CUDA_KERNEL_NODE_PARAMS,
    /// One owned buffer per argument; `pointers[i]` points into `values[i]`.
    /// A packed launch has one buffer, `values[0]`, and no pointers.
    values: Vec<Vec<u64>>,
    pointers: Vec<*mut c_void>,
    /// A packed launch: its `extra` array (pointing at `values[0]` and at
    /// the boxed size) and the buffer's size in bytes.
    packed: Option<(Vec<*mut c_void>, Box<usize>)>,
}

// SAFETY: the raw pointers point into buffers this value owns (or are the
// driver's handles, usable from any thread); it is only used under its
// mutex.
unsafe impl Send for NodeArgs {}

/// The kernel nodes of one executable graph that plans patch, by node.
pub(super) type NodeTable = Mutex<HashMap<usize, Arc<Mutex<NodeArgs>>>>;

/// A kernel node to patch: its shared arguments and the words of the range,
/// as (argument, word, offset from the base).
struct KernelPatch {
    args: Arc<Mutex<NodeArgs>>,
    words: Vec<(usize, usize, u64)>,
}

/// A node's arguments read from the template, and the words of the range.
type Found = Option<(NodeArgs, Vec<(usize, usize, u64)>)>;

/// `CUDA_KERNEL_NODE_PARAMS::extra` keys (cuda.h).
const LAUNCH_PARAM_END: usize = 0;
const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;
/// The most bytes of parameters a kernel takes (CUDA 12.1 and newer).
const MAX_KERNEL_PARAM_BYTES: usize = 32764;

/// The words of `bytes` bytes at `src`, and those in `[lo, hi)` as
/// (argument `arg`, word, offset from `lo`).
///
/// # Safety
/// `bytes` bytes at `src` are readable.
unsafe fn read_words(
    src: *const u8,
    bytes: usize,
    arg: usize,
    lo: u64,
    hi: u64,
    words: &mut Vec<(usize, usize, u64)>,
) -> Vec<u64> {
    let mut v = vec![0u64; bytes.div_ceil(8)];
    // SAFETY: `bytes` readable bytes at `src` (the caller's promise); `v`
    // holds at least as many.
    unsafe { std::ptr::copy_nonoverlapping(src, v.as_mut_ptr() as *mut u8, bytes) };
    for (w, &word) in v.iter().enumerate().take(bytes / 8) {
        if word >= lo && word < hi {
            words.push((arg, w, word - lo));
        }
    }
    v
}

/// A packed launch's buffer (`extra`), copied, with the words in
/// `[lo, hi)`; or why it cannot be read.
fn packed_patch(
    node: sys::CUgraphNode,
    params: sys::CUDA_KERNEL_NODE_PARAMS,
    lo: u64,
    hi: u64,
) -> std::result::Result<Found, String> {
    let (mut buffer, mut size) = (std::ptr::null::<u8>(), None);
    // At most a few pairs: BUFFER_POINTER, BUFFER_SIZE, END.
    for k in 0..8 {
        // SAFETY: `extra` is the driver's array of key/value pairs ending
        // with LAUNCH_PARAM_END; reading stops at that key.
        let key = unsafe { *params.extra.add(2 * k) } as usize;
        if key == LAUNCH_PARAM_END {
            break;
        }
        // SAFETY: a key other than END is followed by its value.
        let value = unsafe { *params.extra.add(2 * k + 1) };
        match key {
            LAUNCH_PARAM_BUFFER_POINTER => buffer = value as *const u8,
            // SAFETY: the value of BUFFER_SIZE points at a size_t.
            LAUNCH_PARAM_BUFFER_SIZE if !value.is_null() => {
                size = Some(unsafe { *(value as *const usize) })
            }
            _ => {
                return Err(format!(
                    "a kernel's packed arguments have an unknown key {key}"
                ))
            }
        }
    }
    let (Some(bytes), false) = (size, buffer.is_null()) else {
        return Err("a kernel was captured with a packed argument buffer of unknown size".into());
    };
    // CUDA's limit on a kernel's parameters: a larger size is not one.
    if bytes > MAX_KERNEL_PARAM_BYTES {
        return Err(format!(
            "a kernel's packed argument buffer claims {bytes} bytes, more than a kernel can take"
        ));
    }
    let mut words = Vec::new();
    // SAFETY: the driver's buffer holds `bytes` bytes.
    let values = vec![unsafe { read_words(buffer, bytes, 0, lo, hi, &mut words) }];
    if words.is_empty() {
        return Ok(None);
    }
    let size = Box::new(bytes);
    let extra = vec![
        LAUNCH_PARAM_BUFFER_POINTER as *mut c_void,
        null_mut(), // values[0], set at each rebind
        LAUNCH_PARAM_BUFFER_SIZE as *mut c_void,
        &*size as *const usize as *mut c_void,
        LAUNCH_PARAM_END as *mut c_void,
    ];
    let args = NodeArgs {
        node,
        params,
        values,
        pointers: Vec::new(),
        packed: Some((extra, size)),
    };
    Ok(Some((args, words)))
}

enum Patch {
    Kernel(KernelPatch),
    /// A copy node: its parameters, and the offsets of its source and
    /// destination from the base (None: outside the range).
    Memcpy {
        node: sys::CUgraphNode,
        params: sys::CUDA_MEMCPY3D,
        src: Option<u64>,
        dst: Option<u64>,
    },
    Memset {
        node: sys::CUgraphNode,
        params: sys::CUDA_MEMSET_NODE_PARAMS,
        dst: u64,
    },
}

pub(super) struct CudaRebinder {
    exec: sys::CUgraphExec,
    inner: Arc<Inner>,
    /// The nodes patched are the template's: it lives as long as the plan.
    _template: Arc<Template>,
    patches: Vec<Patch>,
}

// SAFETY: the handles are driver objects usable from any thread; the raw
// argument pointers point into buffers this value owns.
unsafe impl Send for CudaRebinder {}

fn kernel_patch(
    node: sys::CUgraphNode,
    lo: u64,
    hi: u64,
) -> Result<std::result::Result<Found, String>> {
    // SAFETY: the struct holds only integers and raw pointers, for which
    // all-zero bits are valid.
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a kernel node of a live graph and a valid out pointer.
    check("cuGraphKernelNodeGetParams", unsafe {
        sys::cuGraphKernelNodeGetParams_v2(node, &mut params)
    })?;
    if params.kernelParams.is_null() {
        if params.extra.is_null() {
            return Ok(Err("a kernel node has no arguments to read".into()));
        }
        return Ok(packed_patch(node, params, lo, hi));
    }
    let Some((info, count)) = param_fns() else {
        return Ok(Err(
            "the CUDA driver has no cuFuncGetParamInfo (CUDA 12.4 drivers and newer): kernel arguments \
             cannot be read"
                .into(),
        ));
    };
    let mut func = params.func;
    if func.is_null() && !params.kern.is_null() {
        // SAFETY: a live kernel handle and a valid out pointer; the context
        // is current.
        check("cuKernelGetFunction", unsafe {
            sys::cuKernelGetFunction(&mut func, params.kern)
        })?;
    }
    // The argument count, from the driver where it can tell; else the
    // arguments are read until the driver answers that there is no such
    // argument (an error it reports, which the sanitizer shows).
    let n = match count {
        Some(count) => {
            let mut n = 0usize;
            // SAFETY: a live function and a valid out pointer.
            check("cuFuncGetParamCount", unsafe { count(func, &mut n) })?;
            n
        }
        None => usize::MAX,
    };
    let mut values = Vec::new();
    let mut words = Vec::new();
    for i in 0..n {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: a live function and valid out pointers; past the last
        // argument the driver returns an error.
        let r = unsafe { info(func, i, &mut offset, &mut size) };
        if r != sys::CUresult::CUDA_SUCCESS {
            if n == usize::MAX {
                break;
            }
            check("cuFuncGetParamInfo", r)?;
        }
        // SAFETY: kernelParams holds one pointer per argument, each to
        // `size` bytes of its value.
        let src = unsafe { *params.kernelParams.add(i) } as *const u8;
        // SAFETY: `size` readable bytes at `src`.
        values.push(unsafe { read_words(src, size, i, lo, hi, &mut words) });
    }
    if words.is_empty() {
        return Ok(Ok(None));
    }
    let pointers = values
        .iter_mut()
        .map(|v| v.as_mut_ptr() as *mut c_void)
        .collect();
    let args = NodeArgs {
        node,
        params,
        values,
        pointers,
        packed: None,
    };
    Ok(Ok(Some((args, words))))
}

/// The parameters of copy node `node`. The struct holds two memory-type
/// enums that have no zero value, so it is read into untyped memory and the
/// driver's words are checked before the struct is taken as initialised; a
/// word outside the enum gives the reason instead.
fn memcpy_params(
    node: sys::CUgraphNode,
) -> Result<std::result::Result<sys::CUDA_MEMCPY3D, String>> {
    let mut raw = MaybeUninit::<sys::CUDA_MEMCPY3D>::zeroed();
    // SAFETY: a copy node of a live graph, and room for the parameters.
    check("cuGraphMemcpyNodeGetParams", unsafe {
        sys::cuGraphMemcpyNodeGetParams(node, raw.as_mut_ptr())
    })?;
    let p = raw.as_ptr();
    // SAFETY: both fields lie inside `raw`, which the driver filled (or the
    // zeroing did); they are read as their `u32` representation, which every
    // bit pattern is, before any enum value is formed.
    let words = unsafe {
        [
            addr_of!((*p).srcMemoryType).cast::<u32>().read(),
            addr_of!((*p).dstMemoryType).cast::<u32>().read(),
        ]
    };
    if let Some(w) = words.iter().find(|w| !(1..=4).contains(*w)) {
        return Ok(Err(format!(
            "a copy node has memory type {w}, which this build does not know"
        )));
    }
    // SAFETY: every other field is an integer or a raw pointer, valid for any
    // bits, and both memory types were just checked to be enum values.
    Ok(Ok(unsafe { raw.assume_init() }))
}

/// The rebinding plan of executable `exec` (instantiated from `graph`) for
/// the range `[base, base + bytes)`; `nodes`: the graph's kernel nodes that
/// earlier plans patch.
pub(super) fn plan(
    template: &Arc<Template>,
    exec: sys::CUgraphExec,
    inner: &Arc<Inner>,
    nodes_table: &NodeTable,
    base: DevPtr,
    bytes: usize,
) -> Result<RebindPlan> {
    let _ctx = inner.bind()?;
    let graph = template.graph;
    let (lo, hi) = (base, base + bytes as u64);
    let inside = |a: u64| a >= lo && a < hi;
    let mut n = 0usize;
    // SAFETY: a live graph; NULL nodes asks for the count.
    check("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, null_mut(), &mut n)
    })?;
    if n == 0 {
        // An empty graph (a backward with nothing to compute); asking an
        // empty graph for its nodes into an empty array is refused.
        return Ok(RebindPlan::Unreferenced);
    }
    let mut nodes = vec![null_mut(); n];
    // SAFETY: room for `n` nodes.
    check("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n)
    })?;
    nodes.truncate(n);
    let mut patches = Vec::new();
    for node in nodes {
        let mut ty: u32 = 0;
        // SAFETY: a node of the live graph; the driver writes one
        // CUgraphNodeType, a 32-bit enum, which is read as a u32 so that
        // types newer than cudarc's enum (conditional nodes, 13) stay
        // defined values.
        check("cuGraphNodeGetType", unsafe {
            sys::cuGraphNodeGetType(node, (&mut ty as *mut u32).cast())
        })?;
        match ty {
            NODE_KERNEL => match kernel_patch(node, lo, hi)? {
                Ok(Some((fresh, words))) => {
                    // The template's arguments are the captured ones, so the
                    // words found are valid for the shared copy too.
                    let mut table = nodes_table.lock().unwrap_or_else(|p| p.into_inner());
                    let args = table
                        .entry(node as usize)
                        .or_insert_with(|| Arc::new(Mutex::new(fresh)))
                        .clone();
                    patches.push(Patch::Kernel(KernelPatch { args, words }));
                }
                Ok(None) => {}
                Err(why) => return Ok(RebindPlan::Refused(why)),
            },
            NODE_MEMCPY => {
                let params = match memcpy_params(node)? {
                    Ok(params) => params,
                    Err(why) => return Ok(RebindPlan::Refused(why)),
                };
                let dev = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
                let src = (params.srcMemoryType == dev && inside(params.srcDevice))
                    .then(|| params.srcDevice - lo);
                let dst = (params.dstMemoryType == dev && inside(params.dstDevice))
                    .then(|| params.dstDevice - lo);
                if src.is_some() || dst.is_some() {
                    patches.push(Patch::Memcpy {
                        node,
                        params,
                        src,
                        dst,
                    });
                }
            }
            NODE_MEMSET => {
                // SAFETY: the struct holds only integers, for which all-zero
                // bits are valid.
                let mut params: sys::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
                // SAFETY: a set node and a valid out pointer.
                check("cuGraphMemsetNodeGetParams", unsafe {
                    sys::cuGraphMemsetNodeGetParams(node, &mut params)
                })?;
                if inside(params.dst) {
                    let dst = params.dst - lo;
                    patches.push(Patch::Memset { node, params, dst });
                }
            }
            NODE_HOST => {
                return Ok(RebindPlan::Refused(
                    "the graph has a host node, whose data is opaque".into(),
                ))
            }
            NODE_GRAPH => {
                return Ok(RebindPlan::Refused(
                    "the graph has a child graph node, which is not looked into".into(),
                ))
            }
            // Events, waits, empty nodes and graph allocations take no
            // address of the range.
            NODE_EMPTY..=NODE_MEM_FREE => {}
            other => {
                return Ok(RebindPlan::Refused(format!(
                "the graph has a node of type {other} (a conditional node, or a type newer than \
                     graphed), which is not looked into"
            )))
            }
        }
    }
    if patches.is_empty() {
        return Ok(RebindPlan::Unreferenced);
    }
    Ok(RebindPlan::Plan(Box::new(CudaRebinder {
        exec,
        inner: inner.clone(),
        _template: template.clone(),
        patches,
    })))
}

/// CUgraphNodeType values (read as integers: see `plan`).
const NODE_KERNEL: u32 = 0;
const NODE_MEMCPY: u32 = 1;
const NODE_MEMSET: u32 = 2;
const NODE_HOST: u32 = 3;
const NODE_GRAPH: u32 = 4;
const NODE_EMPTY: u32 = 5;
const NODE_MEM_FREE: u32 = 11;

impl Rebinder for CudaRebinder {
    fn nodes(&self) -> usize {
        self.patches.len()
    }

    fn rebind(&mut self, base: DevPtr) -> Result<()> {
        let _ctx = self.inner.bind()?;
        let ctx = self.inner.ctx;
        for p in &mut self.patches {
            match p {
                Patch::Kernel(p) => {
                    let mut guard = p.args.lock().unwrap_or_else(|e| e.into_inner());
                    let k = &mut *guard;
                    for &(arg, word, off) in &p.words {
                        k.values[arg][word] = base + off;
                    }
                    let mut params = k.params;
                    match &mut k.packed {
                        Some((extra, _)) => {
                            extra[1] = k.values[0].as_mut_ptr() as *mut c_void;
                            params.kernelParams = null_mut();
                            params.extra = extra.as_mut_ptr();
                        }
                        None => params.kernelParams = k.pointers.as_mut_ptr(),
                    }
                    // SAFETY: a node of the graph `exec` was instantiated
                    // from, with the same function and either one pointer
                    // per argument to a buffer of its size or one packed
                    // buffer of the captured size (`extra`, whose size
                    // entry points at the boxed size this patch owns).
                    check("cuGraphExecKernelNodeSetParams", unsafe {
                        sys::cuGraphExecKernelNodeSetParams_v2(self.exec, k.node, &params)
                    })?;
                }
                Patch::Memcpy {
                    node,
                    params,
                    src,
                    dst,
                } => {
                    if let Some(o) = src {
                        params.srcDevice = base + *o;
                    }
                    if let Some(o) = dst {
                        params.dstDevice = base + *o;
                    }
                    // SAFETY: a copy node of the graph, same shape of copy.
                    check("cuGraphExecMemcpyNodeSetParams", unsafe {
                        sys::cuGraphExecMemcpyNodeSetParams(self.exec, *node, params, ctx)
                    })?;
                }
                Patch::Memset { node, params, dst } => {
                    params.dst = base + *dst;
                    // SAFETY: a set node of the graph, same shape of set.
                    check("cuGraphExecMemsetNodeSetParams", unsafe {
                        sys::cuGraphExecMemsetNodeSetParams(self.exec, *node, params, ctx)
                    })?;
                }
            }
        }
        Ok(())
    }
}

/// Rebinding needs the template the executable came from; a graph without
/// one cannot be planned.
pub(super) fn no_template() -> Error {
    Error::Internal("a captured graph lost its template".into())
}
