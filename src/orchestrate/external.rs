//! External buffers: a callable may declare that a buffer it writes (an
//! output, an input's grad, a parameter's grad) lives in memory its callback
//! provides, as frameworks with their own allocator want (PyTorch's outputs
//! and autograd's grads). The library places nothing for such a buffer; the
//! callback hands its address over during capture (graphed_pass_set_buffer),
//! and replays return that address. One `Provided` collects the addresses
//! of one captured pass.

use crate::backend::DevPtr;
use crate::core::layout::Role;
use crate::error::{Error, Result};
use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The external buffers one captured pass must provide, and those it did.
pub struct Provided {
    /// (role, index) the pass may and must provide.
    expected: Vec<(Role, usize)>,
    got: Mutex<Vec<(Role, usize, DevPtr)>>,
    /// Which pass, for messages.
    context: String,
}

fn live() -> MutexGuard<'static, HashSet<usize>> {
    static LIVE: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

impl Provided {
    /// Boxed: its address is the handle the callback's context carries.
    pub fn new(expected: Vec<(Role, usize)>, context: String) -> Box<Provided> {
        let p = Box::new(Provided {
            expected,
            got: Mutex::new(Vec::new()),
            context,
        });
        live().insert(p.handle());
        p
    }

    pub fn handle(&self) -> usize {
        self as *const Provided as usize
    }

    /// Runs `f` on the collector behind a handle from C, if it is live (it
    /// is during one capture callback).
    pub fn with_handle<T>(handle: usize, f: impl FnOnce(&Provided) -> Result<T>) -> Result<T> {
        let live = live();
        if handle == 0 || !live.contains(&handle) {
            return Err(Error::state(
                "buffers can only be provided during capture (ctx->phase == GRAPHED_PHASE_CAPTURE), \
                 from the callback of the pass that writes them",
            ));
        }
        // SAFETY: registered handles are live boxed collectors; they
        // unregister (under this lock) before they are freed.
        f(unsafe { &*(handle as *const Provided) })
    }

    /// The callback provides `ptr` for (role, index).
    pub fn set(&self, role: Role, index: usize, ptr: DevPtr) -> Result<()> {
        if !self.expected.contains(&(role, index)) {
            return Err(Error::invalid(format!(
                "{}: {} {index} was not declared external for this pass (only buffers registered with \
                 GRAPHED_TENSOR_FLAGS_EXTERNAL or GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD, by the pass that writes them)",
                self.context,
                role.name()
            )));
        }
        if ptr == 0 {
            return Err(Error::NullPointer { what: "ptr" });
        }
        let mut got = self.got.lock().unwrap_or_else(|p| p.into_inner());
        if got.iter().any(|&(r, i, _)| (r, i) == (role, index)) {
            return Err(Error::invalid(format!(
                "{}: {} {index} was already provided",
                self.context,
                role.name()
            )));
        }
        got.push((role, index, ptr));
        Ok(())
    }

    /// Every expected buffer with its address, or an error naming the first
    /// one the callback did not provide.
    pub fn finish(&self) -> Result<Vec<(Role, usize, DevPtr)>> {
        let got = self.got.lock().unwrap_or_else(|p| p.into_inner());
        for &(role, index) in &self.expected {
            if !got.iter().any(|&(r, i, _)| (r, i) == (role, index)) {
                return Err(Error::invalid(format!(
                    "{} declared {} {index} external but did not provide it with graphed_pass_set_buffer \
                     during capture",
                    self.context,
                    role.name()
                )));
            }
        }
        Ok(got.clone())
    }
}

impl Drop for Provided {
    fn drop(&mut self) {
        live().remove(&self.handle());
    }
}
