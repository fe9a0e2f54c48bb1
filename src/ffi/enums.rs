//! The C enums, each with its conversion to the plain Rust enum of the
//! layer that uses it. The enums are declared here as cbindgen reads them:
//! `#[repr(u32)]`, variants prefixed with the C name in the header
//! (`GRAPHED_DTYPE_F32`), never renumbered. Structs carry them as
//! `uint32_t` fields and functions take them as `uint32_t`, so an unknown
//! value is an `InvalidArgument` naming the field, never undefined
//! behaviour. cbindgen does not expand macros on a stable toolchain, so the
//! declaration stays literal; `c_enum!` beside it writes both conversions
//! as exhaustive matches, so a variant added on one side only does not
//! compile.

use crate::backend::{BackendKind, CaptureMode};
use crate::core::collective::CollectiveOp;
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::core::policy::{GradPolicy, ParamFlags};
use crate::core::PassKind;
use crate::error::{Error, Result};
use crate::orchestrate::spec::{CollectiveAt, Looping, UpdatePhase};
use crate::orchestrate::{LogLevel, Phase, RefKind};

/// Declares the conversions between C enum `$c` and Rust enum `$rust`.
macro_rules! c_enum {
    ($c:ident <=> $rust:ty { $($cv:ident <=> $rv:path),+ $(,)? }) => {
        impl $c {
            /// The Rust value of a C code; `InvalidArgument` naming `what`
            /// for any other value.
            #[allow(dead_code)]
            pub(crate) fn decode(code: u32, what: &str) -> Result<$rust> {
                $( if code == $c::$cv as u32 { return Ok($rv); } )+
                Err(Error::invalid(format!(
                    "{what}: {code} is not a {} value",
                    stringify!($c)
                )))
            }

            /// The C code of a Rust value.
            #[allow(dead_code)]
            pub(crate) fn encode(v: $rust) -> u32 {
                match v { $( $rv => $c::$cv as u32, )+ }
            }

            /// Every C variant has a Rust one.
            #[allow(dead_code)]
            fn rust(self) -> $rust {
                match self { $( $c::$cv => $rv, )+ }
            }
        }
    };
}

/// Element type of a tensor.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_dtype {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    F64 = 3,
    I8 = 4,
    U8 = 5,
    I32 = 6,
    I64 = 7,
    Bool = 8,
}

c_enum!(graphed_dtype <=> DType {
    F32 <=> DType::F32,
    F16 <=> DType::F16,
    Bf16 <=> DType::Bf16,
    F64 <=> DType::F64,
    I8 <=> DType::I8,
    U8 <=> DType::U8,
    I32 <=> DType::I32,
    I64 <=> DType::I64,
    Bool <=> DType::Bool,
});

/// How a parameter gradient is returned.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_grad_policy {
    /// No explicit choice: decided at capture (CLONE; ALIAS for
    /// delayed-wgrad parameters and when the session opts out of clones).
    Default = 0,
    /// A fresh buffer the caller owns (release its `owner` with
    /// graphed_buffer_release).
    Clone = 1,
    /// The static buffer itself: valid until this callable's next backward
    /// (or weight-grad) replay overwrites it.
    Alias = 2,
    /// Copied into a caller buffer given at replay; no allocation.
    CopyInto = 3,
    /// Added into a caller buffer given at replay (f32, f16, bf16; the
    /// buffer aligned to the element size).
    AccumulateInto = 4,
}

c_enum!(graphed_grad_policy <=> GradPolicy {
    Default <=> GradPolicy::Default,
    Clone <=> GradPolicy::Clone,
    Alias <=> GradPolicy::Alias,
    CopyInto <=> GradPolicy::CopyInto,
    AccumulateInto <=> GradPolicy::AccumulateInto,
});

/// Which backend a session runs on.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_backend {
    /// CUDA through the driver API.
    Cuda = 0,
    /// Host emulation: "device" memory is host memory, a stream is a task
    /// queue, capture records tasks and replay re-runs them.
    Host = 1,
}

c_enum!(graphed_backend <=> BackendKind {
    Cuda <=> BackendKind::Cuda,
    Host <=> BackendKind::Host,
});

/// Capture mode of the stream captures (see cudaStreamCaptureMode).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_capture_mode {
    /// Unsafe calls from any thread invalidate a capture (PyTorch's default).
    Global = 0,
    /// Only unsafe calls from the capturing thread invalidate it.
    ThreadLocal = 1,
    /// No checks.
    Relaxed = 2,
}

