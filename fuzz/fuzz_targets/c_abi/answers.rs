//! What a caller asks instead of re-deriving it: the bucket a size runs
//! (graphed_session_bucket_of, and of two sizes graphed_session_bucket_of2),
//! instance numbers
//! (graphed_session_instance_of) and where the graphs read each parameter
//! (graphed_session_param_addresses), on any target, in any state, with
//! any arguments and NULL or misaligned outputs, checked against the
//! model: the status in the library's order of checks, nothing written on
//! failure, the model's answer on success (the host backend never moves a
//! parameter here: the registered addresses). Also what a captured
//! session answers for each of its instances (`answers_after_capture`).
//! Where each pass stands in the capture order and which instance it is
//! (graphed_pass_ctx) is checked in every callback (`seen`).

use super::*;

/// The bucket a forward replay of `cl` given `size` rows runs, and its
/// size; None: refused.
fn bucket_model(cl: &Callable, size: u64) -> Option<(u32, u64)> {
    match cl.buckets.last() {
        None => (size == 0).then_some((0, 0)),
        Some(_) if size == 0 => None,
        Some(_) => cl
            .buckets
            .iter()
            .position(|&b| b >= size)
            .map(|b| (b as u32, cl.buckets[b])),
    }
}

/// A size worth asking about for `cl`: 0, one of its buckets, one past
/// one, or anything.
fn fuzzed_size(cl: Option<&Callable>) -> u64 {
    let i = &w().input;
    let b = cl.map_or(&[][..], |c| c.buckets.as_slice());
    match i.below(6) {
        0 => 0,
        1 | 2 if !b.is_empty() => b[i.below(b.len())],
        3 if !b.is_empty() => b[i.below(b.len())] + 1,
        4 => i.pick(&[1, 2, u64::MAX]),
        _ => i.below(40) as u64,
    }
}

/// The model's session and callables, for a live target.
fn model(t: Target) -> Option<(St, Vec<Callable>, u32)> {
    let Target::Live(k) = t else { return None };
    let s = &w().sessions.borrow()[k];
    Some((s.st, s.callables.clone(), s.mb))
}

/// A callable index: mostly one that exists.
fn fuzzed_callable(n: usize) -> u32 {
    let i = &w().input;
    if n > 0 && !i.chance(30) {
        i.below(n) as u32
    } else {
        i.pick(&[n as u32, u32::MAX])
    }
}

/// What a query asks about: a target, the model of it (for a live one),
/// and a callable index.
fn fuzzed_query() -> (Target, Option<(St, Vec<Callable>, u32)>, u32) {
    let t = target();
    let m = model(t);
    let c = fuzzed_callable(m.as_ref().map_or(0, |m| m.1.len()));
    (t, m, c)
}

pub fn op_bucket_of() {
    let i = &w().input;
    let (t, m, c) = fuzzed_query();
    let cl = m.as_ref().and_then(|m| m.1.get(c as usize).cloned());
    let size = fuzzed_size(cl.as_ref());
    let null = if i.chance(20) { Some(i.below(2)) } else { None };
    let (mut b, mut n) = (0x77u32, 0x77u64);
    let mut want = t.lookup();
    first(&mut want, null.map(|_| S::NullPointer));
    first(&mut want, t.lock());
    let mut answer = None;
    if let Some((st, _, _)) = &m {
        first(&mut want, (*st == St::Reset).then_some(S::SessionReset));
        match &cl {
            None => first(&mut want, Some(S::InvalidArgument)),
            Some(cl) => {
                answer = bucket_model(cl, size);
                first(&mut want, answer.is_none().then_some(S::InvalidArgument));
            }
        }
    }
    mark();
    // SAFETY: locals or NULL.
    let r = unsafe {
        graphed_session_bucket_of(
            t.ptr(),
            c,
            size,
            if null == Some(0) { null_mut() } else { &mut b },
            if null == Some(1) { null_mut() } else { &mut n },
        )
    };
    trace!("bucket_of {t:?} callable {c} size {size} want {want:?} got {r:?}");
    expect_answer(
        r,
        want,
        "graphed_session_bucket_of",
        &format!("the bucket of {size} rows"),
        ((b, n), (0x77, 0x77)),
        answer,
    );
    if r != S::Ok && want == Some(S::InvalidArgument) && cl.is_some() {
        assert!(msg().contains("callable '"), "{}", msg());
    }
}

