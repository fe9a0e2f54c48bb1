//! Memory that has an owner, through the C ABI on the host backend: the
//! process-wide figure (graphed_memory_stats_get) reads nothing once every
//! session of every kind is destroyed and every clone released; releasing
//! one callable (graphed_session_release_callable) gives back exactly what
//! graphed_session_callable_memory says it owns, refuses its later replays
//! and the steps that include it, and leaves the other callables
//! replaying; the shared static allocation goes with the last callable
//! using it.
//!
//! The figures are the process's, so the tests of this file run one at a
//! time (each takes `LOCK`) and each destroys what it made.

use graphed::ffi::*;
use std::ffi::{c_void, CString};
use std::ptr::{null, null_mut};
use std::sync::Mutex;

mod common;
use common::{create, empty_ref, free_nothing, host_config, memory_stats as held, msg, ok, stats};

use graphed_status as S;

/// Bytes of one row of a tensor (4 f32).
const ROW: usize = 16;
/// Rows of a tensor without buckets.
const ROWS: usize = 4;
const BYTES: usize = ROW * ROWS;
/// Bytes of every parameter.
const PBYTES: usize = ROW;
/// The bucket sizes of bucketed callables (rows).
const BUCKETS: [u64; 2] = [2, 8];

static LOCK: Mutex<()> = Mutex::new(());

/// Takes `LOCK`; the process's figures once taken.
fn serial() -> (std::sync::MutexGuard<'static, ()>, graphed_memory_stats) {
    let g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    (g, held())
}

fn figures(m: &graphed_memory_stats) -> (u64, u64, u32, u64) {
    (m.device_bytes, m.allocations, m.sessions, m.graphs)
}

fn memory(s: *mut graphed_session, c: u32) -> graphed_callable_memory {
    let mut m = graphed_callable_memory_default();
    // SAFETY: an initialised struct.
    ok(unsafe { graphed_session_callable_memory(s, c, &mut m) });
    m
}

/// A host task: copies `src` into each (destination, bytes).
struct Copy {
    src: usize,
    dsts: Vec<(usize, usize)>,
}

unsafe extern "C" fn run_copy(data: *mut c_void) {
    // SAFETY: a leaked Copy whose buffers live while the graphs do.
    let c = unsafe { &*(data as *const Copy) };
    for &(d, n) in &c.dsts {
        // SAFETY: every buffer holds at least n bytes.
        unsafe { std::ptr::copy(c.src as *const u8, d as *mut u8, n) };
    }
}

/// What a callable's user data says.
struct Layer {
    wgrad: bool,
    /// Its backward fails under capture.
    fails: bool,
}

const PLAIN: Layer = Layer {
    wgrad: false,
    fails: false,
};
const WGRAD: Layer = Layer {
    wgrad: true,
    fails: false,
};
const FAILS: Layer = Layer {
    wgrad: false,
    fails: true,
};

/// Forward: output = input. Backward: input grad = grad-output, and each
/// parameter grad its first PBYTES (unless a weight-grad pass writes
/// those: the input's first PBYTES). Each pass takes and frees scratch.
unsafe extern "C" fn pass(ctx: *const graphed_pass_ctx, data: *mut c_void) -> i32 {
    // SAFETY: valid during the call, arrays of the stated lengths; `data`
    // is a static Layer.
    unsafe {
        let c = &*ctx;
        let layer = &*(data as *const Layer);
        let rows = match c.num_buckets {
            0 => ROWS,
            _ => c.bucket_size as usize,
        };
        let bytes = rows * ROW;
        if layer.fails && c.pass == 1 && c.phase == graphed_phase::Capture as u32 {
            return 3;
        }
        let mut tmp = null_mut();
        if graphed_scratch_alloc(c.scratch, 3 * ROW, &mut tmp) != S::Ok {
            return 7;
        }
        if graphed_scratch_free(c.scratch, tmp) != S::Ok {
            return 8;
        }
        let params = |dsts: &mut Vec<(usize, usize)>| {
            for i in 0..c.num_params {
                let g = *c.param_grads.add(i) as usize;
                if g != 0 {
                    dsts.push((g, PBYTES));
                }
            }
        };
        let mut dsts = Vec::new();
        let src = match c.pass {
            0 => {
                dsts.push((*c.outputs as usize, bytes));
                *c.inputs as usize
            }
            1 => {
                let gin = *c.grad_inputs as usize;
                if gin != 0 {
                    dsts.push((gin, bytes));
                }
                if !layer.wgrad {
                    params(&mut dsts);
                }
                *c.grad_outputs as usize
            }
            _ => {
                params(&mut dsts);
                *c.inputs as usize
            }
        };
        let t: &'static Copy = Box::leak(Box::new(Copy { src, dsts }));
        graphed_host_enqueue(c.stream, Some(run_copy), t as *const Copy as *mut c_void) as i32
    }
}

