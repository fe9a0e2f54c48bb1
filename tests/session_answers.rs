//! What a caller asks graphed instead of re-deriving it, through the C ABI
//! on the host backend: which pass a callback records, by its position in
//! the capture order and its instance (graphed_pass_ctx.capture_position
//! and .instance, in warmup, in the pass's own capture, its clone slots'
//! and a step's), which bucket a size runs (graphed_session_bucket_of, the
//! bucket a forward replay then runs), the instance numbers
//! (graphed_session_instance_of) and where the graphs read each parameter
//! (graphed_session_param_addresses); and every refusal of the three
//! queries, with nothing written. The host backend's callbacks enqueue
//! opaque tasks, so no parameter moves here: the moves themselves are in
//! the orchestration's unit tests and the C++ suite's CUDA instances.

use graphed::ffi::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Mutex;

use graphed_status as S;

mod common;
use common::{create, empty_ref, host_config, msg, ok, stats};

const COLS: usize = 4;
const ROWS: usize = 4;
const BYTES: usize = ROWS * COLS * 4;
const FWD: u32 = graphed_pass::Forward as u32;
const BWD: u32 = graphed_pass::Backward as u32;
static SHAPE: [i64; 2] = [ROWS as i64, COLS as i64];

/// One call of a callback, as its context said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Call {
    callable: u32,
    microbatch: u32,
    bucket: u32,
    pass: u32,
    phase: u32,
    position: u32,
    instance: u32,
}

/// What the callbacks of one session record: every call; the statuses of
/// the three queries asked from inside a callback; the bucket the last
/// forward replay ran (callable << 8 | bucket + 1, set by the task each
/// forward's capture records).
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<Call>>,
    session: AtomicUsize,
    inside: Mutex<Vec<[graphed_status; 3]>>,
    ran: AtomicU32,
}

/// A forward task's data: where to say which bucket ran.
struct Mark {
    recorder: &'static Recorder,
    value: u32,
}

unsafe extern "C" fn mark(data: *mut c_void) {
    // SAFETY: a leaked Mark.
    let m = unsafe { &*(data as *const Mark) };
    m.recorder.ran.store(m.value, Ordering::SeqCst);
}

unsafe extern "C" fn record(ctx: *const graphed_pass_ctx, data: *mut c_void) -> i32 {
    // SAFETY: the context is valid during the call; the data is a leaked
    // Recorder.
    let (c, r) = unsafe { (&*ctx, &*(data as *const Recorder)) };
    assert_eq!(c.struct_size, std::mem::size_of::<graphed_pass_ctx>());
    r.calls.lock().unwrap().push(Call {
        callable: c.callable,
        microbatch: c.microbatch,
        bucket: c.bucket,
        pass: c.pass,
        phase: c.phase,
        position: c.capture_position,
        instance: c.instance,
    });
    // The session is held by its capture: each query answers BUSY.
    let s = r.session.load(Ordering::SeqCst) as *mut graphed_session;
    if !s.is_null() {
        let (mut b, mut n, mut i) = (7u32, 7u64, 7u32);
        let mut at = [null_mut::<c_void>(); 4];
        // SAFETY: locals, room for the callable's parameters (at most 4).
        let got = unsafe {
            [
                graphed_session_bucket_of(s, c.callable, c.bucket_size, &mut b, &mut n),
                graphed_session_instance_of(s, c.callable, c.microbatch, c.bucket, &mut i),
                graphed_session_param_addresses(
                    s,
                    c.callable,
                    c.microbatch,
                    at.as_mut_ptr(),
                    c.num_params,
                ),
            ]
        };
        assert_eq!((b, n, i), (7, 7, 7), "written while BUSY");
        assert!(at.iter().all(|p| p.is_null()), "written while BUSY");
        r.inside.lock().unwrap().push(got);
    }
    if c.pass == FWD && c.phase == graphed_phase::Capture as u32 {
        let m = Box::leak(Box::new(Mark {
            recorder: r,
            value: c.callable << 8 | (c.bucket + 1),
        }));
        // SAFETY: the task's data lives for the test.
        return unsafe { graphed_host_enqueue(c.stream, Some(mark), m as *mut Mark as *mut c_void) }
            as i32;
    }
    0
}

fn recorder() -> &'static Recorder {
    Box::leak(Box::default())
}

/// A parameter of its own memory, COLS floats.
fn param() -> graphed_param_desc {
    let mem = Box::leak(vec![0f32; COLS].into_boxed_slice());
    graphed_param_desc {
        data: mem.as_mut_ptr() as *mut c_void,
        bytes: COLS * 4,
        ..graphed_param_desc_default()
    }
}

