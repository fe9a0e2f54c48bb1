//! Checked size arithmetic. Every size, count and offset a caller controls
//! goes through these helpers: a single buffer may hold at most
//! [`MAX_BYTES`], and sums, products and roundings that would wrap are
//! reported as `OutOfMemory` naming what overflowed, never computed modulo
//! 2^64.

use super::ALIGN;
use crate::error::{Error, Result};

/// The largest buffer graphed places or accepts: 2^48 bytes (256 TiB, more
/// than any device holds). Below it, rounding up to [`ALIGN`] cannot wrap.
pub const MAX_BYTES: usize = 1 << 48;

/// `n` rounded up to a multiple of [`ALIGN`], or None when that wraps.
pub const fn align_up(n: usize) -> Option<usize> {
    match n.checked_add(ALIGN - 1) {
        Some(m) => Some(m / ALIGN * ALIGN),
        None => None,
    }
}

fn overflow(what: &str) -> Error {
    Error::OutOfMemory(format!(
        "{what} overflows the address space (more than 2^64 bytes)"
    ))
}

/// [`align_up`] as a `Result` naming `what`.
pub fn aligned(n: usize, what: &str) -> Result<usize> {
    align_up(n).ok_or_else(|| overflow(what))
}

/// `a + b`, or `OutOfMemory` naming `what`.
pub fn add(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_add(b).ok_or_else(|| overflow(what))
}

/// Checks one caller-given size: at most [`MAX_BYTES`], else
/// `InvalidArgument` naming the argument.
pub fn check_bytes(bytes: usize, what: &str) -> Result<usize> {
    if bytes > MAX_BYTES {
        return Err(Error::invalid(format!(
            "{what} is {bytes} bytes; graphed accepts at most 2^48 bytes ({MAX_BYTES}) per buffer"
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_up_rounds_and_never_wraps() {
        assert_eq!(align_up(0), Some(0));
        assert_eq!(align_up(1), Some(ALIGN));
        assert_eq!(align_up(ALIGN), Some(ALIGN));
        assert_eq!(align_up(MAX_BYTES + 1), Some(MAX_BYTES + ALIGN));
        assert_eq!(align_up(usize::MAX), None);
        assert_eq!(align_up(usize::MAX - ALIGN + 2), None);
        assert!(aligned(usize::MAX - 3, "x").is_err());
    }

    #[test]
    fn sums_and_sizes_are_checked() {
        assert_eq!(add(1, 2, "x").unwrap(), 3);
        let e = add(usize::MAX, 1, "the static buffers").unwrap_err();
        assert!(e.to_string().contains("the static buffers"), "{e}");
        assert!(matches!(e, Error::OutOfMemory(_)));
        assert!(check_bytes(MAX_BYTES, "x").is_ok());
        let e = check_bytes(1 << 63, "desc.inputs[0].bytes").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(e.to_string().contains("desc.inputs[0].bytes"), "{e}");
    }
}
