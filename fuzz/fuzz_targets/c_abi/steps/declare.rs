//! Declaring a step (graphed_session_add_step) with fuzzed callables,
//! destinations and descriptor, checked in graphed's order against the
//! model.

use super::*;

pub fn op_add_step() {
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
    first(&mut want, t.lock());
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
        for (k, &c) in cs.iter().enumerate() {
            // Callables are checked in order: an unknown one ends the checks.
            if c as usize >= calls.len() {
                first(&mut want, Some(S::InvalidArgument));
                break;
            }
            if k > 0 && c <= cs[k - 1] {
                first(&mut want, Some(S::InvalidArgument));
            }
            let external = callable_is_external(&calls[c as usize]);
            first(&mut want, external.then_some(S::Incompatible));
        }
        first(
            &mut want,
            (given.len() != params.len()).then_some(S::InvalidArgument),
        );
    }
    let mut index = 0xabcd_u32;
    trace!("add_step {t:?} callables {cs:?} dsts {given:?} want {want:?}");
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
        return;
    }
    let Target::Live(k) = t else { unreachable!() };
    let mut ss = wd.sessions.borrow_mut();
    assert_eq!(index as usize, ss[k].steps.len(), "step index");
    ss[k].steps.push(StepModel {
        callables: cs.iter().map(|&c| c as usize).collect(),
        dsts: given,
    });
}