/// graphed_session_bucket_of2 on the model's callables (none has a grid:
/// a second size is refused, and 0 answers as graphed_session_bucket_of
/// with a second size of 0).
pub fn op_bucket_of2() {
    let i = &w().input;
    let (t, m, c) = fuzzed_query();
    let cl = m.as_ref().and_then(|m| m.1.get(c as usize).cloned());
    let size = fuzzed_size(cl.as_ref());
    let size2 = i.pick(&[0u64, 0, 1, 7, u64::MAX]);
    let null = if i.chance(20) { Some(i.below(3)) } else { None };
    let (mut b, mut n, mut n2) = (0x77u32, 0x77u64, 0x77u64);
    let mut want = t.lookup();
    first(&mut want, null.map(|_| S::NullPointer));
    first(&mut want, t.lock());
    let mut answer = None;
    if let Some((st, _, _)) = &m {
        first(&mut want, (*st == St::Reset).then_some(S::SessionReset));
        match &cl {
            None => first(&mut want, Some(S::InvalidArgument)),
            Some(cl) => {
                answer = bucket_model(cl, size)
                    .filter(|_| size2 == 0)
                    .map(|(b, n)| (b, n, 0));
                first(&mut want, answer.is_none().then_some(S::InvalidArgument));
            }
        }
    }
    mark();
    // SAFETY: locals or NULL.
    let r = unsafe {
        graphed_session_bucket_of2(
            t.ptr(),
            c,
            size,
            size2,
            if null == Some(0) { null_mut() } else { &mut b },
            if null == Some(1) { null_mut() } else { &mut n },
            if null == Some(2) { null_mut() } else { &mut n2 },
        )
    };
    trace!("bucket_of2 {t:?} callable {c} sizes {size} {size2} want {want:?} got {r:?}");
    expect_answer(
        r,
        want,
        "graphed_session_bucket_of2",
        &format!("the bucket of {size} x {size2}"),
        ((b, n, n2), (0x77, 0x77, 0x77)),
        answer,
    );
    if r != S::Ok && want == Some(S::InvalidArgument) && cl.is_some() {
        assert!(msg().contains("callable '"), "{}", msg());
    }
}

pub fn op_instance_of() {
    let i = &w().input;
    let (t, m, c) = fuzzed_query();
    let mb = i.pick(&[0u32, 0, 1, 2, 3, u32::MAX]);
    let bucket = i.pick(&[0u32, 0, 1, 2, 3, u32::MAX]);
    let null = i.chance(20);
    let mut got = 0x77u32;
    let mut want = t.lookup();
    first(&mut want, null.then_some(S::NullPointer));
    first(&mut want, t.lock());
    let mut answer = None;
    if let Some((st, cls, mbs)) = &m {
        match instance_at(&mut want, *st, cls, *mbs, c, mb) {
            Some(cl) if bucket < bucket_count(cl) => {
                answer = Some(instance_number(cls, *mbs, c as usize, mb, bucket));
            }
            Some(_) => first(&mut want, Some(S::InvalidArgument)),
            None => {}
        }
    }
    mark();
    // SAFETY: a local or NULL.
    let r = unsafe {
        graphed_session_instance_of(
            t.ptr(),
            c,
            mb,
            bucket,
            if null { null_mut() } else { &mut got },
        )
    };
    trace!("instance_of {t:?} ({c}, {mb}, {bucket}) want {want:?} got {r:?}");
    expect_answer(
        r,
        want,
        "graphed_session_instance_of",
        &format!("instance of ({c}, {mb}, {bucket})"),
        (got, 0x77),
        answer,
    );
}

