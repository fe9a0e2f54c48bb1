//! A step's microbatch count and copies in and out (graphed_step_io), as a
//! declaration gives them: the fuzzed entries (valid ones into harness
//! memory that lives as long as every session; NULL, bad roles, indices,
//! duplicates, strides, regions past the address space, copies out over
//! another entry's memory, broken element headers), and what graphed must
//! answer for them, with the words of its message.

use super::*;

pub const IO_SIZE: usize = size_of::<graphed_step_io>();

/// A failure the model predicts, with a text its message must hold.
pub type Refusal = (graphed_status, String);

/// The fuzzed io array of a declaration.
pub struct IoArg {
    /// The array's storage (the library reads it during the call only).
    pub _store: Vec<u64>,
    pub ptr: *const graphed_step_io,
    pub count: usize,
    /// What the library reads, when it reads the array whole.
    pub entries: Vec<IoModel>,
    /// Refused while the array is read (before the session is locked).
    pub read_err: Option<Refusal>,
}

/// graphed_step_io_default() is what the header says.
pub fn check_io_default() {
    let d = graphed_step_io_default();
    assert_eq!(
        (d.struct_size, d.magic),
        (IO_SIZE, GRAPHED_STEP_IO_MAGIC),
        "graphed_step_io_default: size and magic"
    );
    assert_eq!(
        (d.callable, d.role, d.index, d.ptr as usize, d.stride),
        (0, 0, 0, 0, 0),
        "graphed_step_io_default: callable 0's input 0, no memory"
    );
    assert_eq!(GRAPHED_STEP_MAX_MICROBATCHES, 4096);
}

/// The microbatch count of a declaration.
pub fn fuzz_microbatches() -> u32 {
    w().input
        .pick(&[1, 2, 3, 4, 1, 2, 0, 7, 4096, 4097, u32::MAX, 5])
}

/// The bytes of tensor `index` of `role` of `cl` (None: no such tensor).
pub fn io_bytes(cl: &Callable, role: u32, index: u32) -> Option<usize> {
    let ts = match role {
        0 | 3 => &cl.inputs,
        1 | 2 => &cl.outputs,
        _ => return None,
    };
    ts.get(index as usize).map(|t| t.bytes)
}

pub fn role_name(role: u32) -> &'static str {
    // (Other values are refused before any message names a role.)
    [
        "input",
        "output",
        "grad-output",
        "grad-input",
        "param-grad slab",
    ]
    .get(role as usize)
    .unwrap_or(&"?")
}

/// Where an entry's memory comes from.
#[derive(Clone, Copy)]
enum Place {
    Own,
    Null,
    /// Near the end of the address space: the region runs past it.
    Top,
    /// Entry j's memory, `off` bytes in.
    Share(usize, usize),
}

/// Reads an io array for a step of `cs` (of the session's `calls`) over
/// `n` microbatches.
pub fn fuzz_io(calls: &[Callable], cs: &[u32], n: u32) -> IoArg {
    let i = &w().input;
    check_io_default();
    let count = i.pick(&[1, 1, 2, 2, 3, 4, 0]);
    let mut es: Vec<IoModel> = Vec::new();
    let mut places = Vec::new();
    let known = cs.iter().all(|&c| (c as usize) < calls.len());
    for k in 0..count {
        let mut e = IoModel {
            callable: 0,
            role: 0,
            index: 0,
            ptr: 0,
            stride: 0,
        };
        // Zeros read the plain, valid choices.
        e.callable = match i.below(12) {
            _ if cs.is_empty() => 0,
            11 => (0..calls.len() as u32)
                .find(|c| !cs.contains(c))
                .unwrap_or(u32::MAX),
            _ => cs[i.below(cs.len())],
        };
        e.role = match i.below(16) {
            14 => 4,
            15 => i.pick(&[5, 9, u32::MAX]),
            r => r as u32 % 4,
        };
        let cl = calls.get(e.callable as usize).filter(|_| known);
        let have = cl.map_or(0, |cl| match e.role {
            0 | 3 => cl.inputs.len(),
            _ => cl.outputs.len(),
        }) as u32;
        e.index = match i.below(12) {
            10 => have,
            11 => u32::MAX,
            _ => i.below(have.max(1) as usize) as u32,
        };
        if k > 0 && i.below(10) == 9 {
            // The same buffer as an earlier entry.
            let j = &es[i.below(k)];
            (e.callable, e.role, e.index) = (j.callable, j.role, j.index);
        }
        let bytes = region_of(calls, known, &e, n).map_or(8, |r| r.2 as usize);
        e.stride = match i.below(10) {
            6 => 0,
            7 => bytes - 1,
            8 => bytes + i.pick(&[8, 64, 256]),
            9 => usize::MAX,
            _ => bytes,
        };
        let place = match i.below(12) {
            10 => Place::Null,
            11 => Place::Top,
            8 | 9 if k > 0 => {
                let j = i.below(k);
                let jb = region_of(calls, known, &es[j], n).map_or(8, |r| r.2 as usize);
                Place::Share(j, i.pick(&[0, jb, 1, 8]))
            }
            _ => Place::Own,
        };
        es.push(e);
        places.push(place);
    }
    place_memory(calls, known, n, &mut es, &places);
    build_array(es)
}

