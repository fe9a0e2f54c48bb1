//! What a capture reads of its session: the backend, the pool, the options,
//! the registered callables and steps, and the memory counters.

use super::pool::Pool;
use super::spec::{CallableSpec, LogLevel, MemCounters, SessionOptions, StepSpec};
use crate::backend::Backend;
use std::sync::Arc;

pub(crate) struct Inputs<'a> {
    pub backend: &'a Arc<dyn Backend>,
    pub pool: &'a Arc<Pool>,
    pub opts: &'a SessionOptions,
    pub callables: &'a [CallableSpec],
    pub steps: &'a [StepSpec],
    pub counters: &'a Arc<MemCounters>,
}

impl Inputs<'_> {
    pub fn log(&self, level: LogLevel, msg: impl FnOnce() -> String) {
        self.opts.log(level, msg)
    }
}
