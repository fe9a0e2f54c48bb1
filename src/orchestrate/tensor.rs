//! One captured tensor and everything known about it: the role it plays for
//! its instance, where its buffer lives, what a replay does with data given
//! for it (copies it, reads another instance's buffer in place, or points
//! the graphs at it), and what a replay hands back for it.

use crate::backend::{DevPtr, Rebinder};
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::core::padded::{Collapsed, Padded};
use crate::core::returns::ParamReturn;
use crate::error::Result;

/// Addresses a rebound tensor may take: the static buffers' alignment
/// (`core::ALIGN`), which kernels (vector loads, tensor-memory
/// descriptors) may rely on. Data elsewhere is copied into the static
/// buffer.
pub const REBIND_ALIGN: u64 = crate::core::ALIGN as u64;

/// What a replay hands back for a tensor: for parameter grads their frozen
/// policy's return; outputs and input grads are aliases of their buffer;
/// inputs and grad-outputs are not handed back (`None`).
pub type Return = ParamReturn;

/// Where a tensor's buffer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// In the session's static allocation.
    Static,
    /// Memory the callback of the pass that writes it provided at capture.
    External,
    /// Another instance's buffer, used in place: a chained input is its
    /// producer's output, and its grad the producer's grad-output.
    Chained,
    /// There is none: an output without grad has no grad-output, an input
    /// without grad no grad-input, a parameter without grad no grad.
    Absent,
}

/// What a replay does with the data it is given for an input (forward) or
/// a grad-output (backward).
pub(crate) enum Feed {
    /// Outputs and grads: replays are given no data for them.
    NotFed,
    /// Copied into the static buffer.
    Copied,
    /// Another instance's buffer: takes no data but that buffer.
    Chained,
    /// The graphs are pointed at the caller's data (verified at capture).
    Rebound(Rebinding),
    /// Asked to be rebound, refused at capture: copied, for this reason.
    Refused(String),
}

impl Feed {
    pub fn is_rebound(&self) -> bool {
        matches!(self, Feed::Rebound(_))
    }
}

/// The rebinding plans of one tensor, one per graph of its instance that
/// reads it, and the address they point at now.
pub(crate) struct Rebinding {
    plans: Vec<Box<dyn Rebinder>>,
    bound: DevPtr,
}

impl Rebinding {
    /// Plans made for the buffer at `at`, where the graphs point now.
    pub fn new(plans: Vec<Box<dyn Rebinder>>, at: DevPtr) -> Rebinding {
        Rebinding { plans, bound: at }
    }

    /// Graph nodes one rebind updates.
    pub fn nodes(&self) -> usize {
        self.plans.iter().map(|p| p.nodes()).sum()
    }

    /// Where the graphs point now (0: unknown after a failed bind).
    pub fn bound(&self) -> DevPtr {
        self.bound
    }

    /// Points the graphs at `target` if they are not already.
    pub fn bind(&mut self, target: DevPtr) -> Result<()> {
        if self.bound != target {
            // Unknown until every plan points at `target`: a failure part
            // way makes the next bind redo them all.
            self.bound = 0;
            for p in &mut self.plans {
                p.rebind(target)?;
            }
            self.bound = target;
        }
        Ok(())
    }
}

/// What a replay may do when it is given another address for a parameter.
pub(crate) enum ParamFeed {
    /// The graphs read it where it was registered only: a replay at another
    /// address is refused, for this reason.
    Fixed(String),
    /// Verified at capture: the graphs can be pointed at another address.
    Rebound(Rebinding),
}

/// A parameter as its instance's (or step's) graphs read it: where it was
/// registered, and whether and where they can be pointed elsewhere.
pub(crate) struct Param {
    pub index: usize,
    /// Where it was registered, and captured.
    pub ptr: DevPtr,
    pub bytes: usize,
    pub dtype: DType,
    pub feed: ParamFeed,
}

/// The largest power of two that divides `p`, up to `REBIND_ALIGN` (kernels
/// chosen at capture may rely on the alignment they saw: a buffer is pointed
/// only at addresses aligned at least as it was).
pub(crate) fn alignment(p: DevPtr) -> u64 {
    if p == 0 {
        REBIND_ALIGN
    } else {
        (1u64 << p.trailing_zeros()).min(REBIND_ALIGN)
    }
}

impl Param {
    /// A parameter registered at `ptr`, read there only (until capture
    /// verifies it can move).
    pub fn fixed(index: usize, ptr: DevPtr, bytes: usize, dtype: DType, why: &str) -> Param {
        Param {
            index,
            ptr,
            bytes,
            dtype,
            feed: ParamFeed::Fixed(why.to_string()),
        }
    }

    /// Where the graphs read it now (0: unknown, after a rebind failed part
    /// way; the next bind redoes it).
    pub fn bound(&self) -> DevPtr {
        match &self.feed {
            ParamFeed::Fixed(_) => self.ptr,
            ParamFeed::Rebound(r) => r.bound(),
        }
    }

    /// Whether its graphs can be pointed elsewhere.
    pub fn movable(&self) -> bool {
        matches!(self.feed, ParamFeed::Rebound(_))
    }

