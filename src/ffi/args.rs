//! C arguments into Rust values: output pointers, arrays, and the structs
//! callers fill. Every caller-filled struct starts with `size_t
//! struct_size; uint32_t magic;`, both set by its `_default()` function: a
//! struct whose magic is wrong was not initialised and is refused before
//! anything else of it is read; a smaller `struct_size` (a caller built
//! against an older header) is accepted down to the first released layout,
//! and the fields it lacks keep their defaults. Arrays of such structs
//! take their stride from the first element's `struct_size`.

use crate::error::{Error, Result};
use std::mem::{align_of, size_of};

/// A struct the caller fills.
///
/// # Safety
/// Implementors are `#[repr(C)]` plain data for which every bit pattern is
/// valid (integers and pointers only: no `bool`, no Rust enum), starting
/// with `struct_size: usize` at offset 0 and `magic: u32` at offset 8.
pub(crate) unsafe trait CStruct: Copy + 'static {
    /// The C type name, for messages.
    const NAME: &'static str;
    const MAGIC: u32;
    /// The size of the first released layout: callers may pass any size
    /// from this one up.
    const MIN_SIZE: usize;
    /// What `_default()` returns.
    fn defaults() -> Self;
}

/// Offsets every `CStruct` shares, checked at compile time per type with
/// [`assert_header!`].
pub(crate) const SIZE_OFFSET: usize = 0;
pub(crate) const MAGIC_OFFSET: usize = 8;
/// Bytes of the header (size and magic); fields start at or after it.
pub(crate) const HEADER: usize = 12;

/// Asserts at compile time that a struct has the `CStruct` header and that
/// its current size is at least its first released one.
macro_rules! assert_header {
    ($t:ty) => {
        const _: () = {
            assert!(std::mem::offset_of!($t, struct_size) == $crate::ffi::args::SIZE_OFFSET);
            assert!(std::mem::offset_of!($t, magic) == $crate::ffi::args::MAGIC_OFFSET);
            assert!(std::mem::size_of::<$t>() >= <$t as $crate::ffi::args::CStruct>::MIN_SIZE);
        };
    };
}
pub(crate) use assert_header;

/// A checked output pointer: NULL is an error, and nothing is written here;
/// callers write through it only once the whole call has succeeded.
pub(crate) fn arg_out<T>(p: *mut T, what: &'static str) -> Result<*mut T> {
    if p.is_null() {
        Err(Error::NullPointer { what })
    } else if (p as usize) % align_of::<T>() != 0 {
        Err(Error::invalid(format!(
            "{what} (0x{:x}) is not aligned for its type ({} bytes)",
            p as usize,
            align_of::<T>()
        )))
    } else {
        Ok(p)
    }
}

/// A call that answers one value: checks the output pointer first, then
/// writes what `answer` gives, only when it succeeds.
///
/// # Safety
/// A non-NULL `p` must be writable.
pub(crate) unsafe fn write_answer<T>(
    p: *mut T,
    what: &'static str,
    answer: impl FnOnce() -> Result<T>,
) -> Result<()> {
    let out = arg_out(p, what)?;
    let value = answer()?;
    // SAFETY: checked non-NULL and aligned; the caller's promise.
    unsafe { out.write(value) };
    Ok(())
}

/// Checks that `len` elements of `elem` bytes at `p` make a valid range.
fn check_range(p: usize, len: usize, elem: usize, align: usize, what: &str) -> Result<()> {
    match len.checked_mul(elem) {
        Some(total) if total <= isize::MAX as usize && p.checked_add(total).is_some() => {}
        _ => {
            return Err(Error::invalid(format!(
                "{what}: {len} elements of {elem} bytes do not fit in memory"
            )))
        }
    }
    if p % align != 0 {
        return Err(Error::invalid(format!(
            "{what} (0x{p:x}) is not aligned for its element type ({align} bytes)"
        )));
    }
    Ok(())
}

/// An optional C string: `None` for NULL, else its text, which must be
/// UTF-8.
///
/// # Safety
/// A non-NULL `p` points to a NUL-terminated string.
pub(crate) unsafe fn arg_str(p: *const std::ffi::c_char, what: &str) -> Result<Option<String>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated per this function's contract.
    let s = unsafe { std::ffi::CStr::from_ptr(p) };
    s.to_str()
        .map(|s| Some(s.to_string()))
        .map_err(|_| Error::invalid(format!("{what} is not valid UTF-8")))
}