/// A region: (ptr, stride, bytes, count) (None: no such tensor).
pub fn region_of(
    calls: &[Callable],
    known: bool,
    e: &IoModel,
    n: u32,
) -> Option<(u128, u128, u128, u128)> {
    let cl = calls.get(e.callable as usize).filter(|_| known)?;
    let b = io_bytes(cl, e.role, e.index)?;
    Some((e.ptr as u128, e.stride as u128, b as u128, n as u128))
}

/// One past the region's last byte, if it is usable.
fn extent(r: (u128, u128, u128, u128)) -> Option<u128> {
    let (_, s, b, n) = r;
    if n == 0 || (n > 1 && s < b) {
        return None;
    }
    let e = (n - 1) * s + b;
    (e <= 1 << 40).then_some(e)
}

/// Points every entry at its memory: each group sharing one block gets one
/// allocation that holds every member's region.
fn place_memory(calls: &[Callable], known: bool, n: u32, es: &mut [IoModel], places: &[Place]) {
    // The root of each entry and its offset from it.
    let mut root: Vec<(usize, usize)> = Vec::new();
    for (k, p) in places.iter().enumerate() {
        root.push(match *p {
            Place::Share(j, off) => (root[j].0, root[j].1 + off),
            _ => (k, 0),
        });
    }
    for k in 0..es.len() {
        if root[k].0 != k {
            continue;
        }
        let need = (0..es.len())
            .filter(|&m| root[m].0 == k)
            .filter_map(|m| {
                let r = region_of(calls, known, &es[m], n)?;
                Some(root[m].1 as u128 + extent(r)?)
            })
            .max()
            .unwrap_or(64);
        es[k].ptr = match places[k] {
            Place::Null => 0,
            Place::Top => {
                let b = region_of(calls, known, &es[k], n).map_or(8, |r| r.2 as usize);
                0usize.wrapping_sub(b)
            }
            // Only a session that must fail its capture (a huge tensor)
            // asks for this much: never touched.
            _ if need > 64 << 20 => 0x10000,
            _ => mem(need as usize, 0),
        };
    }
    for k in 0..es.len() {
        if root[k].0 != k {
            es[k].ptr = es[root[k].0].ptr.wrapping_add(root[k].1);
        }
    }
}

/// The array, with the element size, headers and count fuzzed.
fn build_array(entries: Vec<IoModel>) -> IoArg {
    let i = &w().input;
    let n = entries.len();
    let stride = IO_SIZE + 8 * i.pick(&[0, 0, 0, 1, 2]);
    let items: Vec<graphed_step_io> = entries
        .iter()
        .map(|e| {
            let mut d = graphed_step_io_default();
            (d.callable, d.role, d.index) = (e.callable, e.role, e.index);
            d.ptr = e.ptr as *mut c_void;
            d.stride = e.stride;
            d
        })
        .collect();
    let mut store = array_of(&items, stride);
    let mut count = n;
    let mut ptr = store.as_ptr() as *const graphed_step_io;
    let mut read_err = None;
    let header = |store: &mut Vec<u64>, k: usize, off: usize, v: u64| {
        // SAFETY: a header field of element k, inside `store`.
        unsafe {
            let p = (store.as_mut_ptr() as *mut u8).add(k * stride + off);
            if off == 0 {
                (p as *mut usize).write_unaligned(v as usize);
            } else {
                (p as *mut u32).write_unaligned(v as u32);
            }
        }
    };
    match i.below(16) {
        15 if n > 0 => {
            ptr = null();
            read_err = Some((S::NullPointer, "desc.io".to_string()));
        }
        14 if n > 0 => {
            let k = i.below(n);
            header(&mut store, k, 8, 0x6772_0007);
            read_err = Some((S::BadStruct, format!("desc.io[{k}]")));
        }
        13 if n > 1 => {
            let k = 1 + i.below(n - 1);
            header(&mut store, k, 0, stride as u64 + 8);
            read_err = Some((S::BadStruct, format!("desc.io[{k}] has struct_size")));
        }
        12 if n > 0 => {
            header(&mut store, 0, 0, 32);
            read_err = Some((S::BadStruct, "desc.io[0] has struct_size 32".into()));
        }
        11 if n > 0 => {
            count = i.pick(&[usize::MAX / 8, usize::MAX / 16]);
            read_err = Some((S::InvalidArgument, "do not fit in memory".into()));
        }
        10 if n == 0 => {
            // No entries: whatever the pointer, nothing is read.
            ptr = i.pick(&[null(), std::ptr::dangling()]);
        }
        _ => {}
    }
    if read_err.is_none() {
        // Roles are decoded after every element was read, in order.
        read_err = entries
            .iter()
            .enumerate()
            .find(|(_, e)| e.role > 4)
            .map(|(k, e)| {
                let m = format!(
                    "desc.io[{k}].role: {} is not a graphed_buffer_role value",
                    e.role
                );
                (S::InvalidArgument, m)
            });
    }
    IoArg {
        _store: store,
        ptr,
        count,
        entries,
        read_err,
    }
}