c_enum!(graphed_capture_mode <=> CaptureMode {
    Global <=> CaptureMode::Global,
    ThreadLocal <=> CaptureMode::ThreadLocal,
    Relaxed <=> CaptureMode::Relaxed,
});

/// Severity of a log message, most severe first.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_log_level {
    Error = 0,
    Warn = 1,
    Info = 2,
    Debug = 3,
}

c_enum!(graphed_log_level <=> LogLevel {
    Error <=> LogLevel::Error,
    Warn <=> LogLevel::Warn,
    Info <=> LogLevel::Info,
    Debug <=> LogLevel::Debug,
});

/// A pass of a callable.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_pass {
    Forward = 0,
    Backward = 1,
    /// The delayed weight-gradient pass.
    Wgrad = 2,
}

c_enum!(graphed_pass <=> PassKind {
    Forward <=> PassKind::Forward,
    Backward <=> PassKind::Backward,
    Wgrad <=> PassKind::Wgrad,
});

/// Whether a callback runs eagerly (warmup) or is being captured.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_phase {
    Warmup = 0,
    Capture = 1,
}

c_enum!(graphed_phase <=> Phase {
    Warmup <=> Phase::Warmup,
    Capture <=> Phase::Capture,
});

/// What a graphed_ref is.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_ref_kind {
    /// Nothing is returned for this slot (no gradient, or returned by
    /// another call).
    None = 0,
    /// The static buffer itself; valid until the replay that overwrites it.
    Alias = 1,
    /// An owned copy; release `owner` with graphed_buffer_release.
    Clone = 2,
    /// Copied into the caller's buffer.
    CopyInto = 3,
    /// Added into the caller's buffer.
    AccumulateInto = 4,
}

c_enum!(graphed_ref_kind <=> RefKind {
    None <=> RefKind::None,
    Alias <=> RefKind::Alias,
    Clone <=> RefKind::Clone,
    CopyInto <=> RefKind::CopyInto,
    AccumulateInto <=> RefKind::AccumulateInto,
});

/// How a step's graph holds its microbatches (graphed_step_desc.loop_mode).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_step_loop {
    /// Every microbatch captured in turn: each replay runs all of them.
    Unrolled = 0,
    /// One microbatch captured as the body of a conditional WHILE node:
    /// a replay runs 1 to `microbatches` of them
    /// (graphed_step_args.microbatches), counted on the device. Needs a
    /// CUDA 12.4 driver (the host backend emulates it).
    While = 1,
}

c_enum!(graphed_step_loop <=> Looping {
    Unrolled <=> Looping::Unrolled,
    While <=> Looping::Device,
});

/// Which part of a step's update a call of its update callback records
/// (graphed_update_ctx.phase).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_update_phase {
    /// graphed_step_desc.update_check: reads the grads and writes the skip
    /// flag (ctx->skip_flag), into the step's graph itself.
    Check = 0,
    /// graphed_step_desc.update_apply: the parameter update; with a check,
    /// the body of a conditional IF node that runs only when the flag is 0.
    Apply = 1,
}

c_enum!(graphed_update_phase <=> UpdatePhase {
    Check <=> UpdatePhase::Check,
    Apply <=> UpdatePhase::Apply,
});

/// Where a step's collective callback runs (graphed_step_desc
/// .collective_at).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_collective_at {
    /// Once, after the last microbatch's backward, with every parameter's
    /// accumulated grad (ctx->callable is GRAPHED_COLLECTIVE_ALL_CALLABLES).
    AfterBackward = 0,
    /// After each callable's grad pass (its weight-grad pass where it has
    /// one) in the last microbatch, in backward order, with that callable's
    /// grads: bucket by bucket, so that communication can overlap the
    /// backward of the callables before it.
    PerCallable = 1,
}

c_enum!(graphed_collective_at <=> CollectiveAt {
    AfterBackward <=> CollectiveAt::AfterBackward,
    PerCallable <=> CollectiveAt::PerCallable,
});

/// The operation of a collective (graphed_collective_record).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_collective_op {
    AllReduce = 0,
    AllGather = 1,
    ReduceScatter = 2,
    Broadcast = 3,
    /// Any other (send/recv, a custom kernel that communicates).
    Other = 4,
}

c_enum!(graphed_collective_op <=> CollectiveOp {
    AllReduce <=> CollectiveOp::AllReduce,
    AllGather <=> CollectiveOp::AllGather,
    ReduceScatter <=> CollectiveOp::ReduceScatter,
    Broadcast <=> CollectiveOp::Broadcast,
    Other <=> CollectiveOp::Other,
});