fn tensor(buckets: bool) -> graphed_tensor_desc {
    let t = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    match buckets {
        true => graphed_tensor_desc {
            ndim: 2,
            shape: SHAPE.as_ptr(),
            flags: graphed_tensor_flags::Dynamic as u32,
            ..t
        },
        false => t,
    }
}

/// Registers a callable of one input, one output and `params` (their
/// addresses returned), recording into `r`, with `buckets` (empty: none).
fn add(
    s: *mut graphed_session,
    r: &'static Recorder,
    params: usize,
    buckets: &[u64],
) -> Vec<usize> {
    let (input, output) = (tensor(!buckets.is_empty()), tensor(!buckets.is_empty()));
    let ps: Vec<graphed_param_desc> = (0..params).map(|_| param()).collect();
    let mut d = graphed_callable_desc_default();
    d.num_inputs = 1;
    d.inputs = &input;
    d.num_outputs = 1;
    d.outputs = &output;
    d.num_params = ps.len();
    d.params = ps.as_ptr();
    d.forward = Some(record);
    d.backward = Some(record);
    d.user_data = r as *const Recorder as *mut c_void;
    if !buckets.is_empty() {
        d.bucket_sizes = buckets.as_ptr();
        d.num_buckets = buckets.len();
    }
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    ps.iter().map(|p| p.data as usize).collect()
}

fn bucket_of(s: *mut graphed_session, c: u32, size: u64) -> (S, u32, u64) {
    let (mut b, mut n) = (77u32, 77u64);
    // SAFETY: locals.
    let st = unsafe { graphed_session_bucket_of(s, c, size, &mut b, &mut n) };
    if st != S::Ok {
        assert_eq!((b, n), (77, 77), "written on failure");
        assert!(
            msg().starts_with("graphed_session_bucket_of: "),
            "{}",
            msg()
        );
    }
    (st, b, n)
}

fn instance_of(s: *mut graphed_session, c: u32, mb: u32, b: u32) -> (S, u32) {
    let mut i = 77u32;
    // SAFETY: a local.
    let st = unsafe { graphed_session_instance_of(s, c, mb, b, &mut i) };
    if st != S::Ok {
        assert_eq!(i, 77, "written on failure");
        assert!(
            msg().starts_with("graphed_session_instance_of: "),
            "{}",
            msg()
        );
    }
    (st, i)
}

/// graphed_session_param_addresses into `count` entries (one spare, which
/// must stay untouched).
fn addresses(s: *mut graphed_session, c: u32, mb: u32, count: usize) -> (S, Vec<usize>) {
    let mut at = vec![0x77usize; count + 1];
    // SAFETY: room for count pointers.
    let st = unsafe {
        graphed_session_param_addresses(s, c, mb, at.as_mut_ptr() as *mut *mut c_void, count)
    };
    assert_eq!(at[count], 0x77, "written past count");
    if st != S::Ok {
        assert!(at.iter().all(|&p| p == 0x77), "written on failure");
        assert!(
            msg().starts_with("graphed_session_param_addresses: "),
            "{}",
            msg()
        );
    }
    at.truncate(count);
    (st, at)
}

/// One forward of callable `c` on what its static input holds, `size` rows.
fn forward(s: *mut graphed_session, c: u32, size: u64) -> S {
    let mut a = graphed_replay_args_default();
    a.callable = c;
    a.size = size;
    let mut out = [empty_ref()];
    // SAFETY: valid args and room for one output.
    unsafe { graphed_forward(s, &a, out.as_mut_ptr(), 1) }
}

