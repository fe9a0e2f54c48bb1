//! A session as callers reach it: behind a lock that a second concurrent
//! call (another thread, or a callback calling back into its own session)
//! finds busy, with its lease book and pool reachable without that lock.

use super::captured::LeaseBook;
use super::pool::Pool;
use super::session::Session;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

/// A session as callers reach it. The session itself is behind a lock
/// that a second concurrent call (another thread, or a callback calling
/// back into its own session) finds busy; the lease book and the pool are
/// usable without it.
pub struct SessionCell {
    session: Mutex<Session>,
    pub leases: Arc<LeaseBook>,
    pub pool: Arc<Pool>,
    pub name: String,
}

impl SessionCell {
    pub fn new(session: Session) -> SessionCell {
        SessionCell {
            leases: session.leases.clone(),
            pool: session.pool.clone(),
            name: session.opts.name.clone(),
            session: Mutex::new(session),
        }
    }

    /// The session, or `Busy` while another call holds it.
    pub fn lock(&self) -> Result<MutexGuard<'_, Session>> {
        match self.session.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::WouldBlock) => Err(Error::Busy(format!(
                "session '{}' is in use by another call: a callback called back into its own session, \
                 or two threads used it at once",
                self.name
            ))),
            // A panic inside a previous call was caught at the boundary; the
            // session's invariants hold between statements, so carry on.
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        }
    }
}
