//! Verification with graphs that lie about where they read: inputs and
//! grad-outputs rebound or copied, parameters movable or fixed.

use super::RebindPlan;
use crate::backend::{DevPtr, Rebinder};
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// A test graph's one read (`src`), rebound by moving it; a dishonest plan
/// says it moved and does not.
struct SrcPlan {
    src: Arc<AtomicU64>,
    honest: bool,
}

impl Rebinder for SrcPlan {
    fn nodes(&self) -> usize {
        1
    }
    fn rebind(&mut self, base: DevPtr) -> Result<()> {
        if self.honest {
            self.src.store(base, Relaxed);
        }
        Ok(())
    }
}

/// The plan of a test graph that reads `src`: where `base` is what it
/// reads, a SrcPlan; else it does not reference `base`.
fn plan_of(src: &Arc<AtomicU64>, honest: bool, base: DevPtr) -> Result<RebindPlan> {
    if base != src.load(Relaxed) {
        return Ok(RebindPlan::Unreferenced);
    }
    Ok(RebindPlan::Plan(Box::new(SrcPlan {
        src: src.clone(),
        honest,
    })))
}

mod copies {
    use super::super::super::testing::{host_inputs, Fixture, BYTES};
    use super::super::*;
    use crate::backend::Graph;
    use crate::backend::{Backend, DevPtr, DeviceMemory, StreamRef};
    use crate::core::dtype::DType;
    use crate::core::PassKind;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
    use std::sync::Arc;

    /// A forward that copies its input to its output. An honest one reads
    /// where its plan points it; a sneaky one keeps reading the address it
    /// was captured with (as a kernel reading the address from memory
    /// would), though its plan claims to move it.
    struct CopyGraph {
        backend: Arc<dyn Backend>,
        src: Arc<AtomicU64>,
        dst: DevPtr,
        honest: bool,
        /// Zeroes its input after reading it (an in-place writer).
        writes_input: bool,
        launches: Arc<AtomicUsize>,
    }

    impl Graph for CopyGraph {
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }

        fn launch(&self, stream: StreamRef) -> Result<()> {
            self.launches.fetch_add(1, Relaxed);
            let src = self.src.load(Relaxed);
            self.backend.copy(self.dst, src, BYTES, stream)?;
            if self.writes_input {
                self.backend.zero(src, BYTES, stream)?;
            }
            Ok(())
        }
        fn rebinder(&self, base: DevPtr, _bytes: usize) -> Result<RebindPlan> {
            super::plan_of(&self.src, self.honest, base)
        }
    }

    /// Placed instances of `f` in host memory, and each one's forward
    /// graph (honest or not) with a launch counter.
    fn setup(
        f: &Fixture,
        honest: &[bool],
        writes_input: bool,
    ) -> (Vec<Placed>, Vec<PassGraphs>, Arc<AtomicUsize>, DeviceMemory) {
        let statics = DeviceMemory::new(&f.backend, f.static_bytes()).unwrap();
        let placed = f.placed(statics.ptr());
        let launches = Arc::new(AtomicUsize::new(0));
        let graphs = placed
            .iter()
            .zip(honest)
            .map(|(inst, &honest)| {
                f.backend.upload(inst.inputs[0].ptr, &[3u8; BYTES]).unwrap();
                let mut g = PassGraphs::default();
                g.passes[PassKind::Forward.index()] = Some(Box::new(CopyGraph {
                    backend: f.backend.clone(),
                    src: Arc::new(AtomicU64::new(inst.inputs[0].ptr)),
                    dst: inst.outputs[0].ptr,
                    honest,
                    writes_input,
                    launches: launches.clone(),
                }) as Box<dyn Graph>);
                g
            })
            .collect();
        (placed, graphs, launches, statics)
    }

    /// The placed instances after `resolve`, the launches it made, and
    /// their static memory (kept alive for the caller to read).
    fn resolved(f: &Fixture, honest: &[bool]) -> (Vec<Placed>, usize, DeviceMemory) {
        resolved_with(f, honest, false)
    }

    fn resolved_with(
        f: &Fixture,
        honest: &[bool],
        writes_input: bool,
    ) -> (Vec<Placed>, usize, DeviceMemory) {
        let (mut placed, mut graphs, launches, statics) = setup(f, honest, writes_input);
        let mut times = CaptureTimes::default();
        let s = f.inputs();
        resolve(&s, &mut placed, &mut graphs, StreamRef(0), &mut times).unwrap();
        (placed, launches.load(Relaxed), statics)
    }

    #[test]
    fn verification_keeps_what_gives_the_same_bits_and_refuses_the_rest() {
        let mut f = host_inputs(&[("honest", 1, false), ("sneaky", 1, false)]);
        for c in &mut f.callables {
            c.inputs[0].rebind = true;
        }
        let (placed, launches, _statics) = resolved(&f, &[true, false]);
        assert!(placed[0].inputs[0].feed.is_rebound());
        let Feed::Refused(why) = &placed[1].inputs[0].feed else {
            panic!("the sneaky graph reads the static buffer")
        };
        assert!(why.contains("other results"), "{why}");
        // One copying and one rebound replay of each instance's graph: with
        // one tensor, "together" is "alone".
        assert_eq!(launches, 2 + 2);
        // The graphs point back at the static buffers, which hold their data.
        let mut back = [0u8; BYTES];
        f.backend
            .download(&mut back, placed[1].inputs[0].ptr)
            .unwrap();
        assert_eq!(back, [3u8; BYTES]);
    }

    #[test]
    fn one_verification_decides_every_tensor_of_an_instance() {
        let mut f = host_inputs(&[("a", 1, false)]);
        f.callables[0].inputs[0].rebind = true;
        // Its grad-output is read by no graph here: refused before any replay.
        f.callables[0].outputs[0].rebind = true;
        let (placed, launches, _statics) = resolved(&f, &[true]);
        assert!(placed[0].inputs[0].feed.is_rebound());
        let Feed::Refused(why) = &placed[0].grad_outputs[0].feed else {
            panic!("no graph reads the grad-output")
        };
        assert!(why.contains("no graph"), "{why}");
        assert_eq!(launches, 2, "two replays, not two per tensor");
    }

    #[test]
    fn what_cannot_be_planned_is_refused_with_its_reason() {
        let mut f = host_inputs(&[("ints", 1, false), ("p", 1, false), ("c", 1, false)]);
        f.callables[0].inputs[0].dtype = DType::I32;
        f.callables[0].inputs[0].rebind = true;
        f.callables[0].outputs[0].requires_grad = false;
        f.callables[0].outputs[0].rebind = true;
        f.callables[2].inputs[0].chained = Some((1, 0));
        f.callables[2].inputs[0].rebind = true;
        let (placed, launches, _statics) = resolved(&f, &[true, true, true]);
        let why = |feed: &Feed| match feed {
            Feed::Refused(w) => w.clone(),
            _ => panic!("refused"),
        };
        assert!(why(&placed[0].inputs[0].feed).contains("floating-point"));
        assert!(why(&placed[0].grad_outputs[0].feed).contains("no static buffer"));
        assert!(
            matches!(placed[2].inputs[0].feed, Feed::Chained),
            "a chained input keeps its feed (and its replay checks)"
        );
        assert_eq!(launches, 0, "nothing was verified");
    }

    #[test]
    fn a_graph_that_writes_what_it_is_fed_is_not_rebound() {
        let mut f = host_inputs(&[("in_place", 1, false)]);
        f.callables[0].inputs[0].rebind = true;
        let (placed, _, _statics) = resolved_with(&f, &[true], true);
        let Feed::Refused(why) = &placed[0].inputs[0].feed else {
            panic!("rebound, the graph would zero the caller's input")
        };
        assert!(why.contains("wrote the data it was fed"), "{why}");
        // The static input holds what it held before verification.
        let mut back = [0u8; BYTES];
        f.backend
            .download(&mut back, placed[0].inputs[0].ptr)
            .unwrap();
        assert_eq!(back, [3u8; BYTES]);
    }
}

mod params {
    use super::super::super::testing::{floats, host_inputs, read_floats, Fixture};
    use super::super::*;
    use crate::backend::Graph;
    use crate::backend::{Backend, DevPtr, DeviceMemory, StreamRef};
    use crate::core::PassKind;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;

    /// A forward that copies parameter 0 to its output: honestly where its
    /// plan points it, or (sneaky) always from the captured address.
    struct ReadsParam {
        backend: Arc<dyn Backend>,
        src: Arc<AtomicU64>,
        dst: DevPtr,
        honest: bool,
    }