/// What graphed_session_add_step says of the entries of a step of `cs`
/// (all known, in order) over `n` microbatches, after everything else.
pub fn io_refusal(calls: &[Callable], cs: &[u32], n: u32, io: &[IoModel]) -> Option<Refusal> {
    if n == 0 || n > GRAPHED_STEP_MAX_MICROBATCHES {
        // Refused for the count before.
        return None;
    }
    let bad = |m: String| Some((S::InvalidArgument, m));
    let what = |k: usize, e: &IoModel| {
        format!(
            "io[{k}] ({} {} of callable {})",
            role_name(e.role),
            e.index,
            e.callable
        )
    };
    let regions: Vec<_> = io.iter().map(|e| region_of(calls, true, e, n)).collect();
    for (k, e) in io.iter().enumerate() {
        if !cs.contains(&e.callable) {
            return bad(format!(
                "io[{k}] names callable {}, which is not one",
                e.callable
            ));
        }
        if e.role == 4 {
            return bad(format!("io[{k}]: the role is the parameter grads"));
        }
        let Some((p, s, b, cnt)) = regions[k] else {
            return bad(format!("{}: callable '", what(k, e)));
        };
        if let Some(j) = io[..k]
            .iter()
            .position(|o| (o.callable, o.role, o.index) == (e.callable, e.role, e.index))
        {
            return bad(format!("{}: io[{j}] names the same buffer", what(k, e)));
        }
        let problem = if p == 0 {
            Some("is NULL".to_string())
        } else if cnt > 1 && s < b {
            Some(format!("has a stride of {s} bytes for blocks of {b} bytes"))
        } else if p + (cnt - 1) * s + b > u64::MAX as u128 {
            Some("runs past the end of the address space".to_string())
        } else {
            None
        };
        if let Some(pr) = problem {
            return bad(format!("{}: the caller memory {pr}", what(k, e)));
        }
    }
    // What a copy out (OUTPUT, GRAD_INPUT) writes is no other entry's.
    for (k, e) in io
        .iter()
        .enumerate()
        .filter(|(_, e)| e.role == 1 || e.role == 3)
    {
        for (j, o) in io.iter().enumerate().filter(|&(j, _)| j != k) {
            if overlap(regions[k].unwrap(), regions[j].unwrap()) {
                let verb = if o.role == 0 || o.role == 2 {
                    "reads"
                } else {
                    "writes"
                };
                return bad(format!(
                    "{} writes caller memory that io[{j}] also {verb}",
                    what(k, e)
                ));
            }
        }
    }
    None
}

/// Whether two usable regions share a byte: block by block when they are
/// small, else each block of `a` against the one block of `b` that can
/// reach it.
fn overlap(a: (u128, u128, u128, u128), b: (u128, u128, u128, u128)) -> bool {
    let block = |r: (u128, u128, u128, u128), i: u128| (r.0 + i * r.1, r.0 + i * r.1 + r.2);
    let meet = |x: (u128, u128), y: (u128, u128)| x.0 < y.1 && y.0 < x.1;
    if a.3 * b.3 <= 1 << 14 {
        return (0..a.3).any(|i| (0..b.3).any(|j| meet(block(a, i), block(b, j))));
    }
    (0..a.3).any(|i| {
        let x = block(a, i);
        if b.3 == 1 || b.1 == 0 {
            return meet(x, block(b, 0));
        }
        // The first block of b that ends after x starts.
        let j = (x.0 + 1).saturating_sub(b.0 + b.2).div_ceil(b.1);
        j < b.3 && meet(x, block(b, j))
    })
}