/// Parameter memory, kept for the whole test run.
fn param() -> *mut c_void {
    Box::leak(vec![0u8; PBYTES].into_boxed_slice())
        .as_mut_ptr()
        .cast()
}

/// How a callable is registered.
#[derive(Clone, Copy)]
struct Desc {
    /// Chain input 0 to output 0 of this callable.
    chain: Option<u32>,
    /// The input takes a grad.
    input_grad: bool,
    policy: u32,
    wgrad: bool,
    buckets: bool,
    fails: bool,
}

const DESC: Desc = Desc {
    chain: None,
    input_grad: true,
    policy: 0,
    wgrad: false,
    buckets: false,
    fails: false,
};
/// With a weight-grad pass.
const WGRAD_DESC: Desc = Desc {
    wgrad: true,
    ..DESC
};
/// With buckets.
const BUCKETED: Desc = Desc {
    buckets: true,
    ..DESC
};
/// Its backward fails under capture.
const FAILING: Desc = Desc {
    fails: true,
    ..DESC
};

/// Input 0 chained to output 0 of callable `p`.
fn chained_to(p: u32) -> Desc {
    Desc {
        chain: Some(p),
        ..DESC
    }
}

/// Registers callable `name` with one input, one output, one parameter.
fn add(s: *mut graphed_session, name: &str, d: Desc) -> u32 {
    let shape = [BUCKETS[1] as i64, (ROW / 4) as i64];
    let mut t = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    if d.buckets {
        t.bytes = BUCKETS[1] as usize * ROW;
        t.ndim = 2;
        t.shape = shape.as_ptr();
        t.flags = graphed_tensor_flags::Dynamic as u32;
    }
    let output = t;
    let mut input = t;
    input.requires_grad = d.input_grad as u32;
    if let Some(p) = d.chain {
        input.flags |= graphed_tensor_flags::Chained as u32;
        input.chain_callable = p;
        input.chain_output = 0;
    }
    let params = [graphed_param_desc {
        data: param(),
        bytes: PBYTES,
        policy: d.policy,
        ..graphed_param_desc_default()
    }];
    let name = CString::new(name).unwrap();
    let mut desc = common::layer_desc(&input, &output, &params, Some(pass), Some(pass));
    desc.name = name.as_ptr();
    let layer = match (d.wgrad, d.fails) {
        (_, true) => &FAILS,
        (true, _) => &WGRAD,
        _ => &PLAIN,
    };
    desc.user_data = layer as *const Layer as *mut c_void;
    if d.wgrad {
        desc.wgrad = Some(pass);
    }
    if d.buckets {
        desc.bucket_sizes = BUCKETS.as_ptr();
        desc.num_buckets = BUCKETS.len();
    }
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &desc, &mut idx) });
    idx
}

/// Declares a step over `callables` (no destinations: CLONE or ALIAS
/// grads); `mbs` microbatches with `io`, looping on the device or not.
fn add_step(
    s: *mut graphed_session,
    callables: &[u32],
    mbs: u32,
    io: &[graphed_step_io],
    device_loop: bool,
) -> u32 {
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = callables.len();
    d.microbatches = mbs;
    d.io = if io.is_empty() { null() } else { io.as_ptr() };
    d.num_io = io.len();
    if device_loop {
        d.loop_mode = graphed_step_loop::While as u32;
    }
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_step(s, &d, &mut idx) });
    idx
}

