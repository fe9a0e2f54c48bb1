//! Making a replay call: a new epoch for what the graph writes, the call
//! (the session pinned while it may run callbacks), and after a refusal
//! for the parameters' addresses alone, the check that it changed nothing
//! and the same replay again with the registered addresses.

use super::*;

/// Makes the replay `built` of `t`; returns its status and the epoch of
/// what it wrote.
pub(super) fn execute(
    t: Target,
    kind: u32,
    func: &str,
    built: &mut Built,
    e: &Expected,
) -> (graphed_status, u8) {
    let wd = w();
    let i = &wd.input;
    let Built {
        fault,
        sess,
        c,
        mb,
        ref cl,
        a,
        s0,
        s1,
        ref registered,
        ref pa,
        n1,
        n2,
        p1,
        p2,
        ref buf1,
        ref buf2,
        ref mut abuf,
        args,
        ..
    } = *built;
    let Expected {
        want,
        ref lenient,
        before_params,
        params_err,
        after_params,
    } = *e;
    let mut epoch = EPOCH
        .load(Ordering::Relaxed)
        .wrapping_add(1 + i.below(200) as u8);
    EPOCH.store(epoch, Ordering::Relaxed);
    // Refused for the parameters' addresses alone: the instance's buffers
    // are kept to see that the refusal changed nothing.
    let refused_for_params = before_params.is_none() && params_err.is_some();
    let kept = match (refused_for_params, sess, &cl) {
        (true, Some(k), Some(cl)) => {
            let h = wd.sessions.borrow()[k].h as *mut graphed_session;
            Some(instance_bytes(h, c, mb, cl))
        }
        _ => None,
    };
    let call = |args: *const graphed_replay_args, want: Option<graphed_status>| {
        let _pin = sess.filter(|_| want.is_none()).map(pin);
        mark();
        // SAFETY: every array has the room the call is told about (or is
        // one of the faults graphed must catch before writing).
        unsafe {
            match kind {
                0 => graphed_forward(t.ptr(), args, p1.cast(), n1),
                1 => graphed_backward(t.ptr(), args, p1.cast(), n1, p2.cast(), n2),
                _ => graphed_backward_wgrad(t.ptr(), args, p1.cast(), n1),
            }
        }
    };
    let stats_of = |k: usize| {
        let mut st = graphed_session_stats_default();
        let h = wd.sessions.borrow()[k].h as *mut graphed_session;
        // SAFETY: a full stats struct.
        let r = unsafe { graphed_session_stats_get(h, &mut st) };
        expect(r, &[S::Ok], "graphed_session_stats_get", "around a replay");
        st
    };
    let stats_before = kept.as_ref().map(|_| stats_of(sess.unwrap()));
    trace!("{func} {t:?} c {c} mb {mb} fault {fault:?} params {:?} streams {s0:x}/{s1:x} want {want:?}", pa.as_ref().map(|p| (p.mode, p.count, p.moved)));
    let mut r = call(args, want);
    let mut ok = vec![want.unwrap_or(S::Ok)];
    if want.is_none() {
        ok.extend(lenient.iter().copied());
    }
    trace!("{func} -> {r:?}");
    expect(r, &ok, func, &format!("{fault:?}"));
    if let (Some(kept), Some(pa)) = (&kept, &pa) {
        // Refused for the parameters: nothing was enqueued, nothing
        // written, nothing counted.
        pa.check_message(r, func, |j| j);
        assert!(
            buf1.iter().all(|&b| b == 0xab) && buf2.iter().all(|&b| b == 0xab),
            "{func} wrote refs on failure"
        );
        let k = sess.unwrap();
        let h = wd.sessions.borrow()[k].h as *mut graphed_session;
        assert!(
            instance_bytes(h, c, mb, cl.as_ref().unwrap()) == *kept,
            "{func} refused for its parameters' addresses ({r:?}) but changed the instance's buffers"
        );
        let after = stats_of(k);
        let before = stats_before.unwrap();
        assert_eq!(
            (
                after.param_moves,
                after.clone_blocks_outstanding,
                after.leases_held
            ),
            (
                before.param_moves,
                before.clone_blocks_outstanding,
                before.leases_held
            ),
            "{func} refused for its parameters' addresses but changed the stats"
        );
        // The same replay with the registered addresses goes through as
        // if the refused one had not been made.
        let again = ParamsArg::registered(registered);
        let mut a2 = a;
        a2.params = again.ptr;
        a2.num_params = again.count;
        // SAFETY: abuf holds the struct.
        unsafe { (abuf.as_mut_ptr() as *mut graphed_replay_args).write(a2) };
        epoch = EPOCH
            .load(Ordering::Relaxed)
            .wrapping_add(1 + i.below(200) as u8);
        EPOCH.store(epoch, Ordering::Relaxed);
        trace!("{func} again with the registered addresses, want {after_params:?}");
        r = call(abuf.as_ptr().cast(), after_params);
        let mut ok = vec![after_params.unwrap_or(S::Ok)];
        if after_params.is_none() {
            ok.extend(lenient.iter().copied());
        }
        trace!("{func} -> {r:?}");
        expect(r, &ok, func, "again with the registered addresses");
        drop(again);
    }
    (r, epoch)
}
