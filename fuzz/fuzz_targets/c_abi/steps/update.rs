//! A step's update stage (graphed_step_desc.update_check, update_apply,
//! scalar_bytes; graphed_step_args.scalars; graphed_step_skipped), in a
//! session of its own: one callable `y = w * x` (backward `gw = x * gy`)
//! over 1 or 2 microbatches copied in by io, unrolled or looping on the
//! device, its grad CLONE, COPY_INTO or ACCUMULATE_INTO, and an SGD with
//! momentum whose lr and mu are the step's scalars, with or without a
//! check that skips it on non-finite grads. Declarations, captures (with
//! update callbacks that fail or break the capture), replays (with scalars
//! of every size, inputs that overflow) and the flag's query are checked
//! against a model: statuses, and the weights and momentum bit for bit.

use super::*;
use crate::moves::empty_ref;

/// SGD with momentum, shared with the integration tests' model.
#[path = "../../../../tests/common/momentum.rs"]
mod momentum;
use momentum::sgd;
use std::slice::from_raw_parts_mut;

const N: usize = 4;
const BYTES: usize = N * 4;

/// `out = a * b`, N floats; or the check, or the SGD.
enum Task {
    Mul {
        a: *const f32,
        b: *const f32,
        out: *mut f32,
    },
    Check {
        g: *const f32,
        flag: *mut u32,
    },
    Sgd {
        w: *mut f32,
        g: *const f32,
        m: *mut f32,
        s: *const f32,
    },
}

unsafe extern "C" fn run_task(data: *mut c_void) {
    // SAFETY: a Task the op keeps until its session is destroyed, whose
    // buffers hold N floats (the session's static buffers, the op's); an
    // Sgd's three do not overlap.
    unsafe {
        match *(data as *const Task) {
            Task::Mul { a, b, out } => {
                for k in 0..N {
                    *out.add(k) = *a.add(k) * *b.add(k);
                }
            }
            Task::Check { g, flag } => {
                if (0..N).any(|k| !(*g.add(k)).is_finite()) {
                    *flag = 1;
                }
            }
            Task::Sgd { w, g, m, s } => {
                let (lr, mu) = (*s, *s.add(1));
                let (w, m) = (from_raw_parts_mut(w, N), from_raw_parts_mut(m, N));
                sgd(w, m, std::slice::from_raw_parts(g, N), lr, mu);
            }
        }
    }
}

/// The op's memory, kept (boxed) until its session is destroyed.
struct Upd {
    w: [f32; N],
    m: [f32; N],
    xg: [f32; 4 * N],
    dst: [f32; N],
    /// 0 works; 1 the check returns 3; 2 the apply returns 3; 3 the
    /// check synchronizes its capturing stream.
    fail: u8,
    tasks: Vec<Box<Task>>,
}

impl Upd {
    fn enqueue(&mut self, s: graphed_stream, t: Task) -> i32 {
        self.tasks.push(Box::new(t));
        let p: *const Task = &**self.tasks.last().unwrap();
        // SAFETY: the task lives in `tasks` until the session is destroyed.
        unsafe { graphed_host_enqueue(s, Some(run_task), p as *mut c_void) as i32 }
    }
}