/// An io copy of `role` of `callable` for 3 microbatches, from or into
/// memory kept for the test run holding `v` in every byte.
fn step_io(callable: u32, role: graphed_buffer_role, v: u8) -> graphed_step_io {
    let mem: &'static mut [u8] = Box::leak(vec![v; 3 * BYTES].into_boxed_slice());
    graphed_step_io {
        callable,
        role: role as u32,
        ptr: mem.as_mut_ptr().cast(),
        stride: BYTES,
        ..graphed_step_io_default()
    }
}

/// `call` given replay arguments for (callable, microbatch) of `size`
/// rows, with data of bytes `v` (None: NULL data).
fn with_args<R>(
    c: u32,
    mb: u32,
    v: Option<u8>,
    size: u64,
    call: impl FnOnce(&graphed_replay_args) -> R,
) -> R {
    let x = v.map(|v| vec![v; BUCKETS[1] as usize * ROW]);
    let data: Vec<*const c_void> = x.iter().map(|x| x.as_ptr() as *const c_void).collect();
    let mut a = graphed_replay_args_default();
    a.callable = c;
    a.microbatch = mb;
    a.size = size;
    if !data.is_empty() {
        a.data = data.as_ptr();
        a.num_data = 1;
    }
    call(&a)
}

/// A forward of (c, mb) with input bytes `v` (NULL data for a chained
/// input); the status and the output ref.
fn forward(
    s: *mut graphed_session,
    c: u32,
    mb: u32,
    v: Option<u8>,
    size: u64,
) -> (graphed_status, graphed_ref) {
    let mut out = empty_ref();
    // SAFETY: valid args and room for one ref.
    let st = with_args(c, mb, v, size, |a| unsafe {
        graphed_forward(s, a, &mut out, 1)
    });
    (st, out)
}

/// A backward of (c, mb) with grad-output bytes `v` (None: NULL data, for
/// a chained output); the status, the input grad and the parameter grad.
fn backward(
    s: *mut graphed_session,
    c: u32,
    mb: u32,
    v: Option<u8>,
) -> (graphed_status, graphed_ref, graphed_ref) {
    let (mut gin, mut gp) = (empty_ref(), empty_ref());
    // SAFETY: valid args and room for one ref each.
    let st = with_args(c, mb, v, 0, |a| unsafe {
        graphed_backward(s, a, &mut gin, 1, &mut gp, 1)
    });
    (st, gin, gp)
}

fn wgrad(s: *mut graphed_session, c: u32, mb: u32) -> (graphed_status, graphed_ref) {
    let mut gp = empty_ref();
    // SAFETY: valid args and room for one ref.
    let st = with_args(c, mb, None, 0, |a| unsafe {
        graphed_backward_wgrad(s, a, &mut gp, 1)
    });
    (st, gp)
}

/// Replays step `step` (`n` refs); releases every clone it returned.
fn step(s: *mut graphed_session, step: u32, n: usize) -> graphed_status {
    let mut a = graphed_step_args_default();
    a.step = step;
    let mut refs = vec![empty_ref(); n];
    // SAFETY: valid args and room for n refs.
    let st = unsafe { graphed_step_replay(s, &a, refs.as_mut_ptr(), n) };
    if st == S::Ok {
        refs.iter().for_each(release);
    }
    st
}

/// Releases a clone ref (nothing for other kinds).
fn release(r: &graphed_ref) {
    if r.kind == graphed_ref_kind::Clone as u32 {
        ok(graphed_buffer_release(r.owner));
    }
}

/// Callable `c`'s static input (microbatch 0): the status and the address.
fn input_buffer(s: *mut graphed_session, c: u32) -> (graphed_status, *mut c_void) {
    let mut ptrs = [null_mut(); 1];
    // SAFETY: room for one pointer.
    let st = unsafe {
        graphed_session_buffers(
            s,
            c,
            0,
            graphed_buffer_role::Input as u32,
            ptrs.as_mut_ptr(),
            1,
        )
    };
    (st, ptrs[0])
}

