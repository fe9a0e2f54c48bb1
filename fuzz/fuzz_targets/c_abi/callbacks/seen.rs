//! What a callback is given, checked against the model: its context (pass,
//! phase, microbatch, counts, stream, scratch and capture handles), its
//! buffers (external ones only once handed over), and the capture frame it
//! runs in, which it updates.

use super::*;

/// What a call was given that the rest of the call works with.
pub(super) struct Seen {
    pub cl: Callable,
    pub sess_h: usize,
    pub capture_phase: bool,
    pub mb: u32,
    /// The bucket it records (0 without buckets): its external buffers
    /// are that bucket's own.
    pub bucket: u32,
    pub pass: u32,
    pub outputs: Vec<usize>,
    pub gins: Vec<usize>,
    pub pgrads: Vec<usize>,
    /// The first iteration of the measuring phase.
    pub measuring: bool,
    /// What the pass's task mixes into the grads it writes (see `Fill`):
    /// the step microbatch recorded (unrolled), the running microbatch's
    /// index and the data buffer (in a loop body).
    pub step_mb: u32,
    pub index: usize,
    pub data: usize,
    /// Under a step's capture (after every pass's own): external buffers
    /// are handed over in ctx, and none can be provided.
    pub in_step: bool,
}

/// Checks the context of a call of callback `cb` (for pass `which`; 9:
/// any) and its capture frame.
pub(super) fn check_ctx(ctx: &graphed_pass_ctx, cb: &Cb, which: u32) -> Seen {
    let wd = w();
    trace!(
        "  callback sess {} callable {} pass {} phase {} it {} mb {} hook {} step mb {}/{}{} (reads at {})",
        cb.sess,
        cb.callable,
        ctx.pass,
        ctx.phase,
        ctx.iteration,
        ctx.microbatch,
        cb.hook,
        ctx.step_microbatch,
        ctx.step_microbatches,
        if ctx.step_microbatch_index.is_null() {
            ""
        } else {
            " in a loop body"
        },
        wd.input.pos.get()
    );
    assert_eq!(ctx.struct_size, size_of::<graphed_pass_ctx>());
    assert_eq!(ctx.callable as usize, cb.callable, "ctx.callable");
    if which != 9 {
        assert_eq!(ctx.pass, which, "a callback ran for another pass");
    }
    assert!(ctx.phase <= 1 && ctx.pass <= 2);
    let in_body = !ctx.step_microbatch_index.is_null();
    let loop_k = in_body.then(|| loop_of(ctx));
    let (cl, sess_h, mb_known, looped) = {
        let s = &wd.sessions.borrow()[cb.sess];
        let si = check_step_microbatch(ctx, cb, s, loop_k);
        let looped = si.map(|si| s.steps[si].clone());
        (s.callables[cb.callable].clone(), s.h, s.mb, looped)
    };
    if mb_known != 0 {
        assert!(ctx.microbatch < mb_known, "microbatch {}", ctx.microbatch);
    }
    // Buckets: which one this call records, of how many, its size, and
    // the device's actual size (none without buckets).
    if cl.buckets.is_empty() {
        assert_eq!(
            (ctx.bucket, ctx.num_buckets, ctx.bucket_size),
            (0, 0, 0),
            "bucket fields of a callable without buckets"
        );
        assert!(ctx.actual_size.is_null(), "actual_size without buckets");
    } else {
        assert_eq!(
            ctx.num_buckets as usize,
            cl.buckets.len(),
            "ctx.num_buckets"
        );
        assert!(ctx.bucket < ctx.num_buckets, "ctx.bucket {}", ctx.bucket);
        assert_eq!(
            ctx.bucket_size, cl.buckets[ctx.bucket as usize],
            "ctx.bucket_size"
        );
        assert!(
            !ctx.actual_size.is_null(),
            "actual_size of a bucketed callable"
        );
    }
    assert_eq!(ctx.num_inputs, cl.inputs.len());
    assert_eq!(ctx.num_outputs, cl.outputs.len());
    assert_eq!(ctx.num_params, cl.params.len());
    assert!(!ctx.stream.is_null());
    assert!(!ctx.tape.is_null());
    assert_eq!(
        ctx.scratch.is_null(),
        cb.hook,
        "scratch is for callbacks only"
    );
    assert_eq!(
        !ctx.capture.is_null(),
        !cb.hook && ctx.phase == 1,
        "capture only for callbacks under capture"
    );
    let capture_phase = ctx.phase == 1 && !cb.hook;
    let mb = ctx.microbatch;
    let pass = ctx.pass;
    // SAFETY (arrays): graphed passes arrays of the stated lengths.
    let arr = |p: *const *mut c_void, n: usize| -> Vec<usize> {
        if n == 0 {
            return Vec::new();
        }
        unsafe { std::slice::from_raw_parts(p as *const usize, n) }.to_vec()
    };
    let inputs = arr(ctx.inputs, ctx.num_inputs);
    let outputs = arr(ctx.outputs, ctx.num_outputs);
    let gouts = arr(ctx.grad_outputs, ctx.num_outputs);
    let gins = arr(ctx.grad_inputs, ctx.num_inputs);
    let pgrads = arr(ctx.param_grads, ctx.num_params);
    // An external buffer reads 0 until the pass that writes it was captured
    // and handed it over; then the address it handed over (with buckets,
    // the capture of this bucket's pass).
    let ext_ok = |p: usize, role: u32, j: usize| {
        p == 0
            || w().ext.borrow().get(&(
                cb.sess,
                cb.callable,
                ext_key(ctx.microbatch, ctx.bucket),
                role,
                j,
            )) == Some(&p)
    };
    for (j, t) in cl.inputs.iter().enumerate() {
        assert_ne!(inputs[j], 0);
        if t.grad && t.external {
            assert!(
                ext_ok(gins[j], ROLE_GIN, j),
                "external grad input {j}: 0x{:x}",
                gins[j]
            );
        } else {
            assert_eq!(gins[j] != 0, t.grad, "grad input {j}");
        }
    }
    for (j, t) in cl.outputs.iter().enumerate() {
        if t.external {
            assert!(
                ext_ok(outputs[j], ROLE_OUT, j),
                "external output {j}: 0x{:x}",
                outputs[j]
            );
        } else {
            assert_ne!(outputs[j], 0, "output {j}");
        }
        assert_eq!(gouts[j] != 0, t.grad, "grad output {j}");
    }
    for (j, p) in cl.params.iter().enumerate() {
        if p.grad && p.external {
            assert!(
                ext_ok(pgrads[j], ROLE_PARAM, j),
                "external param grad {j}: 0x{:x}",
                pgrads[j]
            );
        } else {
            assert_eq!(pgrads[j] != 0, p.grad, "param grad {j}");
        }
    }
    // The frame of this session's capture.
    {
        let mut fs = wd.frames.borrow_mut();
        let f = fs.last_mut().expect("a callback outside capture");
        assert_eq!(
            f.sess, cb.sess,
            "a callback of another session than the innermost capture"
        );
        assert!(
            f.first.is_none(),
            "a callback ran after its capture had failed ({:?})",
            f.first
        );
        f.ran = true;
        if in_body {
            // A loop's body is recorded on a stream of its own.
            assert!(
                f.stream != 0 && f.stream != ctx.stream as usize,
                "a loop body's callback on the capture's side stream"
            );
            f.body = ctx.stream as usize;
        } else {
            if f.stream == 0 {
                f.stream = ctx.stream as usize;
            }
            assert_eq!(
                f.stream, ctx.stream as usize,
                "the side stream changed during a capture"
            );
        }
        if !cb.hook {
            f.scratch_fail = false;
            f.capturing = capture_phase;
            if capture_phase {
                f.invalidated = false;
                f.broke = 0;
            }
        }
    }
    check_place(ctx, cb);
    // The external buffers this pass writes: all handed over (a step's
    // capture, after the pass's own) or none (its own capture).
    let mine: Vec<usize> = externals(&cl, pass)
        .iter()
        .map(|&(role, j, _)| match role {
            ROLE_OUT => outputs[j],
            ROLE_GIN => gins[j],
            _ => pgrads[j],
        })
        .collect();
    let in_step = capture_phase && {
        let mut fs = wd.frames.borrow_mut();
        let f = fs.last_mut().expect("a callback outside capture");
        // Each bucket's pass is captured once (in rounds, bucket by bucket).
        let key = (cb.callable, mb | (ctx.bucket << 16), pass);
        if f.captured.contains(&key) && f.last != Some(key) {
            f.in_steps = true;
        }
        if !f.captured.contains(&key) {
            f.captured.push(key);
        }
        f.last = Some(key);
        f.in_steps
    };
    // Its own capture provides them; a step's capture hands them over
    // (hooks, outside capture, see them once provided).
    assert!(
        !capture_phase || mine.iter().all(|&p| (p != 0) == in_step),
        "external buffers of pass {pass} of callable {} {} a step's capture: {mine:x?}",
        cb.callable,
        if in_step { "in" } else { "outside" }
    );
    if in_step && !mine.is_empty() {
        trace!("  in a step's capture, external buffers handed over: {mine:x?}");
    }
    let measuring = ctx.phase == 0 && ctx.iteration == 0;
    // In a loop body, the grads also mix in the first byte of the step's
    // first copy in of this callable, read when the task runs.
    let data = looped
        .as_ref()
        .and_then(|st| data_entry(st, cb.callable))
        .map_or(0, |e| match e.role {
            0 => inputs[e.index as usize],
            _ => gouts[e.index as usize],
        });
    Seen {
        cl,
        sess_h,
        capture_phase,
        mb,
        bucket: ctx.bucket,
        pass,
        outputs,
        gins,
        pgrads,
        measuring,
        step_mb: ctx.step_microbatch,
        index: ctx.step_microbatch_index as usize,
        data,
        in_step,
    }
}

