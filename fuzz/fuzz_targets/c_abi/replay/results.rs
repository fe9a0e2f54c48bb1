//! What a replay returned: nothing on failure (refs and destinations
//! untouched); on success its refs read back and checked by frozen policy
//! (aliases holding what the graph wrote, clones, COPY_INTO and
//! ACCUMULATE_INTO destinations), and the leases and clone block it hands
//! out taken into the model.

use super::*;

pub const REF: usize = size_of::<graphed_ref>();

pub struct RefView {
    pub ptr: usize,
    pub bytes: usize,
    pub kind: u32,
    pub owner: usize,
    pub lease: u64,
}

pub fn read_ref(buf: &[u8], at: usize) -> RefView {
    let u = |o: usize| usize::from_ne_bytes(buf[at + o..at + o + 8].try_into().unwrap());
    RefView {
        ptr: u(0),
        bytes: u(8),
        kind: u32::from_ne_bytes(buf[at + 16..at + 20].try_into().unwrap()),
        owner: u(24),
        lease: u(32) as u64,
    }
}

/// An f32 ACCUMULATE_INTO destination holds `before` plus the grad, every
/// element `b` repeated.
pub fn check_accumulated(before: &[u8], dst: usize, b: u8, what: &str) {
    // SAFETY: harness memory of before.len() bytes.
    let got = unsafe { std::slice::from_raw_parts(dst as *const u8, before.len()) };
    for e in 0..before.len() / 4 {
        let was = u32::from_ne_bytes(before[e * 4..e * 4 + 4].try_into().unwrap());
        let want = f32_add(was, u32::from_ne_bytes([b; 4]));
        let g = u32::from_ne_bytes(got[e * 4..e * 4 + 4].try_into().unwrap());
        assert!(
            g == want || (f32::from_bits(g).is_nan() && f32::from_bits(want).is_nan()),
            "{what}: ACCUMULATE_INTO element {e}: 0x{g:08x}, expected 0x{want:08x}"
        );
    }
}

pub fn f32_add(a: u32, b: u32) -> u32 {
    (f32::from_bits(a) + f32::from_bits(b)).to_bits()
}

/// A failed replay wrote no ref and changed no destination.
pub(super) fn check_untouched(built: &Built, func: &str) {
    let Built {
        ref buf1,
        ref buf2,
        ref acc_before,
        ref dsts,
        ..
    } = *built;
    assert!(
        buf1.iter().all(|&b| b == 0xab) && buf2.iter().all(|&b| b == 0xab),
        "{func} wrote refs on failure"
    );
    for (j, before) in acc_before.iter().enumerate() {
        if !before.is_empty() && dsts[j] != 0 {
            assert_eq!(
                // SAFETY: harness memory of this size.
                unsafe { std::slice::from_raw_parts(dsts[j] as *const u8, before.len()) },
                &before[..],
                "{func} changed a destination on failure"
            );
        }
    }
}

