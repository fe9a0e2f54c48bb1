//! graphed_step_collectives with fuzzed capacity, entry size and NULL
//! pointers, checked against the manifest the model expects.

use super::super::*;
use super::callbacks::*;

/// graphed_step_collectives with fuzzed arguments against the manifest.
pub(super) fn query(h: *mut graphed_session, stage: bool, manifest: &[Rec], per_callable: bool) {
    let i = &w().input;
    let what = "a step's manifest";
    for _ in 0..1 + i.below(3) {
        let capacity = i.below(manifest.len() + 3);
        let entry_size = i.pick(&[ENTRY, ENTRY, ENTRY + 8, 2 * ENTRY, 8, ENTRY - 8, ENTRY + 4]);
        let null_entries = i.chance(20);
        let null_count = i.chance(20);
        let step = if i.chance(20) { 1 } else { 0 };
        // Room for `capacity` entries of `entry_size` (8-aligned), and a
        // marker beyond them.
        let words = (capacity * entry_size).div_ceil(8) + 1;
        let mut buf = vec![0xA5A5_A5A5_A5A5_A5A5u64; words];
        let before = buf.clone();
        let entries: *mut graphed_collective_entry = if null_entries {
            null_mut()
        } else {
            buf.as_mut_ptr().cast()
        };
        let mut n = 77usize;
        let count: *mut usize = if null_count { null_mut() } else { &mut n };
        // SAFETY: room for `capacity` entries of `entry_size` bytes.
        let st = unsafe { graphed_step_collectives(h, step, entries, capacity, entry_size, count) };
        let mut want = None;
        first(&mut want, null_count.then_some(S::NullPointer));
        first(
            &mut want,
            (entry_size < ENTRY).then_some(S::InvalidArgument),
        );
        if capacity > 0 {
            first(&mut want, null_entries.then_some(S::NullPointer));
            first(
                &mut want,
                (entry_size % 8 != 0).then_some(S::InvalidArgument),
            );
        }
        first(
            &mut want,
            (step != 0 || !stage).then_some(S::InvalidArgument),
        );
        expect(
            st,
            &[want.unwrap_or(S::Ok)],
            "graphed_step_collectives",
            what,
        );
        if st != S::Ok {
            assert_eq!(n, 77, "written on failure");
            assert_eq!(buf, before, "entries written on failure");
            continue;
        }
        assert_eq!(n, manifest.len());
        let bytes: &[u8] =
            // SAFETY: the buffer's own bytes.
            unsafe { std::slice::from_raw_parts(buf.as_ptr().cast(), words * 8) };
        let written = capacity.min(manifest.len());
        for (k, r) in manifest.iter().enumerate().take(written) {
            // SAFETY: inside the buffer; read unaligned.
            let e: graphed_collective_entry =
                unsafe { std::ptr::read_unaligned(bytes.as_ptr().add(k * entry_size).cast()) };
            let callable = if per_callable {
                0
            } else {
                GRAPHED_COLLECTIVE_ALL_CALLABLES
            };
            assert_eq!(
                (
                    e.communicator,
                    e.op,
                    e.bytes,
                    e.dtype,
                    e.callable,
                    e.reserved
                ),
                (r.3, r.0, r.2, r.1, callable, 0),
                "entry {k}"
            );
        }
        // Nothing but the entries written (ENTRY bytes at each stride).
        for (k, b) in bytes.iter().enumerate() {
            let entry = k / entry_size;
            if entry >= written || k % entry_size >= ENTRY {
                assert_eq!(*b, 0xA5, "byte {k} written beyond the entries");
            }
        }
    }
}
