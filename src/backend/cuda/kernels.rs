//! graphed's own kernels (scripts/gen_ptx.py, embedded as PTX and loaded
//! once per device): the ACCUMULATE_INTO kernels (one tensor at a time,
//! vectorised where aligned, or up to `BATCH` tensors per launch) and the
//! comparison kernels rebinding verification uses, and the zeroing of a
//! bucket's rows past its actual size; and how they are launched.

use super::driver::check;
use crate::backend::{AccItem, DevPtr, StreamRef, Tail};
use crate::core::dtype::DType;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::ptr::null_mut;

/// Where kernels launch: a device's loaded kernels and its size.
#[derive(Clone, Copy)]
pub(super) struct On<'a> {
    pub kernels: &'a Kernels,
    pub sm_count: u32,
}

/// The most u64 parameters `launch_grid` passes.
const MAX_ARGS: usize = 4;

/// The library's kernels (accumulate, compare; scripts/gen_ptx.py),
/// NUL-terminated for cuModuleLoadData.
static KERNELS_PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

/// Descriptors per batched accumulate launch (the kernel's parameter array).
const BATCH: usize = 160;

/// The kernels of one dtype.
#[derive(Clone, Copy)]
pub(super) struct AccKernels {
    vector: sys::CUfunction,
    scalar: sys::CUfunction,
    batch: sys::CUfunction,
    /// Elements per 16-byte vector.
    per_vec: usize,
}

pub(super) struct Kernels {
    pub module: sys::CUmodule,
    f32: AccKernels,
    f16: AccKernels,
    bf16: AccKernels,
    /// Whether two buffers differ, by 4-byte words and by bytes.
    differ_b32: sys::CUfunction,
    differ_b8: sys::CUfunction,
    /// Zeroes a bucket's rows past the size in device memory.
    zero_tail: sys::CUfunction,
}

impl Kernels {
    fn of(&self, dtype: DType) -> Result<AccKernels> {
        match dtype {
            DType::F32 => Ok(self.f32),
            DType::F16 => Ok(self.f16),
            DType::Bf16 => Ok(self.bf16),
            other => Err(Error::invalid(format!(
                "cannot accumulate {}",
                other.name()
            ))),
        }
    }
}

/// Loads the module and looks its kernels up (the context is bound).
pub(super) fn load_kernels() -> Result<Kernels> {
    let mut module: sys::CUmodule = null_mut();
    // SAFETY: the image is a NUL-terminated PTX string; the context is bound.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut module, KERNELS_PTX.as_ptr().cast())
    })?;
    let get = |name: &'static str| -> Result<sys::CUfunction> {
        let mut f: sys::CUfunction = null_mut();
        let cname =
            std::ffi::CString::new(name).map_err(|_| Error::Internal("kernel name".into()))?;
        // SAFETY: module is loaded; valid out pointer and C string.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut f, module, cname.as_ptr())
        })?;
        Ok(f)
    };
    let k = (|| {
        let kernels = |vector, scalar, batch, per_vec| -> Result<AccKernels> {
            Ok(AccKernels {
                vector: get(vector)?,
                scalar: get(scalar)?,
                batch: get(batch)?,
                per_vec,
            })
        };
        Ok(Kernels {
            module,
            f32: kernels(
                "graphed_acc_f32x4",
                "graphed_acc_f32",
                "graphed_acc_batch_f32",
                4,
            )?,
            f16: kernels(
                "graphed_acc_f16x8",
                "graphed_acc_f16",
                "graphed_acc_batch_f16",
                8,
            )?,
            bf16: kernels(
                "graphed_acc_bf16x8",
                "graphed_acc_bf16",
                "graphed_acc_batch_bf16",
                8,
            )?,
            differ_b32: get("graphed_differ_b32")?,
            differ_b8: get("graphed_differ_b8")?,
            zero_tail: get("graphed_zero_tail")?,
        })
    })();
    if k.is_err() {
        // SAFETY: the module was loaded above and is not used after this.
        unsafe { sys::cuModuleUnload(module) };
    }
    k
}

/// One tensor: vectorised where both addresses are 16-byte aligned.
fn accumulate_one(
    on: On,
    dst: DevPtr,
    src: DevPtr,
    count: usize,
    dtype: DType,
    stream: StreamRef,
) -> Result<()> {
    let k = on.kernels.of(dtype)?;
    if dst % 16 == 0 && src % 16 == 0 {
        let nvec = count / k.per_vec;
        launch_acc(on, k.vector, dst, src, nvec, stream)?;
        let done = (nvec * 16) as u64;
        launch_acc(
            on,
            k.scalar,
            dst + done,
            src + done,
            count - nvec * k.per_vec,
            stream,
        )
    } else {
        launch_acc(on, k.scalar, dst, src, count, stream)
    }
}

fn launch_acc(
    on: On,
    f: sys::CUfunction,
    dst: DevPtr,
    src: DevPtr,
    n: usize,
    stream: StreamRef,
) -> Result<()> {
    // SAFETY: the accumulate kernels take (dst, src, n); dst/src hold n
    // elements (or vectors) per the caller's contract.
    unsafe { launch_grid(on, f, &mut [dst, src, n as u64], n, stream) }
}

