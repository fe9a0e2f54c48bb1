//! Returned clone blocks and leases: release, retain and release on a
//! stream, of live, stale and forged handles.

use super::*;

pub fn op_buffer() {
    let wd = w();
    let i = &wd.input;
    let retain = i.chance(80);
    let n = wd.blocks.borrow().len();
    let ns = wd.stale_blocks.borrow().len();
    let (h, want, at) = match i.below(8) {
        0 => (0, if retain { S::NullPointer } else { S::Ok }, None),
        1 if ns > 0 => (
            wd.stale_blocks.borrow()[i.below(ns)],
            S::UseAfterDestroy,
            None,
        ),
        2 => {
            // A session handle is not a buffer.
            let ss = wd.sessions.borrow();
            if ss.is_empty() {
                (forged(), S::InvalidArgument, None)
            } else {
                (ss[i.below(ss.len())].h, S::InvalidArgument, None)
            }
        }
        3 => (
            0x67 << 56 | 2 << 48 | 0xFFFF_FFFF_FF00,
            S::InvalidArgument,
            None,
        ),
        _ if n > 0 => {
            let at = i.below(n);
            (wd.blocks.borrow()[at].owner, S::Ok, Some(at))
        }
        _ => (forged(), S::InvalidArgument, None),
    };
    if let (false, Some(a)) = (retain, at) {
        // Before a live block's release, graphed_buffer_release_on with
        // what is not a host stream (a heap address, a session handle) is
        // refused and keeps the reference. Decided by the model's state,
        // not by input bytes, so that the decoding stays.
        let local = 0u64;
        let not_stream = if a % 2 == 0 {
            &local as *const u64 as usize
        } else {
            let sess = wd.blocks.borrow()[a].sess;
            wd.sessions.borrow()[sess].h
        };
        mark();
        let r = graphed_buffer_release_on(h as *mut graphed_buffer, not_stream as graphed_stream);
        expect(
            r,
            &[S::InvalidArgument],
            "graphed_buffer_release_on",
            "not a host stream",
        );
        assert!(
            msg().contains("not a stream of the host backend"),
            "{}",
            msg()
        );
    }
    mark();
    let r = if retain {
        graphed_buffer_retain(h as *mut graphed_buffer)
    } else {
        graphed_buffer_release(h as *mut graphed_buffer)
    };
    let func = if retain {
        "graphed_buffer_retain"
    } else {
        "graphed_buffer_release"
    };
    // A stale id of kind "buffer" that was never issued reads as never issued.
    let ok: &[graphed_status] = if want == S::InvalidArgument {
        &[S::InvalidArgument, S::UseAfterDestroy]
    } else {
        &[want]
    };
    expect(r, ok, func, "block");
    if let (S::Ok, Some(at)) = (r, at) {
        let mut bs = wd.blocks.borrow_mut();
        if retain {
            bs[at].refs += 1;
        } else {
            bs[at].refs -= 1;
            if bs[at].refs == 0 {
                let b = bs.remove(at);
                wd.stale_blocks.borrow_mut().push(b.owner);
            }
        }
    }
}

pub fn op_lease() {
    let wd = w();
    let i = &wd.input;
    let n = wd.leases.borrow().len();
    let t = target();
    let (tok, owner) = match i.below(6) {
        0 | 1 | 2 if n > 0 => {
            let l = &wd.leases.borrow()[i.below(n)];
            (l.token, Some(l.sess))
        }
        3 => {
            let sl = wd.stale_leases.borrow();
            if sl.is_empty() {
                (i.u64(), None)
            } else {
                (sl[i.below(sl.len())].1, None)
            }
        }
        _ => (i.pick(&[0, u64::MAX, 1 << 48 | 1 << 24 | 1, i.u64()]), None),
    };
    // A token is a value: whoever passes the value of a lease the session
    // holds releases it (tokens are unique across sessions, checked where
    // they are handed out).
    let mine = match t {
        Target::Live(k) => wd
            .leases
            .borrow()
            .iter()
            .any(|l| l.sess == k && l.token == tok),
        _ => false,
    };
    let want = t
        .lookup()
        .unwrap_or(if mine { S::Ok } else { S::InvalidArgument });
    mark();
    let r = graphed_lease_release(t.ptr(), tok);
    expect(
        r,
        &[want],
        "graphed_lease_release",
        if owner.is_some() {
            "a token another session may hold"
        } else {
            "forged or stale"
        },
    );
    if r == S::Ok {
        if let Target::Live(k) = t {
            forget_lease(k, tok);
        }
    }
}

/// graphed_buffer_release_on: the block given back ordered on another
/// stream (NULL: the default one, or a host stream a capture made), or
/// refused for what is not a host stream (forged, stale).
pub fn op_release_on() {
    let wd = w();
    let i = &wd.input;
    let n = wd.blocks.borrow().len();
    let (stream, stream_err) = stream_arg(true);
    let (h, mut want, at) = match i.below(6) {
        0 => (0, S::Ok, None),
        1 => (forged(), S::InvalidArgument, None),
        2 if !wd.stale_blocks.borrow().is_empty() => {
            let sb = wd.stale_blocks.borrow();
            (sb[i.below(sb.len())], S::UseAfterDestroy, None)
        }
        _ if n > 0 => {
            let at = i.below(n);
            (wd.blocks.borrow()[at].owner, S::Ok, Some(at))
        }
        _ => (0, S::Ok, None),
    };
    // A live block's stream is checked before its reference goes, last or
    // not: on the host backend it is NULL or a host stream (capturing or
    // not); anything else is refused and the reference kept.
    let last = at.is_some_and(|a| wd.blocks.borrow()[a].refs == 1);
    if at.is_some() {
        if let Some(e) = stream_err.filter(|&e| e != S::StreamCapturing) {
            want = e;
        }
    }
    mark();
    let r = graphed_buffer_release_on(h as *mut graphed_buffer, stream as graphed_stream);
    let ok: &[graphed_status] = if want == S::InvalidArgument {
        &[S::InvalidArgument, S::UseAfterDestroy]
    } else {
        &[want]
    };
    trace!("release_on 0x{h:x} stream 0x{stream:x} last {last} want {want:?} -> {r:?}");
    expect(r, ok, "graphed_buffer_release_on", "block");
    if let (S::Ok, Some(at)) = (r, at) {
        let mut bs = wd.blocks.borrow_mut();
        bs[at].refs -= 1;
        if bs[at].refs == 0 {
            let b = bs.remove(at);
            wd.stale_blocks.borrow_mut().push(b.owner);
        }
    }
}
