//! The return plan of a captured instance: what each replay hands back for
//! each parameter, derived once at capture from the frozen grad policies,
//! the slab layout and the parameters' dtypes, so that replay walks a plan
//! and never consults a policy again.

use super::dtype::{DType, ACCUMULABLE};
use super::layout::{clone_layout, CloneLayout, ParamShape, Slab};
use super::policy::GradPolicy;
use crate::error::{Error, Result};

/// What a backward (or weight-grad) replay returns for one parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamReturn {
    /// No gradient (the parameter takes none).
    None,
    /// An owned copy at this offset of the replay's clone block.
    Clone { offset: usize },
    /// The static grad buffer itself.
    Alias,
    /// Copied into the caller's destination.
    CopyInto,
    /// Added into the caller's destination, elements of this dtype.
    AccumulateInto { dtype: DType },
}

impl ParamReturn {
    /// Whether replay needs a caller destination for this parameter.
    pub fn needs_destination(self) -> bool {
        matches!(
            self,
            ParamReturn::CopyInto | ParamReturn::AccumulateInto { .. }
        )
    }

    /// Why `dst` (0: none) cannot take this grad, if it cannot: a grad
    /// copied or accumulated needs one, and an accumulated one needs it
    /// aligned to its element size (the kernels read and write whole
    /// elements). The text follows the destination's name.
    pub fn destination_problem(self, dst: u64) -> Option<String> {
        let name = match self {
            ParamReturn::CopyInto => "COPY_INTO",
            ParamReturn::AccumulateInto { .. } => "ACCUMULATE_INTO",
            _ => return None,
        };
        if dst == 0 {
            return Some(format!(
                "is NULL, but that parameter's grad policy ({name}) needs a destination"
            ));
        }
        match self {
            ParamReturn::AccumulateInto { dtype } if dst % dtype.size() as u64 != 0 => {
                Some(format!(
                "(0x{dst:x}) is not aligned to its {} element size ({} bytes): ACCUMULATE_INTO \
                 destinations must be element-aligned",
                dtype.name(),
                dtype.size()
            ))
            }
            _ => None,
        }
    }
}

/// The return plan of one instance.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReturnPlan {
    /// The frozen policy of each parameter (None: no gradient).
    pub policies: Vec<Option<GradPolicy>>,
    /// What each parameter's grad is returned as.
    pub params: Vec<ParamReturn>,
    /// Where the CLONE grads go in their block.
    pub clone: CloneLayout,
    /// The COPY_INTO parameters.
    pub copy_into: Vec<usize>,
    /// The ACCUMULATE_INTO parameters by dtype (one batched launch each).
    pub accumulate: Vec<(DType, Vec<usize>)>,
}

impl ReturnPlan {
    /// The plan for parameters with frozen `policies` (None: no gradient),
    /// their `shapes` as the layout saw them, their `dtypes`, and the slab
    /// the layout made.
    pub fn of(
        policies: &[Option<GradPolicy>],
        shapes: &[Option<ParamShape>],
        dtypes: &[DType],
        slab: &Slab,
    ) -> Result<ReturnPlan> {
        let clone = clone_layout(slab, shapes)?;
        let params = policies
            .iter()
            .zip(dtypes)
            .enumerate()
            .map(|(i, (p, &dtype))| {
                Ok(match p {
                    None => ParamReturn::None,
                    Some(GradPolicy::Clone) => ParamReturn::Clone {
                        offset: clone.offsets[i].ok_or_else(|| {
                            Error::Internal(format!("CLONE parameter {i} has no clone offset"))
                        })?,
                    },
                    Some(GradPolicy::Alias) => ParamReturn::Alias,
                    Some(GradPolicy::CopyInto) => ParamReturn::CopyInto,
                    Some(GradPolicy::AccumulateInto) => ParamReturn::AccumulateInto { dtype },
                    Some(GradPolicy::Default) => {
                        return Err(Error::Internal(format!(
                            "parameter {i}'s policy was not resolved at capture"
                        )))
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let copy_into = (0..params.len())
            .filter(|&i| params[i] == ParamReturn::CopyInto)
            .collect();
        let accumulate = ACCUMULABLE
            .into_iter()
            .map(|d| {
                let idx: Vec<usize> = (0..params.len())
                    .filter(|&i| params[i] == ParamReturn::AccumulateInto { dtype: d })
                    .collect();
                (d, idx)
            })
            .filter(|(_, idx)| !idx.is_empty())
            .collect();
        Ok(ReturnPlan {
            policies: policies.to_vec(),
            params,
            clone,
            copy_into,
            accumulate,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::layout::slab_layout;
    use GradPolicy::*;

    fn shape(bytes: usize, policy: GradPolicy) -> Option<ParamShape> {
        Some(ParamShape {
            bytes,
            policy,
            external: false,
        })
    }

    #[test]
    fn one_plan_per_policy_mix() {
        let policies = [
            Some(AccumulateInto),
            Some(CopyInto),
            None,
            Some(AccumulateInto),
            Some(Clone),
            Some(AccumulateInto),
            Some(CopyInto),
            Some(Alias),
        ];
        let dtypes = [
            DType::Bf16,
            DType::F32,
            DType::F32,
            DType::F32,
            DType::F16,
            DType::Bf16,
            DType::I32,
            DType::F32,
        ];
        let shapes: Vec<_> = policies
            .iter()
            .map(|p| p.and_then(|p| shape(64, p)))
            .collect();
        let slab = slab_layout(&shapes).unwrap();
        let plan = ReturnPlan::of(&policies, &shapes, &dtypes, &slab).unwrap();
        assert_eq!(plan.copy_into, vec![1, 6]);
        assert_eq!(
            plan.accumulate,
            vec![(DType::F32, vec![3]), (DType::Bf16, vec![0, 5])]
        );
        assert_eq!(plan.params[4], ParamReturn::Clone { offset: 0 });
        assert_eq!(plan.params[2], ParamReturn::None);
        assert_eq!(plan.params[7], ParamReturn::Alias);
        assert_eq!(
            plan.params
                .iter()
                .filter(|p| **p == ParamReturn::Alias)
                .count(),
            1
        );
        assert_eq!(plan.clone.count, 1);
        assert!(plan.params[0].needs_destination() && !plan.params[4].needs_destination());
    }

    #[test]
    fn unresolved_policies_are_a_bug_not_a_default() {
        let shapes = [shape(8, Default)];
        let slab = slab_layout(&shapes).unwrap();
        assert!(ReturnPlan::of(&[Some(Default)], &shapes, &[DType::F32], &slab).is_err());
    }
}
