//! Fixtures for the orchestration's unit tests: host-backend sessions of
//! small layers whose callbacks enqueue host copies (which the host
//! backend's graphs can rebind), so that every step of capture runs
//! without a GPU; and a layer whose output and parameter grads are
//! external, provided as a framework's allocator would.

use super::context::Inputs;
use super::instance::{PassRef, Placed};
use super::place;
use super::pool::Pool;
use super::spec::{
    CallableSpec, HookPoint, MemCounters, PassCallbacks, PassView, Phase, SessionOptions, StepSpec,
    TensorSpec,
};
use crate::backend::host::HostBackend;
use crate::backend::{AccItem, Backend, DevPtr, DeviceMemory};
use crate::core::dtype::DType;
use crate::core::layout::Role;
use crate::core::policy::{GradPolicy, ParamFlags, ParamSpec};
use crate::core::schedule::Schedule;
use crate::core::PassKind;
use std::sync::{Arc, Mutex};

/// Elements per tensor and parameter of a test layer.
pub const N: usize = 16;
pub const BYTES: usize = N * 4;

/// A layer whose forward copies its input to its output (then, when it
/// reads its parameters, adds each to it) and whose backward (or
/// weight-grad) copies the grad-output to the input's grad and to every
/// parameter's grad.
struct CopyLayer {
    backend: Arc<dyn Backend>,
    wgrad: bool,
    reads_params: bool,
}

impl CopyLayer {
    fn copy(&self, dst: DevPtr, src: DevPtr, v: &PassView) -> Result<(), i32> {
        if dst == 0 || src == 0 {
            return Ok(());
        }
        self.backend.copy(dst, src, BYTES, v.stream).map_err(|_| 1)
    }
}

impl PassCallbacks for CopyLayer {
    fn run(&self, v: &PassView) -> Result<(), i32> {
        let params = |v: &PassView| -> Result<(), i32> {
            for &g in v.param_grads {
                self.copy(g, v.grad_outputs[0], v)?;
            }
            Ok(())
        };
        match v.pass {
            PassKind::Forward => {
                self.copy(v.outputs[0], v.inputs[0], v)?;
                if !self.reads_params {
                    return Ok(());
                }
                let items: Vec<AccItem> = v
                    .params
                    .iter()
                    .map(|&p| AccItem {
                        dst: v.outputs[0],
                        src: p,
                        count: N,
                    })
                    .collect();
                self.backend
                    .accumulate(&items, DType::F32, v.stream)
                    .map_err(|_| 1)
            }
            PassKind::Backward => {
                self.copy(v.grad_inputs[0], v.grad_outputs[0], v)?;
                if self.wgrad {
                    Ok(())
                } else {
                    params(v)
                }
            }
            PassKind::Wgrad => params(v),
        }
    }

    fn has_wgrad(&self) -> bool {
        self.wgrad
    }

    fn hook(&self, _: HookPoint, _: &PassView) -> Result<(), i32> {
        Ok(())
    }
}

/// What an `ExternalLayer` saw under capture: per pass kind, the address
/// its callback wrote its external output (forward) or first parameter
/// grad (grad pass) to, and whether the library handed it that address
/// (false: the callback provided it); and what providing one again said.
#[derive(Default)]
pub struct ExternalLog {
    pub writes: Vec<(PassKind, DevPtr, bool)>,
    pub refusals: Vec<String>,
}

/// A `CopyLayer` whose output and parameter grads are external: where its
/// view holds no address for one (warmup, its own capture), it allocates
/// fresh memory as a framework's allocator would, and provides it under
/// capture; where the view holds one (a step's capture), it writes there.
/// With `provide_again`, it also tries to provide that one again, and
/// fails with 3 when that is refused.
struct ExternalLayer {
    backend: Arc<dyn Backend>,
    provide_again: bool,
    held: Mutex<Vec<DeviceMemory>>,
    log: Arc<Mutex<ExternalLog>>,
}