    impl Graph for ReadsParam {
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }

        fn launch(&self, stream: StreamRef) -> Result<()> {
            let n = crate::orchestrate::testing::BYTES;
            self.backend
                .copy(self.dst, self.src.load(Relaxed), n, stream)
        }
        fn rebinder(&self, base: DevPtr, _bytes: usize) -> Result<RebindPlan> {
            super::plan_of(&self.src, self.honest, base)
        }
    }

    /// Resolves one layer whose forward reads parameter 0 (honestly or
    /// not); returns the placed instance and the parameter's memory.
    fn resolved(f: &mut Fixture, honest: bool) -> (Placed, Vec<DeviceMemory>, DeviceMemory) {
        let mem = f.reading_params(0, 4.0);
        for p in &mut f.callables[0].params {
            p.flags.rebind = true;
        }
        let statics = DeviceMemory::new(&f.backend, f.static_bytes()).unwrap();
        let mut placed = f.placed(statics.ptr());
        let mut g = PassGraphs::default();
        g.passes[PassKind::Forward.index()] = Some(Box::new(ReadsParam {
            backend: f.backend.clone(),
            src: Arc::new(AtomicU64::new(mem[0].ptr())),
            dst: placed[0].outputs[0].ptr,
            honest,
        }) as Box<dyn Graph>);
        let mut graphs = vec![g];
        let mut times = CaptureTimes::default();
        resolve(
            &f.inputs(),
            &mut placed,
            &mut graphs,
            StreamRef(0),
            &mut times,
        )
        .unwrap();
        (placed.remove(0), mem, statics)
    }

    #[test]
    fn a_parameter_read_through_its_plan_can_move_and_keeps_its_bytes() {
        let mut f = host_inputs(&[("a", 1, false)]);
        let (inst, mem, _statics) = resolved(&mut f, true);
        assert!(inst.params[0].movable());
        assert_eq!(
            read_floats(f.backend.as_ref(), mem[0].ptr()),
            floats_of(4.0)
        );
    }

    #[test]
    fn a_parameter_read_behind_its_plan_stays_fixed_with_the_reason() {
        let mut f = host_inputs(&[("a", 1, false)]);
        let (inst, mem, _statics) = resolved(&mut f, false);
        let ParamFeed::Fixed(why) = &inst.params[0].feed else {
            panic!("the sneaky graph reads the registered address")
        };
        assert!(why.contains("other results"), "{why}");
        // The pattern verification wrote there is gone again.
        assert_eq!(
            read_floats(f.backend.as_ref(), mem[0].ptr()),
            floats_of(4.0)
        );
        assert!(inst.params[0].refusal(mem[0].ptr() + 256).is_some());
        assert!(inst.params[0].refusal(mem[0].ptr()).is_none());
    }

    #[test]
    fn parameters_that_share_memory_stay_fixed() {
        let mut f = host_inputs(&[("a", 2, false)]);
        let mem = f.reading_params(0, 1.0);
        // Param 1 is param 0, registered twice.
        f.callables[0].params[1].data = mem[0].ptr();
        for p in &mut f.callables[0].params {
            p.flags.rebind = true;
        }
        let statics = DeviceMemory::new(&f.backend, f.static_bytes()).unwrap();
        let mut placed = f.placed(statics.ptr());
        let mut graphs = vec![PassGraphs::default()];
        graphs[0].passes[PassKind::Forward.index()] = Some(Box::new(ReadsParam {
            backend: f.backend.clone(),
            src: Arc::new(AtomicU64::new(mem[0].ptr())),
            dst: placed[0].outputs[0].ptr,
            honest: true,
        }) as Box<dyn Graph>);
        let mut times = CaptureTimes::default();
        let s = f.inputs();
        resolve(&s, &mut placed, &mut graphs, StreamRef(0), &mut times).unwrap();
        for (j, other) in [(0, "param 1"), (1, "param 0")] {
            let ParamFeed::Fixed(why) = &placed[0].params[j].feed else {
                panic!("param {j} shares memory")
            };
            assert!(why.contains(other), "{why}");
        }
    }

    fn floats_of(v: f32) -> Vec<f32> {
        floats(v)
            .chunks(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}