pub fn op_param_addresses() {
    let i = &w().input;
    let (t, m, c) = fuzzed_query();
    let mb = i.pick(&[0u32, 0, 1, 2, u32::MAX]);
    let np = m
        .as_ref()
        .and_then(|m| m.1.get(c as usize))
        .map_or(2, |cl| cl.params.len());
    let count = match i.below(5) {
        0 => i.below(4),
        _ => np,
    };
    let mut at = vec![0x77usize; count + 2];
    // 0: NULL, 1: misaligned, else the array.
    let fault = i.below(8);
    let p: *mut *mut c_void = match fault {
        0 => null_mut(),
        // SAFETY: one byte into an array with a spare element.
        1 => unsafe { (at.as_mut_ptr() as *mut u8).add(1) as *mut *mut c_void },
        _ => at.as_mut_ptr() as *mut *mut c_void,
    };
    let mut want = t.lock();
    let mut answer = None;
    if let (Some((st, cls, mbs)), Target::Live(k)) = (&m, t) {
        if let Some(cl) = instance_at(&mut want, *st, cls, *mbs, c, mb) {
            first(
                &mut want,
                released(k, c as usize).then_some(S::CallableReleased),
            );
            first(&mut want, (count != np).then_some(S::InvalidArgument));
            if count > 0 {
                first(&mut want, (fault == 0).then_some(S::NullPointer));
                first(&mut want, (fault == 1).then_some(S::InvalidArgument));
            }
            answer = Some(cl.params.iter().map(|q| q.data).collect::<Vec<_>>());
        }
    }
    mark();
    // SAFETY: p has room for count pointers, or is refused before use.
    let r = unsafe { graphed_session_param_addresses(t.ptr(), c, mb, p, count) };
    trace!("param_addresses {t:?} ({c}, {mb}) count {count} fault {fault} want {want:?} got {r:?}");
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_param_addresses",
        "addresses",
    );
    if r == S::Ok && fault > 1 {
        assert_eq!(
            Some(at[..count].to_vec()),
            answer,
            "where the graphs of ({c}, {mb}) read the parameters (nothing moves here)"
        );
        assert_eq!(at[count], 0x77, "param_addresses wrote past count");
    } else if r != S::Ok {
        assert!(
            at.iter().all(|&x| x == 0x77),
            "param_addresses written on failure"
        );
    }
}

/// Session `h` just captured, of `callables` for `mb` microbatches: the
/// instances dense and numbered as its callbacks saw them, the bucket of
/// each size its buckets imply, every parameter read where registered.
/// Reads no input.
pub fn answers_after_capture(h: *mut graphed_session, callables: &[Callable], mb: u32) {
    let mut all = Vec::new();
    for (c, cl) in callables.iter().enumerate() {
        for m in 0..mb {
            for b in 0..bucket_count(cl) {
                let mut got = 0x77u32;
                // SAFETY: a local.
                let r = unsafe { graphed_session_instance_of(h, c as u32, m, b, &mut got) };
                expect(r, &[S::Ok], "graphed_session_instance_of", "after capture");
                assert_eq!(got, instance_number(callables, mb, c, m, b));
                all.push(got);
            }
            let n = cl.params.len();
            let mut at = vec![0x77usize; n + 1];
            // SAFETY: room for n pointers.
            let r = unsafe {
                graphed_session_param_addresses(h, c as u32, m, at.as_mut_ptr().cast(), n)
            };
            expect(
                r,
                &[S::Ok],
                "graphed_session_param_addresses",
                "after capture",
            );
            let reg: Vec<usize> = cl.params.iter().map(|p| p.data).collect();
            assert_eq!(at[..n], reg[..], "registered addresses of ({c}, {m})");
            assert_eq!(at[n], 0x77, "param_addresses wrote past count");
        }
        let mut sizes = vec![0u64, 1, u64::MAX];
        for &b in &cl.buckets {
            sizes.extend([b - 1, b, b + 1]);
        }
        for size in sizes {
            let (mut b, mut n) = (0x77u32, 0x77u64);
            // SAFETY: locals.
            let r = unsafe { graphed_session_bucket_of(h, c as u32, size, &mut b, &mut n) };
            let answer = bucket_model(cl, size);
            let want = if answer.is_some() { S::Ok } else { S::InvalidArgument };
            expect(r, &[want], "graphed_session_bucket_of", "after capture");
            if r == S::Ok {
                assert_eq!(Some((b, n)), answer, "bucket of {size} rows");
            }
        }
    }
    all.sort_unstable();
    let dense: Vec<u32> = (0..all.len() as u32).collect();
    assert_eq!(all, dense, "instance numbers");
}