impl ExternalLayer {
    /// The address to write (role, index) to: the view's, or fresh memory
    /// (provided under capture).
    fn target(&self, v: &PassView, role: Role, index: usize, at: DevPtr) -> Result<DevPtr, i32> {
        let capture = v.phase == Phase::Capture;
        if at != 0 {
            if let (true, true, Some(p)) = (capture, self.provide_again, v.provided) {
                if let Err(e) = p.set(role, index, at) {
                    self.log.lock().unwrap().refusals.push(e.to_string());
                    return Err(3);
                }
            }
            return Ok(at);
        }
        let m = DeviceMemory::new(&self.backend, BYTES).map_err(|_| 4)?;
        let ptr = m.ptr();
        self.held.lock().unwrap().push(m);
        if let (true, Some(p)) = (capture, v.provided) {
            p.set(role, index, ptr).map_err(|_| 5)?;
        }
        Ok(ptr)
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, v: &PassView) -> Result<(), i32> {
        self.backend.copy(dst, src, BYTES, v.stream).map_err(|_| 1)
    }
}

impl PassCallbacks for ExternalLayer {
    fn run(&self, v: &PassView) -> Result<(), i32> {
        let capture = v.phase == Phase::Capture;
        let (role, index, at) = match v.pass {
            PassKind::Forward => (Role::Output, 0, v.outputs[0]),
            _ => (Role::ParamGrads, 0, v.param_grads[0]),
        };
        let handed = at != 0;
        let dst = self.target(v, role, index, at)?;
        if capture {
            self.log.lock().unwrap().writes.push((v.pass, dst, handed));
        }
        match v.pass {
            PassKind::Forward => self.copy(dst, v.inputs[0], v),
            _ => {
                self.copy(v.grad_inputs[0], v.grad_outputs[0], v)?;
                self.copy(dst, v.grad_outputs[0], v)?;
                for (j, &g) in v.param_grads.iter().enumerate().skip(1) {
                    let g = self.target(v, Role::ParamGrads, j, g)?;
                    self.copy(g, v.grad_outputs[0], v)?;
                }
                Ok(())
            }
        }
    }

    fn has_wgrad(&self) -> bool {
        false
    }

    fn hook(&self, _: HookPoint, _: &PassView) -> Result<(), i32> {
        Ok(())
    }
}

fn tensor(requires_grad: bool) -> TensorSpec {
    TensorSpec {
        bytes: BYTES,
        dtype: DType::F32,
        shape: vec![N as i64],
        requires_grad,
        sample: 0,
        external: false,
        chained: None,
        rebind: false,
        dynamic: false,
        dims: (Some(0), None),
    }
}

/// A host session's parts, owned, to build `Inputs` from.
pub struct Fixture {
    pub backend: Arc<dyn Backend>,
    pub pool: Arc<Pool>,
    pub opts: SessionOptions,
    pub callables: Vec<CallableSpec>,
    pub steps: Vec<StepSpec>,
    pub counters: Arc<MemCounters>,
}