    /// Why its graphs cannot read it at `to` (None: they can, or already
    /// do). Kernels chosen at capture may rely on the alignment they saw
    /// (vector loads), so a new address must be aligned as well, up to
    /// `REBIND_ALIGN`.
    pub fn refusal(&self, to: DevPtr) -> Option<String> {
        if to == self.bound() {
            return None;
        }
        match &self.feed {
            ParamFeed::Fixed(why) => Some(why.clone()),
            ParamFeed::Rebound(_) if alignment(to) < alignment(self.ptr) => Some(format!(
                "the new address is aligned to {} bytes, the captured one to {}: kernels chosen at \
                 capture may rely on that alignment",
                alignment(to),
                alignment(self.ptr)
            )),
            ParamFeed::Rebound(_) => None,
        }
    }

    /// Points the graphs at `to`; `refusal(to)` must be None.
    pub fn bind(&mut self, to: DevPtr) -> Result<()> {
        match &mut self.feed {
            ParamFeed::Rebound(r) => r.bind(to),
            ParamFeed::Fixed(_) if to == self.ptr => Ok(()),
            ParamFeed::Fixed(why) => Err(crate::error::Error::Internal(format!(
                "a fixed parameter bound elsewhere: {why}"
            ))),
        }
    }
}

/// One tensor of a captured instance.
pub(crate) struct Tensor {
    pub role: Role,
    /// Its index among the instance's tensors of that role (an input's grad
    /// and an output's grad-output share their tensor's index).
    pub index: usize,
    pub bytes: usize,
    pub dtype: DType,
    /// Its buffer (0 where there is none).
    pub ptr: DevPtr,
    pub place: Place,
    pub feed: Feed,
    pub ret: Return,
    /// The strict-lease slot of the alias a replay hands out for it.
    pub lease: Option<usize>,
    /// A DYNAMIC tensor of a callable with buckets: how its data lies in
    /// its bucket (`bytes` holds the bucket's). None otherwise.
    pub varies: Option<Varying>,
    /// A DYNAMIC tensor that varies on its first dimension with the first
    /// size alone: the bytes of one row (its data is a prefix of whole
    /// rows, which the device's choice can zero past). 0 otherwise.
    pub row_bytes: usize,
}

/// How a DYNAMIC tensor's data lies in the buffer of one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Varying {
    pub shape: Collapsed,
    /// The bucket's sizes.
    pub bucket: (u64, u64),
}

impl Varying {
    /// Where a replay of `actual` sizes holds its data.
    pub fn at(&self, actual: (u64, u64)) -> Padded {
        self.shape.at(self.bucket, actual)
    }
}

impl Tensor {
    /// A tensor with no feed, no return and no lease (yet).
    pub fn new(role: Role, index: usize, bytes: usize, dtype: DType, place: Place) -> Tensor {
        Tensor {
            role,
            index,
            bytes,
            dtype,
            ptr: 0,
            place,
            feed: Feed::NotFed,
            ret: Return::None,
            lease: None,
            varies: None,
            row_bytes: 0,
        }
    }

    /// How messages name it: "input 0", "the grad of param 2".
    pub fn describe(&self) -> String {
        let i = self.index;
        match self.role {
            Role::Input => format!("input {i}"),
            Role::Output => format!("output {i}"),
            Role::GradOutput => format!("grad-output {i}"),
            Role::GradInput => format!("the grad of input {i}"),
            Role::ParamGrads => format!("the grad of param {i}"),
        }
    }

    /// Whether the callback of the pass that writes it provides its buffer.
    pub fn external(&self) -> bool {
        self.place == Place::External
    }
}

/// The addresses of a list of tensors (0 where there is no buffer).
pub(crate) fn ptrs(tensors: &[Tensor]) -> Vec<DevPtr> {
    tensors.iter().map(|t| t.ptr).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    struct Counting {
        at: std::sync::Arc<std::sync::atomic::AtomicU64>,
        fail: bool,
    }

    impl Rebinder for Counting {
        fn nodes(&self) -> usize {
            2
        }
        fn rebind(&mut self, base: DevPtr) -> Result<()> {
            if self.fail {
                return Err(Error::Internal("no".into()));
            }
            self.at.store(base, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
    }

    #[test]
    fn a_rebinding_updates_its_plans_once_per_new_address() {
        let at = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let plan = |fail| -> Box<dyn Rebinder> {
            Box::new(Counting {
                at: at.clone(),
                fail,
            })
        };
        let mut r = Rebinding::new(vec![plan(false), plan(false)], 0x1000);
        assert_eq!(r.nodes(), 4);
        r.bind(0x1000).unwrap();
        assert_eq!(
            at.load(std::sync::atomic::Ordering::Relaxed),
            0,
            "already there"
        );
        r.bind(0x2000).unwrap();
        assert_eq!(at.load(std::sync::atomic::Ordering::Relaxed), 0x2000);
        // A failure part way leaves the binding unknown: the next bind redoes it.
        let mut bad = Rebinding::new(vec![plan(false), plan(true)], 0x1000);
        assert!(bad.bind(0x3000).is_err());
        assert_eq!(bad.bound, 0);
    }

    #[test]
    fn tensors_are_named_by_role() {
        let t = |role| Tensor::new(role, 2, 4, DType::F32, Place::Static).describe();
        assert_eq!(t(Role::Input), "input 2");
        assert_eq!(t(Role::GradInput), "the grad of input 2");
        assert_eq!(t(Role::ParamGrads), "the grad of param 2");
    }
}
