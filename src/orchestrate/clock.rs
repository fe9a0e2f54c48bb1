//! Where a capture's host time goes, by phase: each phase's time is added
//! up over the capture, so that a slow capture can be explained (and
//! compared with torch's) from the session's stats; and how many graph
//! templates it keeps.

use std::time::{Duration, Instant};

/// Host time of one capture by phase, in nanoseconds. The phases do not
/// overlap; `total` is the whole capture call, so the remainder of `total`
/// over the phases is bookkeeping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaptureTimes {
    pub total: u64,
    /// Layout, buffer plan, static allocation, the samples copied in.
    pub plan: u64,
    /// Every warmup iteration, callbacks and hooks included.
    pub warmup: u64,
    /// The passes' callbacks under stream capture (and their hooks).
    pub capture: u64,
    /// Instantiating the captured graphs (every kind).
    pub instantiate: u64,
    /// Uploading them (host time of the call).
    pub upload: u64,
    /// The captures of clone slots, their instantiation included.
    pub slots: u64,
    /// The captures of steps, their instantiation included.
    pub steps: u64,
    /// Finding where graphs take the rebound buffers' addresses.
    pub rebind_plan: u64,
    /// Verifying rebinds: replays, copies, comparisons.
    pub rebind_verify: u64,
    /// Graph templates kept after capture (those rebinding plans need; the
    /// others are released).
    pub templates_kept: usize,
}

/// Which phase a span of time is added to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Span {
    Plan,
    Warmup,
    Capture,
    Instantiate,
    Upload,
    Slots,
    Steps,
    RebindPlan,
    RebindVerify,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl CaptureTimes {
    pub fn add(&mut self, span: Span, d: Duration) {
        let n = nanos(d);
        let slot = match span {
            Span::Plan => &mut self.plan,
            Span::Warmup => &mut self.warmup,
            Span::Capture => &mut self.capture,
            Span::Instantiate => &mut self.instantiate,
            Span::Upload => &mut self.upload,
            Span::Slots => &mut self.slots,
            Span::Steps => &mut self.steps,
            Span::RebindPlan => &mut self.rebind_plan,
            Span::RebindVerify => &mut self.rebind_verify,
        };
        *slot = slot.saturating_add(n);
    }

    /// Runs `f`, adding its time to `span`.
    pub fn time<T>(&mut self, span: Span, f: impl FnOnce(&mut Self) -> T) -> T {
        let t = Instant::now();
        let out = f(self);
        self.add(span, t.elapsed());
        out
    }

    pub fn set_total(&mut self, d: Duration) {
        self.total = nanos(d);
    }
}
