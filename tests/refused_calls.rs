//! A refused call changes nothing, through the C ABI on the host backend:
//! every refusal of a replay or a step replay comes before anything the
//! call would change (where the graphs read the parameters, the count of
//! moves in the stats, where a step replay given no address finds them,
//! the replay order of sessions sharing a pool).
//!
//! Parameters move on the host backend where no graph reads them: the
//! callables here record no work (their callbacks enqueue nothing), so a
//! parameter registered with GRAPHED_PARAM_FLAGS_REBIND is verified movable
//! at capture, in the callables' graphs and in the steps' graphs. What a
//! replay did with the addresses it was given shows in
//! `graphed_session_stats.param_moves` (one per parameter per instance or
//! step pointed at a new address): a replay given no address (NULL) runs
//! where the last successful replay had the parameters, so a NULL replay
//! then a replay at those addresses count no move.

use graphed::ffi::*;
use std::ffi::c_void;
use std::ptr::null_mut;

use graphed_status as S;

mod common;
use common::{
    create, empty_ref, free_nothing, host_config, layer_desc, msg, ok, refuse_alloc, stats,
    step_replay,
};

const N: usize = 16;
const BYTES: usize = N * 4;
const REBIND: u32 = graphed_param_flags::Rebind as u32;

unsafe extern "C" fn nothing(_: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    0
}

unsafe extern "C" fn noop_task(_: *mut c_void) {}

/// Records work (an opaque host task) in bucket 1 only: the parameters of
/// bucket 0's graphs can move, bucket 1's cannot.
unsafe extern "C" fn opaque_in_bucket_1(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: the context is valid during the call.
    let c = unsafe { &*ctx };
    if c.bucket != 1 {
        return 0;
    }
    // SAFETY: a task without data.
    unsafe { graphed_host_enqueue(c.stream, Some(noop_task), null_mut()) as i32 }
}

/// Fresh memory of BYTES aligned to 256 bytes, kept for the test, holding
/// `v` in every float.
fn aligned(v: f32) -> *mut f32 {
    let b = Box::leak(vec![0u8; BYTES + 256].into_boxed_slice());
    let p = ((b.as_ptr() as usize + 255) & !255) as *mut f32;
    for i in 0..N {
        // SAFETY: N floats inside the leaked allocation.
        unsafe { *p.add(i) = v };
    }
    p
}

fn config(clone_slots: u32, share: *mut graphed_session) -> graphed_session_config {
    let mut c = host_config();
    c.clone_slots = clone_slots;
    c.share_pool_with = share;
    c
}

fn tensor() -> graphed_tensor_desc {
    graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    }
}

/// Registers a callable of one input, one output and the parameters at
/// `params` (REBIND, grads returned by `policy`), with callbacks `cb`.
fn add(
    s: *mut graphed_session,
    params: &[*mut f32],
    policy: graphed_grad_policy,
    cb: graphed_pass_fn,
) -> u32 {
    let t = tensor();
    let p: Vec<graphed_param_desc> = params
        .iter()
        .map(|&data| graphed_param_desc {
            data: data.cast(),
            bytes: BYTES,
            flags: REBIND,
            policy: policy as u32,
            ..graphed_param_desc_default()
        })
        .collect();
    let d = layer_desc(&t, &t, &p, cb, cb);
    let mut idx = 7;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    idx
}

/// Declares a step over `callables`, `microbatches` in one graph.
fn add_step(s: *mut graphed_session, callables: &[u32], microbatches: u32) {
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = callables.len();
    d.microbatches = microbatches;
    let mut idx = 7;
    // SAFETY: a valid descriptor and out pointer.
    ok(unsafe { graphed_session_add_step(s, &d, &mut idx) });
}

fn addrs(ps: &[*mut f32]) -> Vec<*const c_void> {
    ps.iter().map(|&p| p as *const c_void).collect()
}

/// A replay of step 0 with the parameters at `params` (None: a NULL
/// array): the status and the refs (untouched on failure).
fn step(
    s: *mut graphed_session,
    params: Option<&[*const c_void]>,
    n: usize,
) -> (S, Vec<graphed_ref>) {
    let (st, refs) = step_replay(s, n, params);
    if st != S::Ok {
        assert!(
            refs.iter().all(|r| r.ptr.is_null()),
            "refs written on refusal"
        );
    }
    (st, refs)
}