/// The static buffers of a role (graphed_session_buffers,
/// graphed_pass_set_buffer).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_buffer_role {
    Input = 0,
    Output = 1,
    GradOutput = 2,
    GradInput = 3,
    /// One entry per parameter: its slot in the parameter-grad slab.
    ParamGrads = 4,
}

c_enum!(graphed_buffer_role <=> Role {
    Input <=> Role::Input,
    Output <=> Role::Output,
    GradOutput <=> Role::GradOutput,
    GradInput <=> Role::GradInput,
    ParamGrads <=> Role::ParamGrads,
});

/// Flags of a graphed_tensor_desc (bit set).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_tensor_flags {
    None = 0,
    /// The library places no buffer for what the callable writes for this
    /// tensor (the output itself, or the grad of an input): the callback
    /// writes it wherever it likes and, during capture, hands its address to
    /// graphed_pass_set_buffer (it must stay valid while the session's
    /// graphs exist). Replays return that address. For frameworks that
    /// allocate outputs and grads themselves (PyTorch).
    External = 1,
    /// Inputs: the input is another callable's static output
    /// (chain_callable, chain_output), read in place; no copy at replay.
    Chained = 2,
    /// Inputs: a replay with other data points the captured graphs at it
    /// instead of copying it into the static input (floating-point inputs
    /// whose graphs take the address as a kernel argument; capture verifies
    /// it and otherwise copies, saying why in the plan dump). The data must
    /// be 256-byte aligned (others are copied) and stay unchanged until the
    /// callable's backward has run (and its weight-grad pass, if any).
    /// Outputs: the same for the output's grad-output, given at backward:
    /// it must stay unchanged until that backward (and the weight-grad
    /// pass, if any) has run.
    Rebind = 4,
    /// The tensor's first dimension is the callable's dynamic size
    /// (graphed_callable_desc.bucket_sizes): its `shape` is given, with the
    /// largest bucket's size first, and `bytes` are the largest bucket's.
    /// In a bucket of n rows the tensor is the first n rows of its buffer.
    /// With EXTERNAL, the buffer is the one each bucket's capture provided
    /// (its callback writes the bucket's rows; a replay returns the actual
    /// rows of the bucket it ran). Not with CHAINED or REBIND (an input
    /// chained to a DYNAMIC output is DYNAMIC by that).
    Dynamic = 8,
}

/// What a tensor's flags say.
pub(crate) struct TensorFlags {
    pub external: bool,
    pub chained: bool,
    pub rebind: bool,
    pub dynamic: bool,
}

impl graphed_tensor_flags {
    /// The flags of a bit set; unknown bits are refused.
    pub(crate) fn decode(bits: u32, what: &str) -> Result<TensorFlags> {
        let (external, chained, rebind, dynamic) = (
            graphed_tensor_flags::External as u32,
            graphed_tensor_flags::Chained as u32,
            graphed_tensor_flags::Rebind as u32,
            graphed_tensor_flags::Dynamic as u32,
        );
        let known = external | chained | rebind | dynamic;
        if bits & !known != 0 {
            return Err(Error::invalid(format!(
                "{what} has unknown bits 0x{:x}",
                bits & !known
            )));
        }
        if bits & chained != 0 && bits & rebind != 0 {
            return Err(Error::invalid(format!(
                "{what}: a chained input is read in place; it cannot also be rebound"
            )));
        }
        if bits & dynamic != 0 && bits & (chained | rebind) != 0 {
            return Err(Error::invalid(format!(
                "{what}: a DYNAMIC tensor is copied in and out of its bucket's rows; it cannot also be \
                 CHAINED or REBIND"
            )));
        }
        Ok(TensorFlags {
            external: bits & external != 0,
            chained: bits & chained != 0,
            rebind: bits & rebind != 0,
            dynamic: bits & dynamic != 0,
        })
    }
}