/// Checks the refs of the successful replay `built` (of `kind`, writing
/// with `epoch`) and takes its leases and clone block into the model.
pub(super) fn check_results(kind: u32, func: &str, epoch: u8, built: Built) {
    let wd = w();
    let Built {
        sess,
        model,
        c,
        mb,
        cl,
        policies,
        returns_params,
        dsts,
        acc_before,
        n1,
        n2,
        buf1,
        buf2,
        stride,
        abuf,
        data,
        bucket_rows,
        ..
    } = built;
    // The bytes of a DYNAMIC tensor's ref: its actual rows when the host
    // chose the bucket (rows of bytes / largest bucket), whole when the
    // device did.
    let largest = cl.as_ref().and_then(|c| c.buckets.last().copied());
    let rows_bytes = |t: &Tensor| match (t.dynamic, largest, bucket_rows) {
        (true, Some(l), Some(FRows::Host(n))) => t.bytes / l as usize * n as usize,
        _ => t.bytes,
    };
    let k = sess.unwrap();
    let cl = cl.unwrap();
    // The external buffers it returns: those its bucket's capture provided.
    let bucket = bucket_run(&cl, bucket_rows);
    let ext_of = |role: u32, j: usize| {
        wd.ext
            .borrow()
            .get(&(k, c as usize, ext_key(mb, bucket), role, j))
            .copied()
    };
    let strict = model.as_ref().unwrap().3;
    // A size above the largest bucket chosen on the device: no bucket ran,
    // and the pass wrote zeros where it writes its results.
    let zeroed = matches!(bucket_rows, Some(FRows::Device(true)));
    let wrote = |b: u8| if zeroed { 0 } else { b ^ epoch };
    // ---- results ----
    let refs1: Vec<RefView> = (0..n1).map(|j| read_ref(&buf1, j * stride)).collect();
    let refs2: Vec<RefView> = (0..n2).map(|j| read_ref(&buf2, j * stride)).collect();
    for buf in [&buf1, &buf2] {
        for j in 0..(buf.len() - 16) / stride.max(1) {
            assert!(
                buf[j * stride + REF..(j + 1) * stride]
                    .iter()
                    .all(|&b| b == 0xab),
                "a ref written past its {REF} bytes"
            );
        }
    }
    let mut new_leases = Vec::new();
    // Destroyed when idle from inside this replay: the session went when the
    // call returned, and its static buffers (the aliases) with it.
    let gone = !wd.sessions.borrow()[k].alive;
    let mut check_alias = |r: &RefView, bytes: usize, b: u8, what: u8, j: usize| {
        assert_eq!(r.kind, 1, "{func}: {what}/{j} is not an ALIAS");
        assert_ne!(r.ptr, 0);
        assert_eq!(r.bytes, bytes);
        assert_eq!(r.owner, 0);
        assert_eq!(r.lease != 0, strict, "{func}: lease on {what}/{j}");
        assert!(
            gone || all_bytes(r.ptr, bytes, wrote(b)),
            "{func}: {what}/{j} does not hold what the graph wrote{}",
            if zeroed {
                " (zeros, above every bucket)"
            } else {
                ""
            }
        );
        if r.lease != 0 {
            // An external buffer is its bucket's own.
            let external = match what {
                0 => cl.outputs[j].external,
                1 => cl.inputs[j].external,
                _ => cl.params[j].external,
            };
            new_leases.push(Lease {
                sess: k,
                token: r.lease,
                slot: (c as usize, mb, what, j),
                bucket: external.then_some(bucket),
            });
        }
    };
    match kind {
        0 => {
            for (j, t) in cl.outputs.iter().enumerate() {
                check_alias(
                    &refs1[j],
                    rows_bytes(t),
                    seed(k, c as usize, mb, ROLE_OUT, j),
                    0,
                    j,
                );
                if t.external {
                    assert_eq!(
                        Some(refs1[j].ptr),
                        ext_of(ROLE_OUT, j),
                        "{func}: external output {j} (bucket {bucket}) is not the buffer provided"
                    );
                }
            }
        }
        1 => {
            for (j, t) in cl.inputs.iter().enumerate() {
                if t.grad {
                    check_alias(
                        &refs1[j],
                        rows_bytes(t),
                        seed(k, c as usize, mb, ROLE_GIN, j),
                        1,
                        j,
                    );
                    if t.external {
                        assert_eq!(
                            Some(refs1[j].ptr),
                            ext_of(ROLE_GIN, j),
                            "{func}: external grad of input {j} (bucket {bucket}) is not the buffer provided"
                        );
                    }
                } else {
                    let r = &refs1[j];
                    assert_eq!(
                        (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                        (0, 0, 0, 0, 0),
                        "input {j} without grad"
                    );
                }
            }
        }
        _ => {}
    }
    let mut block: Option<HeldBlock> = None;
    let param_refs = if kind == 2 { &refs1 } else { &refs2 };
    if kind >= 1 {
        for (j, p) in cl.params.iter().enumerate() {
            let r = &param_refs[j];
            let pol = if returns_params { policies[j] } else { 0 };
            let b = wrote(seed(k, c as usize, mb, ROLE_PARAM, j));
            match pol {
                0 => assert_eq!(
                    (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                    (0, 0, 0, 0, 0),
                    "param {j}: NONE"
                ),
                1 => {
                    assert_eq!(r.kind, 2, "param {j}: CLONE");
                    assert!(r.owner != 0 && r.ptr != 0 && r.bytes == p.bytes && r.lease == 0);
                    assert!(
                        all_bytes(r.ptr, p.bytes, b),
                        "param {j}: the clone does not hold the grad"
                    );
                    let blk = block.get_or_insert(HeldBlock {
                        owner: r.owner,
                        refs: 0,
                        sess: k,
                        grads: Vec::new(),
                        words: Vec::new(),
                        inst: (c as usize, mb),
                        slot: false,
                    });
                    assert_eq!(
                        blk.owner, r.owner,
                        "the clones of one replay have different owners"
                    );
                    blk.refs += 1;
                    blk.grads.push((r.ptr, r.bytes, b));
                }
                2 => {
                    let pb = seed(k, c as usize, mb, ROLE_PARAM, j);
                    check_alias(r, p.bytes, pb, 2, j);
                }
                3 => {
                    assert_eq!(
                        (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                        (3, dsts[j], p.bytes, 0, 0),
                        "param {j}: COPY_INTO"
                    );
                    assert!(
                        all_bytes(r.ptr, p.bytes, b),
                        "param {j}: COPY_INTO destination"
                    );
                }
                _ => {
                    assert_eq!(
                        (r.kind, r.ptr, r.bytes, r.owner, r.lease),
                        (4, dsts[j], p.bytes, 0, 0),
                        "param {j}: ACCUMULATE_INTO"
                    );
                    if p.dtype == 0 {
                        check_accumulated(&acc_before[j], dsts[j], b, &format!("param {j}"));
                    }
                }
            }
        }
    }
    // Leases: never one on a slot the caller still holds.
    for l in &new_leases {
        let held = wd
            .leases
            .borrow()
            .iter()
            .any(|h| h.sess == k && h.slot == l.slot && h.bucket == l.bucket);
        assert!(
            !held,
            "{func} handed out a second lease on {:?} while the first is held",
            l.slot
        );
        assert!(
            !wd.leases
                .borrow()
                .iter()
                .any(|h| h.sess == k && h.token == l.token),
            "a lease token was handed out twice"
        );
        if !waived("lease-cross-session") {
            let other = wd
                .leases
                .borrow()
                .iter()
                .find(|h| h.sess != k && h.token == l.token)
                .map(|h| h.sess);
            assert!(
                other.is_none(),
                "{func}: session {k} handed out lease 0x{:x}, a token session {} holds too: either session can release the other's lease",
                l.token,
                other.unwrap()
            );
        }
    }
    wd.leases.borrow_mut().extend(new_leases);
    if let Some(b) = block {
        assert!(
            !wd.blocks.borrow().iter().any(|x| x.owner == b.owner),
            "a clone block handle was reused"
        );
        wd.blocks.borrow_mut().push(b);
    }
    forget_if_gone(k);
    let _ = (abuf, data, dsts);
}