impl Fixture {
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            backend: &self.backend,
            pool: &self.pool,
            opts: &self.opts,
            callables: &self.callables,
            steps: &self.steps,
            counters: &self.counters,
        }
    }

    /// The default order of its callables' passes.
    pub fn schedule(&self) -> Schedule {
        let wgrad: Vec<bool> = self
            .callables
            .iter()
            .map(|c| c.callbacks.has_wgrad())
            .collect();
        Schedule::sequential(&wgrad)
    }

    /// The default capture order of its passes.
    pub fn order(&self) -> Vec<PassRef> {
        self.schedule()
            .passes
            .iter()
            .map(|q| PassRef {
                instance: q.callable,
                kind: q.kind,
            })
            .collect()
    }

    /// Its instances placed in a static allocation at `base`.
    pub fn placed(&self, base: DevPtr) -> Vec<Placed> {
        let s = self.inputs();
        let p = place::plan(&s, &self.schedule()).unwrap();
        place::place(&s, &p, base, &self.order()).unwrap()
    }

    /// The static bytes its placement needs.
    pub fn static_bytes(&self) -> usize {
        place::plan(&self.inputs(), &self.schedule())
            .unwrap()
            .plan
            .total_bytes
    }

    /// A layer of this fixture's backend (see `layer`).
    pub fn layer(&self, name: &str, params: usize, wgrad: bool) -> CallableSpec {
        CallableSpec {
            name: name.into(),
            inputs: vec![tensor(true)],
            params: (0..params)
                .map(|j| ParamSpec {
                    data: 0x1000 * (j as u64 + 1),
                    bytes: BYTES,
                    dtype: DType::F32,
                    requires_grad: true,
                    flags: ParamFlags::default(),
                    policy: GradPolicy::Default,
                })
                .collect(),
            outputs: vec![tensor(true)],
            callbacks: Box::new(CopyLayer {
                backend: self.backend.clone(),
                wgrad,
                reads_params: false,
            }),
            buckets: Vec::new(),
            buckets2: Vec::new(),
        }
    }

    /// Makes callable `c` an `ExternalLayer` (its output and every
    /// parameter grad external); returns what it sees under capture.
    pub fn external(&mut self, c: usize, provide_again: bool) -> Arc<Mutex<ExternalLog>> {
        let log = Arc::new(Mutex::new(ExternalLog::default()));
        let spec = &mut self.callables[c];
        spec.outputs[0].external = true;
        for p in &mut spec.params {
            p.flags.external_grad = true;
        }
        spec.callbacks = Box::new(ExternalLayer {
            backend: self.backend.clone(),
            provide_again,
            held: Mutex::new(Vec::new()),
            log: log.clone(),
        });
        log
    }

    /// Makes callable `c` a layer whose forward adds its parameters to its
    /// output, each parameter in memory of its own holding `value`
    /// (returned: keep it alive while the fixture is used).
    pub fn reading_params(&mut self, c: usize, value: f32) -> Vec<DeviceMemory> {
        let spec = &mut self.callables[c];
        let wgrad = spec.callbacks.has_wgrad();
        spec.callbacks = Box::new(CopyLayer {
            backend: self.backend.clone(),
            wgrad,
            reads_params: true,
        });
        spec.params
            .iter_mut()
            .map(|p| {
                let m = DeviceMemory::new(&self.backend, BYTES).unwrap();
                self.backend.upload(m.ptr(), &floats(value)).unwrap();
                p.data = m.ptr();
                m
            })
            .collect()
    }
}

/// A tensor of `N` floats equal to `v`, as bytes.
pub fn floats(v: f32) -> Vec<u8> {
    (0..N).flat_map(|_| v.to_ne_bytes()).collect()
}

/// The `N` floats at `p`.
pub fn read_floats(backend: &dyn Backend, p: DevPtr) -> Vec<f32> {
    let mut b = vec![0u8; BYTES];
    backend.download(&mut b, p).unwrap();
    b.chunks(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A host session with default options and no callables yet.
pub fn host() -> Fixture {
    let backend: Arc<dyn Backend> = HostBackend::new();
    Fixture {
        pool: Pool::new(backend.clone()),
        backend,
        opts: SessionOptions::default(),
        callables: Vec::new(),
        steps: Vec::new(),
        counters: Arc::new(MemCounters::default()),
    }
}

/// A host session of `layers` (name, parameters, weight-grad pass).
pub fn host_inputs(layers: &[(&str, usize, bool)]) -> Fixture {
    let mut f = host();
    f.callables = layers
        .iter()
        .map(|&(name, params, wgrad)| f.layer(name, params, wgrad))
        .collect();
    f
}

/// a (external output and parameter grad, COPY_INTO `dst`) then b
/// (CLONE grads), in one step with two clone slots.
pub fn external_step(provide_again: bool) -> (Fixture, DeviceMemory) {
    let mut f = host_inputs(&[("a", 1, false), ("b", 1, false)]);
    f.opts.clone_slots = 2;
    f.external(0, provide_again);
    f.callables[0].params[0].policy = GradPolicy::CopyInto;
    let dst = DeviceMemory::new(&f.backend, BYTES).unwrap();
    f.steps = vec![StepSpec::plain(vec![0, 1], vec![dst.ptr(), 0])];
    (f, dst)
}