/// Flags of a parameter (bit set).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum graphed_param_flags {
    None = 0,
    /// The parameter's real gradient is produced elsewhere (delayed
    /// weight-gradient, Transformer Engine's skip_backward_post_hook): its
    /// returned grad keeps aliasing the static buffer by default.
    DelayedWgrad = 1,
    /// The parameter's grad is provided by the callback at capture (external
    /// memory, e.g. a framework's tensor), not placed in the slab.
    ExternalGrad = 2,
    /// The parameter may move between iterations: capture plans and
    /// verifies pointing its graphs at another address (it fills the
    /// parameter with a pattern for one verification replay and puts its
    /// bytes back before capture returns), and a forward replay given its
    /// new address (graphed_replay_args.params) points them there instead
    /// of reading the old memory.
    Rebind = 4,
    /// With GRAPHED_GRAD_POLICY_COPY_INTO: the grad is written straight
    /// into the destination a replay gives (graphed_replay_args.param_dsts)
    /// instead of into the grad's buffer and then copied. Capture plans and
    /// verifies pointing the pass that writes the grad (backward, or
    /// weight-grad where there is one) at another buffer, as for REBIND:
    /// a replay with a destination then points that pass's graph at it
    /// (node updates only when the destination changes). Where capture
    /// refused it (graphed_session_plan_dump says why), where the
    /// destination is less aligned than the grad's buffer (up to 256
    /// bytes), and on replays that run another graph of the pass (a clone
    /// slot's, a device-chosen bucket's, a step's), the grad is copied as
    /// COPY_INTO does. Either way the destination holds the grad once the
    /// replay has run, and its previous contents are not read; nothing else
    /// may use it until then. With EXTERNAL_GRAD, the memory the callback
    /// provides must be the grad's alone while its pass is captured: no
    /// other buffer the pass uses (a temporary a framework's pool handed
    /// the same memory earlier in the pass) may overlap it, or pointing the
    /// graph elsewhere would take that buffer's references along. Another
    /// policy with this flag is GRAPHED_STATUS_INVALID_ARGUMENT at
    /// registration.
    RebindGrad = 8,
}

impl graphed_param_flags {
    /// The flags of a bit set; unknown bits are refused.
    pub(crate) fn decode(bits: u32, what: &str) -> Result<ParamFlags> {
        let (delayed, external, rebind, rebind_grad) = (
            graphed_param_flags::DelayedWgrad as u32,
            graphed_param_flags::ExternalGrad as u32,
            graphed_param_flags::Rebind as u32,
            graphed_param_flags::RebindGrad as u32,
        );
        let known = delayed | external | rebind | rebind_grad;
        if bits & !known != 0 {
            return Err(Error::invalid(format!(
                "{what} has unknown bits 0x{:x}",
                bits & !known
            )));
        }
        Ok(ParamFlags {
            delayed_wgrad: bits & delayed != 0,
            external_grad: bits & external != 0,
            rebind: bits & rebind != 0,
            rebind_grad: bits & rebind_grad != 0,
        })
    }
}

/// A 0/1 flag field; anything else is refused (C has no bool the ABI can
/// trust).
pub(crate) fn decode_bool(v: u32, what: &str) -> Result<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(Error::invalid(format!("{what} is {v}; it must be 0 or 1"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_refused() {
        for code in 0..9 {
            let d = graphed_dtype::decode(code, "x").unwrap();
            assert_eq!(graphed_dtype::encode(d), code);
        }
        let e = graphed_dtype::decode(9, "desc.inputs[0].dtype").unwrap_err();
        assert!(
            e.to_string()
                .contains("desc.inputs[0].dtype: 9 is not a graphed_dtype value"),
            "{e}"
        );
        assert!(graphed_grad_policy::decode(5, "p").is_err());
        assert!(graphed_pass::decode(3, "p").is_err());
        assert!(graphed_buffer_role::decode(u32::MAX, "role").is_err());
        assert_eq!(graphed_ref_kind::encode(RefKind::Clone), 2);
        assert_eq!(graphed_backend::Host.rust(), BackendKind::Host);
    }

    #[test]
    fn flags_and_bools_refuse_unknown_bits() {
        assert!(graphed_param_flags::decode(16, "f").is_err());
        assert!(graphed_param_flags::decode(8, "f").unwrap().rebind_grad);
        assert!(graphed_param_flags::decode(3, "f").unwrap().external_grad);
        assert!(graphed_param_flags::decode(4, "f").unwrap().rebind);
        assert!(graphed_tensor_flags::decode(16, "f").is_err());
        assert!(graphed_tensor_flags::decode(8, "f").unwrap().dynamic);
        for other in [2, 4] {
            assert!(
                graphed_tensor_flags::decode(8 | other, "f").is_err(),
                "dynamic with {other}"
            );
        }
        let f = graphed_tensor_flags::decode(8 | 1, "f").unwrap();
        assert!(f.dynamic && f.external, "dynamic and external");
        assert!(
            graphed_tensor_flags::decode(6, "f").is_err(),
            "chained and rebound"
        );
        assert!(graphed_tensor_flags::decode(2, "f").unwrap().chained);
        assert!(decode_bool(2, "b").is_err());
        assert!(decode_bool(1, "b").unwrap());
    }
}