/// Where the call's pass stands: its position in the capture order and
/// its instance, the same in every call of the pass (each warmup
/// iteration, its capture, its clone slots', a step's, its hooks) and
/// another for every other pass (the instance shared by the passes of one
/// (callable, microbatch, bucket)); the instance by its formula where the
/// model knows the microbatches, the position by the default order where
/// the session has no schedule.
fn check_place(ctx: &graphed_pass_ctx, cb: &Cb) {
    let wd = w();
    let (pos, inst) = (ctx.capture_position, ctx.instance);
    {
        let ss = wd.sessions.borrow();
        let s = &ss[cb.sess];
        if s.mb != 0 {
            let want = instance_number(&s.callables, s.mb, cb.callable, ctx.microbatch, ctx.bucket);
            assert_eq!(inst, want, "ctx.instance");
        }
        if matches!(s.sched, Some(None)) {
            let want = default_position(&s.callables, cb.callable, ctx.bucket, ctx.pass);
            assert_eq!(Some(pos), want, "ctx.capture_position");
        }
    }
    let key = (cb.callable, ext_key(ctx.microbatch, ctx.bucket), ctx.pass);
    let mut fs = wd.frames.borrow_mut();
    let f = fs.last_mut().expect("a callback outside capture");
    for &(k, (p, i)) in &f.places {
        if k == key {
            assert_eq!((p, i), (pos, inst), "the place of pass {key:?} changed");
            return;
        }
        assert_ne!(p, pos, "passes {k:?} and {key:?} at one position");
        assert_eq!(
            (k.0, k.1) == (key.0, key.1),
            i == inst,
            "the instances of {k:?} and {key:?}"
        );
    }
    f.places.push((key, (pos, inst)));
}

