//! Where a replay faulted, and what the graphs hold, through the C ABI on
//! the host backend: host kernels (graphed_host_enqueue_kernel) that fail
//! in one pass, armed after capture, and a session in debug mode
//! (graphed_session_config.debug) whose replay names that callable, its
//! index, microbatch, bucket, pass and graph (main, clone slot, the
//! device's bucket choice; a step replayed pass by pass, or checked around
//! its one graph), an error pending from earlier work, and the same fault
//! surfacing only at the next synchronize without debug mode; then
//! graphed_session_export_dot: one cluster per graph, labelled, each
//! kernel named, the length asked for and truncation as
//! graphed_session_plan_dump does, and every refusal writing nothing.

use graphed::ffi::*;
use std::ffi::{c_char, c_void, CString};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU32, Ordering};

use graphed_status as S;

mod common;
use common::{create, empty_ref, host_config, msg, ok, stats};

/// Held by each test: graphed_host_synchronize(NULL) synchronizes the
/// whole host device, which invalidates a capture running on another
/// thread, as a device synchronize does under CUDA's global capture mode.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

const COLS: usize = 4;
const ROWS: usize = 4;
const BYTES: usize = ROWS * COLS * 4;
static SHAPE: [i64; 2] = [ROWS as i64, COLS as i64];

/// A callable's kernels: each pass enqueues one host kernel named
/// "<name>.<pass>", which returns 7 while that pass is armed (a bit per
/// graphed_pass value) and counts its runs.
struct Layer {
    name: &'static str,
    armed: AtomicU32,
    runs: [AtomicU32; 3],
}

/// A kernel's data: its layer and pass.
struct KernelOf {
    layer: &'static Layer,
    pass: u32,
}

unsafe extern "C" fn kernel(data: *mut c_void) -> i32 {
    // SAFETY: a leaked KernelOf.
    let k = unsafe { &*(data as *const KernelOf) };
    k.layer.runs[k.pass as usize].fetch_add(1, Ordering::SeqCst);
    if k.layer.armed.load(Ordering::SeqCst) & (1 << k.pass) != 0 {
        7
    } else {
        0
    }
}

fn pass_name(pass: u32) -> &'static str {
    ["forward", "backward", "wgrad"][pass as usize]
}

unsafe extern "C" fn enqueue(ctx: *const graphed_pass_ctx, data: *mut c_void) -> i32 {
    // SAFETY: the context is valid during the call; the data is a leaked
    // Layer.
    let (c, layer) = unsafe { (&*ctx, &*(data as *const Layer)) };
    let k = Box::leak(Box::new(KernelOf {
        layer,
        pass: c.pass,
    }));
    let name = CString::new(format!("{}.{}", layer.name, pass_name(c.pass))).unwrap();
    // SAFETY: the kernel's data lives for the test; the name is copied.
    unsafe {
        graphed_host_enqueue_kernel(
            c.stream,
            name.as_ptr(),
            Some(kernel),
            k as *mut KernelOf as *mut c_void,
        ) as i32
    }
}

fn layer(name: &'static str) -> &'static Layer {
    Box::leak(Box::new(Layer {
        name,
        armed: AtomicU32::new(0),
        runs: Default::default(),
    }))
}

/// What a callable is registered with.
#[derive(Clone, Copy, Default)]
struct Shape<'a> {
    wgrad: bool,
    buckets: &'a [u64],
}

/// Registers `l` as a callable of one input, one output and one parameter
/// (its own memory).
fn add(s: *mut graphed_session, l: &'static Layer, shape: Shape) -> u32 {
    let dynamic = !shape.buckets.is_empty();
    let t = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    let t = match dynamic {
        true => graphed_tensor_desc {
            ndim: 2,
            shape: SHAPE.as_ptr(),
            flags: graphed_tensor_flags::Dynamic as u32,
            ..t
        },
        false => t,
    };
    let mem = Box::leak(vec![0f32; COLS].into_boxed_slice());
    let p = graphed_param_desc {
        data: mem.as_mut_ptr() as *mut c_void,
        bytes: COLS * 4,
        ..graphed_param_desc_default()
    };
    let mut d = graphed_callable_desc_default();
    let name = CString::new(l.name).unwrap();
    d.name = name.as_ptr();
    d.num_inputs = 1;
    d.inputs = &t;
    d.num_outputs = 1;
    d.outputs = &t;
    d.num_params = 1;
    d.params = &p;
    d.forward = Some(enqueue);
    d.backward = Some(enqueue);
    if shape.wgrad {
        d.wgrad = Some(enqueue);
    }
    d.user_data = l as *const Layer as *mut c_void;
    if dynamic {
        d.bucket_sizes = shape.buckets.as_ptr();
        d.num_buckets = shape.buckets.len();
    }
    let mut idx = 0;
    // SAFETY: the descriptor and its arrays are valid locals.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    idx
}

