//! Minimal reproducers of C ABI bugs, on the host backend, kept as
//! regression tests: those the fuzz target (fuzz/fuzz_targets/c_abi.rs)
//! found, and gaps of the boundary found by tests written apart from it.
//! Each test states the contract it checks.

use graphed::ffi::*;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use graphed_status as S;

mod common;
use common::{empty_ref, free_nothing, msg, ok};

unsafe extern "C" fn noop(_: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    0
}

/// A host session with one callable: no input, `params` parameters of
/// 16 bytes with `policy`, one 16-byte output.
fn session(
    cfg: graphed_session_config,
    params: usize,
    policy: u32,
    forward: graphed_pass_fn,
) -> *mut graphed_session {
    let mut s = null_mut();
    // SAFETY: a valid config and out pointer.
    ok(unsafe { graphed_session_create(&cfg, &mut s) });
    let out = [graphed_tensor_desc {
        bytes: 16,
        ..graphed_tensor_desc_default()
    }];
    let pdesc: Vec<graphed_param_desc> = (0..params)
        .map(|_| graphed_param_desc {
            data: Box::leak(Box::new([0f32; 4])).as_mut_ptr().cast(),
            bytes: 16,
            policy,
            ..graphed_param_desc_default()
        })
        .collect();
    let mut d = graphed_callable_desc_default();
    d.num_outputs = 1;
    d.outputs = out.as_ptr();
    d.num_params = params;
    d.params = pdesc.as_ptr();
    d.forward = forward;
    d.backward = Some(noop);
    let mut idx = 0;
    // SAFETY: the arrays hold the stated counts.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    s
}

fn host(strict: bool) -> graphed_session_config {
    let mut c = graphed_session_config_default();
    c.backend = graphed_backend::Host as u32;
    c.strict_leases = strict as u32;
    c
}

fn forward(s: *mut graphed_session) -> (graphed_status, graphed_ref) {
    let a = graphed_replay_args_default();
    let mut out = [empty_ref()];
    // SAFETY: args and room for one ref.
    let st = unsafe { graphed_forward(s, &a, out.as_mut_ptr(), 1) };
    (st, out[0])
}

/// A lease token names the session that issued it: another session must
/// refuse it, as graphed_lease_release's message says ("it is from an
/// earlier capture, another session, or not a lease"). The bug: two
/// sessions captured once each issued the same tokens (a per-session epoch
/// 1, slot 1, generation 1), so one session's token released the other's
/// lease, and strict mode then let a replay overwrite an alias the caller
/// still held. Epochs are now numbered across the process.
#[test]
fn a_lease_of_one_session_does_not_release_another_sessions() {
    let a = session(host(true), 0, 0, Some(noop));
    let b = session(host(true), 0, 0, Some(noop));
    ok(graphed_session_capture(a));
    ok(graphed_session_capture(b));
    let (st, out_a) = forward(a);
    ok(st);
    let (st, out_b) = forward(b);
    ok(st);
    assert_ne!(out_a.lease, 0);
    assert_ne!(out_b.lease, 0);
    // b's alias is still held; a's token must not release it.
    let st = graphed_lease_release(b, out_a.lease);
    assert_eq!(
        st,
        S::InvalidArgument,
        "session b released a lease with session a's token 0x{:x} (b's own is 0x{:x})",
        out_a.lease,
        out_b.lease
    );
    let (st, _) = forward(b);
    assert_eq!(st, S::AliasHeld, "b's held output was overwritten");
    ok(graphed_session_destroy(a));
    ok(graphed_session_destroy(b));
}

static LEASE: AtomicU64 = AtomicU64::new(0);
static SESSION: AtomicU64 = AtomicU64::new(0);

/// A clone allocator that, like a framework's allocator running tensor
/// deleters, releases the lease of an alias the caller no longer uses.
unsafe extern "C" fn alloc_releasing_a_lease(
    _: *mut c_void,
    bytes: usize,
    _: graphed_stream,
    out: *mut *mut c_void,
) -> i32 {
    let lease = LEASE.swap(0, Ordering::SeqCst);
    if lease != 0 {
        let s = SESSION.load(Ordering::SeqCst) as usize as *mut graphed_session;
        ok(graphed_lease_release(s, lease));
    }
    let mem = Box::leak(vec![0u8; bytes].into_boxed_slice());
    // SAFETY: graphed passes a writable out pointer.
    unsafe { *out = mem.as_mut_ptr().cast() };
    0
}

