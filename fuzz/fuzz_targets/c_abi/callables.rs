//! Callables: fuzzed descriptors (tensors, parameters, flags, policies,
//! sizes) registered and modelled, and parameter flags set afterwards.

use super::*;

pub const SMALL: [usize; 8] = [1, 2, 3, 4, 8, 16, 64, 256];

pub fn fuzz_bytes(dsize: usize) -> (usize, bool) {
    let i = &w().input;
    if i.chance(24) {
        let b = i.pick(&[
            0,
            3,
            1 << 48,
            (1 << 48) + 8,
            1 << 63,
            usize::MAX - 3,
            usize::MAX,
            1 << 41,
            1 << 47,
        ]);
        let ok = b != 0 && b <= 1 << 48 && b % dsize == 0;
        return (b, ok);
    }
    (SMALL[i.below(SMALL.len())] * dsize, true)
}

pub const T_SIZE: usize = size_of::<graphed_tensor_desc>();
pub const P_SIZE: usize = size_of::<graphed_param_desc>();

/// Writes `n` structs of type T at stride `stride` into a fresh buffer.
pub fn array_of<T: Copy>(items: &[T], stride: usize) -> Vec<u64> {
    let mut buf = vec![0u64; (items.len() * stride).div_ceil(8) + 1];
    for (k, t) in items.iter().enumerate() {
        // SAFETY: element k lies inside buf; stride >= size_of::<T>().
        unsafe {
            ((buf.as_mut_ptr() as *mut u8).add(k * stride) as *mut T).write_unaligned(*t);
            ((buf.as_mut_ptr() as *mut u8).add(k * stride) as *mut usize).write_unaligned(stride);
        }
    }
    buf
}

pub unsafe extern "C" fn cb_forward(ctx: *const graphed_pass_ctx, ud: *mut c_void) -> i32 {
    callback(ctx, ud, 0)
}
pub unsafe extern "C" fn cb_backward(ctx: *const graphed_pass_ctx, ud: *mut c_void) -> i32 {
    callback(ctx, ud, 1)
}
pub unsafe extern "C" fn cb_wgrad(ctx: *const graphed_pass_ctx, ud: *mut c_void) -> i32 {
    callback(ctx, ud, 2)
}
pub unsafe extern "C" fn cb_hook(ctx: *const graphed_pass_ctx, ud: *mut c_void) -> i32 {
    callback(ctx, ud, 9)
}