/// A slice from a C pointer and length. A length of zero gives an empty
/// slice whatever the pointer; a non-zero length with NULL is an error, as
/// is a length whose bytes overflow or a misaligned pointer.
///
/// # Safety
/// When `len > 0`, `p` must point to `len` valid, initialised `T`s that
/// outlive `'a` and are not mutated while the slice lives.
pub(crate) unsafe fn arg_slice<'a, T>(
    p: *const T,
    len: usize,
    what: &'static str,
) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    check_range(p as usize, len, size_of::<T>(), align_of::<T>(), what)?;
    // SAFETY: non-NULL, aligned, a valid range, and the caller guarantees
    // `len` initialised elements.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// A struct the caller did not set up with its `_default()` function:
/// `detail` says what is wrong, and the message adds how to set it up.
fn bad_struct(what: String, detail: String) -> Error {
    Error::BadStruct {
        what,
        detail: format!(
            "{detail} (initialise it with its _default() function, then set the fields you need)"
        ),
    }
}

/// Checks the header of the struct at `p`; returns its `struct_size`.
///
/// # Safety
/// `p` must point to at least `HEADER` readable bytes.
unsafe fn header<T: CStruct>(p: *const u8, what: &dyn Fn() -> String) -> Result<usize> {
    // SAFETY: the caller guarantees the header bytes; unaligned reads
    // accept any address.
    let (size, magic) = unsafe {
        (
            std::ptr::read_unaligned(p.add(SIZE_OFFSET) as *const usize),
            std::ptr::read_unaligned(p.add(MAGIC_OFFSET) as *const u32),
        )
    };
    if magic != T::MAGIC {
        return Err(bad_struct(
            what(),
            format!(
                "is not an initialised {} (its magic field is 0x{magic:08x}, not 0x{:08x})",
                T::NAME,
                T::MAGIC
            ),
        ));
    }
    if size < T::MIN_SIZE {
        return Err(bad_struct(
            what(),
            format!(
                "has struct_size {size}; the smallest {} is {} bytes",
                T::NAME,
                T::MIN_SIZE
            ),
        ));
    }
    Ok(size)
}

/// Copies the caller's struct at `p` (of `size` bytes) over the defaults.
///
/// # Safety
/// `p` must point to `size` readable bytes.
unsafe fn copy_over_defaults<T: CStruct>(p: *const u8, size: usize) -> T {
    let mut out = T::defaults();
    let n = size.min(size_of::<T>());
    // SAFETY: the caller guarantees `size` readable bytes; at most
    // size_of::<T>() are written into `out`, and any bytes form a valid T
    // (the CStruct contract).
    unsafe { std::ptr::copy_nonoverlapping(p, &mut out as *mut T as *mut u8, n) };
    out
}

/// Reads a caller-filled struct (see the module comment).
///
/// # Safety
/// `p` must be NULL or point to a struct the caller filled, of at least
/// its `struct_size` readable bytes (12 at least, for the header).
pub(crate) unsafe fn read_struct<T: CStruct>(p: *const T, what: &'static str) -> Result<T> {
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    let p = p as *const u8;
    // SAFETY: per this function's contract.
    let size = unsafe { header::<T>(p, &|| what.to_string()) }?;
    // SAFETY: the header said `size` bytes, and the magic shows the caller
    // set it with the struct's _default().
    Ok(unsafe { copy_over_defaults(p, size) })
}

/// Reads an array of `n` caller-filled structs whose stride is the first
/// element's `struct_size`; every element must have that size.
///
/// # Safety
/// When `n > 0`, `p` must point to `n` structs of the first one's
/// `struct_size` each.
pub(crate) unsafe fn read_array<T: CStruct>(
    p: *const T,
    n: usize,
    what: &'static str,
) -> Result<Vec<T>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    let base = p as *const u8;
    // SAFETY: the first element is there per the contract.
    let stride = unsafe { header::<T>(base, &|| format!("{what}[0]")) }?;
    check_range(base as usize, n, stride, 1, what)?;
    (0..n)
        .map(|i| {
            // SAFETY: i * stride is inside the range checked above.
            let e = unsafe { base.add(i * stride) };
            // SAFETY: element i is there per the contract.
            let size = unsafe { header::<T>(e, &|| format!("{what}[{i}]")) }?;
            if size != stride {
                return Err(bad_struct(
                    format!("{what}[{i}]"),
                    format!(
                        "has struct_size {size} but {what}[0] has {stride}: the elements of an array all have \
                         the size of the array's element type"
                    ),
                ));
            }
            // SAFETY: `size` bytes of element i.
            Ok(unsafe { copy_over_defaults(e, size) })
        })
        .collect()
}

