//! A step's collective stage (graphed_step_desc.collective, collective_at,
//! collective_exchange, collective_rank, collective_ranks;
//! graphed_collective_record; graphed_step_collectives), in a session of
//! its own: one callable `y = w * x` (backward `gw = x * gy`) over 1 to 3
//! microbatches copied in by io, unrolled or looping on the device, its
//! grad COPY_INTO or CLONE (with 0 to 2 clone slots). The collective
//! callback records 0 to 3 collectives of fuzzed operations and dtypes
//! (a refused record declares nothing), each valid one enqueuing a task
//! that doubles the grad (the "collective"); it may fail, break the
//! capture, record with a forged ctx, or record one more in the graph of
//! clone slot 1; a ctx kept from it is refused afterwards. An exchange
//! (1 rank, or 2 with a faked other rank: the same manifest, a failed
//! capture, one collective more, garbage, a huge count, a changed entry)
//! or none. Declarations, captures, replays (the grad doubled once per
//! valid record, bit for bit) and manifest queries (fuzzed capacity,
//! entry size, NULL pointers) are checked against a model.

use super::*;
use crate::moves::empty_ref;

const N: usize = 4;
const BYTES: usize = N * 4;
const ENTRY: usize = size_of::<graphed_collective_entry>();

/// `out = a * b`, N floats; or `g *= 2`.
enum Task {
    Mul {
        a: *const f32,
        b: *const f32,
        out: *mut f32,
    },
    Double {
        g: *mut f32,
    },
}

unsafe extern "C" fn run_task(data: *mut c_void) {
    // SAFETY: a Task the op keeps until its session is destroyed, whose
    // buffers hold N floats (the session's static buffers, the op's).
    unsafe {
        match *(data as *const Task) {
            Task::Mul { a, b, out } => {
                for k in 0..N {
                    *out.add(k) = *a.add(k) * *b.add(k);
                }
            }
            Task::Double { g } => {
                for k in 0..N {
                    *g.add(k) *= 2.0;
                }
            }
        }
    }
}

/// One record the callback makes: (op, dtype, bytes, communicator).
type Rec = (u32, u32, u64, u64);

fn valid(r: &Rec) -> bool {
    r.0 <= graphed_collective_op::Other as u32 && r.1 <= graphed_dtype::Bool as u32
}

/// The op's memory, kept (boxed) until its session is destroyed.
struct Coll {
    w: [f32; N],
    xg: [f32; 6 * N],
    dst: [f32; N],
    recs: Vec<Rec>,
    /// 0 works; 1 returns 6 before recording; 2 synchronizes its
    /// capturing stream; 3 also records with a forged ctx; 4 returns 6
    /// after recording; 5 records one more in clone slot 1's graph.
    mode: u8,
    /// The exchange's fake: 0 the same manifest as ours; 1 the other
    /// rank's capture failed; 2 it records one more; 3 garbage; 4 a huge
    /// count; 5 the exchange returns 9; 6 one entry changed.
    fake: u8,
    /// This rank and how many ranks (1, or 2 with a faked other).
    rank: usize,
    ranks: usize,
    garbage: [u8; 24],
    /// (call, slot) per call; the last ctx the callback was given.
    calls: Vec<u32>,
    kept: usize,
    tasks: Vec<Box<Task>>,
}

impl Coll {
    fn enqueue(&mut self, s: graphed_stream, t: Task) -> i32 {
        self.tasks.push(Box::new(t));
        let p: *const Task = &**self.tasks.last().unwrap();
        // SAFETY: the task lives in `tasks` until the session is destroyed.
        unsafe { graphed_host_enqueue(s, Some(run_task), p as *mut c_void) as i32 }
    }
}

unsafe extern "C" fn fwd(ctx: *const graphed_pass_ctx, data: *mut c_void) -> i32 {
    // SAFETY: a valid context; data is the op's Coll.
    let (c, u) = unsafe { (&*ctx, &mut *(data as *mut Coll)) };
    // SAFETY: one input, parameter and output.
    let t = unsafe {
        Task::Mul {
            a: *c.inputs as *const f32,
            b: *c.params as *const f32,
            out: *c.outputs as *mut f32,
        }
    };
    u.enqueue(c.stream, t)
}