/// graphed_lease_release is documented as never waiting for calls in
/// progress on the session, safe from any thread at any time. A lease
/// released from inside a replay of a strict session (here from the clone
/// allocator, as a tensor deleter would) must not deadlock. The bug: the
/// replay held the lease book from its checks until its results were
/// staged (src/orchestrate/replay.rs), so the release waited on its own
/// thread. The book is now locked only around the check and the staging.
#[test]
fn a_lease_released_during_a_strict_replay_does_not_deadlock() {
    let mut cfg = host(true);
    cfg.clone_alloc = Some(alloc_releasing_a_lease);
    cfg.clone_free = Some(free_nothing);
    // One CLONE parameter, so that backward calls the allocator.
    let s = session(cfg, 1, graphed_grad_policy::Clone as u32, Some(noop));
    ok(graphed_session_capture(s));
    let (st, out) = forward(s);
    ok(st);
    assert_ne!(out.lease, 0);
    LEASE.store(out.lease, Ordering::SeqCst);
    SESSION.store(s as usize as u64, Ordering::SeqCst);
    let (tx, rx) = mpsc::channel();
    let h = s as usize;
    std::thread::spawn(move || {
        let s = h as *mut graphed_session;
        let a = graphed_replay_args_default();
        let mut gin: [graphed_ref; 0] = [];
        let mut gp = [empty_ref()];
        // SAFETY: args and room for the stated refs.
        let st = unsafe { graphed_backward(s, &a, gin.as_mut_ptr(), 0, gp.as_mut_ptr(), 1) };
        let _ = tx.send((st, gp[0].owner as usize));
    });
    let (st, owner) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("graphed_backward deadlocked: the lease release inside it never returned");
    ok(st);
    // The scenario was reached: the allocator ran and released the lease.
    assert_eq!(
        LEASE.load(Ordering::SeqCst),
        0,
        "the clone allocator never ran"
    );
    let mut stats = graphed_session_stats_default();
    // SAFETY: a full stats struct.
    ok(unsafe { graphed_session_stats_get(s, &mut stats) });
    assert_eq!(stats.leases_held, 0);
    ok(graphed_buffer_release(owner as *mut graphed_buffer));
    ok(graphed_session_destroy(s));
}

/// A callback that asks for more scratch than the device has, is refused,
/// and carries on without it (a workspace probe with a fallback).
unsafe extern "C" fn probe_then_fallback(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: ctx is valid during the call.
    let scratch = unsafe { (*ctx).scratch };
    let mut p = null_mut();
    // 2^47 bytes: within graphed's 2^48 limit, beyond any allocator here.
    // SAFETY: a local out pointer.
    let big = unsafe { graphed_scratch_alloc(scratch, 1 << 47, &mut p) };
    if big == S::Ok {
        ok(graphed_scratch_free(scratch, p));
    }
    // SAFETY: as above.
    ok(unsafe { graphed_scratch_alloc(scratch, 256, &mut p) });
    ok(graphed_scratch_free(scratch, p));
    0
}

/// A scratch request that was refused must not count toward the arena
/// capture allocates, and a callback that carries on without it does not
/// fail capture. The bug: the first warmup iteration's offset arena kept
/// the refused request's high-water mark (src/orchestrate/scratch.rs took
/// the offset before the memory), so capture failed with OUT_OF_MEMORY
/// allocating an arena of 2^47 bytes although the callbacks keep 256.
#[test]
fn a_refused_scratch_request_does_not_size_the_arena() {
    let mut cfg = host(false);
    cfg.warmup_iterations = 1;
    let s = session(cfg, 0, 0, Some(probe_then_fallback));
    ok(graphed_session_capture(s));
    let mut st = graphed_session_stats_default();
    // SAFETY: a full stats struct.
    ok(unsafe { graphed_session_stats_get(s, &mut st) });
    assert!(
        st.scratch_bytes <= 4096,
        "scratch arena of {} bytes",
        st.scratch_bytes
    );
    ok(graphed_session_destroy(s));
}