/// Checks the header of an output struct the caller initialised with its
/// `_default()`, before anything else of the call runs (`write_struct`
/// checks it again when it writes).
///
/// # Safety
/// `p` must be NULL or point to at least the header's bytes.
pub(crate) unsafe fn check_struct<T: CStruct>(p: *const T, what: &'static str) -> Result<()> {
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    // SAFETY: per this function's contract.
    unsafe { header::<T>(p as *const u8, &|| what.to_string()) }.map(|_| ())
}

/// Writes `value` into an output struct the caller initialised with its
/// `_default()`: as many bytes as the caller's `struct_size` holds, its
/// header left as the caller set it.
///
/// # Safety
/// `p` must be NULL or point to a writable struct the caller initialised,
/// of at least its `struct_size` bytes.
pub(crate) unsafe fn write_struct<T: CStruct>(
    p: *mut T,
    value: &T,
    what: &'static str,
) -> Result<()> {
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    // SAFETY: per this function's contract.
    let size = unsafe { header::<T>(p as *const u8, &|| what.to_string()) }?;
    let n = size.min(size_of::<T>());
    // SAFETY: the caller's struct has `size` writable bytes; bytes
    // [HEADER, n) are written from a full T.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (value as *const T as *const u8).add(HEADER),
            (p as *mut u8).add(HEADER),
            n - HEADER,
        )
    };
    Ok(())
}

/// Checks an output array of `n` elements of `stride` bytes (the caller's
/// element size, at least `min`) before anything is written to it.
pub(crate) fn check_out_array<T>(
    p: *mut T,
    n: usize,
    stride: usize,
    min: usize,
    what: &'static str,
) -> Result<()> {
    if stride < min {
        return Err(Error::invalid(format!(
            "{what}: the element size is {stride} bytes; the smallest is {min} (set it from sizeof)"
        )));
    }
    if n == 0 {
        return Ok(());
    }
    if p.is_null() {
        return Err(Error::NullPointer { what });
    }
    check_range(p as usize, n, stride, align_of::<T>(), what)?;
    if stride % align_of::<T>() != 0 {
        return Err(Error::invalid(format!(
            "{what}: an element size of {stride} bytes breaks the alignment of its type"
        )));
    }
    Ok(())
}

