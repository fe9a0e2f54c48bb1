//! The unit of host stream work ([`Task`]) and how one runs; the task list a
//! graph records, shared with its rebinders.

use crate::core::dot::{Node, Nodes};
use crate::core::dtype::{accumulate_host, DType};
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};

/// User work on a host stream.
pub type HostTask = Arc<dyn Fn() + Send + Sync>;

/// A host kernel: user work that may fail, as a kernel may fault (a
/// non-zero return, which its stream reports at its next synchronization).
pub type HostKernel = Arc<dyn Fn() -> i32 + Send + Sync>;

/// One unit of stream work. Addresses are stored as integers: they are
/// device addresses in the CUDA sense, only dereferenced when the task runs.
#[derive(Clone)]
pub(super) enum Task {
    Copy {
        dst: usize,
        src: usize,
        bytes: usize,
    },
    Zero {
        dst: usize,
        bytes: usize,
    },
    Accumulate {
        dst: usize,
        src: usize,
        count: usize,
        dtype: DType,
    },
    /// Sets the u32 at `flag` to 1 when the two ranges differ.
    Differ {
        a: usize,
        b: usize,
        bytes: usize,
        flag: usize,
    },
    User(HostTask),
    /// A named host kernel; a non-zero return is a fault.
    Kernel {
        name: Arc<str>,
        f: HostKernel,
    },
    /// `count` elements of `elem` bytes set to the low bytes of `pattern`.
    Fill {
        dst: usize,
        pattern: u32,
        elem: usize,
        count: usize,
    },
    /// A copy at offsets `i * stride`, i the u32 at `index` when it runs.
    CopyIndexed {
        dst: usize,
        dst_stride: usize,
        src: usize,
        src_stride: usize,
        bytes: usize,
        index: usize,
    },
    /// A loop: `body` runs, the u32 at `state` is incremented, and `body`
    /// runs again while it is below the u32 at `state + 4`; with `skip`
    /// (flag, counter), nothing runs and the u64 at counter is incremented
    /// when the u32 at flag is not 0.
    Loop {
        body: Arc<Vec<Task>>,
        state: usize,
        skip: Option<(usize, usize)>,
    },
    /// A choice: body i for the first i with `table[i] >= *size` (u64s),
    /// else none, `*overflows += 1` and the ranges of `zeros` (address,
    /// bytes) zeroed.
    Switch {
        bodies: Arc<Vec<Arc<Vec<Task>>>>,
        size: usize,
        table: usize,
        overflows: usize,
        zeros: Arc<Vec<(usize, usize)>>,
    },
    /// `body` runs when the u32 at `flag` is 0; otherwise the u64 at
    /// `counter` is incremented.
    Unless {
        body: Arc<Vec<Task>>,
        flag: usize,
        counter: usize,
    },
    /// `rows` blocks of `width` bytes at `dst + i * dst_pitch` copied from
    /// `src + i * src_pitch`, or zeroed when `src` is 0.
    Rows2d {
        dst: usize,
        dst_pitch: usize,
        src: usize,
        src_pitch: usize,
        width: usize,
        rows: usize,
    },
    /// Zeroes `[dst + min(*size * row, bytes), dst + bytes)`.
    ZeroTail {
        dst: usize,
        row: usize,
        size: usize,
        bytes: usize,
    },
}

