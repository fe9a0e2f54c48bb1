//! The schedule helpers: Transformer Engine's order to steps, a
//! schedule's shape and its passes, with bad arguments.

use super::*;

pub fn op_schedule_helpers() {
    let i = &w().input;
    let n = i.below(12);
    let order: Vec<f64> = (0..n)
        .map(|_| {
            i.pick(&[
                1.0,
                2.0,
                -1.0,
                -2.0,
                -1.5,
                -2.5,
                0.0,
                0.5,
                -0.5,
                4096.0,
                -4096.5,
                4097.0,
                f64::NAN,
                f64::INFINITY,
                1e300,
                -3.0,
                3.0,
            ])
        })
        .collect();
    let stride = i.pick(&[8usize, 8, 12, 16, 4, 6]);
    let mut out = vec![0xabu8; n * stride.max(8) + 8];
    mark();
    // SAFETY: room for n steps of `stride` bytes (or refused).
    let r = unsafe {
        graphed_schedule_from_te_order(order.as_ptr(), n, out.as_mut_ptr().cast(), stride)
    };
    post(r, "graphed_schedule_from_te_order");
    let valid_stride = stride >= 8 && stride % 4 == 0;
    if !valid_stride {
        assert_eq!(r, S::InvalidArgument);
    }
    if r != S::Ok {
        assert!(out.iter().all(|&b| b == 0xab));
        return;
    }
    let mut chunks = 0u32;
    let mut mbs = 0u32;
    let mut layers = [0xeeu32; 8];
    let mut firsts = [0xeeu32; 8];
    let ncall = i.below(6) as u32;
    // The arrays hold 8; a pick of 8 is a capacity whose bytes overflow
    // (refused whenever the arrays are given).
    let cap = match i.below(9) {
        8 => usize::MAX,
        c => c,
    };
    let want_arrays = i.chance(128);
    // SAFETY: the steps just written; outputs are locals.
    let r = unsafe {
        graphed_schedule_shape(
            out.as_ptr().cast(),
            n,
            stride,
            null(),
            0,
            ncall,
            &mut chunks,
            &mut mbs,
            if want_arrays {
                layers.as_mut_ptr()
            } else {
                null_mut()
            },
            if want_arrays {
                firsts.as_mut_ptr()
            } else {
                null_mut()
            },
            cap,
        )
    };
    post(r, "graphed_schedule_shape");
    if want_arrays && cap == usize::MAX {
        assert_ne!(r, S::Ok, "a chunk capacity of SIZE_MAX was accepted");
    }
    if r == S::Ok {
        assert!(chunks >= 1 && mbs >= 1);
        if want_arrays {
            let sum: u32 = layers[..chunks as usize].iter().sum();
            assert_eq!(sum, ncall);
        }
    } else {
        assert_eq!((chunks, mbs), (0, 0));
    }
}

