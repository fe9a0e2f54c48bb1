//! The arguments of a replay, read from the input: the fault to inject,
//! callable and microbatch, streams, data, parameter destinations, the
//! parameters' addresses, the ref arrays and the args struct itself.

use super::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fault {
    None,
    ArgsNull,
    Magic,
    Small,
    BigSize,
    DataNull,
    DataCount,
    DataEntry,
    DstsMissing,
    DstNull,
    DstMisaligned,
    OutCount,
    OutNull,
    RefSmall,
    RefOdd,
    RefBig,
    Callable,
    Microbatch,
    OutMisaligned,
    DstCount,
}

pub const FAULTS: [Fault; 20] = [
    Fault::None,
    Fault::ArgsNull,
    Fault::Magic,
    Fault::Small,
    Fault::BigSize,
    Fault::DataNull,
    Fault::DataCount,
    Fault::DataEntry,
    Fault::DstsMissing,
    Fault::DstNull,
    Fault::DstMisaligned,
    Fault::OutCount,
    Fault::OutNull,
    Fault::RefSmall,
    Fault::RefOdd,
    Fault::RefBig,
    Fault::Callable,
    Fault::Microbatch,
    Fault::OutMisaligned,
    Fault::DstCount,
];

/// What the model knows of the replayed session: (state, callables,
/// microbatches, strict, reuse, clone, pool, caller allocator).
pub(super) type Model = (St, Vec<Callable>, u32, bool, bool, bool, usize, bool);

/// A replay's arguments, as built (the arrays the call is given point into
/// the vectors held here), and what building them decided.
pub(super) struct Built {
    pub fault: Fault,
    pub sess: Option<usize>,
    pub model: Option<Model>,
    pub c: u32,
    pub mb: u32,
    pub cl: Option<Callable>,
    pub n_first: usize,
    pub n_second: usize,
    pub policies: Vec<u32>,
    pub returns_params: bool,
    pub needs_dst: Vec<bool>,
    pub a: graphed_replay_args,
    pub s0: usize,
    pub s1: usize,
    pub st0: Option<graphed_status>,
    pub st1: Option<graphed_status>,
    pub data_n: usize,
    pub data: Vec<usize>,
    pub data_entry_bad: bool,
    pub np: usize,
    pub dsts: Vec<usize>,
    pub acc_before: Vec<Vec<u8>>,
    pub misaligned: bool,
    pub dst_null_bad: bool,
    pub dsts_given: bool,
    pub registered: Vec<usize>,
    pub pa: Option<ParamsArg>,
    pub stride: usize,
    pub n1: usize,
    pub n2: usize,
    pub buf1: Vec<u8>,
    pub buf2: Vec<u8>,
    pub p1: *mut u8,
    pub p2: *mut u8,
    pub p1_null: bool,
    pub out_misaligned: bool,
    pub abuf: Vec<u64>,
    pub struct_err: Option<graphed_status>,
    pub args: *const graphed_replay_args,
    /// args.size or args.device_size is set (as the library reads them).
    pub bucket_arg: bool,
    /// A bucketed callable's replay: the rows it runs (a forward's as
    /// given, a backward's its last forward's; None: no forward yet).
    pub bucket_rows: Option<FRows>,
}

