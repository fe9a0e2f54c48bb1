//! COPY_INTO grads written straight into their destination
//! (`GRAPHED_PARAM_FLAGS_REBIND_GRAD`), end to end on host-backend
//! sessions whose layers write their grads with library copies (which host
//! graphs can point elsewhere): written in place where verified, copied
//! where refused, and what verification refuses.

use super::super::session::Session;
use super::super::spec::{PassCallbacks, PassView, ReplayArgs};
use super::super::testing::{floats, host_inputs, read_floats, Fixture, BYTES, N};
use crate::backend::{AccItem, Backend, DevPtr, DeviceMemory, StreamRef};
use crate::core::dtype::DType;
use crate::core::policy::GradPolicy;
use crate::core::PassKind;
use std::sync::Arc;

/// A captured session of `f`'s callables.
fn session(f: Fixture) -> Session {
    let mut s = Session::new(f.backend.clone(), Some(f.pool.clone()), f.opts).unwrap();
    for c in f.callables {
        s.add_callable(c).unwrap();
    }
    s.capture().unwrap();
    s
}

/// One layer (a copy: every grad is its grad-output) with `params`
/// parameters, each COPY_INTO asked to be written in place; with
/// `external`, its grads are memory its callback provides.
fn layer(params: usize, external: bool) -> Fixture {
    let mut f = host_inputs(&[("a", params, false)]);
    if external {
        f.external(0, false);
    }
    for p in &mut f.callables[0].params {
        p.policy = GradPolicy::CopyInto;
        p.flags.rebind_grad = true;
    }
    f
}

fn args<'a>(data: &'a [DevPtr], dsts: Option<&'a [DevPtr]>) -> ReplayArgs<'a> {
    ReplayArgs {
        callable: 0,
        microbatch: 0,
        stream: StreamRef(0),
        side_stream: None,
        data: Some(data),
        param_dsts: dsts,
        params: None,
        size: 0,
        size2: 0,
        device_size: 0,
    }
}

/// `N` floats equal to `v` in memory of their own, `offset` bytes in.
fn filled(b: &Arc<dyn Backend>, v: f32, offset: u64) -> (DeviceMemory, DevPtr) {
    let m = DeviceMemory::new(b, BYTES + 256).unwrap();
    b.upload(m.ptr() + offset, &floats(v)).unwrap();
    let p = m.ptr() + offset;
    (m, p)
}

/// A forward on `x`, then a backward fed `gy` writing into `dsts`.
fn step(s: &mut Session, x: DevPtr, gy: DevPtr, dsts: &[DevPtr]) {
    s.forward(&args(&[x], None)).unwrap();
    let r = s.backward(&args(&[gy], Some(dsts))).unwrap();
    for (ret, &d) in r.second.iter().zip(dsts) {
        assert_eq!(ret.ptr, d, "a COPY_INTO ref names its destination");
    }
}

fn grads_in_place(external: bool) {
    let f = layer(2, external);
    let b = f.backend.clone();
    let mut s = session(f);
    let st = s.stats();
    assert_eq!((st.grads_in_place, st.grads_in_place_refused), (2, 0));
    let plan = s.plan_dump().unwrap();
    assert!(
        plan.contains("written straight into its destination"),
        "{plan}"
    );
    let (_x, x) = filled(&b, 1.0, 0);
    let (_g1, g1) = filled(&b, 5.0, 0);
    let (_g2, g2) = filled(&b, 7.0, 0);
    let (_d1, d1) = filled(&b, -1.0, 0);
    let (_d2, d2) = filled(&b, -1.0, 0);
    let (_e1, e1) = filled(&b, -1.0, 0);
    let (_e2, e2) = filled(&b, -1.0, 0);
    let grad = s
        .buffers(0, 0, crate::core::layout::Role::ParamGrads)
        .unwrap();
    for &g in &grad {
        b.upload(g, &floats(-3.0)).unwrap();
    }
    step(&mut s, x, g1, &[d1, d2]);
    assert_eq!(read_floats(b.as_ref(), d1), vec![5.0; N]);
    assert_eq!(read_floats(b.as_ref(), d2), vec![5.0; N]);
    // Written there, not into the grads' own buffers.
    for &g in &grad {
        assert_eq!(
            read_floats(b.as_ref(), g),
            vec![-3.0; N],
            "the grad's buffer was written"
        );
    }
    // The next replay writes its own destinations and leaves the first
    // ones (held by the caller) as they are.
    step(&mut s, x, g2, &[e1, e2]);
    assert_eq!(read_floats(b.as_ref(), e1), vec![7.0; N]);
    assert_eq!(
        read_floats(b.as_ref(), d1),
        vec![5.0; N],
        "a held grad was written"
    );
    // A destination less aligned than the grad's buffer: copied there.
    let (_o, odd) = filled(&b, -1.0, 4);
    step(&mut s, x, g1, &[odd, d2]);
    assert_eq!(read_floats(b.as_ref(), odd), vec![5.0; N]);
    assert_eq!(read_floats(b.as_ref(), d2), vec![5.0; N]);
}