fn config(debug: bool, clone_slots: u32) -> graphed_session_config {
    let mut c = host_config();
    c.debug = debug as u32;
    c.clone_slots = clone_slots;
    let name: &'static [u8] = b"net\0";
    c.name = name.as_ptr() as *const c_char;
    c
}

/// A replay of `pass` (0 forward, 1 backward, 2 weight-grad) of callable
/// `c`, forward `size` rows: its status and message ("" when it
/// succeeded); returned clones are released.
fn replay(s: *mut graphed_session, c: u32, pass: u32, size: u64) -> (S, String) {
    let mut a = graphed_replay_args_default();
    a.callable = c;
    a.size = size;
    let (mut first, mut grads) = ([empty_ref()], [empty_ref()]);
    // SAFETY: valid args and room for one ref of each kind.
    let st = unsafe {
        match pass {
            0 => graphed_forward(s, &a, first.as_mut_ptr(), 1),
            1 => graphed_backward(s, &a, first.as_mut_ptr(), 1, grads.as_mut_ptr(), 1),
            _ => graphed_backward_wgrad(s, &a, grads.as_mut_ptr(), 1),
        }
    };
    for g in grads.iter().filter(|g| !g.owner.is_null()) {
        ok(graphed_buffer_release(g.owner));
    }
    (st, if st == S::Ok { String::new() } else { msg() })
}

#[track_caller]
fn says(m: &str, parts: &[&str]) {
    for p in parts {
        assert!(m.contains(p), "the message lacks \"{p}\": {m}");
    }
}

/// Two callables, the second's backward faulting after capture: with debug
/// mode, the backward replay of 'second' fails naming its session,
/// callable, index, microbatch, bucket, pass and graph (a clone slot's,
/// where its CLONE grads are written), and the kernel's own error; every replay
/// before it succeeds, and once disarmed replays succeed again (the host
/// backend's faults are not sticky).
#[test]
fn a_fault_is_named_by_its_callable_pass_and_graph() {
    let _one = one_at_a_time();
    let (a, b) = (layer("first"), layer("second"));
    let s = create(&config(true, 2));
    add(s, a, Shape::default());
    add(s, b, Shape::default());
    ok(graphed_session_capture(s));
    assert_eq!(replay(s, 0, 0, 0).0, S::Ok);
    assert_eq!(replay(s, 1, 0, 0).0, S::Ok);
    b.armed.store(1 << 1, Ordering::SeqCst);
    let (st, m) = replay(s, 1, 1, 0);
    assert_eq!(st, S::CudaError, "{m}");
    says(
        &m,
        &[
            "graphed_backward: debug check in session 'net': an error surfaced right after the backward \
             pass of callable 'second' (index 1), microbatch 0, no buckets ran its clone slot ",
            " graph and the copies around it: host kernel 'second.backward' returned 7",
            "the NULL stream",
        ],
    );
    b.armed.store(0, Ordering::SeqCst);
    assert_eq!(replay(s, 1, 1, 0).0, S::Ok);
    assert_eq!(replay(s, 0, 1, 0).0, S::Ok);
    // Without clone slots the backward's own graph runs, then the grads
    // are copied into a block.
    a.armed.store(1 << 1, Ordering::SeqCst);
    let t = create(&config(true, 0));
    add(t, a, Shape::default());
    a.armed.store(0, Ordering::SeqCst);
    ok(graphed_session_capture(t));
    assert_eq!(replay(t, 0, 0, 0).0, S::Ok);
    a.armed.store(1 << 1, Ordering::SeqCst);
    let (st, m) = replay(t, 0, 1, 0);
    assert_eq!(st, S::CudaError, "{m}");
    says(
        &m,
        &["the backward pass of callable 'first' (index 0), microbatch 0, no buckets ran its main graph"],
    );
    a.armed.store(1, Ordering::SeqCst);
    let (st, m) = replay(t, 0, 0, 0);
    assert_eq!(st, S::CudaError, "{m}");
    says(
        &m,
        &[
            "graphed_forward: ",
            "right after the forward pass of callable 'first' (index 0)",
            "ran its main graph",
            "host kernel 'first.forward' returned 7",
        ],
    );
    a.armed.store(0, Ordering::SeqCst);
    for h in [s, t] {
        ok(graphed_session_destroy(h));
    }
}

