//! A step's collective stage through the C ABI on the host backend: the
//! callback called under capture at its points with each parameter's
//! accumulated grad (unrolled, and looping on the device with the last
//! microbatch after the loop, replays of fewer microbatches included), its
//! manifest, two ranks as two threads whose host "communicator" sums the
//! grads at replay (equal to the eager sum bit for bit) and whose
//! manifests are compared through an in-process all-gather; mismatches
//! named on both ranks; teardown in both orders; every refusal.
//!
//! The model: two elementwise layers `y = w * x` over f32 (backward
//! `gw = x * gy`; tests/common/mul.rs), each with its own io, in one step.

use graphed::ffi::*;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::{Arc, Barrier, Mutex};

mod common;
use common::mul::{enqueue, leak};
use common::{add_step, create, host_config, msg, mul, ok, step_desc, step_replay_args, Session};

const N: usize = 8;
const BYTES: usize = N * 4;

thread_local! {
    /// Whether this thread's forward callbacks fail (a rank whose capture
    /// fails in its warmup, before any step).
    static FORWARD_FAILS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The layer's forward (`y = x * w`, tests/common/mul.rs) that fails where
/// FORWARD_FAILS says so and keeps a scratch workspace: each microbatch's
/// capture lays its scratch out from the start again, the last one's after
/// the loop too (the warmup measured one microbatch).
unsafe extern "C" fn forward(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    if FORWARD_FAILS.with(|f| f.get()) {
        return 3;
    }
    // SAFETY: the context and its arrays are valid during the call.
    let c = unsafe { &*ctx };
    let mut ws = null_mut();
    // SAFETY: the pass's scratch allocator and a valid out pointer.
    let st = unsafe { graphed_scratch_alloc(c.scratch, 256, &mut ws) };
    if st != graphed_status::Ok {
        return 40 + st as i32;
    }
    // SAFETY: as above.
    let (x, w, y) = unsafe { (*c.inputs, *c.params, *c.outputs) };
    mul::enqueue_mul::<N>(c.stream, x, w, y)
}

/// A host "communicator" of `ranks` threads: an all-reduce sums every
/// rank's buffer in rank order; an all-gather concatenates bytes.
struct Comm {
    ranks: usize,
    barrier: Barrier,
    slots: Mutex<Vec<Vec<u8>>>,
}

impl Comm {
    fn new(ranks: usize) -> Arc<Comm> {
        Arc::new(Comm {
            ranks,
            barrier: Barrier::new(ranks),
            slots: Mutex::new(vec![Vec::new(); ranks]),
        })
    }

    /// Every rank's `mine`, in rank order.
    fn gather(&self, rank: usize, mine: &[u8]) -> Vec<Vec<u8>> {
        self.slots.lock().unwrap()[rank] = mine.to_vec();
        self.barrier.wait();
        let all = self.slots.lock().unwrap().clone();
        self.barrier.wait();
        all
    }
}

/// The all-reduce task recorded into the step's graph: sums one grad
/// across the ranks in place, then keeps a copy of the result.
struct AllReduce {
    comm: Arc<Comm>,
    rank: usize,
    grad: *mut f32,
    seen: Arc<Mutex<Vec<Vec<f32>>>>,
}

unsafe extern "C" fn run_all_reduce(data: *mut c_void) {
    // SAFETY: a leaked AllReduce whose grad holds N floats.
    let a = unsafe { &*(data as *const AllReduce) };
    // SAFETY: as above.
    let g = unsafe { std::slice::from_raw_parts_mut(a.grad, N) };
    let bytes: Vec<u8> = g.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = a.comm.gather(a.rank, &bytes);
    for (i, v) in g.iter_mut().enumerate() {
        let mut sum = 0.0f32;
        for (r, b) in all.iter().enumerate() {
            let x = f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
            sum = if r == 0 { x } else { sum + x };
        }
        *v = sum;
    }
    a.seen.lock().unwrap().push(g.to_vec());
}

/// What a rank's collective callback does and saw.
struct Coll {
    comm: Arc<Comm>,
    rank: usize,
    /// 0 works; 1 returns 5; 2 breaks the capture; 3 records one more
    /// collective; 4 records 4 bytes more on its first; 5 records with an
    /// unknown op (and returns what the record returned).
    mode: u32,
    /// (callable, num_params, slot) per call.
    calls: Vec<(u32, usize, u32)>,
    /// Each reduced grad, at each replay.
    seen: Arc<Mutex<Vec<Vec<f32>>>>,
}

unsafe extern "C" fn collective(ctx: *const graphed_collective_ctx, data: *mut c_void) -> i32 {
    // SAFETY: the context and its arrays are valid during the call; data
    // is the test's Coll.
    let (c, o) = unsafe { (&*ctx, &mut *(data as *mut Coll)) };
    o.calls.push((c.callable, c.num_params, c.slot));
    match o.mode {
        1 => return 5,
        2 => {
            let _ = graphed_host_synchronize(c.stream);
            return 0;
        }
        _ => {}
    }
    for k in 0..c.num_params {
        // SAFETY: num_params entries.
        let (g, bytes) = unsafe { (*c.grads.add(k), *c.bytes.add(k)) };
        let extra = if o.mode == 4 && k == 0 { 4 } else { 0 };
        let op = if o.mode == 5 {
            99
        } else {
            graphed_collective_op::AllReduce as u32
        };
        // SAFETY: the ctx this callback was given.
        let st = unsafe {
            graphed_collective_record(
                ctx,
                7,
                op,
                (bytes + extra) as u64,
                graphed_dtype::F32 as u32,
            )
        };
        if st != graphed_status::Ok {
            return 100 + st as i32;
        }
        let t = AllReduce {
            comm: o.comm.clone(),
            rank: o.rank,
            grad: g as *mut f32,
            seen: o.seen.clone(),
        };
        let st = enqueue(c.stream, Some(run_all_reduce), leak(t));
        if st != 0 {
            return st;
        }
    }
    if o.mode == 3 {
        // SAFETY: the ctx this callback was given.
        unsafe { graphed_collective_record(ctx, 7, graphed_collective_op::Broadcast as u32, 8, 0) };
    }
    0
}

/// The in-process all-gather of the manifests (data: the Coll).
unsafe extern "C" fn exchange(
    mine: *const c_void,
    bytes: usize,
    all: *mut c_void,
    data: *mut c_void,
) -> i32 {
    // SAFETY: data is the test's Coll; the buffers as the contract says.
    let o = unsafe { &*(data as *const Coll) };
    let mine = unsafe { std::slice::from_raw_parts(mine.cast::<u8>(), bytes) };
    let out = unsafe { std::slice::from_raw_parts_mut(all.cast::<u8>(), bytes * o.comm.ranks) };
    for (r, b) in o.comm.gather(o.rank, mine).iter().enumerate() {
        out[r * bytes..][..bytes].copy_from_slice(b);
    }
    0
}

unsafe extern "C" fn failing_exchange(
    _: *const c_void,
    _: usize,
    _: *mut c_void,
    _: *mut c_void,
) -> i32 {
    9
}

/// One rank's memory: two weights, each layer's `mbs` microbatches of x
/// and gy side by side (x0 g0 x1 g1 ...), the grad destinations.
struct Model {
    w: [Vec<f32>; 2],
    xg: [Vec<f32>; 2],
    dst: [Vec<f32>; 2],
    mbs: usize,
    coll: Box<Coll>,
}

impl Model {
    fn new(mbs: usize, comm: Arc<Comm>, rank: usize) -> Model {
        Model {
            w: [vec![0.5; N], vec![-0.25; N]],
            xg: [vec![0.0; 2 * N * mbs], vec![0.0; 2 * N * mbs]],
            dst: [vec![0.0; N], vec![0.0; N]],
            mbs,
            coll: Box::new(Coll {
                comm,
                rank,
                mode: 0,
                calls: Vec::new(),
                seen: Arc::new(Mutex::new(Vec::new())),
            }),
        }
    }

    /// Iteration `it`'s data of this rank.
    fn fill(&mut self, it: usize) {
        let rank = self.coll.rank;
        for (l, xg) in self.xg.iter_mut().enumerate() {
            mul::fill::<N>(xg, self.mbs, it, l * 5 + rank * 11);
        }
    }

    /// Layer `l`'s grad eager accumulation makes over the first `mbs`.
    fn grad(&self, l: usize, mbs: usize) -> Vec<f32> {
        mul::grad::<N>(&self.xg[l], mbs)
    }
}

#[derive(Clone, Copy)]
struct Setup {
    loop_mode: graphed_step_loop,
    at: graphed_collective_at,
    exchange: bool,
    ranks: u32,
}

const PLAIN: Setup = Setup {
    loop_mode: graphed_step_loop::Unrolled,
    at: graphed_collective_at::AfterBackward,
    exchange: false,
    ranks: 1,
};

/// The session with both layers and the step (uncaptured); the add_step
/// status. `edit` changes the step's descriptor last.
fn build(
    m: &mut Model,
    setup: Setup,
    edit: &dyn Fn(&mut graphed_step_desc),
) -> (Session, graphed_status) {
    let b = Session(create(&host_config()));
    let mut io = Vec::new();
    for l in 0..2 {
        mul::add_layer_with::<N>(
            b.0,
            m.w[l].as_mut_ptr(),
            graphed_grad_policy::CopyInto,
            0,
            Some(forward),
        );
        io.extend(mul::io::<N>(l as u32, m.xg[l].as_mut_ptr()));
    }
    let dsts = [
        m.dst[0].as_mut_ptr().cast::<c_void>(),
        m.dst[1].as_mut_ptr().cast(),
    ];
    let callables = [0u32, 1];
    let mut d = step_desc(&callables, m.mbs, setup.loop_mode, &io, &dsts);
    d.collective = Some(collective);
    d.collective_data = (&mut *m.coll as *mut Coll).cast();
    d.collective_at = setup.at as u32;
    if setup.exchange {
        d.collective_exchange = Some(exchange);
        d.collective_exchange_data = d.collective_data;
    }
    d.collective_rank = m.coll.rank as u32;
    d.collective_ranks = setup.ranks;
    edit(&mut d);
    let st = add_step(b.0, &d);
    (b, st)
}

/// Replays step 0 running `mbs` microbatches (0: all).
fn replay(s: *mut graphed_session, mbs: u32) -> graphed_status {
    let mut a = graphed_step_args_default();
    a.microbatches = mbs;
    step_replay_args(s, &a, 2).0
}

/// Step 0's manifest.
fn manifest(s: *mut graphed_session) -> Vec<graphed_collective_entry> {
    let mut n = 0;
    // SAFETY: capacity 0, a valid count pointer.
    ok(unsafe { graphed_step_collectives(s, 0, null_mut(), 0, size_of_entry(), &mut n) });
    let mut v = vec![graphed_collective_entry::default(); n];
    // SAFETY: room for n entries.
    ok(unsafe { graphed_step_collectives(s, 0, v.as_mut_ptr(), n, size_of_entry(), &mut n) });
    v
}

fn size_of_entry() -> usize {
    std::mem::size_of::<graphed_collective_entry>()
}

/// One rank trains 5 iterations, each replay running `counts[it % len]`
/// microbatches; every reduced grad is what the callback saw at replay,
/// against `expect(model, layer, count)`.
fn one_rank(mbs: usize, setup: Setup, counts: &[u32]) {
    let what = format!("{mbs} microbatches, {:?}, {:?}", setup.loop_mode, setup.at);
    let mut m = Model::new(mbs, Comm::new(1), 0);
    let (b, st) = build(&mut m, setup, &|_| {});
    ok(st);
    ok(graphed_session_capture(b.0));
    // Called under capture only, at its points, in backward order.
    let want: Vec<(u32, usize, u32)> = match setup.at {
        graphed_collective_at::AfterBackward => vec![(GRAPHED_COLLECTIVE_ALL_CALLABLES, 2, 0)],
        graphed_collective_at::PerCallable => vec![(1, 1, 0), (0, 1, 0)],
    };
    assert_eq!(m.coll.calls, want, "{what}");
    let entries = manifest(b.0);
    assert_eq!(entries.len(), 2, "{what}");
    for (k, e) in entries.iter().enumerate() {
        assert_eq!(
            (e.communicator, e.bytes, e.op),
            (7, BYTES as u64, 0),
            "{what}"
        );
        assert_eq!(e.callable, want[k.min(want.len() - 1)].0, "{what}");
    }
    let seen = m.coll.seen.clone();
    seen.lock().unwrap().clear();
    for it in 0..5 {
        let count = counts[it % counts.len()];
        m.fill(it);
        assert_eq!(replay(b.0, count), graphed_status::Ok, "{what}: {}", msg());
        let n = if count == 0 { mbs } else { count as usize };
        // Each grad as the collective saw it, summed over the microbatches.
        let order: Vec<usize> = match setup.at {
            graphed_collective_at::AfterBackward => vec![0, 1],
            graphed_collective_at::PerCallable => vec![1, 0],
        };
        let got = std::mem::take(&mut *seen.lock().unwrap());
        let eager: Vec<Vec<f32>> = order.iter().map(|&l| m.grad(l, n)).collect();
        assert_eq!(got, eager, "{what}, iteration {it}, {n} microbatches");
        assert_eq!(m.dst[0], m.grad(0, n), "{what}: the destination holds it");
    }
}

#[test]
fn the_callback_sees_each_accumulated_grad_unrolled() {
    for at in [
        graphed_collective_at::AfterBackward,
        graphed_collective_at::PerCallable,
    ] {
        for mbs in [1, 3] {
            one_rank(mbs, Setup { at, ..PLAIN }, &[0]);
        }
    }
}

#[test]
fn looped_the_last_microbatch_follows_the_loop_at_every_count() {
    for at in [
        graphed_collective_at::AfterBackward,
        graphed_collective_at::PerCallable,
    ] {
        let setup = Setup {
            at,
            loop_mode: graphed_step_loop::While,
            ..PLAIN
        };
        one_rank(4, setup, &[0, 1, 2, 3, 4]);
        one_rank(1, setup, &[1]);
    }
}

/// Two ranks as two threads; `mode_of(rank)` sets each's callback mode.
/// Each thread's capture status and message.
fn two_ranks(
    setup: Setup,
    mode_of: fn(usize) -> u32,
    train: bool,
) -> Vec<(graphed_status, String)> {
    let comm = Comm::new(2);
    let threads: Vec<_> = (0..2)
        .map(|rank| {
            let comm = comm.clone();
            std::thread::spawn(move || {
                let mut m = Model::new(3, comm, rank);
                m.coll.mode = mode_of(rank);
                let (b, st) = build(&mut m, setup, &|_| {});
                ok(st);
                let st = graphed_session_capture(b.0);
                let said = msg();
                if st != graphed_status::Ok || !train {
                    return (st, said);
                }
                let seen = m.coll.seen.clone();
                seen.lock().unwrap().clear();
                for it in 0..5 {
                    m.fill(it);
                    ok(replay(b.0, 0));
                    let got = std::mem::take(&mut *seen.lock().unwrap());
                    // The eager sum over the ranks: each rank's own grads
                    // gathered (the data is a function of rank), summed
                    // in rank order.
                    let mut eager = Vec::new();
                    for l in 0..2 {
                        let per: Vec<Vec<f32>> = (0..2)
                            .map(|r| {
                                let mut o = Model::new(3, Comm::new(1), r);
                                o.fill(it);
                                o.grad(l, 3)
                            })
                            .collect();
                        eager.push((0..N).map(|i| per[0][i] + per[1][i]).collect::<Vec<f32>>());
                    }
                    assert_eq!(got, eager, "rank {rank}, iteration {it}");
                    assert_eq!(m.dst[0], eager[0]);
                }
                (st, said)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn two_ranks_exchange_manifests_and_reduce_as_the_eager_sum() {
    for loop_mode in [graphed_step_loop::Unrolled, graphed_step_loop::While] {
        let setup = Setup {
            loop_mode,
            exchange: true,
            ranks: 2,
            ..PLAIN
        };
        for (st, said) in two_ranks(setup, |_| 0, true) {
            assert_eq!(st, graphed_status::Ok, "{said}");
        }
    }
}

#[test]
fn a_mismatch_fails_both_ranks_naming_both_sides() {
    let setup = Setup {
        exchange: true,
        ranks: 2,
        ..PLAIN
    };
    // Rank 1 records 4 bytes more on its first collective.
    let out = two_ranks(setup, |r| if r == 1 { 4 } else { 0 }, false);
    for (st, said) in &out {
        assert_eq!(*st, graphed_status::CollectiveMismatch, "{said}");
        assert!(
            said.contains(
                "rank 0 records all_reduce of 32 bytes f32 on communicator 7 as collective 0 (after \
                 the last microbatch's backward); rank 1 records all_reduce of 36 bytes f32"
            ),
            "{said}"
        );
    }
    // Rank 0 records one more.
    let out = two_ranks(setup, |r| if r == 0 { 3 } else { 0 }, false);
    for (st, said) in &out {
        assert_eq!(*st, graphed_status::CollectiveMismatch, "{said}");
        assert!(
            said.contains(
                "rank 0 records broadcast of 8 bytes f32 on communicator 7 as collective 2"
            ) && said.contains("rank 1 records no collective 2 (it records 2 in all)"),
            "{said}"
        );
    }
    // Rank 1's callback fails: it says why, rank 0 says that rank 1 failed.
    let out = two_ranks(setup, |r| if r == 1 { 1 } else { 0 }, false);
    assert_eq!(out[1].0, graphed_status::CallbackFailed, "{}", out[1].1);
    assert_eq!(out[0].0, graphed_status::CollectiveMismatch, "{}", out[0].1);
    assert!(
        out[0].1.contains("rank 1's capture of the step failed"),
        "{}",
        out[0].1
    );
}

#[test]
fn a_rank_failing_before_the_step_still_takes_part_in_its_exchange() {
    // Rank 1's warmup fails, before any step is captured: it still tells
    // rank 0 in the step's exchange, so rank 0 fails naming it instead of
    // waiting in the all-gather for a rank that never comes.
    let comm = Comm::new(2);
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in 0..2 {
        let (comm, tx) = (comm.clone(), tx.clone());
        std::thread::spawn(move || {
            FORWARD_FAILS.with(|f| f.set(rank == 1));
            let mut m = Model::new(2, comm, rank);
            let setup = Setup {
                exchange: true,
                ranks: 2,
                ..PLAIN
            };
            let (b, st) = build(&mut m, setup, &|_| {});
            ok(st);
            let st = graphed_session_capture(b.0);
            tx.send((rank, st, msg())).unwrap();
        });
    }
    let mut out = [None, None];
    for _ in 0..2 {
        let got = rx.recv_timeout(std::time::Duration::from_secs(20));
        let (rank, st, said) = got.expect("a rank waits in the exchange for the rank that failed");
        out[rank] = Some((st, said));
    }
    let (st1, said1) = out[1].take().unwrap();
    assert_eq!(st1, graphed_status::CallbackFailed, "{said1}");
    let (st0, said0) = out[0].take().unwrap();
    assert_eq!(st0, graphed_status::CollectiveMismatch, "{said0}");
    assert!(
        said0.contains("rank 1's capture of the step failed"),
        "{said0}"
    );
}

#[test]
fn teardown_in_either_order_is_clean() {
    // Graphs first (the documented order), then the communicator, which
    // still works; and the communicator dropped by its owner first, the
    // graphs after: the host fake is held by the recorded tasks, so the
    // step replays as before (on CUDA, destroy graphs before
    // ncclCommDestroy). Each session's destroy must succeed.
    for graphs_first in [true, false] {
        let comm = Comm::new(1);
        let mut m = Model::new(2, comm.clone(), 0);
        let (b, st) = build(&mut m, PLAIN, &|_| {});
        ok(st);
        ok(graphed_session_capture(b.0));
        m.fill(0);
        ok(replay(b.0, 0));
        if graphs_first {
            drop(b);
            // The communicator outlives the graphs and still works.
            let all = comm.gather(0, &[1, 2, 3]);
            assert_eq!(
                all,
                vec![vec![1u8, 2, 3]],
                "one rank's all-gather after the graphs went"
            );
            drop(comm);
        } else {
            // The owner lets the communicator go first: the step's graph
            // still replays with what it recorded, the grads as before.
            drop(comm);
            m.fill(1);
            ok(replay(b.0, 0));
            for l in 0..2 {
                assert_eq!(
                    m.dst[l],
                    m.grad(l, 2),
                    "layer {l} after the communicator's owner let go"
                );
            }
            drop(b);
        }
        drop(m);
    }
}

/// A change to a step's descriptor.
type Edit = dyn Fn(&mut graphed_step_desc);

#[test]
fn refusals_and_failing_callbacks() {
    let comm = Comm::new(1);
    // Data, exchange or ranks without the callback; a bad point; ranks.
    let cases: [(&Edit, &str); 5] = [
        (
            &|d| d.collective = None,
            "desc.collective_data is set but desc.collective is NULL",
        ),
        (
            &|d| {
                d.collective = None;
                d.collective_data = null_mut();
                d.collective_exchange = Some(exchange);
            },
            "desc.collective_exchange is set",
        ),
        (
            &|d| d.collective_at = 2,
            "desc.collective_at: 2 is not a graphed_collective_at value",
        ),
        (
            &|d| d.collective_rank = 1,
            "collective_rank is 1 and collective_ranks 1",
        ),
        (
            &|d| {
                d.collective_exchange = None;
                d.collective_exchange_data = 8 as *mut c_void;
            },
            "desc.collective_exchange_data is set but desc.collective_exchange is NULL",
        ),
    ];
    for (edit, words) in cases {
        let mut m = Model::new(1, comm.clone(), 0);
        let (_b, st) = build(&mut m, PLAIN, edit);
        assert_eq!(st, graphed_status::InvalidArgument, "{words}");
        assert!(msg().contains(words), "{}", msg());
    }
    // Recording outside a callback.
    let ctx = 64 as *const graphed_collective_ctx;
    // SAFETY: compared, never read.
    let st = unsafe { graphed_collective_record(ctx, 1, 0, 4, 0) };
    assert_eq!(st, graphed_status::WrongState);
    assert!(
        msg().contains("only from a step's collective callback"),
        "{}",
        msg()
    );
    // SAFETY: a NULL ctx is refused.
    let st = unsafe { graphed_collective_record(std::ptr::null(), 1, 0, 4, 0) };
    assert_eq!(st, graphed_status::NullPointer);
    // Failing at capture: the callback's code, a broken capture, a bad op,
    // a failing exchange; nothing is kept and the manifest is not there.
    for (mode, exch, want, words) in [
        (1, false, graphed_status::CallbackFailed, "the collective callback of step 0 after the last microbatch's backward returned 5 during capture"),
        (2, false, graphed_status::CaptureInvalidated, "the collective callback of step 0 after the last microbatch's backward invalidated the capture"),
        (5, false, graphed_status::CallbackFailed, "returned 101 during capture"),
        (0, true, graphed_status::CallbackFailed, "the collective exchange of step 0 (the headers) returned 9"),
    ] {
        for loop_mode in [graphed_step_loop::Unrolled, graphed_step_loop::While] {
            let mut m = Model::new(2, comm.clone(), 0);
            m.coll.mode = mode;
            let setup = Setup { loop_mode, ..PLAIN };
            let (b, st) = build(&mut m, setup, &|d| {
                if exch {
                    d.collective_exchange = Some(failing_exchange);
                }
            });
            ok(st);
            let st = graphed_session_capture(b.0);
            assert_eq!(st, want, "mode {mode}: {}", msg());
            assert!(msg().contains(words), "mode {mode}: {}", msg());
            let mut n = 0;
            // SAFETY: a valid count pointer.
            let st = unsafe { graphed_step_collectives(b.0, 0, null_mut(), 0, size_of_entry(), &mut n) };
            assert_ne!(st, graphed_status::Ok);
        }
    }
    // The query: a step without collectives, a small entry size.
    let mut m = Model::new(1, comm, 0);
    let (b, st) = build(&mut m, PLAIN, &|d| {
        d.collective = None;
        d.collective_data = null_mut();
    });
    ok(st);
    ok(graphed_session_capture(b.0));
    let mut n = 0;
    // SAFETY: valid pointers.
    let st = unsafe { graphed_step_collectives(b.0, 0, null_mut(), 0, size_of_entry(), &mut n) };
    assert_eq!(st, graphed_status::InvalidArgument);
    assert!(
        msg().contains("step 0 has no collective stage"),
        "{}",
        msg()
    );
    let mut e = [graphed_collective_entry::default()];
    // SAFETY: room for one entry.
    let st = unsafe { graphed_step_collectives(b.0, 0, e.as_mut_ptr(), 1, 8, &mut n) };
    assert_eq!(st, graphed_status::InvalidArgument);
}

/// A second rank faked by the exchange whose header claims u32::MAX
/// collectives (a corrupted or foreign header): a mismatch naming it,
/// before the second all-gather, not an allocation of 2^38 bytes that
/// aborts the process (found by the fuzz target).
unsafe extern "C" fn huge_count_exchange(
    mine: *const c_void,
    bytes: usize,
    all: *mut c_void,
    _: *mut c_void,
) -> i32 {
    // SAFETY: the buffers as the contract says, for 2 ranks.
    let mine = unsafe { std::slice::from_raw_parts(mine.cast::<u8>(), bytes) };
    let out = unsafe { std::slice::from_raw_parts_mut(all.cast::<u8>(), 2 * bytes) };
    out[..bytes].copy_from_slice(mine);
    out[bytes..].copy_from_slice(mine);
    assert_eq!(bytes, 24, "only the headers are exchanged");
    out[bytes + 4..bytes + 8].copy_from_slice(&1u32.to_le_bytes());
    out[bytes + 16..bytes + 20].copy_from_slice(&u32::MAX.to_le_bytes());
    0
}

#[test]
fn a_huge_count_from_another_rank_is_a_mismatch_not_an_allocation() {
    for loop_mode in [graphed_step_loop::Unrolled, graphed_step_loop::While] {
        let mut m = Model::new(2, Comm::new(1), 0);
        let setup = Setup {
            loop_mode,
            ranks: 2,
            ..PLAIN
        };
        let (b, st) = build(&mut m, setup, &|d| {
            d.collective_exchange = Some(huge_count_exchange);
        });
        ok(st);
        let st = graphed_session_capture(b.0);
        assert_eq!(st, graphed_status::CollectiveMismatch, "{}", msg());
        assert!(
            msg().contains("rank 1 says it records 4294967295 collectives"),
            "{}",
            msg()
        );
    }
}
