//! Grad-return policies: how the gradient of each parameter slot is handed
//! back after a backward replay, decided once at capture from the session
//! option, the parameter's flags and an explicit override, and never re-read.

use super::dtype::DType;
use super::size;
use crate::error::{Error, Result};

/// How a parameter gradient is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GradPolicy {
    /// No explicit choice: decided at capture (CLONE, or ALIAS for
    /// delayed-wgrad parameters and when the session opts out of clones).
    Default,
    /// A fresh buffer the caller owns.
    Clone,
    /// The static buffer itself: valid until this callable's next backward
    /// (or weight-grad) replay overwrites it.
    Alias,
    /// Copied into a caller buffer given at replay; no allocation.
    CopyInto,
    /// Added into a caller buffer given at replay (f32, f16, bf16).
    AccumulateInto,
}

impl GradPolicy {
    pub fn name(self) -> &'static str {
        match self {
            GradPolicy::Default => "DEFAULT",
            GradPolicy::Clone => "CLONE",
            GradPolicy::Alias => "ALIAS",
            GradPolicy::CopyInto => "COPY_INTO",
            GradPolicy::AccumulateInto => "ACCUMULATE_INTO",
        }
    }
}

/// What a parameter's flags say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamFlags {
    /// The parameter's real gradient is produced elsewhere (delayed
    /// weight-gradient, Transformer Engine's skip_backward_post_hook): its
    /// returned grad keeps aliasing the static buffer by default.
    pub delayed_wgrad: bool,
    /// The parameter's grad is provided by the callback at capture (external
    /// memory, e.g. a framework's tensor), not placed in the slab.
    pub external_grad: bool,
    /// The parameter may move: capture verifies that its graphs can be
    /// pointed at another address, and replays given one point them there.
    pub rebind: bool,
    /// With COPY_INTO: capture verifies that the pass writing the grad can
    /// write it straight into another buffer, and replays point that pass
    /// at the destination they are given instead of copying into it.
    pub rebind_grad: bool,
}

/// A parameter as registered, copied out of the caller's descriptor.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub data: u64,
    pub bytes: usize,
    pub dtype: DType,
    pub requires_grad: bool,
    pub flags: ParamFlags,
    pub policy: GradPolicy,
}

impl ParamSpec {
    pub fn delayed_wgrad(&self) -> bool {
        self.flags.delayed_wgrad
    }

    pub fn external_grad(&self) -> bool {
        self.flags.external_grad
    }

    /// Checks what can be checked at registration, so that resolution at
    /// capture cannot fail.
    pub fn validate(&self, what: &str) -> Result<()> {
        if self.bytes == 0 {
            return Err(Error::invalid(format!("{what}.bytes is 0")));
        }
        size::check_bytes(self.bytes, &format!("{what}.bytes"))?;
        if self.bytes % self.dtype.size() != 0 {
            return Err(Error::invalid(format!(
                "{what}.bytes ({}) is not a multiple of the {} element size ({})",
                self.bytes,
                self.dtype.name(),
                self.dtype.size()
            )));
        }
        if self.policy == GradPolicy::AccumulateInto && !self.dtype.accumulable() {
            return Err(Error::invalid(format!(
                "{what}: ACCUMULATE_INTO supports f32, f16 and bf16 parameters, not {}",
                self.dtype.name()
            )));
        }
        if self.flags.rebind_grad && self.policy != GradPolicy::CopyInto {
            return Err(Error::invalid(format!(
                "{what}.flags has REBIND_GRAD, which writes the grad straight into the COPY_INTO destination; its \
                 policy is {}: set GRAPHED_GRAD_POLICY_COPY_INTO",
                self.policy.name()
            )));
        }
        if !self.requires_grad && self.policy != GradPolicy::Default {
            return Err(Error::invalid(format!(
                "{what} has requires_grad = false but an explicit grad policy ({})",
                self.policy.name()
            )));
        }
        Ok(())
    }
}

/// What decided a parameter slot's policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decided {
    /// The parameter's own policy.
    Explicit,
    /// A delayed weight-gradient parameter: its grad aliases.
    DelayedWgrad,
    /// The session's option (`clone_param_grads_on_return`).
    Session,
}

/// The policy of one parameter slot and what decided it: `None` when the
/// parameter takes no gradient. An explicit policy wins; then delayed-wgrad
/// parameters alias; then the session option (clone by default, alias when
/// opted out).
pub fn resolve_why(
    clone_param_grads_on_return: bool,
    p: &ParamSpec,
) -> Option<(GradPolicy, Decided)> {
    if !p.requires_grad {
        return None;
    }
    Some(match p.policy {
        GradPolicy::Default if p.delayed_wgrad() => (GradPolicy::Alias, Decided::DelayedWgrad),
        GradPolicy::Default if !clone_param_grads_on_return => {
            (GradPolicy::Alias, Decided::Session)
        }
        GradPolicy::Default => (GradPolicy::Clone, Decided::Session),
        explicit => (explicit, Decided::Explicit),
    })
}

