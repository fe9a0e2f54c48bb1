//! The session's life: create, capture, reset, destroy. A session handle
//! is an id in the handle table; every call pins the session for its
//! duration, so a destroy racing another call gets GRAPHED_STATUS_BUSY
//! and a use after destroy gets GRAPHED_STATUS_USE_AFTER_DESTROY.

use super::args::{arg_out, read_struct};
use super::boundary::boundary;
use super::config::{convert, graphed_session_config};
use super::handles::{get, graphed_session, id, ptr};
use super::status::graphed_status;
use crate::backend;
use crate::core::handle::{self, Kind};
use crate::error::Result;
use crate::orchestrate::{Session, SessionCell};
use std::sync::Arc;

/// The live session behind a handle, pinned for the call.
pub(crate) fn session(p: *mut graphed_session) -> Result<Arc<SessionCell>> {
    get::<SessionCell, _>(p, Kind::Session, "session")
}

/// Creates a session. On the CUDA backend this retains the device's
/// primary context (the one the CUDA runtime and PyTorch use).
/// Destroy it with graphed_session_destroy.
///
/// # Safety
/// `config` must be NULL or point to a graphed_session_config initialised
/// by graphed_session_config_default(); `session_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn graphed_session_create(
    config: *const graphed_session_config,
    session_out: *mut *mut graphed_session,
) -> graphed_status {
    boundary("graphed_session_create", || {
        let out = arg_out(session_out, "session_out")?;
        // SAFETY: per this function's contract.
        let cfg = convert(&unsafe { read_struct(config, "config") }?)?;
        let pool = if cfg.share_pool_with.is_null() {
            None
        } else {
            Some(session(cfg.share_pool_with)?.pool.clone())
        };
        let backend = backend::open(cfg.backend, cfg.device)?;
        let s = Session::new(backend, pool, cfg.options)?;
        let h = handle::insert(Kind::Session, Arc::new(SessionCell::new(s)), 1);
        // SAFETY: checked non-NULL; written only on success.
        unsafe { out.write(ptr(h)) };
        Ok(())
    })
}

/// Destroys a session: waits for the device, destroys its graphs and frees
/// its static buffers and scratch (a pool shared with another session
/// lives on with it). Clones already returned stay valid until released.
/// NULL is a no-op. A session in use by another call (another thread, or
/// the session's own callback) is not destroyed: GRAPHED_STATUS_BUSY. A
/// destroyed session gives GRAPHED_STATUS_USE_AFTER_DESTROY.
#[no_mangle]
pub extern "C" fn graphed_session_destroy(session: *mut graphed_session) -> graphed_status {
    boundary("graphed_session_destroy", || {
        if session.is_null() {
            return Ok(());
        }
        let obj = handle::remove_unpinned(Kind::Session, id(session), || {
            "the session is in use by another call (another thread, or one of its own callbacks); \
             destroy it once that call has returned"
                .to_string()
        })?;
        // Dropped here, outside the handle table's lock: waits for the device.
        drop(obj);
        Ok(())
    })
}

/// Destroys a session once no call is using it: the handle is gone at once
/// (a later use reports GRAPHED_STATUS_USE_AFTER_DESTROY), and the session
/// is destroyed when the last call in progress on it returns, or now when
/// there is none (what a C++ destructor wants). NULL is a no-op.
#[no_mangle]
pub extern "C" fn graphed_session_destroy_when_idle(
    session: *mut graphed_session,
) -> graphed_status {
    boundary("graphed_session_destroy_when_idle", || {
        if session.is_null() {
            return Ok(());
        }
        // Dropped outside the table's lock; calls in progress hold pins.
        drop(handle::take(Kind::Session, id(session))?);
        Ok(())
    })
}

/// Warms up and captures every registered callable (see docs/design.md):
/// warmup iterations eagerly on a side stream, then one graph per pass,
/// instantiated and uploaded. On failure (a callback's non-zero return, an
/// illegal call under capture, a driver error) everything the attempt
/// made is released, the message names the session, the callable (name
/// and index), the pass, the microbatch, the bucket and what broke it (the
/// driver's answer, the first failing call graphed saw, what the callback
/// said with graphed_callback_fail_message: docs/c-api.md, "When a
/// capture fails"), and the session can be captured again.
#[no_mangle]
pub extern "C" fn graphed_session_capture(session: *mut graphed_session) -> graphed_status {
    boundary("graphed_session_capture", || {
        self::session(session)?.lock()?.capture()
    })
}

/// Releases one callable of a captured session while the others keep
/// replaying (Transformer Engine's per-callable reset). It waits for the
/// device (every stream of the session's context, as a destroy does),
/// then destroys every graph of the callable (every microbatch, bucket,
/// clone slot and weight-grad pass, the graphs choosing its bucket on the
/// device) and of every step that includes it, frees its clone blocks
/// kept for reuse, the static allocation of the buffers only it uses, and
/// the allocation callables share once no captured callable uses it (with
/// the last callable, the scratch arena goes too). Later forward,
/// backward and weight-grad replays of it, replays of steps that include
/// it, and graphed_session_buffers on it return
/// GRAPHED_STATUS_CALLABLE_RELEASED naming it, changing nothing; queries
/// of its shape, policies and memory still answer. Clones already
/// returned stay valid until released; its aliases (outputs, input grads,
/// ALIAS parameter grads) are invalid from this call on. Releasing a
/// released callable again is a no-op (GRAPHED_STATUS_OK).
///
/// Refused, changing nothing: NULL or stale session; BUSY; a session not
/// captured (WRONG_STATE) or reset (SESSION_RESET); a callable that does
/// not exist (INVALID_ARGUMENT); with strict leases, a lease still held on
/// one of its aliases (ALIAS_HELD, naming the callable and the alias); a
/// failing wait for the device (CUDA_ERROR). Errors while freeing are
/// teardown errors (counted, logged), never the call's.
#[no_mangle]
pub extern "C" fn graphed_session_release_callable(
    session: *mut graphed_session,
    callable: u32,
) -> graphed_status {
    boundary("graphed_session_release_callable", || {
        self::session(session)?.lock()?.release_callable(callable)
    })
}

/// Releases the session's graphs, static buffers and scratch (waiting for
/// the device first). Every later replay or capture returns
/// GRAPHED_STATUS_SESSION_RESET; clones already returned stay valid.
#[no_mangle]
pub extern "C" fn graphed_session_reset(session: *mut graphed_session) -> graphed_status {
    boundary("graphed_session_reset", || {
        self::session(session)?.lock()?.reset()
    })
}