#[test]
fn grads_of_the_slab_are_written_straight_into_each_replays_destination() {
    grads_in_place(false);
}

#[test]
fn external_grads_are_written_straight_into_each_replays_destination() {
    grads_in_place(true);
}

/// A layer whose backward adds its grad-output into its parameter grads
/// (reading what they held) or, as a temporary sharing a grad's memory
/// would, writes past their end from inside them.
struct Sloppy {
    backend: Arc<dyn Backend>,
    overrun: bool,
}

impl PassCallbacks for Sloppy {
    fn run(&self, v: &PassView) -> Result<(), i32> {
        let b = &self.backend;
        match v.pass {
            PassKind::Forward => b
                .copy(v.outputs[0], v.inputs[0], BYTES, v.stream)
                .map_err(|_| 1),
            _ => {
                b.copy(v.grad_inputs[0], v.grad_outputs[0], BYTES, v.stream)
                    .map_err(|_| 1)?;
                for &g in v.param_grads {
                    if self.overrun {
                        b.copy(g, v.grad_outputs[0], BYTES, v.stream)
                            .map_err(|_| 1)?;
                        // Its last 4 bytes and 4 past its end.
                        let tail = g + BYTES as DevPtr - 4;
                        b.copy(tail, v.grad_outputs[0], 8, v.stream)
                            .map_err(|_| 1)?;
                    } else {
                        let item = AccItem {
                            dst: g,
                            src: v.grad_outputs[0],
                            count: N,
                        };
                        b.accumulate(&[item], DType::F32, v.stream).map_err(|_| 1)?;
                    }
                }
                Ok(())
            }
        }
    }

    fn has_wgrad(&self) -> bool {
        false
    }

    fn hook(&self, _: super::super::spec::HookPoint, _: &PassView) -> Result<(), i32> {
        Ok(())
    }
}

fn refused(overrun: bool) {
    // Two parameters: the first grad's overrun lands in the second's.
    let mut f = layer(2, false);
    f.callables[0].callbacks = Box::new(Sloppy {
        backend: f.backend.clone(),
        overrun,
    });
    let b = f.backend.clone();
    let mut s = session(f);
    let st = s.stats();
    assert_eq!(
        st.grads_in_place, 0,
        "verification kept a plan it should refuse"
    );
    assert!(st.grads_in_place_refused >= 1);
    let plan = s.plan_dump().unwrap();
    assert!(plan.contains("copied into its destination"), "{plan}");
    // Copied: the destinations get what the grads' buffers got.
    let (_x, x) = filled(&b, 1.0, 0);
    let (_g, g) = filled(&b, 5.0, 0);
    let (_d1, d1) = filled(&b, -1.0, 0);
    let (_d2, d2) = filled(&b, -1.0, 0);
    let grad = s
        .buffers(0, 0, crate::core::layout::Role::ParamGrads)
        .unwrap();
    step(&mut s, x, g, &[d1, d2]);
    assert_eq!(
        read_floats(b.as_ref(), d1),
        read_floats(b.as_ref(), grad[0])
    );
}

#[test]
fn a_grad_pass_that_reads_what_its_grad_held_is_copied() {
    refused(false);
}

#[test]
fn a_grad_pass_that_writes_past_its_grad_is_copied() {
    refused(true);
}
