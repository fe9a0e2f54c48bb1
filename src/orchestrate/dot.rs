//! A captured session's graphs as DOT text: one cluster per graph that
//! exists now (each pass of each instance, its clone slots, the graphs
//! choosing a bucket on the device, each step's graphs), labelled with the
//! callable, pass, microbatch and bucket (or the step) and which graph it
//! is; its nodes as the backend recorded them when the capture ended
//! (`Graph::nodes`: kernel names on CUDA, task kinds on the host).

use super::captured::Captured;
use super::instance::Instance;
use super::session::Session;
use super::spec::CallableSpec;
use crate::backend::Graph;
use crate::core::dot::{self, Cluster};
use crate::core::PassKind;
use crate::error::Result;

const PASSES: [PassKind; 3] = [PassKind::Forward, PassKind::Backward, PassKind::Wgrad];

impl Session {
    /// The captured graphs as DOT text (see the module comment). Refused
    /// before capture (`WrongState`) and after a reset (`SessionReset`).
    pub fn export_dot(&self) -> Result<String> {
        let cap = self.captured()?;
        let mut clusters = Vec::new();
        let mut comments = vec![format!(
            "graphed {}: the graphs of session '{}' ({} backend), one cluster each",
            env!("CARGO_PKG_VERSION"),
            self.opts.name,
            self.backend.kind().name()
        )];
        let add = |clusters: &mut Vec<Cluster>, label: String, g: &dyn Graph| {
            clusters.push(Cluster {
                label,
                nodes: g.nodes(),
            })
        };
        for (c, spec) in self.callables.iter().enumerate() {
            if cap.is_released(c) {
                comments.push(format!(
                    "callable '{}' (index {c}) was released: its graphs are gone",
                    spec.name
                ));
                continue;
            }
            for &n in &cap.by_callable[c] {
                let inst = &cap.instances[n];
                for kind in PASSES {
                    if let Some(g) = &inst.graphs.passes[kind.index()] {
                        add(
                            &mut clusters,
                            label(inst, spec, kind, "main graph"),
                            g.as_ref(),
                        );
                    }
                }
                for (k, slot) in inst.graphs.slots.iter().enumerate() {
                    let which = format!("clone slot {k} graph");
                    let kind = inst.grad_pass();
                    add(
                        &mut clusters,
                        label(inst, spec, kind, &which),
                        slot.graph.as_ref(),
                    );
                }
            }
            choices(cap, c, spec, &mut clusters);
        }
        for (k, st) in cap.steps.iter().enumerate() {
            let names: Vec<String> = st
                .instances
                .iter()
                .map(|&i| format!("'{}'", self.callables[cap.instances[i].callable].name))
                .collect();
            let of = format!(
                "step {k} (callables {}; {} microbatch(es))",
                names.join(", "),
                st.microbatches
            );
            if let Some(g) = &st.graph {
                add(&mut clusters, format!("{of}, main graph"), g.as_ref());
            }
            for (j, g) in st.slots.iter().enumerate() {
                add(
                    &mut clusters,
                    format!("{of}, clone slot {j} graph"),
                    g.as_ref(),
                );
            }
        }
        Ok(dot::write(
            &format!("session '{}'", self.opts.name),
            &comments,
            &clusters,
        ))
    }
}

/// The graphs of callable `c` that choose its bucket on the device.
fn choices(cap: &Captured, c: usize, spec: &CallableSpec, clusters: &mut Vec<Cluster>) {
    let Some(sw) = cap.switches.get(c) else {
        return;
    };
    let of = |kind: PassKind, which: &str| {
        format!(
            "callable '{}' (index {c}), {kind}, microbatch 0, the bucket chosen on the device (of {}), {which}",
            spec.name,
            spec.bucket_count()
        )
    };
    for kind in PASSES {
        if let Some(g) = &sw.passes[kind.index()] {
            clusters.push(Cluster {
                label: of(kind, "choosing graph"),
                nodes: g.nodes(),
            });
        }
    }
    let grad_pass = cap.by_callable[c]
        .first()
        .map_or(PassKind::Backward, |&n| cap.instances[n].grad_pass());
    for (k, g) in sw.slots.iter().enumerate() {
        clusters.push(Cluster {
            label: of(grad_pass, &format!("choosing graph of clone slot {k}")),
            nodes: g.nodes(),
        });
    }
}

/// "callable 'fc' (index 0), forward, microbatch 0, bucket 1 (16 rows),
/// main graph".
fn label(inst: &Instance, spec: &CallableSpec, kind: PassKind, which: &str) -> String {
    let bucket = match spec.describe_bucket(inst.bucket as usize) {
        Some(rows) => format!("bucket {} ({rows})", inst.bucket),
        None => "no buckets".to_string(),
    };
    format!(
        "callable '{}' (index {}), {kind}, microbatch {}, {bucket}, {which}",
        spec.name, inst.callable, inst.microbatch
    )
}