/// graphed_schedule_passes builds the passes it counts: a callable count
/// whose passes could never be built is refused instead of allocating
/// until the process aborts.
#[test]
fn a_schedule_of_too_many_callables_is_refused() {
    let mut count = 7usize;
    // SAFETY: no arrays; a local count.
    let st = unsafe {
        graphed_schedule_passes(
            std::ptr::null(),
            0,
            8,
            std::ptr::null(),
            0,
            std::ptr::null(),
            u32::MAX,
            null_mut(),
            0,
            12,
            &mut count,
        )
    };
    assert_eq!(st, S::InvalidArgument);
    assert_eq!(count, 7);
}

/// graphed_schedule_passes and the session config read a schedule the same
/// way: a layer split without its array, a split without a schedule and
/// steps without a count are refused by both (graphed_schedule_passes
/// used to ignore the split's count and a split given without steps).
#[test]
fn schedule_passes_and_the_config_refuse_the_same_schedules() {
    let steps = [
        graphed_schedule_step { pass: 0, chunk: 0 },
        graphed_schedule_step { pass: 1, chunk: 0 },
    ];
    let split = [1u32];
    let step_size = std::mem::size_of::<graphed_schedule_step>();
    // (steps, num_steps, split, num_split, status, words of the message)
    let cases: [(
        *const graphed_schedule_step,
        usize,
        *const u32,
        usize,
        S,
        &str,
    ); 3] = [
        (
            steps.as_ptr(),
            2,
            std::ptr::null(),
            2,
            S::InvalidArgument,
            "layers_per_chunk is NULL",
        ),
        (
            std::ptr::null(),
            0,
            split.as_ptr(),
            1,
            S::InvalidSchedule,
            "without a schedule",
        ),
        (
            steps.as_ptr(),
            0,
            std::ptr::null(),
            0,
            S::InvalidSchedule,
            "= 0",
        ),
    ];
    for (i, &(st_ptr, n, lpc, nl, want, words)) in cases.iter().enumerate() {
        let mut count = 7usize;
        // SAFETY: the arrays hold at least the stated counts; a local count.
        let st = unsafe {
            graphed_schedule_passes(
                st_ptr,
                n,
                step_size,
                lpc,
                nl,
                std::ptr::null(),
                1,
                null_mut(),
                0,
                12,
                &mut count,
            )
        };
        assert_eq!(st, want, "case {i}: {}", msg());
        assert!(msg().contains(words), "case {i}: {}", msg());
        assert_eq!(count, 7, "case {i}: nothing written");

        let mut c = host(false);
        c.schedule = st_ptr;
        c.num_schedule_steps = n;
        c.schedule_step_size = step_size;
        c.layers_per_chunk = lpc;
        c.num_layers_per_chunk = nl;
        let mut s = null_mut();
        // SAFETY: a config whose arrays hold at least the stated counts.
        let st = unsafe { graphed_session_create(&c, &mut s) };
        assert_eq!(st, want, "case {i}: {}", msg());
        assert!(msg().contains(words), "case {i}: {}", msg());
        assert!(s.is_null(), "case {i}: no session");
    }
    // The same arrays, well formed, are accepted by both.
    let mut count = 0usize;
    // SAFETY: as above.
    ok(unsafe {
        graphed_schedule_passes(
            steps.as_ptr(),
            2,
            step_size,
            split.as_ptr(),
            1,
            std::ptr::null(),
            1,
            null_mut(),
            0,
            12,
            &mut count,
        )
    });
    assert_eq!(count, 2);
}