/// graphed_schedule_passes: the sequential expansion checked exactly, a
/// schedule's checked against its own count, and bad arguments; then
/// graphed_schedule_releases over the same schedule.
pub fn op_schedule_passes() {
    let i = &w().input;
    // Sometimes a count whose passes could not be built.
    let huge = i.chance(10);
    let ncall = if huge { u32::MAX } else { i.below(5) as u32 };
    let wg: Vec<u32> = if huge {
        Vec::new()
    } else {
        (0..ncall).map(|_| i.pick(&[0, 0, 1, 2])).collect()
    };
    let wg_null = huge || i.chance(60);
    let sched = i.chance(100);
    let steps: Vec<u32> = if sched {
        (0..1 + i.below(8))
            .flat_map(|_| [i.pick(&[0, 1, 2, 0, 1, 5]), i.pick(&[0, 1, 0, 2])])
            .collect()
    } else {
        Vec::new()
    };
    // A pick of 11 is a capacity whose bytes overflow: refused whenever
    // there is an array (`out` then holds 11 passes).
    let (cap, room) = match i.below(12) {
        11 => (usize::MAX / i.pick(&[1, 8, 12]), 11),
        c => (c, c),
    };
    let huge_cap = cap != room;
    let pass_size = i.pick(&[12usize, 12, 12, 16, 8, 13]);
    let passes_null = i.chance(40);
    let count_null = i.chance(8);
    // Sometimes a layer split: 1, NULL with a count (refused), 2, one
    // layer for one chunk (refused without a schedule).
    let split_pick = i.below(16);
    let split = [1u32];
    let (split_ptr, split_n) = match split_pick {
        1 => (null(), 2),
        2 => (split.as_ptr(), 1),
        _ => (null(), 0),
    };
    let mut out = vec![0xabu8; room * pass_size.max(12) + 16];
    let mut count = 0x77usize;
    let described = Described {
        steps: if sched { steps.as_ptr().cast() } else { null() },
        num_steps: steps.len() / 2,
        split: split_ptr,
        num_split: split_n,
        has_wgrad: if wg_null { null() } else { wg.as_ptr() },
        callables: ncall,
    };
    mark();
    // SAFETY: every array holds the stated count; `out` has room for `cap`
    // passes of `pass_size` bytes, or `cap` is one the call refuses.
    let r = unsafe {
        graphed_schedule_passes(
            described.steps,
            described.num_steps,
            8,
            described.split,
            described.num_split,
            described.has_wgrad,
            ncall,
            if passes_null {
                null_mut()
            } else {
                out.as_mut_ptr().cast()
            },
            cap,
            pass_size,
            if count_null { null_mut() } else { &mut count },
        )
    };
    post(r, "graphed_schedule_passes");
    let bad_flag = !wg_null && wg.iter().any(|&x| x > 1);
    let has = |c: u32| !wg_null && wg[c as usize] == 1;
    // The sequential expansion: every forward, then every backward in
    // reverse, each weight-grad right after its backward (none for a count
    // whose passes cannot be built: the call refuses it).
    let built = if huge { 0 } else { ncall };
    let mut want: Vec<(u32, u32)> = (0..built).map(|c| (c, 0)).collect();
    for c in (0..built).rev() {
        want.push((c, 1));
        if has(c) {
            want.push((c, 2));
        }
    }
    // The element size is checked whenever there is an array, and the
    // array as its capacity describes it: the alignment of its elements
    // when it has any, its bytes fitting in memory.
    let bad_size = !passes_null && (pass_size < 12 || (pass_size % 4 != 0 && cap > 0) || huge_cap);
    if count_null {
        assert_eq!(r, S::NullPointer);
    } else if huge {
        assert_eq!(r, S::InvalidArgument);
    } else if bad_flag {
        assert_eq!(r, S::InvalidArgument);
    } else if split_pick == 1 {
        assert_eq!(r, S::InvalidArgument, "a NULL layer split with a count");
    } else if split_pick == 2 && !sched {
        assert_eq!(r, S::InvalidSchedule, "a layer split without a schedule");
    } else if !sched {
        assert_eq!(r, if bad_size { S::InvalidArgument } else { S::Ok });
    }
    if r != S::Ok {
        assert_eq!(count, 0x77, "count written on failure");
        assert!(out.iter().all(|&b| b == 0xab), "passes written on failure");
    } else {
        check_written_passes(&want, sched, &out, (cap, pass_size), passes_null, count);
    }
    check_releases(&described, sched);
}

/// What a successful graphed_schedule_passes wrote: without a schedule
/// exactly the sequential expansion `want`; never past min(count, cap).
fn check_written_passes(
    want: &[(u32, u32)],
    sched: bool,
    out: &[u8],
    (cap, pass_size): (usize, usize),
    passes_null: bool,
    count: usize,
) {
    if !sched {
        assert_eq!(count, want.len(), "sequential pass count");
        if !passes_null {
            for (j, &(c, p)) in want.iter().take(cap).enumerate() {
                let at = j * pass_size;
                let word =
                    |o: usize| u32::from_ne_bytes(out[at + o..at + o + 4].try_into().unwrap());
                assert_eq!(
                    (word(0), word(4), word(8)),
                    (c, 0, p),
                    "sequential pass {j}"
                );
            }
        }
    }
    if !passes_null {
        let written = count.min(cap) * pass_size;
        assert!(
            out[written..].iter().all(|&b| b == 0xab),
            "passes written past min(count, capacity)"
        );
    }
}

/// One schedule as graphed_schedule_passes and graphed_schedule_releases
/// take it (NULL arrays where the caller gives none).
struct Described {
    steps: *const graphed_schedule_step,
    num_steps: usize,
    split: *const u32,
    num_split: usize,
    has_wgrad: *const u32,
    callables: u32,
}

impl Described {
    /// The passes in order as (callable, microbatch, pass), or the status
    /// of asking for them.
    fn passes(&self) -> Result<Vec<(u32, u32, u32)>, graphed_status> {
        let call = |out: &mut [[u32; 3]], n: &mut usize| {
            // SAFETY: the arrays hold the stated counts; room for
            // out.len() passes of 12 bytes (none: a length query).
            unsafe {
                graphed_schedule_passes(
                    self.steps,
                    self.num_steps,
                    8,
                    self.split,
                    self.num_split,
                    self.has_wgrad,
                    self.callables,
                    if out.is_empty() {
                        null_mut()
                    } else {
                        out.as_mut_ptr().cast()
                    },
                    out.len(),
                    12,
                    n,
                )
            }
        };
        let mut n = 0usize;
        let r = call(&mut [], &mut n);
        post(r, "graphed_schedule_passes");
        if r != S::Ok {
            return Err(r);
        }
        let mut all = vec![[0u32; 3]; n];
        assert_eq!(
            call(&mut all, &mut n),
            S::Ok,
            "the passes it counted: {}",
            msg()
        );
        Ok(all.iter().map(|p| (p[0], p[1], p[2])).collect())
    }
}