/// Without debug mode the same fault does not fail the replay (its work
/// was enqueued): the next synchronize of the stream reports it, naming
/// the kernel only, once.
#[test]
fn without_debug_mode_the_fault_surfaces_at_the_next_synchronize() {
    let _one = one_at_a_time();
    let a = layer("plain");
    let s = create(&config(false, 2));
    add(s, a, Shape::default());
    ok(graphed_session_capture(s));
    a.armed.store(1, Ordering::SeqCst);
    assert_eq!(replay(s, 0, 0, 0).0, S::Ok);
    assert_eq!(replay(s, 0, 0, 0).0, S::Ok, "the first fault is kept");
    a.armed.store(0, Ordering::SeqCst);
    assert_eq!(graphed_host_synchronize(null_mut()), S::CudaError);
    let m = msg();
    says(
        &m,
        &["graphed_host_synchronize: host kernel 'plain.forward' returned 7"],
    );
    assert!(!m.contains("callable"), "{m}");
    ok(graphed_host_synchronize(null_mut()));
    ok(graphed_session_destroy(s));
}

/// An error pending from the caller's own work before a debug replay is
/// said to be from earlier work, and the replay is refused before it runs
/// anything (its kernel does not run, nothing changes).
#[test]
fn an_error_pending_before_the_replay_is_not_blamed_on_it() {
    let _one = one_at_a_time();
    let a = layer("layer");
    let s = create(&config(true, 2));
    add(s, a, Shape::default());
    ok(graphed_session_capture(s));
    let runs = a.runs[0].load(Ordering::SeqCst);
    let before = stats(s);
    let user = layer("user");
    user.armed.store(1, Ordering::SeqCst);
    let k = Box::leak(Box::new(KernelOf {
        layer: user,
        pass: 0,
    }));
    // SAFETY: a leaked kernel data; the NULL stream runs it now.
    ok(unsafe {
        graphed_host_enqueue_kernel(
            null_mut(),
            c"optimizer".as_ptr(),
            Some(kernel),
            k as *mut KernelOf as *mut c_void,
        )
    });
    let (st, m) = replay(s, 0, 0, 0);
    assert_eq!(st, S::CudaError, "{m}");
    says(
        &m,
        &[
            "an error was pending before the forward replay of callable 'layer' (index 0), microbatch 0, \
             no buckets enqueued anything (it came from work enqueued earlier",
            "host kernel 'optimizer' returned 7",
        ],
    );
    assert_eq!(a.runs[0].load(Ordering::SeqCst), runs, "the forward ran");
    let after = stats(s);
    let figures = |st: &graphed_session_stats| {
        (
            st.clone_blocks_outstanding,
            st.clone_bytes_cached,
            st.leases_held,
            st.param_moves,
            st.teardown_errors,
        )
    };
    assert_eq!(figures(&after), figures(&before));
    assert_eq!(replay(s, 0, 0, 0).0, S::Ok);
    ok(graphed_session_destroy(s));
}

/// The weight-grad pass, and a bucket chosen on the host and on the
/// device, are named.
#[test]
fn weight_grad_passes_and_buckets_are_named() {
    let _one = one_at_a_time();
    let (a, b) = (layer("delayed"), layer("bucketed"));
    let mut cfg = config(true, 1);
    cfg.bucket_choice_on_device = 1;
    let s = create(&cfg);
    add(
        s,
        a,
        Shape {
            wgrad: true,
            ..Shape::default()
        },
    );
    add(
        s,
        b,
        Shape {
            buckets: &[2, 4],
            ..Shape::default()
        },
    );
    ok(graphed_session_capture(s));
    assert_eq!(replay(s, 0, 0, 0).0, S::Ok);
    assert_eq!(replay(s, 0, 1, 0).0, S::Ok);
    a.armed.store(1 << 2, Ordering::SeqCst);
    let (st, m) = replay(s, 0, 2, 0);
    assert_eq!(st, S::CudaError, "{m}");
    says(
        &m,
        &[
            "graphed_backward_wgrad: ",
            "right after the weight-grad pass of callable 'delayed' (index 0), microbatch 0, no buckets \
             ran its clone slot 0 graph",
            "host kernel 'delayed.wgrad' returned 7",
        ],
    );
    b.armed.store(1, Ordering::SeqCst);
    let (st, m) = replay(s, 1, 0, 3);
    assert_eq!(st, S::CudaError, "{m}");
    says(
        &m,
        &["the forward pass of callable 'bucketed' (index 1), microbatch 0, bucket 1 (3 of its 4 rows) ran its main graph"],
    );
    let size = Box::leak(Box::new(1u64));
    let mut args = graphed_replay_args_default();
    args.callable = 1;
    args.device_size = size;
    let mut out = [empty_ref()];
    // SAFETY: valid args, device_size in the host backend's memory sense.
    let st = unsafe { graphed_forward(s, &args, out.as_mut_ptr(), 1) };
    assert_eq!(st, S::CudaError, "{}", msg());
    says(
        &msg(),
        &["the forward pass of callable 'bucketed' (index 1), microbatch 0, the bucket chosen on the device ran its graph choosing the bucket on the device"],
    );
    b.armed.store(0, Ordering::SeqCst);
    ok(graphed_session_destroy(s));
}