/// An output capacity is an array length like any other: one whose bytes
/// overflow is INVALID_ARGUMENT, as every other array of the boundary.
/// graphed_schedule_passes and graphed_schedule_shape checked only the
/// elements they wrote, so a capacity of SIZE_MAX was accepted (OK).
#[test]
fn schedule_helpers_refuse_capacities_whose_bytes_overflow() {
    let steps = [
        graphed_schedule_step { pass: 0, chunk: 0 },
        graphed_schedule_step { pass: 1, chunk: 0 },
    ];
    let step_size = std::mem::size_of::<graphed_schedule_step>();
    let pass_size = std::mem::size_of::<graphed_pass_ref>();
    // Each call writes into fresh outputs of 4 elements, set to 7.
    let passes_with = |cap: usize, size: usize| {
        let mut out = [graphed_pass_ref {
            callable: 7,
            microbatch: 7,
            pass: 7,
        }; 4];
        let mut count = 7usize;
        // SAFETY: room for 4 passes; a larger capacity is a lie the call
        // must refuse.
        let st = unsafe {
            graphed_schedule_passes(
                steps.as_ptr(),
                2,
                step_size,
                std::ptr::null(),
                0,
                std::ptr::null(),
                1,
                out.as_mut_ptr(),
                cap,
                size,
                &mut count,
            )
        };
        (st, count, out[0].callable)
    };
    let shape_with = |cap: usize| {
        let (mut chunks, mut mbs) = (7u32, 7u32);
        let (mut layers, mut first) = ([7u32; 4], [7u32; 4]);
        // SAFETY: room for 4 chunks; a larger capacity is a lie the call
        // must refuse.
        let st = unsafe {
            graphed_schedule_shape(
                steps.as_ptr(),
                2,
                step_size,
                std::ptr::null(),
                0,
                1,
                &mut chunks,
                &mut mbs,
                layers.as_mut_ptr(),
                first.as_mut_ptr(),
                cap,
            )
        };
        (st, [chunks, mbs, layers[0], first[0]])
    };
    for (cap, size) in [(usize::MAX, pass_size), (usize::MAX / 2, 16)] {
        let (st, count, first) = passes_with(cap, size);
        assert_eq!(st, S::InvalidArgument, "capacity {cap}: {}", msg());
        assert!(msg().contains("passes: "), "{}", msg());
        assert!(msg().contains("do not fit in memory"), "{}", msg());
        assert_eq!((count, first), (7, 7), "nothing written");
    }
    for cap in [usize::MAX, usize::MAX / 4 + 1] {
        let (st, outs) = shape_with(cap);
        assert_eq!(st, S::InvalidArgument, "capacity {cap}: {}", msg());
        assert!(msg().contains("do not fit in memory"), "{}", msg());
        assert_eq!(outs, [7; 4], "nothing written");
    }
    // The true capacities are accepted.
    let (st, count, first) = passes_with(4, pass_size);
    ok(st);
    assert_eq!((count, first), (2, 0));
    let (st, outs) = shape_with(4);
    ok(st);
    assert_eq!(outs, [1, 1, 1, 0]);
}

/// A host session with one CLONE parameter, captured, and the owner of the
/// clone block one backward returned (one reference).
fn one_clone_block() -> (*mut graphed_session, *mut graphed_buffer) {
    let s = session(
        host(false),
        1,
        graphed_grad_policy::Clone as u32,
        Some(noop),
    );
    ok(graphed_session_capture(s));
    let a = graphed_replay_args_default();
    let mut gp = [empty_ref()];
    // SAFETY: args and room for the refs (no inputs, one parameter).
    ok(unsafe { graphed_backward(s, &a, null_mut(), 0, gp.as_mut_ptr(), 1) });
    assert_eq!(gp[0].kind, graphed_ref_kind::Clone as u32);
    (s, gp[0].owner)
}