/// Reads the arguments of a replay of `t` (see `replay_with`).
pub(super) fn build_args(
    t: Target,
    kind: u32,
    streams: Option<(usize, usize)>,
    params: bool,
) -> Built {
    let wd = w();
    let i = &wd.input;
    let fault = if i.chance(70) {
        FAULTS[1 + i.below(FAULTS.len() - 1)]
    } else {
        Fault::None
    };
    // What the model knows of the session.
    let sess = match t {
        Target::Live(k) => Some(k),
        _ => None,
    };
    let model = sess.map(|k| {
        let s = &wd.sessions.borrow()[k];
        (
            s.st,
            s.callables.clone(),
            s.mb,
            s.strict,
            s.reuse,
            s.clone,
            s.pool,
            s.custom_alloc,
        )
    });
    let ncall = model.as_ref().map_or(1, |m| m.1.len().max(1));
    let mut c = i.below(ncall) as u32;
    let mut mb = if let Some(m) = &model {
        i.below(m.2.max(1) as usize) as u32
    } else {
        0
    };
    if fault == Fault::Callable {
        c = i.pick(&[ncall as u32, u32::MAX]);
    }
    if fault == Fault::Microbatch {
        mb = model.as_ref().map_or(1, |m| m.2.max(1));
    }
    let cl = model.as_ref().and_then(|m| m.1.get(c as usize).cloned());
    let (n_first, n_second) = match &cl {
        None => (0, 0),
        Some(cl) => match kind {
            0 => (cl.outputs.len(), 0),
            1 => (cl.inputs.len(), cl.params.len()),
            // The weight-grad replay's one array is its first.
            _ => (cl.params.len(), 0),
        },
    };
    let clone = model.as_ref().is_some_and(|m| m.5);
    let policies: Vec<u32> = cl.as_ref().map_or(Vec::new(), |cl| {
        cl.params.iter().map(|p| p.resolved(clone)).collect()
    });
    let returns_params = match (&cl, kind) {
        (Some(cl), 1) => !cl.wgrad,
        (Some(_), 2) => true,
        _ => false,
    };
    let needs_dst: Vec<bool> = policies
        .iter()
        .map(|&p| returns_params && (p == 3 || p == 4))
        .collect();

    let mut a = graphed_replay_args_default();
    a.callable = c;
    a.microbatch = mb;
    let (s0, s1, st0, st1) = match streams {
        Some((s, side)) => {
            let cap = |h: usize| (h != 0 && stream_capturing(h)).then_some(S::StreamCapturing);
            (s, side, cap(s), cap(side))
        }
        None => {
            let (s, e) = stream_arg(true);
            let (side, e2) = if i.chance(40) {
                stream_arg(false)
            } else {
                (0, None)
            };
            (s, side, e, e2)
        }
    };
    a.stream = s0 as graphed_stream;
    a.side_stream = s1 as graphed_stream;
    // Data: copies of new inputs / grad outputs.
    let data_n = match (&cl, kind) {
        (Some(cl), 0) => cl.inputs.len(),
        (Some(cl), 1) => cl.outputs.len(),
        _ => 0,
    };
    let mut data: Vec<usize> = Vec::new();
    let use_data = kind != 2 && i.chance(128);
    if use_data {
        if let Some(cl) = &cl {
            for j in 0..data_n {
                let bytes = if kind == 0 {
                    cl.inputs[j].bytes
                } else {
                    cl.outputs[j].bytes
                };
                data.push(if bytes <= 1 << 20 {
                    mem(bytes, i.below(8))
                } else {
                    0x40
                });
            }
        }
    }
    // Some entries: the static buffer itself (no copy), or another one of
    // the session's buffers of the same size (chaining).
    if !data.is_empty() && i.chance(100) {
        if let (Some(k), Some(St::Captured)) = (sess, model.as_ref().map(|m| m.0)) {
            let h = wd.sessions.borrow()[k].h as *mut graphed_session;
            let role = if kind == 0 { 0 } else { 2 };
            let mut ptrs = vec![0usize; data.len()];
            // SAFETY: room for the stated count.
            let r = unsafe {
                graphed_session_buffers(
                    h,
                    c,
                    mb.min(model.as_ref().unwrap().2.saturating_sub(1)),
                    role,
                    ptrs.as_mut_ptr().cast(),
                    ptrs.len(),
                )
            };
            if r == S::Ok {
                for (j, &p) in ptrs.iter().enumerate() {
                    if p != 0 && i.chance(160) {
                        data[j] = p;
                    }
                }
            }
        }
    }
    let mut data_entry_bad = false;
    match fault {
        Fault::DataNull => {}
        Fault::DataCount => data.push(mem(4096, 0)),
        Fault::DataEntry => {
            let need: Vec<usize> = match (&cl, kind) {
                (Some(cl), 0) => (0..cl.inputs.len()).collect(),
                (Some(cl), 1) => (0..cl.outputs.len())
                    .filter(|&j| cl.outputs[j].grad)
                    .collect(),
                _ => Vec::new(),
            };
            if !need.is_empty() {
                if data.len() < data_n {
                    data = (0..data_n).map(|_| mem(8, 0)).collect();
                }
                data[need[i.below(need.len())]] = 0;
                data_entry_bad = true;
            }
        }
        _ => {}
    }
    if fault == Fault::DataNull {
        a.data = null();
        a.num_data = 1 + i.below(3);
    } else if !data.is_empty() || (use_data && fault != Fault::DataCount) {
        a.data = if data.is_empty() {
            8 as *const *const c_void
        } else {
            data.as_ptr().cast()
        };
        a.num_data = data.len();
    }
    // Destinations.
    let np = policies.len();
    let mut dsts: Vec<usize> = vec![0; np];
    let mut acc_before: Vec<Vec<u8>> = vec![Vec::new(); np];
    let mut misaligned = false;
    if let Some(cl) = &cl {
        for j in 0..np {
            if needs_dst[j] || (i.chance(20) && returns_params) {
                let p = &cl.params[j];
                let off = if policies[j] == 4 && needs_dst[j] && fault == Fault::DstMisaligned {
                    misaligned = true;
                    1
                } else if policies[j] == 4 {
                    0
                } else {
                    i.below(8)
                };
                let q = if p.bytes <= 1 << 20 {
                    mem(p.bytes, off)
                } else {
                    0x1000 + off
                };
                if q > 0x10000 {
                    // Start from a known value for accumulation.
                    // SAFETY: fresh harness memory of p.bytes.
                    unsafe { std::ptr::write_bytes(q as *mut u8, i.byte(), p.bytes) };
                    acc_before[j] =
                        unsafe { std::slice::from_raw_parts(q as *const u8, p.bytes) }.to_vec();
                }
                dsts[j] = q;
            }
        }
    }
    let mut dst_null_bad = false;
    if fault == Fault::DstNull {
        if let Some(j) = (0..np).find(|&j| needs_dst[j]) {
            dsts[j] = 0;
            dst_null_bad = true;
        }
    }
    if fault == Fault::DstCount {
        dsts.push(0);
    }
    let dsts_given = fault == Fault::DstCount
        || (fault != Fault::DstsMissing && (needs_dst.iter().any(|&x| x) || i.chance(20)));
    if dsts_given {
        a.param_dsts = if dsts.is_empty() {
            8 as *const *mut c_void
        } else {
            dsts.as_ptr().cast()
        };
        a.num_param_dsts = dsts.len();
    }
    // The parameters' addresses.
    let registered: Vec<usize> = cl
        .as_ref()
        .map_or(Vec::new(), |cl| cl.params.iter().map(|p| p.data).collect());
    let mut pa = params.then(|| {
        let bytes: Vec<usize> = cl
            .as_ref()
            .map_or(Vec::new(), |cl| cl.params.iter().map(|p| p.bytes).collect());
        params_arg(&registered, &bytes)
    });
    // The ref arrays.
    let mut stride = REF;
    match fault {
        Fault::RefSmall => stride = i.pick(&[0, 8, 39]),
        Fault::RefOdd => stride = 44,
        Fault::RefBig => stride = REF + 8 * (1 + i.below(3)),
        _ => {}
    }
    a.ref_size = stride;
    let (mut n1, n2) = (n_first, n_second);
    if fault == Fault::OutCount {
        n1 += 1;
    }
    let mut buf1 = vec![0xabu8; (n1 * stride.max(REF)) + 16];
    let mut buf2 = vec![0xabu8; (n2 * stride.max(REF)) + 16];
    let mut p1 = buf1.as_mut_ptr();
    let p2 = buf2.as_mut_ptr();
    let mut p1_null = false;
    if fault == Fault::OutNull && n1 > 0 {
        p1 = null_mut();
        p1_null = true;
    }
    let mut out_misaligned = false;
    if fault == Fault::OutMisaligned && n1 > 0 {
        // SAFETY: 4 bytes into buf1, which has 16 spare bytes.
        p1 = unsafe { p1.add(4) };
        out_misaligned = true;
    }
    // A bucket size, or device memory holding one. Not with the layout
    // before the parameters' addresses, which ends before them (the library
    // reads both as 0 then). On a callable without buckets either is
    // refused (INVALID_ARGUMENT as the replay resolves its instance).
    let old_layout = pa.as_ref().is_some_and(|pa| pa.mode == PMode::OldLayout);
    let mut bucket_arg = false;
    let mut bucket_rows: Option<FRows> = None;
    let buckets: Vec<u64> = cl.as_ref().map_or(Vec::new(), |c| c.buckets.clone());
    if !buckets.is_empty() {
        // A bucketed callable: mostly a size its replay takes (a forward's
        // within the buckets, a backward's its last forward's or 0), else
        // one refused, or the device's choice (never with the parameters'
        // addresses given; one above the largest bucket runs no bucket and
        // writes zeros).
        let largest = *buckets.last().unwrap();
        let (last, on_device) = {
            let ss = wd.sessions.borrow();
            let s = &ss[sess.unwrap()];
            (
                s.last_fwd.get(c as usize).copied().flatten(),
                s.bucket_device,
            )
        };
        let dev = |a: &mut graphed_replay_args| {
            let m = mem(8, 0);
            let v = i.below(largest as usize + 2) as u64;
            // SAFETY: harness memory of 8 bytes.
            unsafe { (m as *mut u64).write_unaligned(v) };
            a.device_size = m as *const u64;
        };
        match (kind, i.below(12)) {
            (0, 0..=6) => {
                a.size = if i.chance(3) { largest } else { 1 + i.below(largest as usize) as u64 };
            }
            (0, 7..=9) if pa.is_none() && (on_device || i.chance(4)) => dev(&mut a),
            (_, 0..=6) => {
                a.size = match last {
                    Some(FRows::Host(n)) if i.chance(2) => n,
                    _ => 0,
                };
            }
            (_, 7) => a.size = i.pick(&[0, 1, largest, largest + 1]),
            (_, 8) => a.size = i.pick(&[0, largest + 1, u64::MAX, 1 << 32]),
            (_, 9) => dev(&mut a),
            _ => {
                a.size = i.pick(&[1, largest]);
                dev(&mut a);
            }
        }
        if old_layout {
            a.size = 0;
            a.device_size = std::ptr::null();
        }
        bucket_arg = a.size != 0 || !a.device_size.is_null();
        bucket_rows = match kind {
            0 if !a.device_size.is_null() => {
                // SAFETY: harness memory of 8 bytes (dev above).
                let v = unsafe { (a.device_size as *const u64).read_unaligned() };
                Some(FRows::Device(v > largest))
            }
            0 => Some(FRows::Host(a.size)),
            _ => last,
        };
    } else if !old_layout && i.chance(24) {
        match i.below(4) {
            0 => a.size = 1,
            1 => a.size = i.pick(&[2, 4, 16, u64::MAX]),
            2 => a.device_size = mem(8, 0) as *const u64,
            _ => {
                a.size = 1;
                a.device_size = mem(8, 0) as *const u64;
            }
        }
        bucket_arg = true;
    }
    // The struct.
    let mut abuf = vec![0u64; size_of::<graphed_replay_args>() / 8 + 2];
    let mut struct_err = None;
    match fault {
        Fault::Magic => {
            a.magic = 0x6772_0006;
            struct_err = Some(S::BadStruct);
        }
        Fault::Small => {
            a.struct_size = 72;
            struct_err = Some(S::BadStruct);
        }
        Fault::BigSize => a.struct_size = usize::MAX,
        _ => {}
    }
    if let Some(pa) = &mut pa {
        if matches!(fault, Fault::Small | Fault::BigSize) {
            pa.neutral();
        }
        a.params = pa.ptr;
        a.num_params = pa.count;
        if pa.mode == PMode::OldLayout {
            // The layout before the parameters' addresses (and the
            // bucket size after them).
            a.struct_size = std::mem::offset_of!(graphed_replay_args, params);
        }
    }
    // SAFETY: abuf holds the struct.
    unsafe { (abuf.as_mut_ptr() as *mut graphed_replay_args).write(a) };
    let args: *const graphed_replay_args = if fault == Fault::ArgsNull {
        null()
    } else {
        abuf.as_ptr().cast()
    };
    Built {
        fault,
        sess,
        model,
        c,
        mb,
        cl,
        n_first,
        n_second,
        policies,
        returns_params,
        needs_dst,
        a,
        s0,
        s1,
        st0,
        st1,
        data_n,
        data,
        data_entry_bad,
        np,
        dsts,
        acc_before,
        misaligned,
        dst_null_bad,
        dsts_given,
        registered,
        pa,
        stride,
        n1,
        n2,
        buf1,
        buf2,
        p1,
        p2,
        p1_null,
        out_misaligned,
        abuf,
        struct_err,
        args,
        bucket_arg,
        bucket_rows,
    }
}