/// graphed_schedule_releases over the schedule `d` describes, with fuzzed
/// outputs: it refuses what graphed_schedule_passes refuses, and what it
/// lists follows the pass order: each output after its backward, each
/// instance's copied-out parameter grads after its grad pass, each input
/// grad after its backward (without a schedule: exactly the backward of
/// the callable before it; the first callable's is kept).
fn check_releases(d: &Described, sched: bool) {
    let i = &w().input;
    const REL: usize = 16;
    let (cap, room) = match i.below(24) {
        23 => (usize::MAX / i.pick(&[1, 16, 20]), 23),
        c => (c, c),
    };
    let size = i.pick(&[REL, REL, REL, 20, 12, 18]);
    let out_null = i.chance(40);
    let count_null = i.chance(8);
    let mut out = vec![0xcdu8; room * size.max(REL) + 16];
    let mut count = 0x77usize;
    let passes = d.passes();
    mark();
    // SAFETY: the arrays hold the stated counts; `out` has room for `cap`
    // releases of `size` bytes, or `cap` is one the call refuses.
    let r = unsafe {
        graphed_schedule_releases(
            d.steps,
            d.num_steps,
            8,
            d.split,
            d.num_split,
            d.has_wgrad,
            d.callables,
            if out_null {
                null_mut()
            } else {
                out.as_mut_ptr().cast()
            },
            cap,
            size,
            if count_null { null_mut() } else { &mut count },
        )
    };
    let bad_size = !out_null && (size < REL || (size % 4 != 0 && cap > 0) || cap != room);
    let want = if count_null {
        S::NullPointer
    } else {
        match &passes {
            Err(e) => *e,
            Ok(_) if bad_size => S::InvalidArgument,
            Ok(_) => S::Ok,
        }
    };
    expect(r, &[want], "graphed_schedule_releases", "releases");
    if r != S::Ok {
        assert_eq!(count, 0x77, "count written on failure");
        assert!(
            out.iter().all(|&b| b == 0xcd),
            "releases written on failure"
        );
        return;
    }
    let passes = passes.unwrap();
    let written = if out_null { 0 } else { count.min(cap) };
    assert!(
        out[written * size..].iter().all(|&b| b == 0xcd),
        "releases written past min(count, capacity)"
    );
    let got: Vec<[u32; 4]> = (0..written)
        .map(|j| {
            let word = |o: usize| {
                u32::from_ne_bytes(out[j * size + o..j * size + o + 4].try_into().unwrap())
            };
            [word(0), word(4), word(8), word(12)]
        })
        .collect();
    let key = |r: &[u32; 4]| {
        let role = [1u32, 3, 4]
            .iter()
            .position(|&x| x == r[3])
            .expect("a released role");
        (r[0], r[1], r[2], role)
    };
    assert!(
        got.windows(2).all(|p| key(&p[0]) < key(&p[1])),
        "ordered: {got:?}"
    );
    let at = |c: u32, m: u32, p: u32| {
        passes
            .iter()
            .position(|&x| x == (c, m, p))
            .map(|x| x as u32)
    };
    for r in &got {
        let (c, m) = (r[1], r[2]);
        let bwd = at(c, m, 1).expect("an instance with a backward");
        match r[3] {
            1 => assert_eq!(r[0], bwd, "output of {c}/{m}"),
            4 => assert_eq!(
                r[0],
                at(c, m, 2).unwrap_or(bwd),
                "parameter grads of {c}/{m}"
            ),
            _ if !sched => assert_eq!(Some(r[0]), c.checked_sub(1).and_then(|p| at(p, 0, 1))),
            _ => assert!(
                r[0] > bwd && (r[0] as usize) < passes.len(),
                "input grad of {c}/{m}"
            ),
        }
    }
    if written == count {
        // Every instance's output and parameter grads, once each.
        let backwards = passes.iter().filter(|p| p.2 == 1).count();
        assert_eq!(got.iter().filter(|r| r[3] == 1).count(), backwards);
        assert_eq!(got.iter().filter(|r| r[3] == 4).count(), backwards);
        if !sched {
            let n = d.callables as usize;
            assert_eq!(
                got.iter().filter(|r| r[3] == 3).count(),
                n.saturating_sub(1)
            );
        }
    }
}
