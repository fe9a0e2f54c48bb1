//! What a step's passes write into its parameter grads, microbatch by
//! microbatch, and the sums graphed must make of them. Each grad is one
//! byte repeated: its seed ^ the replay's epoch ^ `grad_mix` of the
//! microbatch (recorded at capture in an unrolled step, read from the
//! loop's index in a WHILE step's body) and, in a WHILE body, of the first
//! byte of the step's first copy in of that callable, which the harness
//! refreshes before every replay. So every microbatch adds a different
//! grad, and a sum over a wrong count, in a wrong order or of another
//! microbatch's data differs wherever the arithmetic tells them apart.

use super::*;
use graphed::core::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// What the grads of step microbatch `m` mix in beside their seed and the
/// epoch (0 for microbatch 0 without data: the grads of a plain replay):
/// bits 0 and 7 of each byte, the sign and a factor of 2 to 8 of an f32,
/// f16 or bf16 element, so that the grads stay of a size and the order of
/// their sum matters.
pub fn grad_mix(m: u32, data: u8) -> u8 {
    // Four different ones for the first four microbatches, then mixed.
    let first = [0x00, 0x80, 0x01, 0x81][m as usize % 4];
    let later = ((m / 4).wrapping_mul(0x9E37_79B9) >> 24) as u8;
    (first ^ later ^ data) & 0x81
}

/// The copy in whose data the grad pass of callable `c` mixes into its
/// grads in the body of step `st` (WHILE only): the step's first input or
/// grad-output copy of `c`.
pub fn data_entry(st: &StepModel, c: usize) -> Option<&IoModel> {
    if !st.device_loop {
        return None;
    }
    st.io
        .iter()
        .find(|e| e.callable as usize == c && (e.role == 0 || e.role == 2))
}

/// The first byte of microbatch `m`'s block of copy in `e`.
fn data_of(e: &IoModel, m: u32) -> u8 {
    // SAFETY: harness memory holding every block of a declared region.
    unsafe { *((e.ptr + m as usize * e.stride) as *const u8) }
}

/// Whether a declared region lies in harness memory (one that needs more
/// is never allocated, and its session cannot capture: the placeholder
/// address low in the address space is never written).
fn in_memory(calls: &[Callable], e: &IoModel, n: u32) -> bool {
    e.ptr >= 1 << 24
        && region_of(calls, true, e, n).is_some_and(|(_, s, b, n)| (n - 1) * s + b <= 64 << 20)
}

/// Fresh data in every block of step `st`'s copies in (their first byte,
/// the one the grads mix in), different for each microbatch, before a
/// replay.
pub fn fresh_data(calls: &[Callable], st: &StepModel, epoch: u8) {
    for (q, e) in st.io.iter().enumerate() {
        if !(e.role == 0 || e.role == 2) || !in_memory(calls, e, st.microbatches) {
            continue;
        }
        for m in 0..st.microbatches as usize {
            let v = epoch.wrapping_mul(29) ^ (m.wrapping_mul(0x3b) ^ q.wrapping_mul(0x65)) as u8;
            // SAFETY: as data_of.
            unsafe { *((e.ptr + m * e.stride) as *mut u8) = v };
        }
    }
}

/// The bytes of parameter `j` of callable `c`'s grad in each of the first
/// `count` microbatches of a replay of step `st` of session `k`.
pub fn grads_of(k: usize, st: &StepModel, c: usize, j: usize, epoch: u8, count: u32) -> Vec<u8> {
    let e = data_entry(st, c);
    let base = seed(k, c, 0, ROLE_PARAM, j) ^ epoch;
    (0..count)
        .map(|m| base ^ grad_mix(m, e.map_or(0, |e| data_of(e, m))))
        .collect()
}

/// The width of the elements graphed sums `dtype` in (None: it sums none).
pub fn sum_width(dtype: u32) -> Option<usize> {
    match dtype {
        0 => Some(4),
        1 | 2 => Some(2),
        _ => None,
    }
}

/// The element of `width` bytes that are all `b`.
fn elem_of(b: u8, width: usize) -> u32 {
    elem_bits(&[b; 4][..width])
}

/// a + b as graphed adds `dtype` (f16 and bf16 in f32, rounded to nearest
/// even), in element bits.
fn add(dtype: u32, a: u32, b: u32) -> u32 {
    match dtype {
        0 => (f32::from_bits(a) + f32::from_bits(b)).to_bits(),
        1 => f32_to_f16(f16_to_f32(a as u16) + f16_to_f32(b as u16)) as u32,
        _ => f32_to_bf16(bf16_to_f32(a as u16) + bf16_to_f32(b as u16)) as u32,
    }
}

fn is_nan(dtype: u32, v: u32) -> bool {
    match dtype {
        0 => f32::from_bits(v).is_nan(),
        1 => v & 0x7c00 == 0x7c00 && v & 0x3ff != 0,
        _ => v & 0x7f80 == 0x7f80 && v & 0x7f != 0,
    }
}

/// The sum of the grads `gs` in order: from -0.0 in a WHILE step (its sums
/// start there), from the first grad in an unrolled one.
pub fn sum_of(dtype: u32, gs: &[u8], from_negative_zero: bool) -> u32 {
    let w = sum_width(dtype).unwrap();
    let (start, rest) = if from_negative_zero {
        (if w == 4 { 0x8000_0000 } else { 0x8000 }, gs)
    } else {
        (elem_of(gs[0], w), &gs[1..])
    };
    rest.iter()
        .fold(start, |a, &g| add(dtype, a, elem_of(g, w)))
}

/// Checks that every element of the `bytes` at `p` is `want` (a NaN for a
/// NaN); returns the first element's bits.
pub fn check_sum(p: usize, bytes: usize, dtype: u32, want: u32, what: &str) -> u32 {
    let w = sum_width(dtype).unwrap();
    // SAFETY: a clone or destination of `bytes` bytes.
    let got = unsafe { std::slice::from_raw_parts(p as *const u8, bytes) };
    for (e, c) in got.chunks_exact(w).enumerate() {
        let x = elem_bits(c);
        assert!(
            x == want || (is_nan(dtype, x) && is_nan(dtype, want)),
            "{what}: element {e} is 0x{x:x}, expected 0x{want:x} (dtype {dtype})"
        );
    }
    elem_bits(&got[..w])
}

/// An ACCUMULATE_INTO destination of `dtype` after the grads `gs` were
/// added to what it held (`before`), in order.
pub fn check_accumulated_all(before: &[u8], dst: usize, dtype: u32, gs: &[u8], what: &str) {
    let w = sum_width(dtype).unwrap();
    // SAFETY: harness memory of before.len() bytes.
    let got = unsafe { std::slice::from_raw_parts(dst as *const u8, before.len()) };
    for (e, (c, was)) in got.chunks_exact(w).zip(before.chunks_exact(w)).enumerate() {
        let want = gs
            .iter()
            .fold(elem_bits(was), |a, &g| add(dtype, a, elem_of(g, w)));
        let x = elem_bits(c);
        assert!(
            x == want || (is_nan(dtype, x) && is_nan(dtype, want)),
            "{what}: ACCUMULATE_INTO over {} microbatches, element {e}: 0x{x:x}, expected 0x{want:x} (dtype {dtype})",
            gs.len()
        );
    }
}