/// Releases callable `c`, whose memory was `m`: the process gives back its
/// own allocation, its cached clone blocks, its graphs and its steps'. The
/// process's figures before and after.
#[track_caller]
fn release_owned(
    s: *mut graphed_session,
    c: u32,
    m: &graphed_callable_memory,
) -> (graphed_memory_stats, graphed_memory_stats) {
    let before = held();
    ok(graphed_session_release_callable(s, c));
    let after = held();
    assert_eq!(
        before.device_bytes - after.device_bytes,
        m.own_static_bytes + m.clone_bytes_cached
    );
    assert_eq!(
        before.graphs - after.graphs,
        (m.graphs + m.step_graphs) as u64
    );
    (before, after)
}

fn bytes_of(r: &graphed_ref) -> Vec<u8> {
    // SAFETY: a live ref of r.bytes bytes.
    unsafe { std::slice::from_raw_parts(r.ptr as *const u8, r.bytes) }.to_vec()
}

/// A full iteration of a plain callable: forward then backward, every
/// clone released; checks what comes back.
fn iterate(s: *mut graphed_session, c: u32, v: u8) {
    let (st, out) = forward(s, c, 0, Some(v), 0);
    assert_eq!(st, S::Ok, "{}", msg());
    assert!(bytes_of(&out).iter().all(|&b| b == v));
    let (st, gin, gp) = backward(s, c, 0, Some(v ^ 0x5a));
    assert_eq!(st, S::Ok, "{}", msg());
    assert!(bytes_of(&gin).iter().all(|&b| b == v ^ 0x5a));
    if gp.kind != graphed_ref_kind::None as u32 {
        assert!(bytes_of(&gp).iter().all(|&b| b == v ^ 0x5a));
    }
    release(&gp);
}

#[track_caller]
fn refused_as_released(st: graphed_status, name: &str) {
    assert_eq!(st, S::CallableReleased, "{}", msg());
    let m = msg();
    assert!(
        m.contains(&format!(
            "callable '{name}' was released by graphed_session_release_callable"
        )),
        "{m}"
    );
}

