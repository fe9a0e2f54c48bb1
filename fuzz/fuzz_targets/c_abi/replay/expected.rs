//! The status a replay must answer, worked out from the model in graphed's
//! order: the checks before the parameters' addresses, theirs, and those
//! after them (streams, leases), with what the model cannot rule out.

use super::*;

/// What a replay may also answer for reasons the model does not track: a
/// pool shared with another captured session replayed out of its order,
/// and a caller allocator refusing a clone block.
pub fn replay_lenient(pool: usize, custom: bool) -> Vec<graphed_status> {
    let sharing = w()
        .sessions
        .borrow()
        .iter()
        .filter(|s| s.alive && s.pool == pool && s.st == St::Captured)
        .count();
    let mut v = Vec::new();
    if sharing > 1 {
        v.push(S::WrongState);
    }
    if custom {
        v.push(S::OutOfMemory);
    }
    v
}

/// The status a replay must answer, and around the parameters' addresses.
pub(super) struct Expected {
    pub want: Option<graphed_status>,
    /// Also accepted when `want` (or `after_params`) is success.
    pub lenient: Vec<graphed_status>,
    /// The status before the parameters' addresses are checked.
    pub before_params: Option<graphed_status>,
    /// What the parameters' addresses give.
    pub params_err: Option<graphed_status>,
    /// What follows them (the stream and lease checks).
    pub after_params: Option<graphed_status>,
}

/// The expected status of the replay `built` of `t`.
pub(super) fn expected(t: Target, kind: u32, built: &Built) -> Expected {
    let wd = w();
    let Built {
        fault,
        sess,
        ref model,
        c,
        mb,
        ref cl,
        n_first,
        n_second,
        returns_params,
        ref needs_dst,
        a,
        st0,
        st1,
        data_n,
        ref data,
        data_entry_bad,
        np,
        ref dsts,
        misaligned,
        dst_null_bad,
        dsts_given,
        ref registered,
        ref pa,
        stride,
        n1,
        n2,
        p1_null,
        out_misaligned,
        struct_err,
        args,
        ..
    } = *built;
    let mut want: Option<graphed_status> = None;
    first(&mut want, t.lookup());
    first(&mut want, args.is_null().then_some(S::NullPointer));
    first(&mut want, struct_err);
    first(
        &mut want,
        (fault == Fault::DataNull).then_some(S::InvalidArgument),
    );
    first(&mut want, pa.as_ref().and_then(|p| p.pre_err));
    first(&mut want, t.lock());
    if cl.is_none() && sess.is_some() {
        first(&mut want, Some(S::InvalidArgument));
    }
    // check_out for each array.
    let check_out = |n: usize, expected: usize, null: bool, mis: bool| -> Option<graphed_status> {
        if n != expected {
            return Some(S::InvalidArgument);
        }
        if stride < 40 {
            return Some(S::InvalidArgument);
        }
        if n == 0 {
            return None;
        }
        if null {
            return Some(S::NullPointer);
        }
        if mis || stride % 8 != 0 {
            return Some(S::InvalidArgument);
        }
        None
    };
    first(&mut want, check_out(n1, n_first, p1_null, out_misaligned));
    first(&mut want, check_out(n2, n_second, false, false));
    let mut lenient: Vec<graphed_status> = Vec::new();
    // The status before the parameters' addresses are checked, what they
    // give, and what follows them (the stream and lease checks).
    let mut before_params = want;
    let mut params_err = None;
    let mut after_params: Option<graphed_status> = None;
    if let Some((st, _, mbs, strict, reuse, _, pool, custom)) = &model {
        match st {
            St::Open => first(&mut want, Some(S::WrongState)),
            St::Reset => first(&mut want, Some(S::SessionReset)),
            St::Captured => {}
        }
        // A released callable is refused before the replay's own checks.
        if *st == St::Captured && released(sess.unwrap(), c as usize) {
            first(&mut want, Some(S::CallableReleased));
        }
        let buckets = cl.as_ref().map_or(&[][..], |c| c.buckets.as_slice());
        if *st == St::Captured && !buckets.is_empty() {
            // resolve(), first of the replay's own checks: the callable and
            // microbatch, then the size (see replay/mod.rs).
            if fault == Fault::Microbatch || mb >= *mbs {
                first(&mut want, Some(S::InvalidArgument));
            }
            let largest = *buckets.last().unwrap();
            let (size, dev) = (a.size, !a.device_size.is_null());
            let last = wd.sessions.borrow()[sess.unwrap()].last_fwd[c as usize];
            let on_device = wd.sessions.borrow()[sess.unwrap()].bucket_device;
            let e = if kind != 0 {
                match last {
                    None => Some(S::WrongState),
                    Some(_) if dev => Some(S::InvalidArgument),
                    Some(FRows::Host(n)) if size != 0 && size != n => Some(S::InvalidArgument),
                    Some(FRows::Device(_)) if size != 0 => Some(S::InvalidArgument),
                    Some(_) => None,
                }
            } else if dev {
                (size != 0 || !on_device).then_some(S::InvalidArgument)
            } else {
                (size == 0 || size > largest).then_some(S::InvalidArgument)
            };
            first(&mut want, e);
        } else if built.bucket_arg {
            // size or device_size on a callable without buckets (or none).
            first(&mut want, Some(S::InvalidArgument));
        }
        if fault == Fault::Microbatch || mb >= *mbs {
            first(&mut want, Some(S::InvalidArgument));
        }
        let cl = cl.as_ref();
        match kind {
            0 | 1 => {
                if a.num_data > 0 || !a.data.is_null() {
                    if data.len() != data_n {
                        first(&mut want, Some(S::InvalidArgument));
                    }
                    if data_entry_bad {
                        first(&mut want, Some(S::InvalidArgument));
                    }
                }
            }
            _ => {
                if !cl.is_some_and(|c| c.wgrad) {
                    first(&mut want, Some(S::InvalidArgument));
                }
                if !a.data.is_null() {
                    first(&mut want, Some(S::InvalidArgument));
                }
            }
        }
        if returns_params {
            if !dsts_given {
                if needs_dst.iter().any(|&x| x) {
                    first(&mut want, Some(S::InvalidArgument));
                }
            } else if dst_null_bad || misaligned || dsts.len() != np {
                first(&mut want, Some(S::InvalidArgument));
            }
        }
        before_params = want;
        params_err = pa.as_ref().and_then(|p| p.check(registered, kind == 0));
        first(&mut want, params_err);
        first(&mut after_params, st0);
        first(&mut after_params, st1);
        if *strict && !*reuse {
            // Without reuse, a replay overwrites its own instance's aliases:
            // with buckets, those every bucket shares, and the external
            // buffers of the bucket it runs (each bucket's own).
            let bucket = cl.map(|cl| bucket_run(cl, built.bucket_rows));
            let held = wd.leases.borrow().iter().any(|l| {
                l.sess == sess.unwrap()
                    && l.slot.0 == c as usize
                    && l.slot.1 == mb
                    && (l.bucket.is_none() || l.bucket == bucket)
                    && match kind {
                        0 => l.slot.2 == 0,
                        1 => l.slot.2 == 1 || (l.slot.2 == 2 && !cl.is_some_and(|c| c.wgrad)),
                        _ => l.slot.2 == 2,
                    }
            });
            if held {
                first(&mut after_params, Some(S::AliasHeld));
            }
        } else if *strict {
            lenient.push(S::AliasHeld);
        }
        first(&mut want, after_params);
        lenient.extend(replay_lenient(*pool, *custom));
    }
    Expected {
        want,
        lenient,
        before_params,
        params_err,
        after_params,
    }
}
