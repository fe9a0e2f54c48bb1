//! Declaring a step (graphed_session_add_step) with fuzzed callables,
//! destinations and descriptor (and, from `op_add_step_io`, microbatches,
//! io copies, the loop mode, WHILE included, and the descriptor's layout),
//! checked in graphed's order against the model.

use super::*;

pub fn op_add_step() {
    add_step_with(false)
}

/// A step with a fuzzed microbatch count and io array, in a descriptor of
/// any layout since the first release (read after every other choice).
pub fn op_add_step_io() {
    add_step_with(true)
}

/// The fields a descriptor of `size` bytes holds past the first release's:
/// (io and its count, microbatches, loop_mode, the capture hook).
fn layout_holds(size: usize) -> (bool, bool, bool, bool) {
    (size >= 64, size >= 68, size >= 72, size >= 88)
}

fn add_step_with(ext: bool) {
    let wd = w();
    let i = &wd.input;
    let t = target_where(|s| s.st == St::Open && !s.callables.is_empty());
    let model = match t {
        Target::Live(k) => {
            let s = &wd.sessions.borrow()[k];
            Some((s.st, s.callables.clone(), s.sched.clone()))
        }
        _ => None,
    };
    let calls = model.as_ref().map_or(Vec::new(), |m| m.1.clone());
    let n = calls.len();
    // Usually an increasing subset of the callables.
    let mut cs: Vec<u32> = (0..n as u32).filter(|_| i.below(3) != 0).collect();
    if cs.is_empty() && n > 0 {
        cs.push(i.below(n) as u32);
    }
    match i.below(16) {
        0 => cs.clear(),
        1 => cs.push(i.pick(&[n as u32, u32::MAX])),
        2 if !cs.is_empty() => cs.push(cs[cs.len() - 1]),
        3 if cs.len() > 1 => cs.reverse(),
        _ => {}
    }
    let known = cs.iter().all(|&c| (c as usize) < n);
    let params: Vec<Param> = if known {
        cs.iter()
            .flat_map(|&c| calls[c as usize].params.clone())
            .collect()
    } else {
        Vec::new()
    };
    // A destination for every parameter (the library ignores those whose
    // policy needs none), aligned for ACCUMULATE_INTO.
    let mut dsts: Vec<usize> = params
        .iter()
        .map(|p| {
            if p.bytes <= 1 << 20 {
                mem(p.bytes, 0)
            } else {
                0x1000
            }
        })
        .collect();
    let mut dst_array = true;
    let mut dst_count_null = false;
    match i.below(12) {
        0 if !dsts.is_empty() => {
            let j = i.below(dsts.len());
            dsts[j] = 0;
        }
        1 => dsts.push(mem(8, 0)),
        2 if !dsts.is_empty() => dsts.pop().map_or((), |_| ()),
        3 => dst_array = false,
        4 if !dsts.is_empty() => dst_count_null = true,
        _ => {}
    }
    let mut d = graphed_step_desc_default();
    assert_eq!(
        (
            d.struct_size,
            d.magic,
            d.io,
            d.num_io,
            d.microbatches,
            d.loop_mode,
            d.capture_hook.is_none(),
            d.capture_hook_data
        ),
        (
            size_of::<graphed_step_desc>(),
            GRAPHED_STEP_DESC_MAGIC,
            null(),
            0,
            1,
            0,
            true,
            null_mut()
        ),
        "graphed_step_desc_default"
    );
    d.callables = if cs.is_empty() && i.chance(60) {
        null()
    } else {
        cs.as_ptr()
    };
    d.num_callables = cs.len();
    let mut callables_null = false;
    if !cs.is_empty() && i.chance(10) {
        d.callables = null();
        callables_null = true;
    }
    if dst_array {
        d.param_dsts = if dst_count_null {
            null()
        } else {
            dsts.as_ptr().cast()
        };
        d.num_param_dsts = dsts.len();
    }
    let given = if dst_array {
        dsts.clone()
    } else {
        vec![0; params.len()]
    };
    // Sometimes a capture hook, sometimes failing before or after.
    let hook_mode = match i.below(8) {
        0 => 1,
        1 => 2,
        2 => 3,
        _ => 0,
    };
    if hook_mode != 0 {
        d.capture_hook = Some(step_hook);
        let sess = match t {
            Target::Live(k) => k,
            _ => 0,
        };
        d.capture_hook_data = hook_data(sess, hook_mode);
    }
    let mut struct_err = None;
    match i.below(16) {
        0 => {
            d.magic = 0x6772_0008;
            struct_err = Some(S::BadStruct);
        }
        1 => {
            d.struct_size = 40;
            struct_err = Some(S::BadStruct);
        }
        2 => d.struct_size = size_of::<graphed_step_desc>() + 8,
        _ => {}
    }
    // Microbatches, io and the layout: after every other choice.
    let mut io = None;
    let mut loop_bad = None;
    let mut at = (0, 0, 0);
    if ext {
        // Where the count, the loop mode and the layout are read (in the
        // trace: to write inputs that reach them).
        at.0 = i.pos.get();
        d.microbatches = fuzz_microbatches();
        let a = fuzz_io(&calls, &cs, d.microbatches);
        d.io = a.ptr;
        d.num_io = a.count;
        io = Some(a);
        // One byte: 240 and up a value that is no graphed_step_loop, 160
        // to 239 WHILE (the host backend emulates its loop), below that
        // UNROLLED (the default).
        at.1 = i.pos.get();
        match i.byte() {
            240.. => {
                d.loop_mode = i.pick(&[2, u32::MAX]);
                loop_bad = Some(d.loop_mode);
            }
            160.. => d.loop_mode = graphed_step_loop::While as u32,
            _ => {}
        }
        at.2 = i.pos.get();
        let size = i.pick(&[88, 88, 88, 72, 48, 56, 64, 68]);
        if struct_err.is_none() && d.struct_size == size_of::<graphed_step_desc>() {
            d.struct_size = size;
        }
    }
    let (io_read, mb_read, loop_read, hook_read) = layout_holds(d.struct_size);
    let hook_mode = if hook_read { hook_mode } else { 0 };
    // Kept until the call returns; what the library reads of it.
    let io_arg = io;
    let io = io_arg.as_ref().filter(|_| io_read && d.num_io > 0);
    let microbatches = if mb_read { d.microbatches } else { 1 };
    let loop_bad = loop_bad.filter(|_| loop_read);
    let device_loop = loop_read && d.loop_mode == graphed_step_loop::While as u32;
    let mut buf = vec![0u64; size_of::<graphed_step_desc>() / 8 + 2];
    // SAFETY: buf holds the struct.
    unsafe { (buf.as_mut_ptr() as *mut graphed_step_desc).write(d) };
    let desc: *const graphed_step_desc = if i.chance(8) {
        null()
    } else {
        buf.as_ptr().cast()
    };
    let out_null = i.chance(8);

    // Expected, in graphed's order.
    let mut want = None;
    first(&mut want, t.lookup());
    first(&mut want, out_null.then_some(S::NullPointer));
    first(&mut want, desc.is_null().then_some(S::NullPointer));
    first(&mut want, struct_err);
    first(&mut want, callables_null.then_some(S::NullPointer));
    first(&mut want, dst_count_null.then_some(S::InvalidArgument));
    let mut text: Option<String> = None;
    let mut refuse = |want: &mut Option<graphed_status>, r: Option<Refusal>| {
        if want.is_none() {
            if let Some((e, m)) = r {
                *want = Some(e);
                text = Some(m);
            }
        }
    };
    refuse(&mut want, io.and_then(|a| a.read_err.clone()));
    first(&mut want, t.lock());
    refuse(
        &mut want,
        loop_bad.map(|v| {
            let m = format!("desc.loop_mode: {v} is not a graphed_step_loop value");
            (S::InvalidArgument, m)
        }),
    );
    if let Some((st, calls, sched)) = &model {
        match st {
            St::Captured => first(&mut want, Some(S::WrongState)),
            St::Reset => first(&mut want, Some(S::SessionReset)),
            St::Open => {}
        }
        first(
            &mut want,
            (!matches!(sched, Some(None))).then_some(S::Incompatible),
        );
        first(&mut want, cs.is_empty().then_some(S::InvalidArgument));
        refuse(
            &mut want,
            match microbatches {
                0 => Some((S::InvalidArgument, "microbatches is 0".into())),
                m if m > GRAPHED_STEP_MAX_MICROBATCHES => Some((
                    S::InvalidArgument,
                    format!("microbatches is {m}: a step's graph holds at most 4096"),
                )),
                _ => None,
            },
        );
        for (k, &c) in cs.iter().enumerate() {
            // Callables are checked in order: an unknown one ends the checks.
            if c as usize >= calls.len() {
                first(&mut want, Some(S::InvalidArgument));
                break;
            }
            if k > 0 && c <= cs[k - 1] {
                first(&mut want, Some(S::InvalidArgument));
            }
        }
        first(
            &mut want,
            (given.len() != params.len()).then_some(S::InvalidArgument),
        );
        if let Some(a) = io {
            refuse(&mut want, io_refusal(calls, &cs, microbatches, &a.entries));
        }
    }
    let mut index = 0xabcd_u32;
    trace!(
        "add_step {t:?} callables {cs:?} dsts {given:?} size {} mb {microbatches}{} io {:?} want {want:?} {text:?} (mb, loop, size read at {at:?})",
        d.struct_size,
        if device_loop { " WHILE" } else { "" },
        io.as_ref().map(|a| (a.count, &a.entries))
    );
    mark();
    // SAFETY: every pointer is NULL or to a live local of the stated size.
    let r = unsafe {
        graphed_session_add_step(
            t.ptr(),
            desc,
            if out_null { null_mut() } else { &mut index },
        )
    };
    expect(
        r,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_add_step",
        "step",
    );
    if r != S::Ok {
        assert_eq!(index, 0xabcd, "step index written on failure");
        if let Some(t) = text.filter(|_| want == Some(r)) {
            let m = msg();
            assert!(
                m.contains(&t),
                "graphed_session_add_step: {m:?} does not say {t:?}"
            );
        }
        return;
    }
    let Target::Live(k) = t else { unreachable!() };
    let mut ss = wd.sessions.borrow_mut();
    assert_eq!(index as usize, ss[k].steps.len(), "step index");
    ss[k].steps.push(StepModel {
        callables: cs.iter().map(|&c| c as usize).collect(),
        dsts: given,
        microbatches,
        io: io.map_or(Vec::new(), |a| a.entries.clone()),
        device_loop,
        hook: hook_mode,
    });
}
