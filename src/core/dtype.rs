//! Element types, their sizes, and the dtype-aware accumulate that the host
//! backend runs (the CUDA backend runs the same arithmetic as PTX):
//! `dst += src` computed in f32 and rounded to nearest-even.

use crate::error::{Error, Result};

/// Element type of a tensor. C name: `graphed_dtype`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    F64 = 3,
    I8 = 4,
    U8 = 5,
    I32 = 6,
    I64 = 7,
    Bool = 8,
}

/// The dtypes ACCUMULATE_INTO supports.
pub(crate) const ACCUMULABLE: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

impl DType {
    /// The dtype for a C value, or an error naming the field.
    pub fn from_code(code: u32, what: &str) -> Result<DType> {
        Ok(match code {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Bf16,
            3 => DType::F64,
            4 => DType::I8,
            5 => DType::U8,
            6 => DType::I32,
            7 => DType::I64,
            8 => DType::Bool,
            _ => {
                return Err(Error::invalid(format!(
                    "{what}: {code} is not a graphed_dtype value"
                )))
            }
        })
    }

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
/// # Safety
/// `dst` and `src` must each point to `count` valid, aligned elements of
/// `dtype`; they may be the same buffer but must not otherwise overlap.
pub unsafe fn accumulate_host(
    dst: *mut u8,
    src: *const u8,
    count: usize,
    dtype: DType,
) -> Result<()> {
    if dtype == DType::F32 {
        let (d, s) = (dst as *mut f32, src as *const f32);
        for i in 0..count {
            // SAFETY: i < count, within both buffers per the contract.
            unsafe { *d.add(i) += *s.add(i) };
        }
    } else if let Some((to, from)) = half_codec(dtype) {
        let (d, s) = (dst as *mut u16, src as *const u16);
        for i in 0..count {
            // SAFETY: i < count, within both buffers per the contract.
            unsafe { *d.add(i) = to(from(*d.add(i)) + from(*s.add(i))) };
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
    fn codes_round_trip() {
        for code in 0..9 {
            assert_eq!(DType::from_code(code, "x").unwrap() as u32, code);
        }
        assert!(DType::from_code(9, "x").is_err());
    }

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
    fn accumulate_rejects_other_dtypes() {
        let mut d = [0u8; 8];
        let s = [0u8; 8];
        // SAFETY: 8 bytes each, count 1 of i64.
        let r = unsafe { accumulate_host(d.as_mut_ptr(), s.as_ptr(), 1, DType::I64) };
        assert!(r.is_err());
    }
}
