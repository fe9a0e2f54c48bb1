//! The collective step's callbacks: the layer's passes and tasks, the
//! collective callback (records, fails, breaks the capture, forges a ctx)
//! and the exchange that fakes another rank.

use super::super::*;

pub(super) const N: usize = 4;
pub(super) const BYTES: usize = N * 4;
pub(super) const ENTRY: usize = size_of::<graphed_collective_entry>();

/// `out = a * b`, N floats; or `g *= 2`.
pub(super) enum Task {
    Mul {
        a: *const f32,
        b: *const f32,
        out: *mut f32,
    },
    Double {
        g: *mut f32,
    },
}

pub(super) unsafe extern "C" fn run_task(data: *mut c_void) {
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
pub(super) type Rec = (u32, u32, u64, u64);

pub(super) fn valid(r: &Rec) -> bool {
    r.0 <= graphed_collective_op::Other as u32 && r.1 <= graphed_dtype::Bool as u32
}

/// The op's memory, kept (boxed) until its session is destroyed.
pub(super) struct Coll {
    pub(super) w: [f32; N],
    pub(super) xg: [f32; 6 * N],
    pub(super) dst: [f32; N],
    pub(super) recs: Vec<Rec>,
    /// 0 works; 1 returns 6 before recording; 2 synchronizes its
    /// capturing stream; 3 also records with a forged ctx; 4 returns 6
    /// after recording; 5 records one more in clone slot 1's graph.
    pub(super) mode: u8,
    /// The exchange's fake: 0 the same manifest as ours; 1 the other
    /// rank's capture failed; 2 it records one more; 3 garbage; 4 a huge
    /// count; 5 the exchange returns 9; 6 one entry changed.
    pub(super) fake: u8,
    /// This rank and how many ranks (1, or 2 with a faked other).
    pub(super) rank: usize,
    pub(super) ranks: usize,
    pub(super) garbage: [u8; 24],
    /// (call, slot) per call; the last ctx the callback was given.
    pub(super) calls: Vec<u32>,
    pub(super) kept: usize,
    pub(super) tasks: Vec<Box<Task>>,
}

impl Coll {
    pub(super) fn enqueue(&mut self, s: graphed_stream, t: Task) -> i32 {
        self.tasks.push(Box::new(t));
        let p: *const Task = &**self.tasks.last().unwrap();
        // SAFETY: the task lives in `tasks` until the session is destroyed.
        unsafe { graphed_host_enqueue(s, Some(run_task), p as *mut c_void) as i32 }
    }
}

pub(super) unsafe extern "C" fn fwd(ctx: *const graphed_pass_ctx, data: *mut c_void) -> i32 {
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

pub(super) unsafe extern "C" fn bwd(ctx: *const graphed_pass_ctx, data: *mut c_void) -> i32 {
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

pub(super) unsafe extern "C" fn collective(
    ctx: *const graphed_collective_ctx,
    data: *mut c_void,
) -> i32 {
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
pub(super) unsafe extern "C" fn exchange(
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