/// Callables a (buckets 2 and 4), b (none) and c (buckets 1, 2 and 4), one
/// parameter each (CLONE grads, one clone slot), b alone in a step: each
/// pass's position is its place in the default order, bucket round by
/// bucket round, in warmup and in every capture of it (its own, its clone
/// slot's, the step's); instances go callable by callable, bucket by
/// bucket; each bucket a size runs is the one a forward then runs.
#[test]
fn positions_instances_and_buckets_in_the_default_order() {
    let r = recorder();
    let mut cfg = host_config();
    cfg.clone_slots = 1;
    let s = create(&cfg);
    add(s, r, 1, &[2, 4]);
    add(s, r, 1, &[]);
    add(s, r, 1, &[1, 2, 4]);
    let step_callables = [1u32];
    let mut d = graphed_step_desc_default();
    d.callables = step_callables.as_ptr();
    d.num_callables = 1;
    let mut step = 0;
    // SAFETY: a valid descriptor.
    ok(unsafe { graphed_session_add_step(s, &d, &mut step) });
    // Before capture: the bucket a size runs is known from registration.
    assert_eq!(bucket_of(s, 0, 3), (S::Ok, 1, 4));
    assert_eq!(bucket_of(s, 1, 0), (S::Ok, 0, 0));
    assert_eq!(instance_of(s, 0, 0, 0).0, S::WrongState);
    assert_eq!(addresses(s, 0, 0, 1).0, S::WrongState);
    r.session.store(s as usize, Ordering::SeqCst);
    ok(graphed_session_capture(s));
    r.session.store(0, Ordering::SeqCst);
    let inside = r.inside.lock().unwrap();
    assert!(!inside.is_empty());
    assert!(
        inside.iter().all(|got| *got == [S::Busy; 3]),
        "asked from inside its capture: {inside:?}"
    );
    drop(inside);

    // (callable, bucket, pass) -> position: round 0 runs every callable,
    // round 1 a and c, round 2 c.
    let order = [
        (0, 0, FWD),
        (1, 0, FWD),
        (2, 0, FWD),
        (2, 0, BWD),
        (1, 0, BWD),
        (0, 0, BWD),
        (0, 1, FWD),
        (2, 1, FWD),
        (2, 1, BWD),
        (0, 1, BWD),
        (2, 2, FWD),
        (2, 2, BWD),
    ];
    let position: HashMap<(u32, u32, u32), u32> = order
        .iter()
        .enumerate()
        .map(|(p, &k)| (k, p as u32))
        .collect();
    let first = [0u32, 2, 3];
    let calls = r.calls.lock().unwrap().clone();
    let mut captures: HashMap<(u32, u32, u32), usize> = HashMap::new();
    for c in &calls {
        let key = (c.callable, c.bucket, c.pass);
        assert_eq!(Some(&c.position), position.get(&key), "{c:?}");
        assert_eq!(c.instance, first[c.callable as usize] + c.bucket, "{c:?}");
        if c.phase == graphed_phase::Capture as u32 {
            *captures.entry(key).or_default() += 1;
        }
    }
    assert_eq!(captures.len(), order.len(), "every pass captured");
    // b's backward: its own capture, its clone slot's, the step's.
    assert!(captures[&(1, 0, BWD)] >= 3, "{captures:?}");
    assert!(captures[&(1, 0, FWD)] >= 2, "{captures:?}");
    assert!(captures[&(2, 1, BWD)] >= 2, "a clone slot: {captures:?}");
    // The warmup saw every pass, in that order.
    let warm: Vec<u32> = calls
        .iter()
        .filter(|c| c.phase == graphed_phase::Warmup as u32)
        .map(|c| c.position)
        .collect();
    assert_eq!(warm, (0..order.len() as u32).collect::<Vec<_>>());

    // After capture: the instances as the callbacks saw them, dense.
    assert_eq!(stats(s).instances, 6);
    for (c, buckets) in [(0u32, 2u32), (1, 1), (2, 3)] {
        for b in 0..buckets {
            assert_eq!(instance_of(s, c, 0, b), (S::Ok, first[c as usize] + b));
        }
        let (st, _) = instance_of(s, c, 0, buckets);
        assert_eq!(st, S::InvalidArgument);
        assert!(
            msg().contains(&format!("bucket {buckets} does not exist")),
            "{}",
            msg()
        );
        assert_eq!(instance_of(s, c, 1, 0).0, S::InvalidArgument);
        assert!(msg().contains("microbatch 1 does not exist"), "{}", msg());
    }
    let (st, _) = instance_of(s, 1, 0, 1);
    assert_eq!(st, S::InvalidArgument);
    assert!(msg().contains("no buckets"), "{}", msg());
    assert_eq!(instance_of(s, 3, 0, 0).0, S::InvalidArgument);
    assert!(msg().contains("callable 3 does not exist"), "{}", msg());

    // The bucket a size runs is the bucket its forward runs.
    for (c, buckets) in [(0u32, &[2u64, 4][..]), (2, &[1, 2, 4])] {
        for n in 1..=4u64 {
            // The smallest bucket holding n rows.
            let b = buckets.iter().position(|&b| b >= n).unwrap() as u32;
            assert_eq!(bucket_of(s, c, n), (S::Ok, b, buckets[b as usize]));
            ok(forward(s, c, n));
            assert_eq!(
                r.ran.load(Ordering::SeqCst),
                c << 8 | (b + 1),
                "callable {c}, {n} rows: the forward ran another bucket than {b}"
            );
        }
    }
    // Refusals, each naming what it refuses.
    for (c, n, words) in [
        (0u32, 5u64, "size 5 is above the largest bucket of callable"),
        (0, 0, "names its actual size"),
        (1, 3, "has no buckets"),
        (9, 1, "callable 9 does not exist"),
    ] {
        assert_eq!(bucket_of(s, c, n).0, S::InvalidArgument, "{c} {n}");
        assert!(msg().contains(words), "{c} {n}: {}", msg());
    }
    // NULL outputs: nothing written.
    let mut b = 5u32;
    // SAFETY: a local and NULL.
    let st = unsafe { graphed_session_bucket_of(s, 0, 3, &mut b, null_mut()) };
    assert_eq!((st, b), (S::NullPointer, 5));
    assert!(msg().contains("bucket_size_out"), "{}", msg());
    // SAFETY: NULL.
    let st = unsafe { graphed_session_instance_of(s, 0, 0, 0, null_mut()) };
    assert_eq!(st, S::NullPointer);

    ok(graphed_session_reset(s));
    assert_eq!(bucket_of(s, 0, 3).0, S::SessionReset);
    assert_eq!(instance_of(s, 0, 0, 0).0, S::SessionReset);
    assert_eq!(addresses(s, 0, 0, 1).0, S::SessionReset);
    ok(graphed_session_destroy(s));
    assert_eq!(bucket_of(s, 0, 3).0, S::UseAfterDestroy);
    assert_eq!(instance_of(s, 0, 0, 0).0, S::UseAfterDestroy);
    assert_eq!(addresses(s, 0, 0, 1).0, S::UseAfterDestroy);
    let forged = 12345usize as *mut graphed_session;
    assert_eq!(bucket_of(forged, 0, 3).0, S::InvalidArgument);
    assert_eq!(bucket_of(null_mut(), 0, 3).0, S::NullPointer);
    assert_eq!(instance_of(null_mut(), 0, 0, 0).0, S::NullPointer);
    assert_eq!(addresses(null_mut(), 0, 0, 1).0, S::NullPointer);
}