unsafe extern "C" fn bwd(ctx: *const graphed_pass_ctx, data: *mut c_void) -> i32 {
    // SAFETY: as above.
    let (c, u) = unsafe { (&*ctx, &mut *(data as *mut Coll)) };
    // SAFETY: one input, grad-output and parameter grad.
    let t = unsafe {
        Task::Mul {
            a: *c.inputs as *const f32,
            b: *c.grad_outputs as *const f32,
            out: *c.param_grads as *mut f32,
        }
    };
    u.enqueue(c.stream, t)
}

unsafe extern "C" fn collective(ctx: *const graphed_collective_ctx, data: *mut c_void) -> i32 {
    // SAFETY: a valid context and its arrays; data is the op's Coll.
    let (c, u) = unsafe { (&*ctx, &mut *(data as *mut Coll)) };
    u.calls.push(c.slot);
    u.kept = ctx as usize;
    assert_eq!(c.num_params, 1, "one parameter");
    match u.mode {
        1 => return 6,
        2 => {
            let _ = graphed_host_synchronize(c.stream);
            return 0;
        }
        _ => {}
    }
    // SAFETY: one parameter.
    let g = unsafe { *c.grads } as *mut f32;
    assert!(!g.is_null(), "the parameter has a grad");
    let mut recs = u.recs.clone();
    if u.mode == 5 && c.slot == 1 {
        recs.push((graphed_collective_op::Broadcast as u32, 0, 8, 3));
    }
    for r in &recs {
        // SAFETY: the ctx this callback was given.
        let st = unsafe { graphed_collective_record(ctx, r.3, r.0, r.2, r.1) };
        let want = if valid(r) { S::Ok } else { S::InvalidArgument };
        expect(
            st,
            &[want],
            "graphed_collective_record",
            "a step's collective",
        );
        if st == S::Ok {
            let e = u.enqueue(c.stream, Task::Double { g });
            if e != 0 {
                return e;
            }
        }
    }
    if u.mode == 3 {
        let forged = (ctx as usize + 8) as *const graphed_collective_ctx;
        // SAFETY: compared, never read.
        let st = unsafe { graphed_collective_record(forged, 1, 0, 4, 0) };
        expect(
            st,
            &[S::WrongState],
            "graphed_collective_record",
            "a forged ctx",
        );
    }
    if u.mode == 4 {
        return 6;
    }
    0
}