#[test]
fn releasing_a_callable_gives_back_exactly_what_it_owns() {
    let (_g, start) = serial();
    let s = create(&host_config());
    // a -> b chained (their chained buffers are shared), c alone; a step
    // over c, one over a and b.
    let a = add(s, "a", DESC);
    let b = add(s, "b", chained_to(a));
    let c = add(s, "c", DESC);
    let step_c = add_step(s, &[c], 1, &[], false);
    let step_ab = add_step(s, &[a, b], 1, &[], false);
    ok(graphed_session_capture(s));
    assert_eq!(held().sessions, start.sessions + 1);
    let (ma, mb, mc) = (memory(s, a), memory(s, b), memory(s, c));
    assert_eq!(ma.released, 0);
    assert!(ma.own_static_bytes > 0 && ma.shared_static_bytes > 0);
    assert!(mb.own_static_bytes > 0 && mb.shared_static_bytes > 0);
    assert_eq!(
        ma.shared_static_bytes, mb.shared_static_bytes,
        "a's output and its grad"
    );
    assert_eq!(
        (mc.shared_static_bytes, mc.step_graphs),
        (0, 2),
        "its step, once per clone slot"
    );
    assert_eq!(mc.graphs, 2 + 2, "forward, backward, 2 clone slots");
    let st = stats(s);
    assert_eq!(
        st.static_bytes,
        ma.own_static_bytes + mb.own_static_bytes + mc.own_static_bytes + ma.shared_static_bytes,
        "one shared allocation, three of their own"
    );
    assert_eq!(
        held().graphs - start.graphs,
        (st.graph_count + st.slot_graphs + st.step_graphs) as u64
    );

    // Warm every ring; hold one clone block of `a` across its release.
    for v in 1..4 {
        iterate(s, c, v);
        let (st, _) = forward(s, a, 0, Some(v), 0);
        ok(st);
        let (st, _) = forward(s, b, 0, None, 0);
        ok(st);
        let (st, _, gp) = backward(s, b, 0, Some(v));
        ok(st);
        release(&gp);
        let (st, _, gp) = backward(s, a, 0, None);
        ok(st);
        release(&gp);
    }
    ok(step(s, step_c, 1));
    ok(step(s, step_ab, 2));
    let (st, _) = forward(s, a, 0, Some(9), 0);
    ok(st);
    ok(forward(s, b, 0, None, 0).0);
    let (st, _, gp) = backward(s, b, 0, Some(9));
    ok(st);
    release(&gp);
    let (st, _, kept) = backward(s, a, 0, None);
    ok(st);
    assert_eq!(kept.kind, graphed_ref_kind::Clone as u32);
    let kept_bytes = bytes_of(&kept);

    // Release c: the process gives back its own allocation, its cached
    // clone blocks, its graphs and its step's.
    let mc = memory(s, c);
    assert!(mc.clone_bytes_cached > 0);
    assert_eq!(mc.clone_bytes_outstanding, 0);
    let block = 256; // one PBYTES grad, aligned
    let (before, after) = release_owned(s, c, &mc);
    assert_eq!(
        before.allocations - after.allocations,
        1 + mc.clone_bytes_cached / block
    );
    assert_eq!(after.sessions, before.sessions);
    let m = memory(s, c);
    assert_eq!(
        (
            m.released,
            m.own_static_bytes,
            m.shared_static_bytes,
            m.graphs,
            m.step_graphs
        ),
        (1, 0, 0, 0, 0)
    );
    assert_eq!(m.clone_bytes_cached, 0);
    // Its replays and its step are refused, naming it, changing nothing.
    refused_as_released(forward(s, c, 0, Some(1), 0).0, "c");
    refused_as_released(backward(s, c, 0, Some(1)).0, "c");
    refused_as_released(step(s, step_c, 1), "c");
    refused_as_released(input_buffer(s, c).0, "c");
    let mut n = 0;
    // SAFETY: a valid out pointer.
    ok(unsafe { graphed_session_buffer_count(s, c, 0, graphed_buffer_role::Input as u32, &mut n) });
    assert_eq!(n, 1, "its shape still answers");
    assert_eq!(figures(&held()), figures(&after), "refusals change nothing");
    // Twice is a no-op.
    ok(graphed_session_release_callable(s, c));
    assert_eq!(figures(&held()), figures(&after));
    // The others keep replaying, step included.
    ok(forward(s, a, 0, Some(4), 0).0);
    let (st, out) = forward(s, b, 0, None, 0);
    ok(st);
    assert!(bytes_of(&out).iter().all(|&x| x == 4), "b reads a's output");
    ok(step(s, step_ab, 2));

    // Release a: its own allocation goes; the shared one stays for b.
    let ma = memory(s, a);
    assert_eq!(ma.clone_bytes_outstanding, block, "the block held");
    release_owned(s, a, &ma);
    refused_as_released(step(s, step_ab, 2), "a");
    refused_as_released(backward(s, a, 0, None).0, "a");
    assert_eq!(memory(s, b).shared_static_bytes, mb.shared_static_bytes);
    // The clone of a released callable stays valid until released.
    assert_eq!(bytes_of(&kept), kept_bytes);
    assert_eq!(memory(s, a).clone_bytes_outstanding, block);
    let before = held();
    release(&kept);
    assert_eq!(
        before.device_bytes - held().device_bytes,
        block,
        "freed, no ring to go back to"
    );
    assert_eq!(memory(s, a).clone_bytes_outstanding, 0);
    // b still replays: its input (a's output) is the caller's to fill now.
    let (st, input) = input_buffer(s, b);
    ok(st);
    // SAFETY: b's static input, BYTES long.
    unsafe { std::ptr::write_bytes(input as *mut u8, 0x33, BYTES) };
    let (st, out) = forward(s, b, 0, None, 0);
    ok(st);
    assert!(bytes_of(&out).iter().all(|&x| x == 0x33));

    // Release b, the last: the shared allocation and the scratch arena go.
    let mb = memory(s, b);
    let st = stats(s);
    assert!(st.scratch_bytes > 0);
    let before = held();
    ok(graphed_session_release_callable(s, b));
    let after = held();
    assert_eq!(
        before.device_bytes - after.device_bytes,
        mb.own_static_bytes + mb.clone_bytes_cached + mb.shared_static_bytes + st.scratch_bytes
    );
    let st = stats(s);
    assert_eq!(
        (
            st.static_bytes,
            st.scratch_bytes,
            st.pool_bytes,
            st.graph_count,
            st.slot_graphs,
            st.step_graphs
        ),
        (0, 0, 0, 0, 0, 0),
        "the session holds only what it needs itself"
    );
    assert_eq!(after.graphs, start.graphs);
    assert_eq!(
        (after.device_bytes, after.allocations),
        (start.device_bytes, start.allocations)
    );
    // The plan dump says where every buffer lived.
    let mut len = 0;
    // SAFETY: a NULL buffer asks for the length.
    ok(unsafe { graphed_session_plan_dump(s, null_mut(), 0, &mut len) });
    ok(graphed_session_reset(s));
    ok(graphed_session_destroy(s));
    assert_eq!(figures(&held()), figures(&start));
}