/// Declares a step over `callables`, `microbatches` of them.
fn add_step(s: *mut graphed_session, callables: &[u32], microbatches: u32) {
    let mut d = graphed_step_desc_default();
    d.callables = callables.as_ptr();
    d.num_callables = callables.len();
    d.microbatches = microbatches;
    let mut step = 0;
    // SAFETY: a valid descriptor.
    ok(unsafe { graphed_session_add_step(s, &d, &mut step) });
}

fn step(s: *mut graphed_session, n: usize) -> (S, String) {
    let (st, refs) = common::step_replay(s, n, None);
    for r in refs.iter().filter(|r| !r.owner.is_null()) {
        ok(graphed_buffer_release(r.owner));
    }
    (st, if st == S::Ok { String::new() } else { msg() })
}

/// A step replays pass by pass in debug mode, so that the pass is named;
/// one over microbatches (no pass-by-pass replay) is checked around its
/// one graph, and names the step, its callables and its graph.
#[test]
fn steps_name_the_pass_or_their_graph() {
    let _one = one_at_a_time();
    let (a, b) = (layer("s.first"), layer("s.second"));
    let s = create(&config(true, 1));
    add(s, a, Shape::default());
    add(s, b, Shape::default());
    add_step(s, &[0, 1], 1);
    ok(graphed_session_capture(s));
    let runs = a.runs[1].load(Ordering::SeqCst);
    assert_eq!(step(s, 2).0, S::Ok);
    assert_eq!(
        a.runs[1].load(Ordering::SeqCst),
        runs + 1,
        "one backward of 'first' per step"
    );
    a.armed.store(1 << 1, Ordering::SeqCst);
    let (st, m) = step(s, 2);
    assert_eq!(st, S::CudaError, "{m}");
    says(
        &m,
        &[
            "graphed_step_replay: debug check in session 'net': an error surfaced right after the backward \
             pass of callable 's.first' (index 0), microbatch 0, no buckets ran its clone slot 0 graph and \
             the copies around it, in step 0 (replayed pass by pass in debug mode): ",
            "host kernel 's.first.backward' returned 7",
        ],
    );
    a.armed.store(0, Ordering::SeqCst);
    assert_eq!(step(s, 2).0, S::Ok);
    ok(graphed_session_destroy(s));

    let (c, d) = (layer("m.first"), layer("m.second"));
    let t = create(&config(true, 1));
    add(t, c, Shape::default());
    add(t, d, Shape::default());
    add_step(t, &[0, 1], 2);
    ok(graphed_session_capture(t));
    assert_eq!(step(t, 2).0, S::Ok);
    d.armed.store(1, Ordering::SeqCst);
    let (st, m) = step(t, 2);
    assert_eq!(st, S::CudaError, "{m}");
    says(
        &m,
        &[
            "right after step 0 (callables 'm.first', 'm.second'; 2 microbatch(es)) ran its clone slot 0 \
             graph; the step runs its microbatches or its copies in one graph and has no pass-by-pass \
             replay, so the pass is not known: ",
            "host kernel 'm.second.forward' returned 7",
        ],
    );
    d.armed.store(0, Ordering::SeqCst);
    ok(graphed_session_destroy(t));
}