/// The policy of one parameter slot (see `resolve_why`).
pub fn resolve(clone_param_grads_on_return: bool, p: &ParamSpec) -> Option<GradPolicy> {
    resolve_why(clone_param_grads_on_return, p).map(|(policy, _)| policy)
}

/// The frozen policies of one callable's parameters, one per parameter in
/// registration order.
pub fn snapshot(
    clone_param_grads_on_return: bool,
    params: &[ParamSpec],
) -> Vec<Option<GradPolicy>> {
    params
        .iter()
        .map(|p| resolve(clone_param_grads_on_return, p))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(flags: u32, policy: GradPolicy) -> ParamSpec {
        ParamSpec {
            data: 0x1000,
            bytes: 64,
            dtype: DType::F32,
            requires_grad: true,
            flags: ParamFlags {
                delayed_wgrad: flags & 1 != 0,
                external_grad: flags & 2 != 0,
                rebind: flags & 4 != 0,
                rebind_grad: flags & 8 != 0,
            },
            policy,
        }
    }

    #[test]
    fn rebind_grad_needs_copy_into() {
        assert!(param(8, GradPolicy::CopyInto).validate("p").is_ok());
        for policy in [
            GradPolicy::Default,
            GradPolicy::Clone,
            GradPolicy::Alias,
            GradPolicy::AccumulateInto,
        ] {
            let e = param(8, policy).validate("p").unwrap_err().to_string();
            assert!(
                e.contains("REBIND_GRAD") && e.contains(policy.name()),
                "{e}"
            );
        }
    }

    #[test]
    fn default_clones_and_delayed_wgrad_aliases() {
        assert_eq!(
            resolve(true, &param(0, GradPolicy::Default)),
            Some(GradPolicy::Clone)
        );
        assert_eq!(
            resolve(true, &param(1, GradPolicy::Default)),
            Some(GradPolicy::Alias)
        );
    }

    #[test]
    fn opt_out_aliases_everything_without_an_explicit_policy() {
        assert_eq!(
            resolve(false, &param(0, GradPolicy::Default)),
            Some(GradPolicy::Alias)
        );
        assert_eq!(
            resolve(false, &param(0, GradPolicy::Clone)),
            Some(GradPolicy::Clone)
        );
        assert_eq!(
            resolve(false, &param(0, GradPolicy::AccumulateInto)),
            Some(GradPolicy::AccumulateInto)
        );
    }

    #[test]
    fn explicit_policy_wins_over_flags() {
        assert_eq!(
            resolve(true, &param(1, GradPolicy::CopyInto)),
            Some(GradPolicy::CopyInto)
        );
        assert_eq!(
            resolve(true, &param(1, GradPolicy::Clone)),
            Some(GradPolicy::Clone)
        );
    }

    #[test]
    fn no_grad_means_no_slot() {
        let mut p = param(0, GradPolicy::Default);
        p.requires_grad = false;
        assert_eq!(resolve(true, &p), None);
    }

    #[test]
    fn snapshot_is_a_copy_not_a_view() {
        let mut params = vec![param(0, GradPolicy::Default), param(1, GradPolicy::Default)];
        let snap = snapshot(true, &params);
        params[0].flags.delayed_wgrad = true;
        params[1].flags.delayed_wgrad = false;
        assert_eq!(snap, vec![Some(GradPolicy::Clone), Some(GradPolicy::Alias)]);
        assert_eq!(
            snapshot(true, &params),
            vec![Some(GradPolicy::Alias), Some(GradPolicy::Clone)]
        );
    }

    #[test]
    fn validation_catches_bad_descriptors() {
        assert!(param(0, GradPolicy::Default).validate("p").is_ok());
        assert!(param(2, GradPolicy::Default).validate("p").is_ok());
        let mut p = param(0, GradPolicy::AccumulateInto);
        p.dtype = DType::I32;
        assert!(p.validate("p").is_err());
        let mut p = param(0, GradPolicy::Default);
        p.bytes = 6;
        assert!(p.validate("p").is_err());
        let mut p = param(0, GradPolicy::Clone);
        p.requires_grad = false;
        assert!(p.validate("p").is_err());
        let mut p = param(0, GradPolicy::Default);
        p.bytes = usize::MAX - 3;
        assert!(p.validate("p").is_err(), "sizes past 2^48 are refused");
    }
}