#[test]
fn strict_leases_refuse_releasing_a_callable_whose_alias_is_held() {
    let (_g, start) = serial();
    let mut cfg = host_config();
    cfg.strict_leases = 1;
    let s = create(&cfg);
    let a = add(s, "held", DESC);
    let b = add(s, "other", DESC);
    ok(graphed_session_capture(s));
    let (st, out) = forward(s, a, 0, Some(1), 0);
    ok(st);
    assert_ne!(out.lease, 0);
    let (st, out_b) = forward(s, b, 0, Some(2), 0);
    ok(st);
    let before = held();
    let st = graphed_session_release_callable(s, a);
    assert_eq!(st, S::AliasHeld, "{}", msg());
    let m = msg();
    assert!(
        m.contains("callable 'held'") && m.contains("output 0"),
        "{m}"
    );
    assert_eq!(figures(&held()), figures(&before), "nothing released");
    assert_eq!(memory(s, a).released, 0);
    ok(graphed_lease_release(s, out.lease));
    ok(graphed_session_release_callable(s, a));
    assert_eq!(memory(s, a).released, 1);
    // The other's lease is its own business.
    ok(graphed_lease_release(s, out_b.lease));
    ok(forward(s, b, 0, Some(3), 0).0);
    ok(graphed_session_destroy(s));
    assert_eq!(figures(&held()), figures(&start));
}

#[test]
fn refused_calls_name_what_is_wrong() {
    let (_g, start) = serial();
    assert_eq!(
        graphed_session_release_callable(null_mut(), 0),
        S::NullPointer
    );
    // SAFETY: NULL is refused.
    assert_eq!(
        unsafe { graphed_memory_stats_get(null_mut()) },
        S::NullPointer
    );
    let mut m = graphed_memory_stats_default();
    m.magic = 0;
    // SAFETY: an initialised struct with a broken magic.
    assert_eq!(unsafe { graphed_memory_stats_get(&mut m) }, S::BadStruct);
    assert!(msg().contains("graphed_memory_stats_get"), "{}", msg());
    let mut m = graphed_memory_stats_default();
    m.struct_size = 39;
    // SAFETY: as above.
    assert_eq!(unsafe { graphed_memory_stats_get(&mut m) }, S::BadStruct);
    let s = create(&host_config());
    add(s, "x", DESC);
    assert_eq!(
        graphed_session_release_callable(s, 0),
        S::WrongState,
        "not captured"
    );
    let mut cm = graphed_callable_memory_default();
    // SAFETY: an initialised struct.
    assert_eq!(
        unsafe { graphed_session_callable_memory(s, 0, &mut cm) },
        S::WrongState
    );
    ok(graphed_session_capture(s));
    assert_eq!(graphed_session_release_callable(s, 1), S::InvalidArgument);
    assert!(msg().contains("callable 1 does not exist"), "{}", msg());
    // SAFETY: as above.
    assert_eq!(
        unsafe { graphed_session_callable_memory(s, 1, &mut cm) },
        S::InvalidArgument
    );
    cm.magic = 7;
    // SAFETY: a broken struct, refused before anything.
    assert_eq!(
        unsafe { graphed_session_callable_memory(s, 0, &mut cm) },
        S::BadStruct
    );
    // SAFETY: NULL is refused.
    assert_eq!(
        unsafe { graphed_session_callable_memory(s, 0, null_mut()) },
        S::NullPointer
    );
    ok(graphed_session_reset(s));
    assert_eq!(graphed_session_release_callable(s, 0), S::SessionReset);
    ok(graphed_session_destroy(s));
    assert_eq!(graphed_session_release_callable(s, 0), S::UseAfterDestroy);
    assert_eq!(figures(&held()), figures(&start));
}