pub(super) fn run(task: &Task) -> Result<()> {
    match *task {
        // SAFETY (all arms): the addresses were handed to the backend as
        // device pointers of at least `bytes` bytes (library-owned static
        // buffers, or caller buffers under the API contract), and the host
        // backend's device memory is host memory.
        Task::Copy { dst, src, bytes } => {
            if dst != src && bytes > 0 {
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) }
            }
        }
        Task::Zero { dst, bytes } => unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) },
        Task::Accumulate {
            dst,
            src,
            count,
            dtype,
        } => unsafe { accumulate_host(dst as *mut u8, src as *const u8, count, dtype)? },
        Task::Differ { a, b, bytes, flag } => unsafe {
            let (x, y) = (
                std::slice::from_raw_parts(a as *const u8, bytes),
                std::slice::from_raw_parts(b as *const u8, bytes),
            );
            if x != y {
                *(flag as *mut u32) = 1;
            }
        },
        Task::User(ref f) => f(),
        Task::Kernel { ref name, ref f } => match f() {
            0 => {}
            code => {
                return Err(Error::DeviceFault(match &**name {
                    "" => format!("a host kernel returned {code}"),
                    name => format!("host kernel '{name}' returned {code}"),
                }))
            }
        },
        Task::Fill {
            dst,
            pattern,
            elem,
            count,
        } => {
            let bytes = pattern.to_le_bytes();
            for i in 0..count {
                for (k, b) in bytes.iter().take(elem).enumerate() {
                    // SAFETY: as above, `count` elements of `elem` bytes.
                    unsafe { *((dst + i * elem + k) as *mut u8) = *b };
                }
            }
        }
        Task::CopyIndexed {
            dst,
            dst_stride,
            src,
            src_stride,
            bytes,
            index,
        } => {
            // SAFETY: as above; `index` is a u32 the loop owns, and the
            // regions hold `bytes` at every index the loop reaches.
            unsafe {
                let i = *(index as *const u32) as usize;
                let (d, s) = (dst + i * dst_stride, src + i * src_stride);
                if d != s && bytes > 0 {
                    std::ptr::copy(s as *const u8, d as *mut u8, bytes)
                }
            }
        }
        Task::Switch {
            ref bodies,
            size,
            table,
            overflows,
            ref zeros,
        } => {
            // SAFETY: `size` and `overflows` are u64s and `table` holds one
            // u64 per body, in memory the graph's owner keeps.
            let chosen = unsafe {
                let n = *(size as *const u64);
                (0..bodies.len()).find(|&i| *(table as *const u64).add(i) >= n)
            };
            match chosen {
                Some(i) => {
                    for t in bodies[i].iter() {
                        run(t)?;
                    }
                }
                None => {
                    // SAFETY: as above; each range is a buffer of the
                    // graph's owner of that many bytes.
                    unsafe {
                        *(overflows as *mut u64) += 1;
                        for &(dst, bytes) in zeros.iter() {
                            std::ptr::write_bytes(dst as *mut u8, 0, bytes);
                        }
                    }
                }
            }
        }
        Task::ZeroTail {
            dst,
            row,
            size,
            bytes,
        } => {
            // SAFETY: `size` is a u64; `dst` holds `bytes`.
            let n = unsafe { *(size as *const u64) } as usize;
            let start = n.saturating_mul(row).min(bytes);
            unsafe { std::ptr::write_bytes((dst + start) as *mut u8, 0, bytes - start) }
        }
        Task::Rows2d {
            dst,
            dst_pitch,
            src,
            src_pitch,
            width,
            rows,
        } => {
            for i in 0..rows {
                let d = (dst + i * dst_pitch) as *mut u8;
                // SAFETY: as above, each block holds `width` bytes; the
                // regions do not overlap (the backend's contract).
                unsafe {
                    match src {
                        0 => std::ptr::write_bytes(d, 0, width),
                        s => std::ptr::copy((s + i * src_pitch) as *const u8, d, width),
                    }
                }
            }
        }
        Task::Unless {
            ref body,
            flag,
            counter,
        } => {
            // SAFETY: `flag` is a u32 and `counter` a u64 of memory the
            // graph's owner keeps.
            if unsafe { *(flag as *const u32) } != 0 {
                unsafe { *(counter as *mut u64) += 1 };
            } else {
                for t in body.iter() {
                    run(t)?;
                }
            }
        }
        Task::Loop {
            skip: Some((flag, counter)),
            ..
        } if unsafe { *(flag as *const u32) } != 0 => {
            // SAFETY: `flag` is a u32 and `counter` a u64 of memory the
            // graph's owner keeps.
            unsafe { *(counter as *mut u64) += 1 };
        }
        Task::Loop {
            ref body, state, ..
        } => loop {
            for t in body.iter() {
                run(t)?;
            }
            // SAFETY: `state` holds the loop's two u32 (index, count).
            let (i, n) = unsafe {
                let p = state as *mut u32;
                *p += 1;
                (*p, *p.add(1))
            };
            if i >= n {
                break;
            }
        },
    }
    Ok(())
}

/// What `task` is, as a node of a graph's export.
fn node(task: &Task) -> Node {
    match task {
        Task::Copy { bytes, .. } => Node::new("copy", format!("{bytes} bytes")),
        Task::Zero { bytes, .. } => Node::new("zero", format!("{bytes} bytes")),
        Task::Accumulate { count, dtype, .. } => {
            Node::new("accumulate", format!("{count} x {}", dtype.name()))
        }
        Task::Differ { bytes, .. } => Node::new("compare", format!("{bytes} bytes")),
        Task::User(_) => Node::new("host task", ""),
        Task::Kernel { name, .. } => Node::new("host kernel", &**name),
        Task::Fill { elem, count, .. } => Node::new("fill", format!("{count} x {elem} bytes")),
        Task::CopyIndexed { bytes, .. } => Node::new("copy (indexed)", format!("{bytes} bytes")),
        Task::Loop { body, .. } => Node::new("loop", format!("a body of {} tasks", body.len())),
        Task::Switch { bodies, .. } => Node::new("switch", format!("{} bodies", bodies.len())),
        Task::Unless { body, .. } => Node::new("if", format!("a body of {} tasks", body.len())),
        Task::ZeroTail { bytes, .. } => Node::new("zero tail", format!("of {bytes} bytes")),
        Task::Rows2d {
            src, width, rows, ..
        } => Node::new(
            if *src == 0 { "zero (2d)" } else { "copy (2d)" },
            format!("{rows} x {width} bytes"),
        ),
    }
}

/// The nodes of a task list, in the order they run.
pub(super) fn nodes(tasks: &[Task]) -> Nodes {
    Nodes::in_order(tasks.iter().map(node).collect())
}

/// A graph's recorded tasks, shared by the graph and the rebinders made
/// from it.
pub(super) type TaskList = Arc<Mutex<Vec<Task>>>;

pub(super) fn lock(list: &TaskList) -> MutexGuard<'_, Vec<Task>> {
    // Rebinds replace whole addresses; a task list is never half written.
    list.lock().unwrap_or_else(|p| p.into_inner())
}

/// A task that counts its runs in `c` (for the host backend's tests).
#[cfg(test)]
pub(super) fn counter_task(c: &Arc<std::sync::atomic::AtomicU32>) -> HostTask {
    let c = c.clone();
    Arc::new(move || {
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    })
}
