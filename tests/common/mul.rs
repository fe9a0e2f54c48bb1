//! The elementwise layer the step tests train: `y = w * x` over `N` f32s
//! (backward `gw = x * gy`, no input grad), each pass one host task whose
//! data is leaked (it must outlive the session's graphs); its step io, the
//! microbatches' x and gy side by side in one buffer (x0 g0 x1 g1 ...);
//! the data of an iteration and the grad eager accumulation makes of it.

use super::{layer_desc, ok};
use graphed::ffi::*;
use std::ffi::c_void;

/// `out[i] = a[i] * b[i]`.
struct Mul {
    a: *const f32,
    b: *const f32,
    out: *mut f32,
}

unsafe extern "C" fn run_mul<const N: usize>(data: *mut c_void) {
    // SAFETY: a leaked Mul whose buffers hold N floats while the test runs.
    unsafe {
        let m = &*(data as *const Mul);
        for i in 0..N {
            *m.out.add(i) = *m.a.add(i) * *m.b.add(i);
        }
    }
}

/// Enqueues `task` with `data` on `s`: the status as a callback returns it.
pub fn enqueue(s: graphed_stream, task: graphed_host_task_fn, data: *mut c_void) -> i32 {
    // SAFETY: the task and its (leaked) data stay valid.
    unsafe { graphed_host_enqueue(s, task, data) as i32 }
}

/// `v` on the heap for good: a host task's data.
pub fn leak<T>(v: T) -> *mut c_void {
    Box::into_raw(Box::new(v)).cast()
}

/// Enqueues `out = a * b` over N floats on `s`.
pub fn enqueue_mul<const N: usize>(
    s: graphed_stream,
    a: *mut c_void,
    b: *mut c_void,
    out: *mut c_void,
) -> i32 {
    let m = Mul {
        a: a as *const f32,
        b: b as *const f32,
        out: out.cast(),
    };
    enqueue(s, Some(run_mul::<N>), leak(m))
}

/// The layer's forward over N floats: `y = x * w`.
pub unsafe extern "C" fn forward<const N: usize>(
    ctx: *const graphed_pass_ctx,
    _: *mut c_void,
) -> i32 {
    // SAFETY: the context and its arrays are valid during the call.
    let c = unsafe { &*ctx };
    let (x, w, y) = unsafe { (*c.inputs, *c.params, *c.outputs) };
    enqueue_mul::<N>(c.stream, x, w, y)
}

/// The layer's backward over N floats: `gw = x * gy`.
pub unsafe extern "C" fn backward<const N: usize>(
    ctx: *const graphed_pass_ctx,
    _: *mut c_void,
) -> i32 {
    // SAFETY: as above.
    let c = unsafe { &*ctx };
    let (x, gy, gw) = unsafe { (*c.inputs, *c.grad_outputs, *c.param_grads) };
    enqueue_mul::<N>(c.stream, x, gy, gw)
}

/// Adds the layer over the N floats at `w` (its parameter, registered with
/// `policy` and `flags`) to `s`; the call must succeed.
pub fn add_layer<const N: usize>(
    s: *mut graphed_session,
    w: *mut f32,
    policy: graphed_grad_policy,
    flags: u32,
) {
    add_layer_with::<N>(s, w, policy, flags, Some(forward::<N>));
}

/// add_layer with a forward of the test's own (one that also fails or
/// takes scratch memory, say; it must compute `y = x * w`).
pub fn add_layer_with<const N: usize>(
    s: *mut graphed_session,
    w: *mut f32,
    policy: graphed_grad_policy,
    flags: u32,
    forward: graphed_pass_fn,
) {
    let t = graphed_tensor_desc {
        bytes: N * 4,
        ..graphed_tensor_desc_default()
    };
    let out = graphed_tensor_desc {
        requires_grad: 1,
        ..t
    };
    let params = [graphed_param_desc {
        data: w.cast(),
        bytes: N * 4,
        policy: policy as u32,
        flags,
        ..graphed_param_desc_default()
    }];
    let desc = layer_desc(&t, &out, &params, forward, Some(backward::<N>));
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &desc, &mut idx) });
}

/// The step io of `callable` over the buffer at `xg`: each microbatch's x
/// and, N floats on, its gy, the next microbatch's 2N floats on.
pub fn io<const N: usize>(callable: u32, xg: *mut f32) -> [graphed_step_io; 2] {
    [
        (graphed_buffer_role::Input, 0),
        (graphed_buffer_role::GradOutput, N),
    ]
    .map(|(role, at)| {
        graphed_step_io {
            callable,
            role: role as u32,
            // SAFETY: inside the interleaved buffer.
            ptr: unsafe { xg.add(at) }.cast(),
            stride: 2 * N * 4,
            ..graphed_step_io_default()
        }
    })
}

/// Iteration `it`'s x and gy of `mbs` microbatches into `xg`; `salt` makes
/// another layer's or rank's data.
pub fn fill<const N: usize>(xg: &mut [f32], mbs: usize, it: usize, salt: usize) {
    for mb in 0..mbs {
        for i in 0..N {
            let v = ((it * 31 + mb * 7 + i * 3 + salt) % 23) as f32 * 0.0625 - 0.7;
            xg[2 * N * mb + i] = v;
            xg[2 * N * mb + N + i] = 0.25 - v * 0.5;
        }
    }
}

/// The grad eager accumulation makes of the first `mbs` (at least one)
/// microbatches in `xg`: each `x * gy`, summed in microbatch order.
pub fn grad<const N: usize>(xg: &[f32], mbs: usize) -> Vec<f32> {
    assert!(mbs > 0, "a grad of no microbatch");
    let g = |mb: usize, i: usize| xg[2 * N * mb + i] * xg[2 * N * mb + N + i];
    (0..N)
        .map(|i| (1..mbs).fold(g(0, i), |s, mb| s + g(mb, i)))
        .collect()
}