/// Sessions sharing a pool replay whole iterations in turn; a callable
/// released in one leaves that session's iteration (its passes never
/// run), so the other is not kept waiting for them.
#[test]
fn a_released_callable_leaves_its_sessions_iteration_in_a_shared_pool() {
    let (_g, start) = serial();
    let s1 = create(&host_config());
    let (a, b) = (add(s1, "a", DESC), add(s1, "b", DESC));
    ok(graphed_session_capture(s1));
    let mut cfg = host_config();
    cfg.share_pool_with = s1;
    let s2 = create(&cfg);
    add(s2, "z", DESC);
    ok(graphed_session_capture(s2));
    // Capture order of s1: a fwd, b fwd, b bwd, a bwd. Release a, whose
    // backward ends the iteration.
    ok(graphed_session_release_callable(s1, a));
    for v in 0..3 {
        iterate(s1, b, v);
        iterate(s2, 0, v);
    }
    ok(graphed_session_destroy(s2));
    ok(graphed_session_destroy(s1));
    assert_eq!(figures(&held()), figures(&start));
}

/// A clone allocator of the caller's: its memory is not graphed's.
unsafe extern "C" fn caller_alloc(
    _: *mut c_void,
    bytes: usize,
    _: graphed_stream,
    out: *mut *mut c_void,
) -> i32 {
    let p = Box::leak(vec![0u8; bytes + 256].into_boxed_slice()).as_mut_ptr();
    let aligned = (p as usize).next_multiple_of(256);
    // SAFETY: a valid out pointer.
    unsafe { *out = aligned as *mut c_void };
    0
}