/// graphed_session_export_dot into a buffer of `capacity` (None: NULL),
/// `length_out` given or NULL: the status and the text; on failure the
/// buffer and the length are checked untouched.
fn export(s: *mut graphed_session, capacity: Option<usize>, length: bool) -> (S, String, usize) {
    let mut buf = vec![0x55u8; capacity.unwrap_or(0) + 1];
    let mut len = 0x77usize;
    let bp = match capacity {
        Some(_) => buf.as_mut_ptr() as *mut c_char,
        None => null_mut(),
    };
    let lp = if length {
        &mut len as *mut usize
    } else {
        null_mut()
    };
    // SAFETY: room for `capacity` bytes (one spare), or NULL.
    let st = unsafe { graphed_session_export_dot(s, bp, capacity.unwrap_or(0), lp) };
    assert_eq!(*buf.last().unwrap(), 0x55, "written past the capacity");
    if st != S::Ok {
        assert!(buf.iter().all(|&b| b == 0x55), "written on failure");
        assert_eq!(len, 0x77, "length written on failure");
        assert!(
            msg().starts_with("graphed_session_export_dot: "),
            "{}",
            msg()
        );
        return (st, msg(), len);
    }
    let text = match capacity {
        Some(n) if n > 0 => {
            let end = buf.iter().position(|&b| b == 0).expect("NUL-terminated");
            assert!(end < n);
            String::from_utf8(buf[..end].to_vec()).unwrap()
        }
        _ => String::new(),
    };
    (st, text, len)
}

/// The whole text.
fn dot(s: *mut graphed_session) -> String {
    let (st, _, len) = export(s, None, true);
    assert_eq!(st, S::Ok, "{}", msg());
    let (st, text, again) = export(s, Some(len + 1), true);
    assert_eq!(st, S::Ok, "{}", msg());
    assert_eq!((text.len(), again), (len, len));
    text
}

/// Every graph the session holds is one cluster (the graphs choosing a
/// bucket on the device too), labelled with its callable, index, pass,
/// microbatch and bucket, or its step, and which graph it is; each kernel is a node named by the kernel, with the
/// cluster's label as its tooltip; the tasks of a graph run in order.
#[test]
fn export_dot_shows_every_graph_and_names_its_kernels() {
    let _one = one_at_a_time();
    let (a, b) = (layer("dot.first"), layer("dot.second"));
    let mut cfg = config(false, 1);
    cfg.bucket_choice_on_device = 1;
    let s = create(&cfg);
    add(s, a, Shape::default());
    add(
        s,
        b,
        Shape {
            buckets: &[2, 4],
            ..Shape::default()
        },
    );
    add_step(s, &[0], 1);
    ok(graphed_session_capture(s));
    let text = dot(s);
    let st = stats(s);
    let clusters = text.matches("subgraph cluster_").count();
    assert_eq!(
        clusters as u32,
        st.graph_count + st.slot_graphs + st.step_graphs,
        "{text}"
    );
    assert!(
        text.starts_with("// graphed ") && text.contains("digraph \"session 'net'\" {"),
        "{text}"
    );
    assert_eq!(text.matches('{').count(), text.matches('}').count());
    for label in [
        "label=\"callable 'dot.first' (index 0), forward, microbatch 0, no buckets, main graph\";",
        "label=\"callable 'dot.first' (index 0), backward, microbatch 0, no buckets, main graph\";",
        "label=\"callable 'dot.first' (index 0), backward, microbatch 0, no buckets, clone slot 0 graph\";",
        "label=\"callable 'dot.second' (index 1), forward, microbatch 0, bucket 0 (2 rows), main graph\";",
        "label=\"callable 'dot.second' (index 1), backward, microbatch 0, bucket 1 (4 rows), clone slot 0 graph\";",
        "label=\"step 0 (callables 'dot.first'; 1 microbatch(es)), clone slot 0 graph\";",
        "label=\"callable 'dot.second' (index 1), forward, microbatch 0, the bucket chosen on the device (of 2), choosing graph\";",
        "label=\"callable 'dot.second' (index 1), backward, microbatch 0, the bucket chosen on the device (of 2), choosing graph of clone slot 0\";",
    ] {
        assert!(text.contains(label), "no cluster {label}\n{text}");
    }
    let node =
        "[label=\"host kernel\\ndot.second.forward\", tooltip=\"callable 'dot.second' (index 1), \
                forward, microbatch 0, bucket 1 (4 rows), main graph\"];";
    assert!(text.contains(node), "no node {node}\n{text}");
    assert!(text.contains(" -> "), "no edges: {text}");
    assert_eq!(dot(s), text, "the same text every time");
    ok(graphed_session_release_callable(s, 0));
    let after = dot(s);
    assert!(
        after.contains("// callable 'dot.first' (index 0) was released: its graphs are gone"),
        "{after}"
    );
    assert!(!after.contains("'dot.first' (index 0), forward"), "{after}");
    assert!(
        !after.contains("step 0"),
        "the step's graphs went with it: {after}"
    );
    ok(graphed_session_destroy(s));
}