/// Releases the clone blocks of `refs` (one reference per CLONE ref).
fn release(refs: &[graphed_ref]) {
    for r in refs.iter().filter(|r| !r.owner.is_null()) {
        ok(graphed_buffer_release(r.owner));
    }
}

/// A forward of `callable` (data NULL: what the static input holds), size
/// `size` (0: no buckets), the parameters at `params` (None: NULL).
fn fwd(s: *mut graphed_session, callable: u32, size: u64, params: Option<&[*const c_void]>) -> S {
    let mut a = graphed_replay_args_default();
    a.callable = callable;
    a.size = size;
    if let Some(p) = params {
        a.params = p.as_ptr();
        a.num_params = p.len();
    }
    let mut out = empty_ref();
    // SAFETY: valid args and room for one ref.
    unsafe { graphed_forward(s, &a, &mut out, 1) }
}

/// A backward of `callable`; its grads' blocks released at once.
fn bwd(s: *mut graphed_session, callable: u32, params: usize) -> S {
    let mut a = graphed_replay_args_default();
    a.callable = callable;
    let mut gi = [empty_ref()];
    let mut gp = vec![empty_ref(); params];
    // SAFETY: valid args and room for the stated refs.
    let st = unsafe { graphed_backward(s, &a, gi.as_mut_ptr(), 1, gp.as_mut_ptr(), params) };
    release(&gp);
    st
}

fn movable(s: *mut graphed_session, callable: u32, n: usize) -> Vec<u32> {
    let mut on = vec![7u32; n];
    // SAFETY: room for n values.
    ok(unsafe { graphed_session_params_movable(s, callable, 0, on.as_mut_ptr(), n) });
    on
}

/// A replay of step 0 given the parameters at `to` (`n` refs), refused
/// with `want`, its message saying `says` where given: it counts no move.
#[track_caller]
fn refused_without_a_move(
    s: *mut graphed_session,
    to: &[*mut f32],
    n: usize,
    want: S,
    says: Option<&str>,
) {
    let (st, _) = step(s, Some(&addrs(to)), n);
    assert_eq!(st, want, "{}", msg());
    if let Some(says) = says {
        assert!(msg().contains(says), "{}", msg());
    }
    assert_eq!(
        stats(s).param_moves,
        0,
        "the refused step replay counted a move"
    );
}

/// A replay of step 0 (`n` refs) given the parameters at `at` (None: a
/// NULL array) that succeeds; its clones released.
#[track_caller]
fn replayed(s: *mut graphed_session, at: Option<&[*mut f32]>, n: usize) {
    let (st, g) = step(s, at.map(addrs).as_deref(), n);
    assert_eq!(st, S::Ok, "{}", msg());
    release(&g);
}

/// Replays of step 0 (`n` refs) given no address, then the parameters at
/// `at`, their clones released: both run where the parameters are, so
/// nothing moves (`what` fails the count otherwise).
#[track_caller]
fn replays_without_a_move(s: *mut graphed_session, at: &[*mut f32], n: usize, what: &str) {
    replayed(s, None, n);
    replayed(s, Some(at), n);
    assert_eq!(stats(s).param_moves, 0, "{what}");
}

/// After a whole iteration of `a`, a replay of `b`'s step 0 given the
/// parameters at `to` (`n` refs) succeeds and counts `moves` moves.
#[track_caller]
fn moves_after_an_iteration(
    a: *mut graphed_session,
    b: *mut graphed_session,
    to: &[*mut f32],
    n: usize,
    moves: u64,
) {
    ok(fwd(a, 0, 0, None));
    ok(bwd(a, 0, 0));
    assert_eq!(step(b, Some(&addrs(to)), n).0, S::Ok, "{}", msg());
    assert_eq!(stats(b).param_moves, moves);
}