/// Writes element `i` of an output array checked by [`check_out_array`]:
/// at most `stride` bytes of `value`.
///
/// # Safety
/// The array must have passed `check_out_array` with `stride`, and `i` be
/// below its length.
pub(crate) unsafe fn write_element<T>(p: *mut T, stride: usize, i: usize, value: &T) {
    let n = stride.min(size_of::<T>());
    // SAFETY: element i lies inside the checked range; `n` bytes fit in it.
    unsafe {
        std::ptr::copy_nonoverlapping(
            value as *const T as *const u8,
            (p as *mut u8).add(i * stride),
            n,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A struct as a newer library sees it: the first release had only
    /// `a`; `b` was appended later and defaults to 7.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct V2 {
        struct_size: usize,
        magic: u32,
        a: u32,
        b: u64,
    }

    // SAFETY: repr(C), integers only, header at offsets 0 and 8.
    unsafe impl CStruct for V2 {
        const NAME: &'static str = "v2";
        const MAGIC: u32 = 0x1234_5678;
        const MIN_SIZE: usize = 16;
        fn defaults() -> V2 {
            V2 {
                struct_size: size_of::<V2>(),
                magic: Self::MAGIC,
                a: 1,
                b: 7,
            }
        }
    }
    assert_header!(V2);

    /// The first released layout.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct V1 {
        struct_size: usize,
        magic: u32,
        a: u32,
    }

    #[test]
    fn an_older_callers_struct_gets_defaults_for_newer_fields() {
        let old = V1 {
            struct_size: size_of::<V1>(),
            magic: V2::MAGIC,
            a: 42,
        };
        // SAFETY: `old` has its struct_size readable bytes.
        let got = unsafe { read_struct(&old as *const V1 as *const V2, "old") }.unwrap();
        assert_eq!((got.a, got.b), (42, 7));
    }

    #[test]
    fn uninitialised_and_too_small_structs_are_refused() {
        let mut v = V2::defaults();
        v.magic = 0;
        // SAFETY: a full V2.
        let e = unsafe { read_struct(&v, "cfg") }.unwrap_err();
        assert!(matches!(e, Error::BadStruct { .. }), "{e}");
        assert!(e.to_string().contains("not an initialised v2"), "{e}");
        let mut v = V2::defaults();
        v.struct_size = 12;
        // SAFETY: as above.
        let e = unsafe { read_struct(&v, "cfg") }.unwrap_err();
        assert!(e.to_string().contains("struct_size 12"), "{e}");
        // SAFETY: NULL is checked.
        let e = unsafe { read_struct::<V2>(std::ptr::null(), "cfg") }.unwrap_err();
        assert!(matches!(e, Error::NullPointer { what: "cfg" }));
    }

    #[test]
    fn arrays_take_the_first_elements_stride() {
        let old = [
            V1 {
                struct_size: size_of::<V1>(),
                magic: V2::MAGIC,
                a: 1,
            },
            V1 {
                struct_size: size_of::<V1>(),
                magic: V2::MAGIC,
                a: 2,
            },
        ];
        // SAFETY: two V1 of their stated size.
        let got = unsafe { read_array(old.as_ptr() as *const V2, 2, "xs") }.unwrap();
        assert_eq!(
            got.iter().map(|v| (v.a, v.b)).collect::<Vec<_>>(),
            vec![(1, 7), (2, 7)]
        );
        let mut mixed = [V2::defaults(), V2::defaults()];
        mixed[1].struct_size = 16;
        // SAFETY: two V2.
        let e = unsafe { read_array(mixed.as_ptr(), 2, "xs") }.unwrap_err();
        assert!(e.to_string().contains("xs[1]"), "{e}");
        // SAFETY: the length check comes before any read.
        let e = unsafe { read_array(mixed.as_ptr(), usize::MAX / 8, "xs") }.unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
    }

    #[test]
    fn outputs_keep_the_callers_header_and_size() {
        let mut out = V1 {
            struct_size: size_of::<V1>(),
            magic: V2::MAGIC,
            a: 0,
        };
        let full = V2 {
            struct_size: 999,
            magic: 0,
            a: 5,
            b: 6,
        };
        // SAFETY: `out` has its struct_size writable bytes.
        unsafe { write_struct(&mut out as *mut V1 as *mut V2, &full, "out") }.unwrap();
        assert_eq!(
            (out.struct_size, out.magic, out.a),
            (size_of::<V1>(), V2::MAGIC, 5)
        );
    }

    #[test]
    fn slices_check_length_and_alignment() {
        let xs = [1u32, 2, 3];
        // SAFETY: valid array, or rejected before reading.
        unsafe {
            assert_eq!(arg_slice(xs.as_ptr(), 3, "xs").unwrap(), &xs);
            assert!(arg_slice(xs.as_ptr(), usize::MAX, "xs").is_err());
            assert!(arg_slice((xs.as_ptr() as *const u8).add(1) as *const u32, 1, "xs").is_err());
            assert!(arg_slice(std::ptr::null::<u32>(), 1, "xs").is_err());
            assert!(arg_slice(std::ptr::null::<u32>(), 0, "xs")
                .unwrap()
                .is_empty());
        }
    }

    #[test]
    fn strings_are_optional_and_utf8() {
        // SAFETY: NULL, or NUL-terminated literals.
        unsafe {
            assert_eq!(arg_str(std::ptr::null(), "name").unwrap(), None);
            assert_eq!(
                arg_str(c"layer".as_ptr(), "name").unwrap().as_deref(),
                Some("layer")
            );
            let bad = [0xffu8, 0xfe, 0];
            let e = arg_str(bad.as_ptr().cast(), "desc.name").unwrap_err();
            assert!(
                e.to_string().contains("desc.name is not valid UTF-8"),
                "{e}"
            );
        }
    }
}