pub fn op_add_callable() {
    let wd = w();
    let i = &wd.input;
    let t = target();
    let mut tensors: Vec<Vec<graphed_tensor_desc>> = vec![Vec::new(), Vec::new()];
    let mut models: Vec<Vec<Tensor>> = vec![Vec::new(), Vec::new()];
    let mut conv_err: Option<graphed_status> = None;
    let mut check_err: Option<graphed_status> = None;
    let mut bucket_err: Option<graphed_status> = None;
    let mut shapes: Vec<Vec<i64>> = Vec::new();
    // Buckets (graphed_callable_desc.bucket_sizes): none, a valid set, or
    // one refused where it is read (a pointer without a count, a count
    // without a pointer) or by the session's check (0, above 2^32 - 1, not
    // strictly ascending, over GRAPHED_MAX_BUCKETS).
    let bucket_pick = if i.chance(60) { 1 + i.below(12) } else { 0 };
    let bucket_store: Vec<u64> = match bucket_pick {
        0 => Vec::new(),
        1 | 2 => vec![4],
        3 => vec![1, 2, 4],
        4 => vec![2, 8],
        5 => vec![1, 3, 16],
        6 => vec![0, 4],
        7 => vec![4, 2],
        8 => vec![4, 4],
        9 => vec![1, 1 << 32],
        10 => (1..=257).collect(),
        11 => vec![8],
        _ => vec![1, 4],
    };
    let (bucket_ptr, num_buckets): (*const u64, usize) = match bucket_pick {
        0 => (null(), 0),
        // A pointer with no count, a count with no pointer.
        11 => (bucket_store.as_ptr(), 0),
        12 => (null(), 2),
        _ => (bucket_store.as_ptr(), bucket_store.len()),
    };
    let bucket_read_err = match bucket_pick {
        11 => Some(S::InvalidArgument),
        12 => Some(S::NullPointer),
        _ => None,
    };
    // What the session reads (when the read succeeds).
    let buckets: Vec<u64> = if num_buckets == 0 || bucket_read_err.is_some() {
        Vec::new()
    } else {
        bucket_store.clone()
    };
    let bucketed = !buckets.is_empty();
    let largest = buckets.last().copied().unwrap_or(0);
    let buckets_ok = bucketed
        && buckets.len() <= 256
        && buckets[0] != 0
        && largest <= u32::MAX as u64
        && buckets.windows(2).all(|p| p[0] < p[1]);
    // Shapes given to DYNAMIC tensors of a bucketed callable (set where the
    // tensor is made, so the shapes attached below leave them alone).
    let mut dyn_shapes: Vec<Vec<i64>> = Vec::new();
    // Per DYNAMIC tensor (flags 8, or 9 with EXTERNAL): its shape[0] is the
    // largest bucket.
    let mut dyn_first_ok: Vec<bool> = Vec::new();
    for (side, list) in tensors.iter_mut().enumerate() {
        for _ in 0..i.pick(&[1, 1, 2, 0, 3]) {
            let mut d = graphed_tensor_desc_default();
            d.dtype = i.pick(&[0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
            let ds = dtype_size(d.dtype);
            let (bytes, ok) = fuzz_bytes(ds);
            d.bytes = bytes;
            d.requires_grad = i.pick(&[1, 0, 1, 2]);
            // 8: DYNAMIC (refused without buckets; with EXTERNAL, 9, the
            // buffer each bucket's capture provides; with REBIND refused as
            // a combination); 4: rebound (an input, or an output's
            // grad-output; the host backend refuses at capture and copies,
            // which the replay checks below see). Chained inputs (2) are
            // covered by tests/chain_and_steps.rs, not here.
            d.flags = i.pick(&[0, 0, 0, 1, 8, 4, 5]);
            if d.flags & 1 != 0 && bytes > 1 << 20 {
                // External memory must hold the buffer: keep those small.
                d.flags &= !1;
            }
            if bucketed && d.flags == 0 && i.chance(100) {
                // Bucketed callables: DYNAMIC often.
                d.flags = 8;
            }
            if d.flags & 9 == 1 && i.chance(if bucketed && d.flags == 1 { 200 } else { 24 }) {
                // EXTERNAL and DYNAMIC together (9): on a bucketed callable
                // mostly, each bucket's capture providing its own buffer;
                // without buckets refused as DYNAMIC alone is; with REBIND
                // too (13) refused as the flags are read.
                d.flags |= 8;
            }
            // DYNAMIC as the flags are read: alone or with EXTERNAL.
            let dynamic_ok = d.flags == 8 || d.flags == 9;
            let mut shape_err = None;
            match i.below(8) {
                0 => {
                    // A shape that holds the bytes.
                    let elems = bytes / ds.max(1);
                    shapes.push(vec![1, elems as i64]);
                }
                1 => shapes.push(vec![2, 3, -1]),
                2 => shapes.push(vec![i64::MAX, i64::MAX]),
                3 => {
                    d.ndim = 2;
                    shape_err = Some(S::NullPointer);
                }
                _ => {}
            }
            if dynamic_ok && bucketed && d.ndim == 0 && ds > 0 {
                // A shape whose first dimension is the largest bucket when
                // the elements divide (else [elements] or [1, elements]).
                let elems = (bytes / ds) as u64;
                let s: Vec<i64> = if elems % largest == 0 && elems > 0 && !i.chance(20) {
                    vec![largest as i64, (elems / largest) as i64]
                } else if i.chance(128) {
                    vec![elems as i64]
                } else {
                    vec![1, elems as i64]
                };
                dyn_first_ok.push(s[0] as u64 == largest);
                d.ndim = s.len() as u32;
                d.shape = s.as_ptr();
                let holds = s
                    .iter()
                    .try_fold(
                        1u64,
                        |a, &x| if x < 0 { None } else { a.checked_mul(x as u64) },
                    )
                    .and_then(|p| p.checked_mul(ds as u64))
                    == Some(bytes as u64);
                if !holds && d.dtype <= 8 {
                    check_err.get_or_insert(S::InvalidArgument);
                }
                dyn_shapes.push(s);
            } else if dynamic_ok && bucketed {
                // No readable shape, or one given above: the first
                // dimension is not known to be the largest bucket.
                dyn_first_ok.push(false);
            }
            // In the library's order: flags, shape, dtype, requires_grad.
            // Unknown bits, and DYNAMIC (8) with CHAINED or REBIND, are
            // refused as the flags are read (with EXTERNAL it is not).
            if d.flags & !15 != 0 || (d.flags & 8 != 0 && d.flags & 6 != 0) {
                conv_err.get_or_insert(S::InvalidArgument);
            }
            if dynamic_ok && !bucketed {
                // DYNAMIC (alone or with EXTERNAL): refused after every
                // tensor's own checks, since the callable has no buckets.
                bucket_err = Some(S::InvalidArgument);
            }
            if let Some(e) = shape_err {
                conv_err.get_or_insert(e);
            }
            if d.dtype > 8 || d.requires_grad > 1 {
                conv_err.get_or_insert(S::InvalidArgument);
            }
            if d.flags & 8 == 0 && i.chance(60) {
                // The dimensions a DYNAMIC tensor varies on, set on one
                // that is not: refused after its other fields are read.
                match i.below(2) {
                    0 => d.dynamic_dim = i.pick(&[1, 2, GRAPHED_DIM_NONE]),
                    _ => d.dynamic_dim2 = i.pick(&[0, 1]),
                }
                conv_err.get_or_insert(S::InvalidArgument);
            }
            let valid = ok && d.dtype <= 8 && bytes % ds == 0;
            if !valid {
                check_err.get_or_insert(S::InvalidArgument);
            }
            if side == 0 && i.chance(40) && valid && bytes <= 1 << 20 {
                d.sample = mem(bytes, 0) as *const c_void;
            }
            models[side].push(Tensor {
                bytes,
                grad: d.requires_grad == 1,
                external: d.flags & 1 != 0,
                dynamic: d.flags & 8 != 0,
            });
            list.push(d);
        }
    }
    if bucketed {
        // check_buckets: the set, a DYNAMIC tensor, their first dimension.
        if !buckets_ok || dyn_first_ok.is_empty() || dyn_first_ok.iter().any(|&x| !x) {
            bucket_err = Some(S::InvalidArgument);
        }
    }
    // Shapes: attach each fuzzed shape to a random tensor (its product is
    // checked against the bytes).
    let mut shape_store: Vec<Vec<i64>> = Vec::new();
    for s in shapes {
        let side = i.below(2);
        if tensors[side].is_empty() {
            continue;
        }
        let k = i.below(tensors[side].len());
        if tensors[side][k].ndim != 0 {
            continue;
        }
        let d = &mut tensors[side][k];
        let ds = dtype_size(d.dtype);
        let prod = s.iter().try_fold(
            1u64,
            |a, &x| if x < 0 { None } else { a.checked_mul(x as u64) },
        );
        let holds = prod.and_then(|p| p.checked_mul(ds as u64)) == Some(d.bytes as u64);
        d.ndim = s.len() as u32;
        d.shape = s.as_ptr();
        if !holds && d.dtype <= 8 {
            check_err.get_or_insert(S::InvalidArgument);
        }
        shape_store.push(s);
    }
    let mut params = Vec::new();
    let mut pmodels = Vec::new();
    let mut param_err: Option<graphed_status> = None;
    for _ in 0..i.pick(&[1, 2, 0, 3, 1]) {
        let mut p = graphed_param_desc_default();
        p.dtype = i.pick(&[0, 0, 1, 2, 3, 6, 9]);
        let ds = dtype_size(p.dtype);
        let (bytes, ok) = fuzz_bytes(ds);
        p.bytes = bytes;
        p.flags = i.pick(&[0, 0, 0, 1, 2, 3, 4]);
        if p.flags == 4 {
            // REBIND, alone or with the others, REBIND_GRAD (valid with
            // COPY_INTO only), or an unknown bit: a second choice, so that
            // the inputs that picked the others read as before.
            p.flags = i.pick(&[4, 4, 5, 6, 7, 8, 12, 10, 16]);
        }
        if bytes > 1 << 20 {
            p.flags &= !2;
        }
        p.policy = i.pick(&[0, 0, 1, 2, 3, 4, 4, 5]);
        p.requires_grad = i.pick(&[1, 1, 0, 2]);
        if !i.chance(8) {
            p.data = mem(bytes.min(1 << 16), 0) as *mut c_void;
        }
        if p.dtype > 8 || p.requires_grad > 1 || p.flags & !15 != 0 || p.policy > 4 {
            conv_err.get_or_insert(S::InvalidArgument);
        }
        let valid = ok
            && bytes % ds == 0
            && !(p.policy == 4 && !matches!(p.dtype, 0..=2))
            && !(p.requires_grad == 0 && p.policy != 0)
            && !(p.flags & 8 != 0 && p.policy != 3);
        if !valid {
            param_err.get_or_insert(S::InvalidArgument);
        } else if p.data.is_null() {
            param_err.get_or_insert(S::NullPointer);
        }
        pmodels.push(Param {
            bytes,
            dtype: p.dtype,
            grad: p.requires_grad == 1,
            delayed: p.flags & 1 != 0,
            external: p.flags & 2 != 0,
            policy: p.policy,
            rebind: p.flags & 4 != 0,
            data: p.data as usize,
        });
        params.push(p);
    }
    let wgrad = i.chance(50);
    let idx_sess = match t {
        Target::Live(k) | Target::Dead(k) => k,
        _ => usize::MAX,
    };
    let n_callables = if idx_sess != usize::MAX {
        wd.sessions.borrow()[idx_sess].callables.len()
    } else {
        0
    };
    let scratch = i.pick(&[0, 0, 64, 1000, 4096]);
    let mk = |hook: bool| {
        let b = Box::new(Cb {
            sess: idx_sess,
            callable: n_callables,
            scratch,
            hook,
        });
        let p = &*b as *const Cb as *mut c_void;
        wd.cbs.borrow_mut().push(b);
        p
    };
    let mut d = graphed_callable_desc_default();
    d.forward = Some(cb_forward);
    d.backward = Some(cb_backward);
    if wgrad {
        d.wgrad = Some(cb_wgrad);
    }
    d.user_data = mk(false);
    if i.chance(60) {
        d.pre_hook = Some(cb_hook);
        d.post_hook = Some(cb_hook);
        d.hook_data = mk(true);
    }
    let names: [&[u8]; 3] = [b"layer\0", b"\xc3\x28\0", b"\0"];
    let name_pick = i.below(8);
    if name_pick < 3 {
        d.name = names[name_pick].as_ptr().cast();
    }
    // Arrays, with their strides.
    let stride_t = T_SIZE + 8 * i.pick(&[0, 0, 0, 1, 2]);
    let stride_p = P_SIZE + 8 * i.pick(&[0, 0, 0, 1]);
    let tin = array_of(&tensors[0], stride_t);
    let tout = array_of(&tensors[1], stride_t);
    let mut tpar = array_of(&params, stride_p);
    d.num_inputs = tensors[0].len();
    d.inputs = tin.as_ptr().cast();
    d.num_outputs = tensors[1].len();
    d.outputs = tout.as_ptr().cast();
    d.num_params = params.len();
    d.params = tpar.as_ptr().cast();
    d.bucket_sizes = bucket_ptr;
    d.num_buckets = num_buckets;
    let mut array_err: Option<graphed_status> = None;
    match i.below(24) {
        0 => {
            d.inputs = null();
            d.num_inputs = d.num_inputs.max(1);
            array_err = Some(S::NullPointer);
        }
        1 if !params.is_empty() => {
            // SAFETY: the first element's magic, inside tpar.
            unsafe { ((tpar.as_mut_ptr() as *mut u8).add(8) as *mut u32).write_unaligned(0xdead) };
            array_err = Some(S::BadStruct);
        }
        2 if params.len() > 1 => {
            // SAFETY: the second element's struct_size, inside tpar.
            unsafe {
                ((tpar.as_mut_ptr() as *mut u8).add(stride_p) as *mut usize)
                    .write_unaligned(stride_p + 8)
            };
            array_err = Some(S::BadStruct);
        }
        3 if !params.is_empty() => {
            d.num_params = usize::MAX / 64;
            array_err = Some(S::InvalidArgument);
        }
        4 if !params.is_empty() => {
            // SAFETY: as in 1.
            unsafe { (tpar.as_mut_ptr() as *mut usize).write_unaligned(16) };
            array_err = Some(S::BadStruct);
        }
        _ => {}
    }
    let mut cb_err = None;
    match i.below(24) {
        0 => {
            d.forward = None;
            cb_err = Some(S::NullPointer);
        }
        1 => {
            d.backward = None;
            cb_err = Some(S::NullPointer);
        }
        _ => {}
    }
    let mut desc_buf = vec![0u64; size_of::<graphed_callable_desc>() / 8 + 2];
    let shape = i.below(20);
    let mut struct_err = None;
    match shape {
        0 => {
            d.magic = 0x6772_0001;
            struct_err = Some(S::BadStruct);
        }
        1 => {
            d.struct_size = 100;
            struct_err = Some(S::BadStruct);
        }
        2 => d.struct_size = usize::MAX,
        _ => {}
    }
    // shape 5: the descriptor at an address 4 bytes off its alignment.
    let off = if shape == 5 { 4 } else { 0 };
    // SAFETY: desc_buf holds the struct with 16 spare bytes.
    unsafe {
        ((desc_buf.as_mut_ptr() as *mut u8).add(off) as *mut graphed_callable_desc)
            .write_unaligned(d)
    };
    let desc_arg: *const graphed_callable_desc = if shape == 3 {
        null()
    } else {
        // SAFETY: inside desc_buf.
        unsafe { (desc_buf.as_ptr() as *const u8).add(off) }.cast()
    };
    let out_null = shape == 4;

    // Expected, in graphed's order.
    let mut want = None;
    first(&mut want, t.lookup());
    first(&mut want, out_null.then_some(S::NullPointer));
    first(&mut want, desc_arg.is_null().then_some(S::NullPointer));
    first(&mut want, struct_err);
    first(&mut want, (name_pick == 1).then_some(S::InvalidArgument));
    first(&mut want, array_err);
    first(&mut want, bucket_read_err);
    first(&mut want, cb_err);
    first(&mut want, conv_err);
    first(&mut want, t.lock());
    let state = if let Target::Live(k) = t {
        Some(wd.sessions.borrow()[k].st)
    } else {
        None
    };
    match state {
        Some(St::Captured) => first(&mut want, Some(S::WrongState)),
        Some(St::Reset) => first(&mut want, Some(S::SessionReset)),
        _ => {}
    }
    first(&mut want, check_err);
    first(&mut want, bucket_err);
    first(&mut want, param_err);
    if wgrad && !pmodels.iter().any(|p| p.grad) {
        first(&mut want, Some(S::InvalidArgument));
    }
    let mut index: u32 = 0xabcd;
    trace!("add_callable {t:?} inputs {:?} outputs {:?} params {pmodels:?} wgrad {wgrad} want {want:?}", models[0], models[1]);
    mark();
    // SAFETY: every pointer is to a live local buffer of the stated size.
    let st = unsafe {
        graphed_session_add_callable(
            t.ptr(),
            desc_arg,
            if out_null { null_mut() } else { &mut index },
        )
    };
    drop((
        tin,
        tout,
        tpar,
        desc_buf,
        shape_store,
        dyn_shapes,
        bucket_store,
    ));
    expect(
        st,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_add_callable",
        "descriptor",
    );
    if st != S::Ok {
        assert_eq!(index, 0xabcd, "index written on failure");
        return;
    }
    let Target::Live(k) = t else { unreachable!() };
    assert_eq!(index as usize, n_callables, "callable index");
    assert!(
        buckets.is_empty() || models.iter().flatten().any(|t| t.dynamic),
        "buckets accepted without a DYNAMIC tensor"
    );
    wd.sessions.borrow_mut()[k].callables.push(Callable {
        inputs: models[0].clone(),
        outputs: models[1].clone(),
        params: pmodels,
        wgrad,
        buckets,
    });
}

pub fn op_set_param_flags() {
    let wd = w();
    let i = &wd.input;
    let t = target();
    let c = i.below(4) as u32;
    let p = i.below(4) as u32;
    let mut flags = i.pick(&[0, 1, 2, 3, 4, 0x80]);
    if flags == 4 {
        // As in op_add_callable: REBIND and its combinations are a second
        // choice.
        flags = i.pick(&[4, 4, 5, 6, 7, 8, 16]);
    }
    if let Target::Live(k) = t {
        // External memory must hold the buffer: keep those small.
        let big = wd.sessions.borrow()[k]
            .callables
            .get(c as usize)
            .and_then(|cl| cl.params.get(p as usize))
            .is_some_and(|pm| pm.bytes > 1 << 20);
        if big {
            flags &= !2;
        }
    }
    let mut want = if flags & !15 != 0 {
        Some(S::InvalidArgument)
    } else {
        None
    };
    want = want.or(t.lock());
    let mut ok_model = None;
    if want.is_none() {
        let Target::Live(k) = t else { unreachable!() };
        let ss = wd.sessions.borrow();
        let s = &ss[k];
        want = match s.st {
            St::Captured => Some(S::WrongState),
            St::Reset => Some(S::SessionReset),
            St::Open => match s.callables.get(c as usize) {
                None => Some(S::InvalidArgument),
                Some(cl) if p as usize >= cl.params.len() => Some(S::InvalidArgument),
                // REBIND_GRAD writes into the COPY_INTO destination.
                Some(cl) if flags & 8 != 0 && cl.params[p as usize].policy != 3 => {
                    Some(S::InvalidArgument)
                }
                Some(_) => {
                    ok_model = Some(k);
                    None
                }
            },
        };
    }
    mark();
    let st = graphed_session_set_param_flags(t.ptr(), c, p, flags);
    expect(
        st,
        &[want.unwrap_or(S::Ok)],
        "graphed_session_set_param_flags",
        "flags",
    );
    if let (S::Ok, Some(k)) = (st, ok_model) {
        let mut ss = wd.sessions.borrow_mut();
        let pm = &mut ss[k].callables[c as usize].params[p as usize];
        pm.delayed = flags & 1 != 0;
        pm.external = flags & 2 != 0;
        pm.rebind = flags & 4 != 0;
    }
}
