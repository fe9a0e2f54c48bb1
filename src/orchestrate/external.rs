//! External buffers: a callable may declare that a buffer it writes (an
//! output, an input's grad, a parameter's grad) lives in memory its callback
//! provides, as frameworks with their own allocator want (PyTorch's outputs
//! and autograd's grads). The library places nothing for such a buffer; the
//! callback hands its address over during capture (graphed_pass_set_buffer),
//! and replays return that address. One `Provided` collects the addresses
//! of one captured pass. A step's captures repeat passes whose own capture
//! already provided them: there the callback finds them in its view and
//! providing one again is refused (`Provided::in_step`).

use crate::backend::DevPtr;
use crate::core::layout::Role;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex};

/// The external buffers one captured pass must provide, and those it did.
pub struct Provided {
    /// (role, index) the pass may and must provide.
    expected: Vec<(Role, usize)>,
    got: Mutex<Vec<(Role, usize, DevPtr)>>,
    /// Which pass, for messages.
    context: String,
    /// Under the capture of this step: every buffer is already provided.
    step: Option<usize>,
}

impl Provided {
    pub fn new(expected: Vec<(Role, usize)>, context: String) -> Arc<Provided> {
        Arc::new(Provided {
            expected,
            got: Mutex::new(Vec::new()),
            context,
            step: None,
        })
    }

    /// A pass under the capture of step `step`: its external buffers are
    /// where its own capture provided them, and it provides none.
    pub fn in_step(step: usize, context: String) -> Arc<Provided> {
        Arc::new(Provided {
            expected: Vec::new(),
            got: Mutex::new(Vec::new()),
            context,
            step: Some(step),
        })
    }

    /// The callback provides `ptr` for (role, index).
    pub fn set(&self, role: Role, index: usize, ptr: DevPtr) -> Result<()> {
        if let Some(step) = self.step {
            return Err(Error::state(format!(
                "{}: {} {index} cannot be provided in the capture of step {step}: external buffers are \
                 where the pass's own capture provided them (ctx->outputs, ctx->grad_inputs, \
                 ctx->param_grads): write the results there",
                self.context,
                role.name()
            )));
        }
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
                    "{} declared {} {index} external but did not provide its buffer during capture",
                    self.context,
                    role.name()
                )));
            }
        }
        Ok(got.clone())
    }
}