/// Transformer Engine's interleaved order (2 chunks of 1 layer, 3
/// microbatches): each pass's position indexes graphed_schedule_passes's
/// list, in warmup and capture; instances are callable * 3 + microbatch;
/// each (callable, microbatch) reads its parameters where they were
/// registered.
#[test]
fn positions_index_the_schedule_helpers_order() {
    let te = [1i32, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1];
    let steps: Vec<graphed_schedule_step> = te
        .iter()
        .map(|&x| graphed_schedule_step {
            pass: if x > 0 { FWD } else { BWD },
            chunk: x.unsigned_abs() - 1,
        })
        .collect();
    let step_size = std::mem::size_of::<graphed_schedule_step>();
    let mut passes = vec![
        graphed_pass_ref {
            callable: 0,
            microbatch: 0,
            pass: 0,
        };
        12
    ];
    let mut count = 0usize;
    // SAFETY: the arrays hold the stated counts.
    ok(unsafe {
        graphed_schedule_passes(
            steps.as_ptr(),
            steps.len(),
            step_size,
            std::ptr::null(),
            0,
            std::ptr::null(),
            2,
            passes.as_mut_ptr(),
            passes.len(),
            std::mem::size_of::<graphed_pass_ref>(),
            &mut count,
        )
    });
    assert_eq!(count, 12);
    let r = recorder();
    let mut cfg = host_config();
    cfg.schedule = steps.as_ptr();
    cfg.num_schedule_steps = steps.len();
    cfg.schedule_step_size = step_size;
    cfg.warmup_iterations = 2;
    let s = create(&cfg);
    let regs = [add(s, r, 2, &[]), add(s, r, 1, &[])];
    ok(graphed_session_capture(s));
    let calls = r.calls.lock().unwrap().clone();
    for c in &calls {
        let p = passes[c.position as usize];
        assert_eq!(
            (p.callable, p.microbatch, p.pass),
            (c.callable, c.microbatch, c.pass),
            "{c:?}"
        );
        assert_eq!(c.instance, c.callable * 3 + c.microbatch, "{c:?}");
        assert_eq!(c.bucket, 0);
    }
    // Two warmup iterations, then every pass's own capture, in that order
    // (each backward's clone slots are captured right after it).
    let warm: Vec<u32> = calls.iter().take(24).map(|c| c.position).collect();
    assert_eq!(
        warm,
        [(0..12).collect::<Vec<u32>>(), (0..12).collect()].concat()
    );
    let mut own: Vec<u32> = calls[24..].iter().map(|c| c.position).collect();
    own.dedup();
    assert_eq!(own, (0..12).collect::<Vec<u32>>());
    assert_eq!(stats(s).instances, 6);
    for c in 0..2u32 {
        for mb in 0..3u32 {
            assert_eq!(instance_of(s, c, mb, 0), (S::Ok, c * 3 + mb));
            let n = regs[c as usize].len();
            assert_eq!(addresses(s, c, mb, n), (S::Ok, regs[c as usize].clone()));
        }
        assert_eq!(instance_of(s, c, 3, 0).0, S::InvalidArgument);
        assert!(msg().contains("microbatch 3 does not exist"), "{}", msg());
        assert_eq!(addresses(s, c, 3, 1).0, S::InvalidArgument);
        assert!(msg().contains("microbatch 3 does not exist"), "{}", msg());
    }
    ok(graphed_session_destroy(s));
}