/// The length is asked with a NULL buffer; a short buffer gets the first
/// bytes and a NUL, and the full length; every refusal writes nothing.
#[test]
fn export_dot_lengths_truncation_and_refusals() {
    let _one = one_at_a_time();
    let a = layer("refusals");
    let s = create(&config(false, 2));
    add(s, a, Shape::default());
    let (st, m, _) = export(s, Some(64), true);
    assert_eq!(st, S::WrongState);
    says(&m, &["not captured yet"]);
    ok(graphed_session_capture(s));
    let full = dot(s);
    let (st, text, len) = export(s, Some(10), true);
    assert_eq!(st, S::Ok);
    assert_eq!((text.as_str(), len), (&full[..9], full.len()));
    let (st, text, len) = export(s, Some(0), true);
    assert_eq!((st, text.as_str(), len), (S::Ok, "", full.len()));
    assert_eq!(export(null_mut(), Some(64), true).0, S::NullPointer);
    assert_eq!(export(s, Some(64), false).0, S::NullPointer);
    let forged = 0x1234usize as *mut graphed_session;
    assert_eq!(export(forged, Some(64), true).0, S::InvalidArgument);
    let mut len = 0x77usize;
    let mut byte = 0x55u8;
    // SAFETY: a capacity that cannot be memory is refused before any write.
    let st = unsafe {
        graphed_session_export_dot(s, &mut byte as *mut u8 as *mut c_char, usize::MAX, &mut len)
    };
    assert_eq!((st, len, byte), (S::InvalidArgument, 0x77, 0x55));
    says(&msg(), &["buffer", "do not fit in memory"]);
    let mut words = [0x77usize; 2];
    // SAFETY: a misaligned length pointer is refused before any write.
    let st = unsafe {
        graphed_session_export_dot(
            s,
            null_mut(),
            0,
            (words.as_mut_ptr() as *mut u8).add(1) as *mut usize,
        )
    };
    assert_eq!(st, S::InvalidArgument, "{}", msg());
    assert_eq!(words, [0x77, 0x77]);
    ok(graphed_session_reset(s));
    let (st, m, _) = export(s, Some(64), true);
    assert_eq!(st, S::SessionReset);
    says(&m, &["reset"]);
    ok(graphed_session_destroy(s));
    assert_eq!(export(s, Some(64), true).0, S::UseAfterDestroy);
}

/// Asked from inside a callback of its own session's capture: BUSY, with
/// nothing written.
#[test]
fn export_dot_inside_a_capture_is_busy() {
    let _one = one_at_a_time();
    static SESSION: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    static SEEN: AtomicU32 = AtomicU32::new(0);
    unsafe extern "C" fn ask(_: *const graphed_pass_ctx, _: *mut c_void) -> i32 {
        let s = SESSION.load(Ordering::SeqCst) as *mut graphed_session;
        let mut len = 0x77usize;
        let mut buf = [0x55u8; 8];
        // SAFETY: room for 8 bytes.
        let st =
            unsafe { graphed_session_export_dot(s, buf.as_mut_ptr() as *mut c_char, 8, &mut len) };
        assert_eq!((st, len, buf), (S::Busy, 0x77, [0x55; 8]), "{}", msg());
        SEEN.fetch_add(1, Ordering::SeqCst);
        0
    }
    let t = graphed_tensor_desc {
        bytes: BYTES,
        requires_grad: 1,
        ..graphed_tensor_desc_default()
    };
    let s = create(&config(false, 0));
    SESSION.store(s as usize, Ordering::SeqCst);
    let d = common::layer_desc(&t, &t, &[], Some(ask), Some(ask));
    let mut idx = 0;
    // SAFETY: a valid descriptor.
    ok(unsafe { graphed_session_add_callable(s, &d, &mut idx) });
    ok(graphed_session_capture(s));
    assert!(SEEN.load(Ordering::SeqCst) >= 4, "warmup and capture");
    ok(graphed_session_destroy(s));
}