/// Launches `f`, which takes `args.len()` u64 parameters (at most
/// `MAX_ARGS`), over a grid striding across `n` items (nothing for n = 0).
///
/// # Safety
/// `f` takes exactly these u64 parameters, and the memory they name
/// holds what the kernel reads and writes for `n` items.
unsafe fn launch_grid(
    on: On,
    f: sys::CUfunction,
    args: &mut [u64],
    n: usize,
    stream: StreamRef,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let threads = 256u32;
    let blocks = n
        .div_ceil(threads as usize)
        .min(on.sm_count as usize * 16)
        .max(1) as u32;
    // One pointer per parameter, on the stack: replays launch these.
    let mut params = [null_mut::<c_void>(); MAX_ARGS];
    for (p, a) in params.iter_mut().zip(args.iter_mut()) {
        *p = (a as *mut u64).cast();
    }
    // SAFETY: the parameters are passed by address, one per u64 the
    // kernel takes (the caller's promise).
    let r = unsafe {
        sys::cuLaunchKernel(
            f,
            blocks,
            1,
            1,
            threads,
            1,
            1,
            0,
            stream.0 as sys::CUstream,
            params.as_mut_ptr(),
            null_mut(),
        )
    };
    check("cuLaunchKernel", r)
}

/// `dst += src` for every item (see `Backend::accumulate`): one batched
/// launch per `BATCH` items when all are 16-byte aligned, else one per item.
pub(super) fn accumulate(on: On, items: &[AccItem], dtype: DType, stream: StreamRef) -> Result<()> {
    let k = on.kernels.of(dtype)?;
    if items.iter().any(|it| it.dst % 16 != 0 || it.src % 16 != 0) {
        // The batched kernel reads 16-byte vectors; element-aligned
        // tensors go one launch each.
        for it in items {
            accumulate_one(on, it.dst, it.src, it.count, dtype, stream)?;
        }
        return Ok(());
    }
    for group in items.chunks(BATCH) {
        // The kernel's parameters: a u32 count, then the descriptor array
        // (8-aligned); unused descriptors are never read.
        let mut count = group.len() as u32;
        let mut desc = [0u64; BATCH * 3];
        for (i, it) in group.iter().enumerate() {
            desc[3 * i] = it.dst;
            desc[3 * i + 1] = it.src;
            desc[3 * i + 2] = it.count as u64;
        }
        let most = group
            .iter()
            .map(|it| it.count / k.per_vec)
            .max()
            .unwrap_or(0)
            .max(1);
        let per_tensor = (on.sm_count as usize * 16).div_ceil(group.len()).max(1);
        let blocks_x = most.div_ceil(256).min(per_tensor).max(1) as u32;
        let mut params: [*mut c_void; 2] =
            [(&mut count as *mut u32).cast(), desc.as_mut_ptr().cast()];
        // SAFETY: the kernel takes (u32, 3840-byte array), passed by
        // address; every descriptor's buffers hold `count` elements of
        // `dtype`, 16-byte aligned, per the caller's contract.
        let r = unsafe {
            sys::cuLaunchKernel(
                k.batch,
                blocks_x,
                group.len() as u32,
                1,
                256,
                1,
                1,
                0,
                stream.0 as sys::CUstream,
                params.as_mut_ptr(),
                null_mut(),
            )
        };
        check("cuLaunchKernel(accumulate batch)", r)?;
    }
    Ok(())
}

/// Sets the u32 at `flag` when `bytes` at `a` and `b` differ (see
/// `Backend::differ`).
pub(super) fn differ(
    on: On,
    a: DevPtr,
    b: DevPtr,
    bytes: usize,
    flag: DevPtr,
    stream: StreamRef,
) -> Result<()> {
    let k = on.kernels;
    // Whole 4-byte words where both are aligned to them, bytes for the rest.
    let words = if a % 4 == 0 && b % 4 == 0 {
        bytes / 4
    } else {
        0
    };
    let done = 4 * words as u64;
    // SAFETY: both kernels take (a, b, n, flag); a and b hold `bytes`
    // bytes and flag a u32 of device memory, per the caller's contract.
    unsafe {
        launch_grid(
            on,
            k.differ_b32,
            &mut [a, b, words as u64, flag],
            words,
            stream,
        )?;
        let rest = bytes - 4 * words;
        launch_grid(
            on,
            k.differ_b8,
            &mut [a + done, b + done, rest as u64, flag],
            rest,
            stream,
        )
    }
}

/// Zeroes `[dst + min(n * row, bytes), dst + bytes)`, n the u64 at `size`
/// when the kernel runs: one thread per 16 bytes of the most it can take.
pub(super) fn zero_tail(on: On, t: Tail, stream: StreamRef) -> Result<()> {
    let threads = t.most.min(t.bytes).div_ceil(16).max(1);
    // SAFETY: the kernel takes (dst, row, size, bytes); dst holds `bytes`
    // bytes and size a u64 of device memory, per the caller's contract.
    unsafe {
        launch_grid(
            on,
            on.kernels.zero_tail,
            &mut [t.dst, t.row as u64, t.size, t.bytes as u64],
            threads,
            stream,
        )
    }
}
