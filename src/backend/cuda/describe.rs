//! What a captured graph holds, read from its template when its capture
//! ended (the template may be released after capture; this list stays):
//! each node's type, each kernel's name, and the dependencies between
//! nodes, for the DOT export. Kernel names come from `cuFuncGetName`
//! (CUDA 12.3 drivers and newer) and the edges from `cuGraphGetEdges_v2`
//! (12.3) or `cuGraphGetEdges`; both are looked up by name, newer than the
//! bindings graphed builds with. Reading never fails a capture: what the
//! driver cannot tell is said in the list's note.

use super::driver::check;
use crate::core::dot::{Node, Nodes};
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::ptr::{null, null_mut};
use std::sync::OnceLock;

/// `cuFuncGetName`.
type FuncGetName = unsafe extern "C" fn(*mut *const c_char, sys::CUfunction) -> sys::CUresult;
/// `cuGraphGetEdges_v2` (edge data NULL: not asked for).
type GetEdgesV2 = unsafe extern "C" fn(
    sys::CUgraph,
    *mut sys::CUgraphNode,
    *mut sys::CUgraphNode,
    *mut std::ffi::c_void,
    *mut usize,
) -> sys::CUresult;
/// `cuGraphGetEdges` (CUDA 12.0's signature).
type GetEdges = unsafe extern "C" fn(
    sys::CUgraph,
    *mut sys::CUgraphNode,
    *mut sys::CUgraphNode,
    *mut usize,
) -> sys::CUresult;

/// The entry points this file looks up, where the driver has them.
struct Entries {
    func_name: Option<FuncGetName>,
    edges_v2: Option<GetEdgesV2>,
    edges: Option<GetEdges>,
}

fn entries() -> &'static Entries {
    static E: OnceLock<Entries> = OnceLock::new();
    E.get_or_init(|| {
        // SAFETY: the driver library is loaded (a graph was captured);
        // looking a symbol up does not call it, and the types are the
        // ones the CUDA headers declare for these names.
        unsafe {
            let lib = sys::culib();
            Entries {
                func_name: lib.get::<FuncGetName>(b"cuFuncGetName\0").ok().map(|s| *s),
                edges_v2: lib
                    .get::<GetEdgesV2>(b"cuGraphGetEdges_v2\0")
                    .ok()
                    .map(|s| *s),
                edges: lib.get::<GetEdges>(b"cuGraphGetEdges\0").ok().map(|s| *s),
            }
        }
    })
}

/// The nodes of `graph` (a live template), never failing: what cannot be
/// read is said in the note.
pub(super) fn describe(graph: sys::CUgraph) -> Nodes {
    match read(graph) {
        Ok(n) => n,
        Err(e) => Nodes::unknown(format!("the driver did not list the graph's nodes: {e}")),
    }
}

/// The kind of a node of type `ty` (a CUgraphNodeType value).
fn kind(ty: u32) -> &'static str {
    match ty {
        0 => "kernel",
        1 => "memcpy",
        2 => "memset",
        3 => "host function",
        4 => "child graph",
        5 => "empty",
        6 => "event wait",
        7 => "event record",
        8 => "semaphore signal",
        9 => "semaphore wait",
        10 => "memory alloc",
        11 => "memory free",
        12 => "batch memory op",
        13 => "conditional",
        _ => "node",
    }
}

fn read(graph: sys::CUgraph) -> Result<Nodes> {
    let handles = graph_nodes(graph)?;
    let mut names: HashMap<usize, String> = HashMap::new();
    let mut notes: Vec<String> = Vec::new();
    let mut nodes = Vec::with_capacity(handles.len());
    for &h in &handles {
        let mut ty: u32 = 0;
        // SAFETY: a node of the live graph; the driver writes one
        // CUgraphNodeType, a 32-bit enum, read as a u32 so that types
        // newer than cudarc's enum stay defined values.
        check("cuGraphNodeGetType", unsafe {
            sys::cuGraphNodeGetType(h, (&mut ty as *mut u32).cast())
        })?;
        let name = match ty {
            0 => kernel_name(h, &mut names).unwrap_or_else(|why| {
                if !notes.contains(&why) {
                    notes.push(why);
                }
                String::new()
            }),
            13 => "its bodies are not listed".to_string(),
            1..=12 => String::new(),
            other => format!("type {other}"),
        };
        nodes.push(Node::new(kind(ty), name));
    }
    let edges = match edges(graph, &handles) {
        Ok(e) => e,
        Err(why) => {
            notes.push(why);
            Vec::new()
        }
    };
    Ok(Nodes {
        nodes,
        edges,
        note: (!notes.is_empty()).then(|| notes.join("; ")),
    })
}

