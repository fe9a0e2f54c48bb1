//! Element types, their sizes, and the dtype-aware accumulate that the host
//! backend runs (the CUDA backend runs the same arithmetic as PTX):
//! `dst += src` computed in f32 and rounded to nearest-even.

use crate::error::{Error, Result};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    Bf16,
    F64,
    I8,
    U8,
    I32,
    I64,
    Bool,
}

/// The dtypes ACCUMULATE_INTO supports.
pub(crate) const ACCUMULABLE: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::F64 | DType::I64 => 8,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }

    /// Whether ACCUMULATE_INTO supports this dtype.
    pub fn accumulable(self) -> bool {
        ACCUMULABLE.contains(&self)
    }
}

/// f32 to bf16, round to nearest even; NaN stays a quiet NaN. The PTX kernel
/// does exactly this, so host and CUDA results are bit-identical.
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if x.is_nan() {
        return ((u >> 16) | 0x0040) as u16;
    }
    let lsb = (u >> 16) & 1;
    (u.wrapping_add(0x7FFF + lsb) >> 16) as u16
}

pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

pub fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// Conversions between f32 and a 16-bit float format: (to bits, from bits).
pub type HalfCodec = (fn(f32) -> u16, fn(u16) -> f32);

/// The codec of a 16-bit float dtype, None for other dtypes.
pub fn half_codec(dtype: DType) -> Option<HalfCodec> {
    match dtype {
        DType::F16 => Some((f32_to_f16, f16_to_f32)),
        DType::Bf16 => Some((f32_to_bf16, bf16_to_f32)),
        _ => None,
    }
}

/// `dst[i] += src[i]` for `count` elements of `dtype` (f32, f16 or bf16),
/// the sum computed in f32 and rounded to nearest even.
///
/// Elements are read and written unaligned: the caller's destination needs
/// no alignment (the C API still asks for element alignment, which the CUDA
/// kernels need).
///
/// # Safety
/// `dst` and `src` must each point to `count` valid elements of `dtype`;
/// they may be the same buffer but must not otherwise overlap.
pub unsafe fn accumulate_host(
    dst: *mut u8,
    src: *const u8,
    count: usize,
    dtype: DType,
) -> Result<()> {
    if dtype == DType::F32 {
        let (d, s) = (dst as *mut f32, src as *const f32);
        for i in 0..count {
            // SAFETY: i < count, within both buffers per the contract;
            // unaligned accesses are allowed for any address.
            unsafe {
                d.add(i)
                    .write_unaligned(d.add(i).read_unaligned() + s.add(i).read_unaligned())
            };
        }
    } else if let Some((to, from)) = half_codec(dtype) {
        let (d, s) = (dst as *mut u16, src as *const u16);
        for i in 0..count {
            // SAFETY: as above.
            unsafe {
                let sum = from(d.add(i).read_unaligned()) + from(s.add(i).read_unaligned());
                d.add(i).write_unaligned(to(sum));
            }
        }
    } else {
        return Err(Error::invalid(format!(
            "ACCUMULATE_INTO supports f32, f16 and bf16, not {}",
            dtype.name()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is exactly half way between two bf16 values: ties to even (down).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        // 1 + 3 * 2^-8 is half way with an odd lower neighbour: rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        // Just above half way rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
    }

    #[test]
    fn accumulate_matches_f32_then_round() {
        let a = [1.5f32, -2.25, 1e-3, 65504.0];
        let b = [0.25f32, 2.25, 3e-3, 16.0];
        for dtype in [DType::F16, DType::Bf16] {
            let (to, from) = half_codec(dtype).unwrap();
            let mut d: Vec<u16> = a.iter().map(|&x| to(x)).collect();
            let s: Vec<u16> = b.iter().map(|&x| to(x)).collect();
            // SAFETY: both vectors hold 4 elements of 2 bytes.
            unsafe { accumulate_host(d.as_mut_ptr().cast(), s.as_ptr().cast(), 4, dtype).unwrap() };
            for i in 0..4 {
                assert_eq!(
                    d[i],
                    to(from(to(a[i])) + from(to(b[i]))),
                    "{dtype:?} element {i}"
                );
            }
        }
        let mut d = a;
        // SAFETY: 4 f32 elements each.
        unsafe {
            accumulate_host(d.as_mut_ptr().cast(), b.as_ptr().cast(), 4, DType::F32).unwrap()
        };
        assert_eq!(d, [1.75, 0.0, 1e-3 + 3e-3, 65520.0]);
    }

    #[test]
    fn accumulate_handles_misaligned_buffers() {
        // Destination and source at odd addresses inside byte buffers.
        let mut dst = [0u8; 4 * 3 + 1];
        let mut src = [0u8; 4 * 3 + 3];
        for (i, v) in [1.0f32, 2.0, 3.0].iter().enumerate() {
            dst[1 + 4 * i..1 + 4 * i + 4].copy_from_slice(&v.to_ne_bytes());
            src[3 + 4 * i..3 + 4 * i + 4].copy_from_slice(&(v * 10.0).to_ne_bytes());
        }
        // SAFETY: 3 f32 elements at each (unaligned) start.
        unsafe {
            accumulate_host(dst.as_mut_ptr().add(1), src.as_ptr().add(3), 3, DType::F32).unwrap()
        };
        let got: Vec<f32> = (0..3)
            .map(|i| f32::from_ne_bytes(dst[1 + 4 * i..5 + 4 * i].try_into().unwrap()))
            .collect();
        assert_eq!(got, vec![11.0, 22.0, 33.0]);
        let mut h = [0u8; 5];
        let one = f32_to_bf16(1.0).to_ne_bytes();
        h[1..3].copy_from_slice(&one);
        h[3..5].copy_from_slice(&one);
        // SAFETY: one bf16 element at each odd address.
        unsafe {
            accumulate_host(h.as_mut_ptr().add(1), h.as_ptr().add(3), 1, DType::Bf16).unwrap()
        };
        assert_eq!(u16::from_ne_bytes([h[1], h[2]]), f32_to_bf16(2.0));
    }

    #[test]
    fn accumulate_rejects_other_dtypes() {
        let mut d = [0u8; 8];
        let s = [0u8; 8];
        // SAFETY: 8 bytes each, count 1 of i64.
        let r = unsafe { accumulate_host(d.as_mut_ptr(), s.as_ptr(), 1, DType::I64) };
        assert!(r.is_err());
    }
}