/// graphed_session_param_addresses: the registered addresses, also after
/// a move the host backend refuses; every argument refused in the
/// documented order, nothing written; a released callable refused, the
/// other still answering.
#[test]
fn param_addresses_checks_its_arguments() {
    let r = recorder();
    let s = create(&host_config());
    let reg = add(s, r, 2, &[]);
    let none = add(s, r, 0, &[]);
    assert!(none.is_empty());
    assert_eq!(addresses(s, 0, 0, 2).0, S::WrongState);
    assert!(msg().contains("not captured"), "{}", msg());
    ok(graphed_session_capture(s));
    assert_eq!(addresses(s, 0, 0, 2), (S::Ok, reg.clone()));
    // A callable without parameters: count 0, the array not read.
    // SAFETY: nothing written for count 0.
    ok(unsafe { graphed_session_param_addresses(s, 1, 0, null_mut(), 0) });
    // A refused move changes nothing.
    let away = Box::leak(vec![0f32; COLS].into_boxed_slice()).as_ptr() as *const c_void;
    let at = [away, std::ptr::null()];
    let mut a = graphed_replay_args_default();
    a.params = at.as_ptr();
    a.num_params = 2;
    let mut out = [empty_ref()];
    // SAFETY: valid args and room for one output.
    let st = unsafe { graphed_forward(s, &a, out.as_mut_ptr(), 1) };
    assert_eq!(st, S::ParamMoved, "{}", msg());
    assert_eq!(addresses(s, 0, 0, 2), (S::Ok, reg.clone()));
    ok(forward(s, 0, 0));
    assert_eq!(addresses(s, 0, 0, 2), (S::Ok, reg.clone()));
    // The count, then the array.
    for n in [0, 1, 3] {
        assert_eq!(addresses(s, 0, 0, n).0, S::InvalidArgument, "{n}");
        assert!(
            msg().contains(&format!("count is {n}; the callable has 2 parameters")),
            "{}",
            msg()
        );
    }
    // SAFETY: NULL is checked.
    let st = unsafe { graphed_session_param_addresses(s, 0, 0, null_mut(), 2) };
    assert_eq!(st, S::NullPointer);
    assert!(msg().contains("addresses"), "{}", msg());
    let mut buf = [0x77u8; 3 * 8];
    // SAFETY: a misaligned pointer is refused before anything is written.
    let st = unsafe {
        graphed_session_param_addresses(s, 0, 0, buf.as_mut_ptr().add(1) as *mut *mut c_void, 2)
    };
    assert_eq!(st, S::InvalidArgument);
    assert!(msg().contains("not aligned"), "{}", msg());
    assert!(buf.iter().all(|&b| b == 0x77));
    assert_eq!(addresses(s, 2, 0, 0).0, S::InvalidArgument);
    assert!(msg().contains("callable 2 does not exist"), "{}", msg());
    assert_eq!(addresses(s, 0, 1, 2).0, S::InvalidArgument);
    // Released: refused, naming it; the other callable still answers, and
    // the released one keeps its instance number.
    ok(graphed_session_release_callable(s, 0));
    assert_eq!(addresses(s, 0, 0, 2).0, S::CallableReleased);
    assert!(msg().contains("was released"), "{}", msg());
    assert_eq!(addresses(s, 1, 0, 0).0, S::Ok);
    assert_eq!(instance_of(s, 0, 0, 0), (S::Ok, 0));
    assert_eq!(instance_of(s, 1, 0, 0), (S::Ok, 1));
    ok(graphed_session_destroy(s));
}