/// The nodes of `graph`.
fn graph_nodes(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNode>> {
    let mut n = 0usize;
    // SAFETY: a live graph; NULL nodes asks for the count.
    check("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, null_mut(), &mut n)
    })?;
    if n == 0 {
        // Asking an empty graph for its nodes into an empty array is refused.
        return Ok(Vec::new());
    }
    let mut nodes = vec![null_mut(); n];
    // SAFETY: room for `n` nodes.
    check("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n)
    })?;
    nodes.truncate(n);
    Ok(nodes)
}

/// The name of the kernel a kernel node launches (`names` caches them by
/// function), or why it is not known.
fn kernel_name(
    node: sys::CUgraphNode,
    names: &mut HashMap<usize, String>,
) -> std::result::Result<String, String> {
    // SAFETY: the struct holds only integers and raw pointers, for which
    // all-zero bits are valid.
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a kernel node of a live graph and a valid out pointer.
    check("cuGraphKernelNodeGetParams", unsafe {
        sys::cuGraphKernelNodeGetParams_v2(node, &mut params)
    })
    .map_err(|e| format!("kernel names: {e}"))?;
    let mut func = params.func;
    if func.is_null() && !params.kern.is_null() {
        // SAFETY: a live kernel handle and a valid out pointer; the
        // context is current (capture binds it).
        check("cuKernelGetFunction", unsafe {
            sys::cuKernelGetFunction(&mut func, params.kern)
        })
        .map_err(|e| format!("kernel names: {e}"))?;
    }
    if let Some(n) = names.get(&(func as usize)) {
        return Ok(n.clone());
    }
    let get = entries().func_name.ok_or_else(|| {
        "kernel names: the CUDA driver has no cuFuncGetName (CUDA 12.3 drivers and newer)"
            .to_string()
    })?;
    let mut p: *const c_char = null();
    // SAFETY: a live function and a valid out pointer.
    check("cuFuncGetName", unsafe { get(&mut p, func) })
        .map_err(|e| format!("kernel names: {e}"))?;
    if p.is_null() {
        return Err("kernel names: cuFuncGetName gave none".into());
    }
    // SAFETY: the driver returns a NUL-terminated string it keeps.
    let name = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    names.insert(func as usize, name.clone());
    Ok(name)
}

/// The dependencies of `graph` as indices into `nodes`, or why they are
/// not known.
fn edges(
    graph: sys::CUgraph,
    nodes: &[sys::CUgraphNode],
) -> std::result::Result<Vec<(u32, u32)>, String> {
    let e = entries();
    // `data`: room for each edge's CUgraphEdgeData (8 bytes), which
    // cuGraphGetEdges_v2 fills (asked without it, edges with data other
    // than the default are a lossy query); NULL with the count.
    let get = |from: *mut sys::CUgraphNode,
               to: *mut sys::CUgraphNode,
               data: *mut std::ffi::c_void,
               n: &mut usize| {
        // SAFETY: a live graph, and room for `*n` edges in `from`, `to`
        // and `data` (or all NULL to ask for the count).
        unsafe {
            match (e.edges_v2, e.edges) {
                (Some(f), _) => Some(check("cuGraphGetEdges_v2", f(graph, from, to, data, n))),
                (None, Some(f)) => Some(check("cuGraphGetEdges", f(graph, from, to, n))),
                (None, None) => None,
            }
        }
    };
    let no_entry = || "dependencies: the CUDA driver has no cuGraphGetEdges".to_string();
    let failed = |r: Result<()>| r.map_err(|e| format!("dependencies: {e}"));
    let mut n = 0usize;
    failed(get(null_mut(), null_mut(), null_mut(), &mut n).ok_or_else(no_entry)?)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let (mut from, mut to) = (vec![null_mut(); n], vec![null_mut(); n]);
    let mut data = vec![0u64; n];
    let (f, t, d) = (from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr().cast());
    failed(get(f, t, d, &mut n).ok_or_else(no_entry)?)?;
    let index: HashMap<usize, u32> = nodes
        .iter()
        .enumerate()
        .map(|(i, &h)| (h as usize, i as u32))
        .collect();
    Ok(from
        .iter()
        .zip(&to)
        .take(n)
        .filter_map(|(a, b)| Some((*index.get(&(*a as usize))?, *index.get(&(*b as usize))?)))
        .collect())
}