/// The caller's all-gather, with the other rank faked.
unsafe extern "C" fn exchange(
    mine: *const c_void,
    bytes: usize,
    all: *mut c_void,
    data: *mut c_void,
) -> i32 {
    // SAFETY: data is the op's Coll; the buffers as the contract says.
    let u = unsafe { &*(data as *const Coll) };
    if u.fake == 5 {
        return 9;
    }
    let mine = unsafe { std::slice::from_raw_parts(mine.cast::<u8>(), bytes) };
    let out = unsafe { std::slice::from_raw_parts_mut(all.cast::<u8>(), bytes * u.ranks) };
    for r in 0..u.ranks {
        out[r * bytes..][..bytes].copy_from_slice(mine);
    }
    if u.ranks == 1 {
        return 0;
    }
    let other = 1 - u.rank;
    let theirs = &mut out[other * bytes..][..bytes];
    let header = bytes == 24 && theirs[..4] == 0x6d63_7267u32.to_le_bytes();
    if header {
        theirs[4..8].copy_from_slice(&(other as u32).to_le_bytes());
        let count = u32::from_le_bytes([theirs[16], theirs[17], theirs[18], theirs[19]]);
        match u.fake {
            1 => theirs[12..16].copy_from_slice(&0u32.to_le_bytes()),
            2 => theirs[16..20].copy_from_slice(&(count + 1).to_le_bytes()),
            3 => theirs.copy_from_slice(&u.garbage),
            4 => theirs[16..20].copy_from_slice(&u32::MAX.to_le_bytes()),
            _ => {}
        }
    } else {
        match u.fake {
            // Their extra entry (the padding of ours): a broadcast.
            2 => {
                let e = &mut theirs[bytes - 32..];
                e.fill(0);
                e[16..20].copy_from_slice(&3u32.to_le_bytes());
                e[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
            }
            6 if bytes >= 32 => theirs[8] ^= 1,
            _ => {}
        }
    }
    0
}

/// Builds, captures, replays, queries and destroys a session with a
/// collective step.
pub fn op_step_collective() {
    let i = &w().input;
    let what = "a step's collective";
    let mut u = Box::new(Coll {
        w: [0.5, -0.25, 1.0, 2.0],
        xg: [0.0; 6 * N],
        dst: [0.0; N],
        recs: Vec::new(),
        mode: 0,
        fake: 0,
        rank: 0,
        ranks: 1,
        garbage: [0; 24],
        calls: Vec::new(),
        kept: 0,
        tasks: Vec::new(),
    });
    let mut cfg = graphed_session_config_default();
    cfg.backend = graphed_backend::Host as u32;
    cfg.warmup_iterations = 1;
    let slots = i.below(3) as u32;
    cfg.clone_slots = slots;
    let mut h = null_mut();
    // SAFETY: a valid config and out pointer.
    let r = unsafe { graphed_session_create(&cfg, &mut h) };
    expect(r, &[S::Ok], "graphed_session_create", what);
    let policy = i.pick(&[graphed_grad_policy::CopyInto, graphed_grad_policy::Clone]);
    let t = graphed_tensor_desc {
        bytes: BYTES,
        ..graphed_tensor_desc_default()
    };
    let out = graphed_tensor_desc {
        requires_grad: 1,
        ..t
    };
    let params = [graphed_param_desc {
        data: u.w.as_mut_ptr().cast(),
        bytes: BYTES,
        policy: policy as u32,
        ..graphed_param_desc_default()
    }];
    let mut d = graphed_callable_desc_default();
    d.num_inputs = 1;
    d.inputs = &t;
    d.num_outputs = 1;
    d.outputs = &out;
    d.num_params = 1;
    d.params = params.as_ptr();
    d.forward = Some(fwd);
    d.backward = Some(bwd);
    let data: *mut Coll = &mut *u;
    d.user_data = data.cast();
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    let r = unsafe { graphed_session_add_callable(h, &d, &mut idx) };
    expect(r, &[S::Ok], "graphed_session_add_callable", what);
    // The step and its collective stage.
    let mbs = 1 + i.below(3);
    let looping = i.chance(100);
    let per_callable = i.chance(100);
    for _ in 0..i.below(4) {
        let op = i.pick(&[0u32, 0, 1, 2, 3, 4, 5, 99]);
        let dtype = i.pick(&[0u32, 0, 1, 8, 9, 200]);
        let bytes = i.pick(&[BYTES as u64, 0, 8, u64::MAX]);
        let comm = i.pick(&[7u64, 0, u64::MAX]);
        u.recs.push((op, dtype, bytes, comm));
    }
    u.mode = match i.below(24) {
        m @ 1..=5 => m as u8,
        _ => 0,
    };
    let with_exchange = i.chance(120);
    if with_exchange {
        u.ranks = 1 + i.below(2);
        u.rank = i.below(u.ranks);
        u.fake = match i.below(12) {
            f @ 1..=6 => f as u8,
            _ => 0,
        };
        for b in u.garbage.iter_mut() {
            *b = i.byte();
        }
    }
    // A fault in the declaration: 1 data without the callback, 2 a bad
    // point, 3 the rank out of range, 4 exchange data without the
    // exchange, 5 no collective stage at all (valid).
    let fault = match i.below(20) {
        f @ 1..=5 => f,
        _ => 0,
    };
    let xg = u.xg.as_mut_ptr();
    let io = [
        graphed_step_io {
            role: graphed_buffer_role::Input as u32,
            ptr: xg.cast(),
            stride: 2 * BYTES,
            ..graphed_step_io_default()
        },
        graphed_step_io {
            role: graphed_buffer_role::GradOutput as u32,
            // SAFETY: inside the op's buffer.
            ptr: unsafe { xg.add(N) }.cast(),
            stride: 2 * BYTES,
            ..graphed_step_io_default()
        },
    ];
    let dsts = [u.dst.as_mut_ptr().cast::<c_void>()];
    let callables = [0u32];
    let mut sd = graphed_step_desc_default();
    sd.callables = callables.as_ptr();
    sd.num_callables = 1;
    sd.microbatches = mbs as u32;
    sd.loop_mode = if looping {
        graphed_step_loop::While as u32
    } else {
        graphed_step_loop::Unrolled as u32
    };
    sd.io = io.as_ptr();
    sd.num_io = 2;
    if policy != graphed_grad_policy::Clone {
        sd.param_dsts = dsts.as_ptr();
        sd.num_param_dsts = 1;
    }
    sd.collective = Some(collective);
    sd.collective_data = data.cast();
    sd.collective_at = if per_callable {
        graphed_collective_at::PerCallable as u32
    } else {
        graphed_collective_at::AfterBackward as u32
    };
    if with_exchange {
        sd.collective_exchange = Some(exchange);
        sd.collective_exchange_data = data.cast();
    }
    sd.collective_rank = u.rank as u32;
    sd.collective_ranks = u.ranks as u32;
    match fault {
        1 => sd.collective = None,
        2 => sd.collective_at = 2,
        3 => sd.collective_rank = sd.collective_ranks,
        4 => {
            sd.collective_exchange = None;
            sd.collective_exchange_data = data.cast();
        }
        5 => {
            sd.collective = None;
            sd.collective_data = null_mut();
            sd.collective_exchange = None;
            sd.collective_exchange_data = null_mut();
            sd.collective_rank = 0;
            sd.collective_ranks = 1;
        }
        _ => {}
    }
    let declared = match fault {
        1..=4 => S::InvalidArgument,
        _ => S::Ok,
    };
    let mut step = 0;
    // SAFETY: valid descriptor and out pointer.
    let r = unsafe { graphed_session_add_step(h, &sd, &mut step) };
    expect(r, &[declared], "graphed_session_add_step", what);
    let stage = fault != 5;
    if declared == S::Ok {
        let r = graphed_session_capture(h);
        let graphs = if policy == graphed_grad_policy::Clone {
            slots as usize
        } else {
            1
        };
        let own = match u.mode {
            _ if policy == graphed_grad_policy::Clone && slots == 0 => Some(S::Incompatible),
            _ if !stage => None,
            1 | 4 => Some(S::CallbackFailed),
            2 => Some(S::CaptureInvalidated),
            5 if graphs > 1 => Some(S::CollectiveMismatch),
            _ => None,
        };
        let ex = match (stage && with_exchange, u.fake) {
            (false, _) => None,
            (true, 5) => Some(S::CallbackFailed),
            (true, _) if u.ranks == 1 => None,
            (true, 0) => None,
            (true, 6) if u.recs.iter().all(|r| !valid(r)) => None,
            (true, _) => Some(S::CollectiveMismatch),
        };
        let want: Vec<graphed_status> = match (own, ex) {
            (Some(S::Incompatible), _) => vec![S::Incompatible],
            (Some(o), Some(e)) => vec![o, e],
            (Some(o), None) => vec![o],
            (None, Some(e)) => vec![e],
            (None, None) => vec![S::Ok],
        };
        trace!(
            "  collective: {} records, mode {}, exchange {with_exchange} ({} of {}, fake {}), \
             {policy:?}, {slots} slots: capture {r:?}",
            u.recs.len(),
            u.mode,
            u.rank,
            u.ranks,
            u.fake
        );
        expect(r, &want, "graphed_session_capture", what);
        // A ctx kept from the callback is refused afterwards.
        if u.kept != 0 {
            // SAFETY: compared, never read.
            let st = unsafe {
                graphed_collective_record(u.kept as *const graphed_collective_ctx, 7, 0, 4, 0)
            };
            expect(
                st,
                &[S::WrongState],
                "graphed_collective_record",
                "a kept ctx",
            );
        }
        // SAFETY: a NULL ctx is refused.
        let st = unsafe { graphed_collective_record(null(), 7, 0, 4, 0) };
        expect(st, &[S::NullPointer], "graphed_collective_record", "NULL");
        if r == S::Ok {
            if stage {
                let want_calls = graphs.max(1);
                assert_eq!(u.calls.len(), want_calls, "called once per graph");
            } else {
                assert!(u.calls.is_empty(), "no collective stage, no call");
            }
            let manifest: Vec<Rec> = if stage {
                u.recs.iter().copied().filter(valid).collect()
            } else {
                Vec::new()
            };
            query(h, stage, &manifest, per_callable);
            replays(h, &mut u, mbs, looping, policy, manifest.len());
        } else {
            let mut n = 77usize;
            // SAFETY: a valid count pointer.
            let st = unsafe { graphed_step_collectives(h, 0, null_mut(), 0, ENTRY, &mut n) };
            post(st, "graphed_step_collectives");
            assert!(
                st != S::Ok && st != S::Internal,
                "graphed_step_collectives after a failed capture: {st:?}"
            );
            assert_eq!(n, 77, "written on failure");
        }
    }
    expect(
        graphed_session_destroy(h),
        &[S::Ok],
        "graphed_session_destroy",
        what,
    );
    drop(u);
}

/// graphed_step_collectives with fuzzed arguments against the manifest.
fn query(h: *mut graphed_session, stage: bool, manifest: &[Rec], per_callable: bool) {
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

/// Fuzzed replays of step 0: the grad summed over the microbatches run,
/// doubled once per collective recorded.
fn replays(
    h: *mut graphed_session,
    u: &mut Coll,
    mbs: usize,
    looping: bool,
    policy: graphed_grad_policy,
    doublings: usize,
) {
    let i = &w().input;
    let what = "a step's collective replay";
    for it in 0..1 + i.below(3) {
        for k in 0..2 * N * mbs {
            u.xg[k] = (i.below(17) as f32 - 8.0) * 0.25;
        }
        let count = if looping { i.below(mbs + 2) } else { 0 };
        let want = if count > mbs {
            S::InvalidArgument
        } else {
            S::Ok
        };
        let mut a = graphed_step_args_default();
        a.microbatches = count as u32;
        let mut r = [empty_ref()];
        // SAFETY: valid args and room for a ref.
        let st = unsafe { graphed_step_replay(h, &a, r.as_mut_ptr(), 1) };
        expect(st, &[want], "graphed_step_replay", what);
        trace!("  collective: replay of {count} (of {mbs}): {st:?}");
        if st != S::Ok {
            continue;
        }
        let n = if count == 0 { mbs } else { count };
        let grad = |mb: usize, k: usize| u.xg[2 * N * mb + k] * u.xg[2 * N * mb + N + k];
        let want: Vec<f32> = (0..N)
            .map(|k| {
                let s = (1..n).fold(grad(0, k), |s, mb| s + grad(mb, k));
                (0..doublings).fold(s, |v, _| v * 2.0)
            })
            .collect();
        let got: Vec<f32> = if policy == graphed_grad_policy::Clone {
            assert_eq!(r[0].kind, graphed_ref_kind::Clone as u32, "iteration {it}");
            // SAFETY: the clone holds N floats until it is released.
            let g = unsafe { std::slice::from_raw_parts(r[0].ptr as *const f32, N) }.to_vec();
            expect(
                graphed_buffer_release(r[0].owner),
                &[S::Ok],
                "graphed_buffer_release",
                what,
            );
            g
        } else {
            u.dst.to_vec()
        };
        let same = got
            .iter()
            .zip(&want)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "iteration {it}, {n} microbatches, {doublings} collectives: {got:?} vs {want:?}"
        );
    }
}