/// The regression: a step over microbatches whose one clone slot is held
/// is refused with ALIAS_HELD, and the parameter moves it was given stay
/// unmade: not counted, and the next replay given no address runs where
/// the last successful one had the parameter.
#[test]
fn a_step_over_microbatches_refused_for_its_held_slot_keeps_no_parameter_move() {
    let w = aligned(1.5);
    let s = create(&config(1, null_mut()));
    add(s, &[w], graphed_grad_policy::Clone, Some(nothing));
    add_step(s, &[0], 2);
    ok(graphed_session_capture(s));
    assert_eq!(movable(s, 0, 1), [1], "the parameter moves on this backend");
    let (st, held) = step(s, None, 1);
    assert_eq!(st, S::Ok, "{}", msg());
    assert_eq!(held[0].kind, graphed_ref_kind::Clone as u32);
    // The slot is held: refused, with the parameter given elsewhere.
    let to = aligned(1.5);
    refused_without_a_move(s, &[to], 1, S::AliasHeld, Some("all 1 are held"));
    release(&held);
    // Given no address, the step runs where the last successful replay had
    // the parameter: back there, nothing moves.
    replays_without_a_move(
        s,
        &[w],
        1,
        "the step ran at the refused call's address after it",
    );
    // A move that succeeds is counted: the step follows it.
    replayed(s, Some(&[to]), 1);
    assert_eq!(stats(s).param_moves, 1);
    ok(graphed_session_destroy(s));
}

/// Two sessions sharing a pool, `a` with one callable without parameters,
/// `b` with the callables `build` registers and a step over them. Returns
/// (a, b), both captured.
fn sharing(
    build: impl FnOnce(*mut graphed_session) -> Vec<u32>,
    clone_slots: u32,
) -> (*mut graphed_session, *mut graphed_session) {
    let a = create(&config(2, null_mut()));
    add(a, &[], graphed_grad_policy::Default, Some(nothing));
    let b = create(&config(clone_slots, a));
    let callables = build(b);
    add_step(b, &callables, 1);
    ok(graphed_session_capture(a));
    ok(graphed_session_capture(b));
    (a, b)
}

/// A step that would launch its graph, refused because the session it
/// shares its pool with is in the middle of its iteration: its graph is
/// not pointed at the addresses it was given.
#[test]
fn a_step_refused_by_its_shared_pool_keeps_no_parameter_move() {
    let w = aligned(2.0);
    let (a, b) = sharing(
        |b| vec![add(b, &[w], graphed_grad_policy::Alias, Some(nothing))],
        0,
    );
    let to = aligned(2.0);
    ok(fwd(a, 0, 0, None));
    refused_without_a_move(
        b,
        &[to],
        1,
        S::WrongState,
        Some("in the middle of its iteration"),
    );
    ok(bwd(a, 0, 0));
    replays_without_a_move(
        b,
        &[w],
        1,
        "the step ran at the refused call's address after it",
    );
    // Then a move that succeeds is counted.
    moves_after_an_iteration(a, b, &[to], 1, 1);
    ok(graphed_session_destroy(b));
    ok(graphed_session_destroy(a));
}

/// A step whose clone slot is held replays pass by pass; refused by its
/// shared pool, it keeps the addresses of its last successful replay.
#[test]
fn a_step_replayed_pass_by_pass_refused_by_its_shared_pool_keeps_its_addresses() {
    let w = aligned(3.0);
    let (a, b) = sharing(
        |b| vec![add(b, &[w], graphed_grad_policy::Clone, Some(nothing))],
        1,
    );
    let (st, held) = step(b, None, 1);
    assert_eq!(st, S::Ok, "{}", msg());
    let to = aligned(3.0);
    ok(fwd(a, 0, 0, None));
    refused_without_a_move(b, &[to], 1, S::WrongState, None);
    ok(bwd(a, 0, 0));
    // Still held: pass by pass, where the last successful replay had it.
    replayed(b, None, 1);
    release(&held);
    replayed(b, Some(&[w]), 1);
    assert_eq!(
        stats(b).param_moves,
        0,
        "the step ran at the refused call's address after it"
    );
    ok(graphed_session_destroy(b));
    ok(graphed_session_destroy(a));
}

