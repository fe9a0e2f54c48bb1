//! The steady-state replay path allocates nothing on the host: after a few
//! warm-up replays, a counting global allocator sees no allocation during
//! thousands of forward + backward replays through the C ABI (host backend,
//! whose "device" memory comes from the system allocator, so device
//! allocations count too). CLONE grads included: their blocks are recycled
//! through the instance's ring once released.

use graphed::ffi::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::null_mut;

mod common;
use common::{empty_ref, ok};

struct Counting;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

fn bump() {
    if ON.with(|o| o.get()) {
        COUNT.with(|c| c.set(c.get() + 1));
    }
}

// SAFETY: forwards every call to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        bump();
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        bump();
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        bump();
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Allocations made by `f` on this thread.
fn count(f: impl FnOnce()) -> usize {
    COUNT.with(|c| c.set(0));
    ON.with(|o| o.set(true));
    f();
    ON.with(|o| o.set(false));
    COUNT.with(|c| c.get())
}

unsafe extern "C" fn task(data: *mut c_void) {
    // SAFETY: the tests pass a pointer to a live f32.
    unsafe { *(data as *mut f32) += 1.0 };
}

static mut COUNTER: f32 = 0.0;

unsafe extern "C" fn pass(ctx: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
    // SAFETY: ctx is valid during the call; the task's target is a static.
    unsafe {
        graphed_host_enqueue(
            (*ctx).stream,
            Some(task),
            std::ptr::addr_of_mut!(COUNTER).cast(),
        ) as i32
    }
}

/// Gives back what a replay returned: every lease, then every clone block
/// (an alias has none: releasing NULL is a no-op).
fn release(s: *mut graphed_session, refs: &[graphed_ref]) {
    for r in refs.iter().filter(|r| r.lease != 0) {
        ok(graphed_lease_release(s, r.lease));
    }
    for r in refs {
        ok(graphed_buffer_release(r.owner));
    }
}

/// How the tests replay the callable.
#[derive(Clone, Copy, PartialEq)]
enum Replay {
    /// graphed_forward, then graphed_backward.
    Passes,
    /// graphed_step_replay of a step declared with the callable.
    Step,
}

/// Captures one callable (1 input, 2 parameters, 1 output) and returns the
/// allocations made by `iters` forward + backward replays.
fn replay_allocations(clones: bool, strict: bool, policy: u32, iters: usize) -> usize {
    allocations(Replay::Passes, clones, strict, policy, iters)
}

fn allocations(how: Replay, clones: bool, strict: bool, policy: u32, iters: usize) -> usize {
    let mut input = vec![1.0f32; 64];
    let mut params = [vec![0.5f32; 256], vec![0.25f32; 16]];
    let mut dsts = [vec![0.0f32; 256], vec![0.0f32; 16]];
    let tensor = |bytes: usize, grad: bool| graphed_tensor_desc {
        bytes,
        requires_grad: grad as u32,
        ..graphed_tensor_desc_default()
    };
    let inputs = [tensor(256, true)];
    let outputs = [tensor(256, true)];
    let pdesc: Vec<graphed_param_desc> = params
        .iter_mut()
        .map(|p| graphed_param_desc {
            data: p.as_mut_ptr().cast(),
            bytes: p.len() * 4,
            policy,
            ..graphed_param_desc_default()
        })
        .collect();
    let mut cfg = graphed_session_config_default();
    cfg.backend = 1;
    cfg.clone_param_grads_on_return = clones as u32;
    cfg.strict_leases = strict as u32;
    let dst_ptrs: [*mut c_void; 2] = [dsts[0].as_mut_ptr().cast(), dsts[1].as_mut_ptr().cast()];
    let with_dsts = policy == 3 || policy == 4;
    let mut s: *mut graphed_session = null_mut();
    // SAFETY (all FFI calls below): valid pointers to live locals, counts
    // matching the arrays.
    unsafe {
        ok(graphed_session_create(&cfg, &mut s));
        let mut d = graphed_callable_desc_default();
        d.num_inputs = 1;
        d.inputs = inputs.as_ptr();
        d.num_outputs = 1;
        d.outputs = outputs.as_ptr();
        d.num_params = 2;
        d.params = pdesc.as_ptr();
        d.forward = Some(pass);
        d.backward = Some(pass);
        let mut idx = 0;
        ok(graphed_session_add_callable(s, &d, &mut idx));
        if how == Replay::Step {
            let callables = [idx];
            let mut sd = graphed_step_desc_default();
            sd.callables = callables.as_ptr();
            sd.num_callables = 1;
            if with_dsts {
                sd.param_dsts = dst_ptrs.as_ptr();
                sd.num_param_dsts = 2;
            }
            let mut step = u32::MAX;
            ok(graphed_session_add_step(s, &sd, &mut step));
            assert_eq!(step, 0);
        }
        ok(graphed_session_capture(s));
    }
    let data: [*const c_void; 1] = [input.as_mut_ptr().cast()];
    let step_replay = || {
        let a = graphed_step_args_default();
        let mut gp = [empty_ref(); 2];
        // SAFETY: as above; room for the step's two parameter grads.
        ok(unsafe { graphed_step_replay(s, &a, gp.as_mut_ptr(), 2) });
        release(s, &gp);
    };
    let passes = || {
        let mut a = graphed_replay_args_default();
        a.data = data.as_ptr();
        a.num_data = 1;
        if with_dsts {
            a.param_dsts = dst_ptrs.as_ptr();
            a.num_param_dsts = 2;
        }
        let mut out = [empty_ref()];
        let mut gin = out;
        let mut gp = [out[0]; 2];
        // SAFETY: as above; the output arrays have the stated lengths.
        unsafe {
            ok(graphed_forward(s, &a, out.as_mut_ptr(), 1));
            ok(graphed_backward(
                s,
                &a,
                gin.as_mut_ptr(),
                1,
                gp.as_mut_ptr(),
                2,
            ));
        }
        release(s, &[out[0], gin[0], gp[0], gp[1]]);
    };
    let step: &dyn Fn() = match how {
        Replay::Passes => &passes,
        Replay::Step => &step_replay,
    };
    for _ in 0..10 {
        step();
    }
    let n = count(|| {
        for _ in 0..iters {
            step();
        }
    });
    ok(graphed_session_destroy(s));
    n
}

#[test]
fn aliased_grads_replay_without_allocating() {
    assert_eq!(replay_allocations(false, false, 0, 2000), 0);
}

#[test]
fn strict_leases_replay_without_allocating() {
    assert_eq!(replay_allocations(false, true, 0, 2000), 0);
}

#[test]
fn copy_into_and_accumulate_into_replay_without_allocating() {
    assert_eq!(replay_allocations(true, false, 3, 2000), 0);
    assert_eq!(replay_allocations(true, false, 4, 2000), 0);
}

#[test]
fn cloned_grads_replay_without_allocating() {
    // The block released after each step is the one the next step takes.
    assert_eq!(replay_allocations(true, false, 0, 2000), 0);
}

#[test]
fn steps_replay_without_allocating() {
    // (clones, strict leases, policy); with CLONE grads the step replays
    // its slot graphs (the pass-by-pass fallback is not the steady state).
    let cases = [
        (false, false, 0),
        (false, true, 0),
        (true, false, 0),
        (true, false, 3),
        (true, false, 4),
    ];
    for (clones, strict, policy) in cases {
        assert_eq!(
            allocations(Replay::Step, clones, strict, policy, 2000),
            0,
            "clones {clones}, strict {strict}, policy {policy}"
        );
    }
}