/// On the host backend a stream is NULL or a host stream: a replay refuses
/// any other pointer (INVALID_ARGUMENT), and so does
/// graphed_buffer_release_on, which drops nothing then. It used to
/// accept any pointer and drop the reference.
#[test]
fn release_on_refuses_what_is_not_a_host_stream_and_drops_nothing() {
    let (s, owner) = one_clone_block();
    let mut a = graphed_replay_args_default();
    let mut out = [empty_ref()];
    let mut local = 0u64;
    let not_streams = [
        0x1234usize,
        &mut local as *mut u64 as usize,
        s as usize, // a handle, but a session's
    ];
    for bad in not_streams {
        a.stream = bad as graphed_stream;
        // SAFETY: args and room for one ref.
        let st = unsafe { graphed_forward(s, &a, out.as_mut_ptr(), 1) };
        assert_eq!(st, S::InvalidArgument, "forward on 0x{bad:x}: {}", msg());
        let st = graphed_buffer_release_on(owner, bad as graphed_stream);
        assert_eq!(st, S::InvalidArgument, "release_on 0x{bad:x}: {}", msg());
        assert!(
            msg().starts_with("graphed_buffer_release_on: "),
            "{}",
            msg()
        );
        assert!(
            msg().contains("not a stream of the host backend"),
            "{}",
            msg()
        );
    }
    let mut st = graphed_session_stats_default();
    // SAFETY: a full stats struct.
    ok(unsafe { graphed_session_stats_get(s, &mut st) });
    assert_eq!(
        st.clone_blocks_outstanding, 1,
        "the refused releases dropped nothing"
    );
    // The block's one reference is still there, and NULL is still the
    // default stream.
    ok(graphed_buffer_release_on(owner, null_mut()));
    assert_eq!(graphed_buffer_release(owner), S::UseAfterDestroy);
    ok(graphed_session_destroy(s));
}

/// The legacy default stream (CU_STREAM_LEGACY, 0x1) and the per-thread
/// default stream (CU_STREAM_PER_THREAD, 0x2) cannot be a session's
/// capture stream: CUDA cannot capture the legacy stream, and callbacks
/// never receive a default stream. Both are refused when the session is
/// created, naming the stream, on every backend (the CUDA backend took
/// them and failed at capture with a driver error).
#[test]
fn a_default_stream_as_capture_stream_is_refused_at_create() {
    for (raw, name) in [(1usize, "CU_STREAM_LEGACY"), (2, "CU_STREAM_PER_THREAD")] {
        for backend in [graphed_backend::Host, graphed_backend::Cuda] {
            let mut c = graphed_session_config_default();
            c.backend = backend as u32;
            c.capture_stream = raw as graphed_stream;
            let mut s = null_mut();
            // SAFETY: a valid config and out pointer.
            let st = unsafe { graphed_session_create(&c, &mut s) };
            assert_eq!(st, S::InvalidArgument, "{name}: {}", msg());
            assert!(
                msg().contains(&format!("config.capture_stream is {name}")),
                "{}",
                msg()
            );
            assert!(s.is_null());
        }
    }
}

/// Steps do not go with a pipeline schedule: that refusal is INCOMPATIBLE
/// (the call combines features that do not work together), not
/// UNSUPPORTED (which says the backend or build lacks something). Callables
/// whose callbacks provide buffers are accepted (they were refused before
/// steps wrote external buffers where their passes provided them).
#[test]
fn steps_over_a_schedule_are_incompatible_and_external_buffers_fine() {
    let steps = [
        graphed_schedule_step { pass: 0, chunk: 0 },
        graphed_schedule_step { pass: 1, chunk: 0 },
    ];
    let mut c = host(false);
    c.schedule = steps.as_ptr();
    c.num_schedule_steps = steps.len();
    let scheduled = session(c, 1, 0, Some(noop));
    let plain = session(host(false), 1, 0, Some(noop));
    ok(graphed_session_set_param_flags(
        plain,
        0,
        0,
        graphed_param_flags::ExternalGrad as u32,
    ));
    let callables = [0u32];
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = 1;
    let mut idx = 77;
    // SAFETY: a valid descriptor and out pointer.
    let st = unsafe { graphed_session_add_step(scheduled, &d, &mut idx) };
    assert_eq!(st, S::Incompatible, "{}", msg());
    assert!(msg().contains("pipeline schedule"), "{}", msg());
    assert_eq!(idx, 77);
    ok(graphed_session_destroy(scheduled));
    // SAFETY: a valid descriptor and out pointer.
    ok(unsafe { graphed_session_add_step(plain, &d, &mut idx) });
    assert_eq!(idx, 0);
    ok(graphed_session_destroy(plain));
    // SAFETY: a static string.
    let name = unsafe { std::ffi::CStr::from_ptr(graphed_status_name(20)) };
    assert_eq!(name.to_str().unwrap(), "GRAPHED_STATUS_INCOMPATIBLE");
}