unsafe extern "C" fn fwd(ctx: *const graphed_pass_ctx, data: *mut c_void) -> i32 {
    // SAFETY: a valid context; data is the op's Upd.
    let (c, u) = unsafe { (&*ctx, &mut *(data as *mut Upd)) };
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
    let (c, u) = unsafe { (&*ctx, &mut *(data as *mut Upd)) };
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

unsafe extern "C" fn check(ctx: *const graphed_update_ctx, data: *mut c_void) -> i32 {
    // SAFETY: as above.
    let (c, u) = unsafe { (&*ctx, &mut *(data as *mut Upd)) };
    match u.fail {
        1 => return 3,
        3 => {
            let _ = graphed_host_synchronize(c.stream);
            return 0;
        }
        _ => {}
    }
    // SAFETY: one parameter.
    let g = unsafe { *c.grads } as *const f32;
    u.enqueue(
        c.stream,
        Task::Check {
            g,
            flag: c.skip_flag,
        },
    )
}

unsafe extern "C" fn apply(ctx: *const graphed_update_ctx, data: *mut c_void) -> i32 {
    // SAFETY: as above.
    let (c, u) = unsafe { (&*ctx, &mut *(data as *mut Upd)) };
    if u.fail == 2 {
        return 3;
    }
    if c.scalars.is_null() {
        return 0;
    }
    // SAFETY: one parameter.
    let (w, g) = unsafe { (*c.params as *mut f32, *c.grads as *const f32) };
    let t = Task::Sgd {
        w,
        g,
        m: u.m.as_mut_ptr(),
        s: c.scalars as *const f32,
    };
    u.enqueue(c.stream, t)
}

/// Builds, captures, replays and destroys a session with an update step.
pub fn op_step_update() {
    let i = &w().input;
    let what = "a step's update";
    let mut u = Box::new(Upd {
        w: [0.5, -0.25, 1.0, 2.0],
        m: [0.0; N],
        xg: [0.0; 4 * N],
        dst: [0.0; N],
        fail: 0,
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
    let policy = i.pick(&[
        graphed_grad_policy::CopyInto,
        graphed_grad_policy::Clone,
        graphed_grad_policy::AccumulateInto,
    ]);
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
    let data: *mut Upd = &mut *u;
    d.user_data = data.cast();
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    let r = unsafe { graphed_session_add_callable(h, &d, &mut idx) };
    expect(r, &[S::Ok], "graphed_session_add_callable", what);
    // The step.
    let mbs = 1 + i.below(2);
    let looping = i.chance(100);
    let with_check = i.below(4) != 0;
    let with_apply = i.below(8) != 0;
    let scalar_bytes = i.pick(&[8usize, 8, 0, 12, GRAPHED_STEP_MAX_SCALAR_BYTES + 1]);
    u.fail = match i.below(16) {
        0 => 1,
        1 => 2,
        2 => 3,
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
    sd.update_check = if with_check { Some(check) } else { None };
    sd.update_apply = if with_apply { Some(apply) } else { None };
    sd.update_data = data.cast();
    sd.scalar_bytes = scalar_bytes;
    let declared = match (with_check, with_apply, scalar_bytes) {
        (true, false, _) | (false, false, 8 | 12) => S::InvalidArgument,
        (_, _, b) if b > GRAPHED_STEP_MAX_SCALAR_BYTES => S::InvalidArgument,
        _ => S::Ok,
    };
    let mut step = 0;
    // SAFETY: valid descriptor and out pointer.
    let r = unsafe { graphed_session_add_step(h, &sd, &mut step) };
    expect(r, &[declared], "graphed_session_add_step", what);
    if declared == S::Ok && with_apply {
        let r = graphed_session_capture(h);
        let captured = match u.fail {
            _ if policy == graphed_grad_policy::Clone && slots == 0 => S::Incompatible,
            1 if with_check => S::CallbackFailed,
            2 => S::CallbackFailed,
            3 if with_check => S::CaptureInvalidated,
            _ => S::Ok,
        };
        expect(r, &[captured], "graphed_session_capture", what);
        if captured == S::Ok {
            let shape = Shape {
                mbs,
                with_check,
                scalar_bytes,
                policy,
                slots,
            };
            replays(h, &mut u, shape);
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

/// What the replays' model needs of the step.
struct Shape {
    mbs: usize,
    with_check: bool,
    scalar_bytes: usize,
    policy: graphed_grad_policy,
    slots: u32,
}

/// Fuzzed replays of step 0 against the model.
fn replays(h: *mut graphed_session, u: &mut Upd, shape: Shape) {
    let Shape {
        mbs,
        with_check,
        scalar_bytes,
        policy,
        slots,
    } = shape;
    let i = &w().input;
    let what = "a step's update";
    let accumulate = policy == graphed_grad_policy::AccumulateInto;
    let (mut mw, mut mm, mut mdst) = (u.w, u.m, u.dst);
    let mut held: Option<*mut graphed_buffer> = None;
    let mut block = [0.0f32; 3];
    let mut skips = 0u64;
    let mut last = 0u32;
    for it in 0..1 + i.below(4) {
        for k in 0..2 * N * mbs {
            u.xg[k] = (i.below(17) as f32 - 8.0) * 0.25;
        }
        let overflow = i.chance(40);
        if overflow {
            u.xg[i.below(N)] = f32::INFINITY;
        }
        let given = [i.below(5) as f32 * 0.125, 0.5, 0.0];
        let (ptr, bytes) = match i.below(5) {
            0 => (null(), 0),
            1 => (given.as_ptr(), 12),
            2 => (null(), 8),
            _ => (given.as_ptr(), 8),
        };
        let want = match (ptr.is_null(), bytes) {
            (true, 0) => S::Ok,
            (true, _) => S::NullPointer,
            (false, b) if b != scalar_bytes => S::InvalidArgument,
            _ => S::Ok,
        };
        // Every CLONE slot held: the step cannot replay.
        let want = match (want, held) {
            (S::Ok, Some(_)) if policy == graphed_grad_policy::Clone && slots == 1 => S::AliasHeld,
            (w, _) => w,
        };
        let mut a = graphed_step_args_default();
        a.scalars = ptr.cast();
        a.scalar_bytes = bytes;
        let mut r = [empty_ref()];
        // SAFETY: valid args and room for a ref.
        let st = unsafe { graphed_step_replay(h, &a, r.as_mut_ptr(), 1) };
        expect(st, &[want], "graphed_step_replay", what);
        if st == S::Ok {
            if !ptr.is_null() {
                block = given;
            }
            let grad = |mb: usize, k: usize| u.xg[2 * N * mb + k] * u.xg[2 * N * mb + N + k];
            let g: Vec<f32> = match accumulate {
                true => {
                    for mb in 0..mbs {
                        for k in 0..N {
                            mdst[k] += grad(mb, k);
                        }
                    }
                    mdst.to_vec()
                }
                false => (0..N)
                    .map(|k| (1..mbs).fold(grad(0, k), |s, mb| s + grad(mb, k)))
                    .collect(),
            };
            let skip = with_check && g.iter().any(|v| !v.is_finite());
            last = skip as u32;
            skips += skip as u64;
            if !skip && scalar_bytes >= 8 {
                sgd(&mut mw, &mut mm, &g, block[0], block[1]);
            }
            if r[0].kind == graphed_ref_kind::Clone as u32 {
                if let Some(o) = held.replace(r[0].owner) {
                    expect(
                        graphed_buffer_release(o),
                        &[S::Ok],
                        "graphed_buffer_release",
                        what,
                    );
                }
            }
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same(&u.w, &mw),
                "iteration {it}: weights {:?} vs {mw:?}",
                u.w
            );
            assert!(
                same(&u.m, &mm),
                "iteration {it}: momentum {:?} vs {mm:?}",
                u.m
            );
            if accumulate {
                assert!(
                    same(&u.dst, &mdst),
                    "iteration {it}: accumulated {:?}",
                    u.dst
                );
            }
        }
        let (mut got, mut total) = (7u32, 7u64);
        let null_out = i.chance(20);
        let out: *mut u32 = if null_out { null_mut() } else { &mut got };
        // SAFETY: valid or NULL out pointers.
        let st = unsafe { graphed_step_skipped(h, 0, out, &mut total) };
        let want = match (null_out, with_check) {
            (true, _) => S::NullPointer,
            (_, false) => S::InvalidArgument,
            _ => S::Ok,
        };
        expect(st, &[want], "graphed_step_skipped", what);
        if st == S::Ok {
            assert_eq!((got, total), (last, skips), "iteration {it}");
        } else {
            assert_eq!((got, total), (7, 7), "written on failure");
        }
    }
    if let Some(o) = held {
        expect(
            graphed_buffer_release(o),
            &[S::Ok],
            "graphed_buffer_release",
            what,
        );
    }
}