/// Which WHILE step of the innermost capture's session (the k-th) the
/// loop body whose callback runs belongs to: steps are captured in order,
/// each loop with an index of its own.
fn loop_of(ctx: &graphed_pass_ctx) -> usize {
    let mut fs = w().frames.borrow_mut();
    let f = fs.last_mut().expect("a loop body outside capture");
    let ix = ctx.step_microbatch_index as usize;
    match f.loops.iter().position(|&x| x == ix) {
        Some(k) => k,
        None => {
            f.loops.push(ix);
            f.loops.len() - 1
        }
    }
}

/// Which microbatch of a step the call records: 0 of 1 outside the
/// capture of a step over several (and for hooks, which steps do not run,
/// and in warmup); under it, one of a count a step of this callable was
/// declared with, on the callable's first instance. In the body of the
/// k-th WHILE step (`loop_k`), 0 of the step's count, its index to read
/// on the device: returns that step.
fn check_step_microbatch(
    ctx: &graphed_pass_ctx,
    cb: &Cb,
    s: &Sess,
    loop_k: Option<usize>,
) -> Option<usize> {
    let (m, n) = (ctx.step_microbatch, ctx.step_microbatches);
    assert!(m < n, "step_microbatch {m} of {n}");
    if cb.hook || ctx.phase == 0 {
        assert_eq!((m, n), (0, 1), "step microbatch of a hook or a warmup call");
    }
    if let Some(k) = loop_k {
        assert!(
            !cb.hook && ctx.phase == 1,
            "step_microbatch_index outside a loop body's capture"
        );
        let si = s
            .steps
            .iter()
            .enumerate()
            .filter(|(_, st)| st.device_loop)
            .nth(k)
            .map(|(si, _)| si);
        let Some(si) = si else {
            panic!("loop body {k}: the session has fewer WHILE steps");
        };
        let st = &s.steps[si];
        assert!(
            st.callables.contains(&cb.callable),
            "the body of step {si} runs callable {}, not one of its",
            cb.callable
        );
        assert_eq!(
            (m, n, ctx.microbatch),
            (0, st.microbatches, 0),
            "a loop body's step microbatch (of step {si}) and instance"
        );
        return Some(si);
    }
    if n > 1 {
        assert!(
            s.steps.iter().any(|st| !st.device_loop
                && st.microbatches == n
                && st.callables.contains(&cb.callable)),
            "step_microbatches {n}: no unrolled step of callable {} has that many",
            cb.callable
        );
        assert_eq!(
            ctx.microbatch, 0,
            "a step's callables are their first instances"
        );
    }
    None
}