/// A parameter two callables share (tied weights) can move in each
/// callable's graphs but not in the step's (moved apart, one plan would
/// carry the other's references): such a step replays pass by pass. Refused
/// by its shared pool, it keeps the addresses of its last replay.
#[test]
fn a_step_that_only_its_callables_can_follow_keeps_its_addresses_when_refused() {
    let w = aligned(4.0);
    let (a, b) = sharing(
        |b| {
            vec![
                add(b, &[w], graphed_grad_policy::Alias, Some(nothing)),
                add(b, &[w], graphed_grad_policy::Alias, Some(nothing)),
            ]
        },
        0,
    );
    assert_eq!((movable(b, 0, 1), movable(b, 1, 1)), (vec![1], vec![1]));
    let to = aligned(4.0);
    ok(fwd(a, 0, 0, None));
    refused_without_a_move(b, &[to, to], 2, S::WrongState, None);
    ok(bwd(a, 0, 0));
    replays_without_a_move(
        b,
        &[w, w],
        2,
        "the callables' forwards ran at the refused call's address after it",
    );
    // A move that succeeds moves both callables' graphs, pass by pass.
    moves_after_an_iteration(a, b, &[to, to], 2, 2);
    ok(graphed_session_destroy(b));
    ok(graphed_session_destroy(a));
}

/// A forward of a bucketed callable follows a move in every bucket's
/// graphs. One whose other bucket cannot follow is refused, after the
/// forward's own bucket accepted the move: the refusal leaves the order of
/// the sessions sharing its pool as it was, so that the other session
/// replays on.
#[test]
fn a_bucketed_forward_refused_for_another_bucket_keeps_the_pools_order() {
    let w = aligned(5.0);
    let a = create(&config(2, null_mut()));
    let shape = [4i64, 4];
    let t = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ndim: 2,
        shape: shape.as_ptr(),
        flags: graphed_tensor_flags::Dynamic as u32,
        ..graphed_tensor_desc_default()
    };
    let p = [graphed_param_desc {
        data: w.cast(),
        bytes: BYTES,
        flags: REBIND,
        ..graphed_param_desc_default()
    }];
    let buckets = [2u64, 4];
    let mut d = layer_desc(
        &t,
        &t,
        &p,
        Some(opaque_in_bucket_1),
        Some(opaque_in_bucket_1),
    );
    d.name = c"bucketed".as_ptr();
    d.bucket_sizes = buckets.as_ptr();
    d.num_buckets = 2;
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(a, &d, &mut idx) });
    let b = create(&config(2, a));
    add(b, &[], graphed_grad_policy::Default, Some(nothing));
    ok(graphed_session_capture(a));
    ok(graphed_session_capture(b));
    // `a` runs a whole iteration (its last pass in capture order is the
    // largest bucket's backward), then `b` does.
    ok(fwd(a, 0, 3, None));
    ok(bwd(a, 0, 1));
    ok(fwd(b, 0, 0, None));
    ok(bwd(b, 0, 0));
    // Bucket 0 can follow the move, bucket 1 cannot.
    let to = aligned(5.0);
    assert_eq!(
        fwd(a, 0, 1, Some(&addrs(&[to]))),
        S::ParamMoved,
        "{}",
        msg()
    );
    assert!(
        msg().contains("(bucket 1)") && msg().contains("opaque"),
        "{}",
        msg()
    );
    assert_eq!(stats(a).param_moves, 0);
    // `a` did not start an iteration: `b` goes on.
    assert_eq!(fwd(b, 0, 0, None), S::Ok, "{}", msg());
    ok(bwd(b, 0, 0));
    ok(graphed_session_destroy(b));
    ok(graphed_session_destroy(a));
}

/// A backward that fails before its graph runs (the caller's allocator
/// refuses its clone block) did not run: its session is still in the
/// middle of its iteration, so the session sharing its pool may not take
/// over the scratch its forward left for it, and the backward may be
/// replayed again.
#[test]
fn a_backward_that_failed_before_its_launch_leaves_its_iteration_open() {
    let w = aligned(6.0);
    let mut cfg = config(0, null_mut());
    cfg.clone_alloc = Some(refuse_alloc::<3>);
    cfg.clone_free = Some(free_nothing);
    let a = create(&cfg);
    add(a, &[w], graphed_grad_policy::Clone, Some(nothing));
    let b = create(&config(2, a));
    add(b, &[], graphed_grad_policy::Default, Some(nothing));
    ok(graphed_session_capture(a));
    ok(graphed_session_capture(b));
    ok(fwd(a, 0, 0, None));
    assert_eq!(bwd(a, 0, 1), S::OutOfMemory, "{}", msg());
    assert_eq!(fwd(b, 0, 0, None), S::WrongState, "{}", msg());
    assert!(
        msg().contains("in the middle of its iteration"),
        "{}",
        msg()
    );
    ok(graphed_session_destroy(b));
    ok(graphed_session_destroy(a));
}