#[test]
fn after_every_session_of_every_kind_is_destroyed_nothing_is_held() {
    let (_g, start) = serial();
    let mut sessions = Vec::new();

    // Plain, chained, a weight-grad pass, clone slots; released in part.
    let s = create(&host_config());
    let a = add(s, "a", DESC);
    let b = add(s, "b", chained_to(a));
    let w = add(s, "w", WGRAD_DESC);
    ok(graphed_session_capture(s));
    iterate(s, w, 1);
    let (st, gp) = wgrad(s, w, 0);
    ok(st);
    release(&gp);
    ok(forward(s, a, 0, Some(2), 0).0);
    ok(forward(s, b, 0, None, 0).0);
    ok(graphed_session_release_callable(s, w));
    refused_as_released(wgrad(s, w, 0).0, "w");
    let (st, _, gp) = backward(s, b, 0, Some(2));
    ok(st);
    sessions.push((s, Some(gp)));

    // A pipeline schedule over two chunks and two microbatches, weight-grad
    // steps, buffer reuse (memory shared between callables).
    let mut cfg = host_config();
    let order = [
        1.0, 2.0, 1.0, 2.0, -2.0, -2.5, -1.0, -1.5, -2.0, -2.5, -1.0, -1.5,
    ];
    let mut steps = vec![graphed_schedule_step { pass: 0, chunk: 0 }; order.len()];
    // SAFETY: the order's values and room for as many steps.
    ok(unsafe {
        graphed_schedule_from_te_order(
            order.as_ptr(),
            order.len(),
            steps.as_mut_ptr(),
            std::mem::size_of::<graphed_schedule_step>(),
        )
    });
    cfg.schedule = steps.as_ptr();
    cfg.num_schedule_steps = steps.len();
    cfg.reuse_buffers = 1;
    let s = create(&cfg);
    let c0 = add(s, "chunk0", WGRAD_DESC);
    let c1 = add(s, "chunk1", WGRAD_DESC);
    ok(graphed_session_capture(s));
    let (m0, m1) = (memory(s, c0), memory(s, c1));
    assert!(
        m0.shared_static_bytes > 0 && m1.shared_static_bytes > 0,
        "reuse across callables"
    );
    for (c, mb) in [(c0, 0), (c1, 0), (c0, 1), (c1, 1)] {
        ok(forward(s, c, mb, Some(5), 0).0);
    }
    for mb in 0..2 {
        for c in [c1, c0] {
            let (st, _, _) = backward(s, c, mb, Some(6));
            ok(st);
            let (st, gp) = wgrad(s, c, mb);
            ok(st);
            release(&gp);
        }
    }
    ok(graphed_session_release_callable(s, c1));
    refused_as_released(forward(s, c1, 1, Some(1), 0).0, "chunk1");
    sessions.push((s, None));

    // Steps: one over microbatches with io copies (unrolled), one looping
    // on the device (loop state), one plain; a callable of both released.
    let s = create(&host_config());
    let p = add(s, "p", DESC);
    let q = add(s, "q", chained_to(p));
    let r = add(s, "r", DESC);
    let io = [
        step_io(p, graphed_buffer_role::Input, 1),
        step_io(q, graphed_buffer_role::GradOutput, 2),
    ];
    let unrolled = add_step(s, &[p, q], 3, &io, false);
    let looping = add_step(s, &[p, q], 3, &io, true);
    let plain = add_step(s, &[r], 1, &[], false);
    ok(graphed_session_capture(s));
    ok(step(s, unrolled, 2));
    ok(step(s, looping, 2));
    ok(step(s, plain, 1));
    ok(graphed_session_release_callable(s, q));
    refused_as_released(step(s, looping, 2), "q");
    ok(step(s, plain, 1));
    sessions.push((s, None));

    // Buckets, chosen on the host and on the device.
    for device in [false, true] {
        let mut cfg = host_config();
        cfg.bucket_choice_on_device = device as u32;
        let s = create(&cfg);
        let x = add(s, "x", BUCKETED);
        let y = add(s, "y", BUCKETED);
        ok(graphed_session_capture(s));
        ok(forward(s, x, 0, Some(1), 2).0);
        ok(forward(s, y, 0, Some(1), 5).0);
        let (st, _, gp) = backward(s, y, 0, Some(1));
        ok(st);
        release(&gp);
        ok(graphed_session_release_callable(s, x));
        ok(forward(s, y, 0, Some(1), 8).0);
        sessions.push((s, None));
    }

    // The caller's clone allocator; strict leases with ALIAS grads.
    let mut cfg = host_config();
    cfg.clone_alloc = Some(caller_alloc);
    cfg.clone_free = Some(free_nothing);
    let s = create(&cfg);
    add(s, "own", DESC);
    ok(graphed_session_capture(s));
    let (st, out) = forward(s, 0, 0, Some(3), 0);
    ok(st);
    assert!(bytes_of(&out).iter().all(|&x| x == 3));
    let (st, _, gp) = backward(s, 0, 0, Some(3));
    ok(st);
    sessions.push((s, Some(gp)));
    let mut cfg = host_config();
    cfg.strict_leases = 1;
    cfg.clone_param_grads_on_return = 0;
    let s = create(&cfg);
    add(
        s,
        "alias",
        Desc {
            policy: graphed_grad_policy::Alias as u32,
            ..DESC
        },
    );
    ok(graphed_session_capture(s));
    let (st, out) = forward(s, 0, 0, Some(3), 0);
    ok(st);
    ok(graphed_lease_release(s, out.lease));
    sessions.push((s, None));

    // A session never captured, one whose capture failed.
    let s = create(&host_config());
    add(s, "open", DESC);
    sessions.push((s, None));
    let s = create(&host_config());
    add(s, "fine", DESC);
    add(s, "fails", FAILING);
    assert_eq!(graphed_session_capture(s), S::CallbackFailed);
    assert_eq!(stats(s).static_bytes, 0);
    sessions.push((s, None));

    let during = held();
    assert!(during.device_bytes > start.device_bytes);
    assert_eq!(during.sessions, start.sessions + sessions.len() as u32);
    // Destroy every session first: the clones held outlive them.
    let mut kept = Vec::new();
    for (s, gp) in sessions {
        ok(graphed_session_destroy(s));
        kept.extend(gp);
    }
    let mid = held();
    assert_eq!((mid.sessions, mid.graphs), (start.sessions, start.graphs));
    assert!(
        mid.device_bytes > start.device_bytes,
        "a held clone block is graphed's"
    );
    for gp in &kept {
        release(gp);
    }
    assert_eq!(figures(&held()), figures(&start));
    assert_eq!(
        figures(&held()),
        (0, 0, 0, 0),
        "nothing else runs in this process"
    );
}
