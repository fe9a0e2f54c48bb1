//! Captured graphs as Graphviz DOT text: what each graph's nodes are
//! ([`Nodes`], recorded by the backend when its capture ended) and the
//! text that shows them, one cluster per graph ([`write`]). Pure: the
//! orchestration says what each graph is (its label), the backend what it
//! holds.

use std::fmt::Write;

/// One node of a captured graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// What it does: "kernel", "memcpy", "memset", "host task", ...
    pub kind: &'static str,
    /// A kernel's name, or what the node works on; empty where nothing
    /// more is known.
    pub name: String,
}

impl Node {
    pub fn new(kind: &'static str, name: impl Into<String>) -> Node {
        Node {
            kind,
            name: name.into(),
        }
    }
}

/// The nodes of a captured graph and their dependencies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Nodes {
    pub nodes: Vec<Node>,
    /// Dependencies: (from, to), indices into `nodes`.
    pub edges: Vec<(u32, u32)>,
    /// What the list lacks, and why, where it is not complete.
    pub note: Option<String>,
}

impl Nodes {
    /// Nodes that run one after the other (a stream's order).
    pub fn in_order(nodes: Vec<Node>) -> Nodes {
        let edges = (1..nodes.len() as u32).map(|i| (i - 1, i)).collect();
        Nodes {
            nodes,
            edges,
            note: None,
        }
    }

    /// A graph whose nodes are not known, and why.
    pub fn unknown(why: impl Into<String>) -> Nodes {
        Nodes {
            note: Some(why.into()),
            ..Nodes::default()
        }
    }
}

/// One graph of the export: what it is, and what it holds.
pub struct Cluster {
    /// What the graph is (its callable, pass, microbatch, bucket, slot or
    /// step), on one line.
    pub label: String,
    pub nodes: Nodes,
}

/// The DOT text of `clusters` in one digraph named `title`, each in a
/// cluster of its own labelled with its label; each node labelled with its
/// kind and name, and with its cluster's label as its tooltip, so that a
/// node found alone (a kernel name searched for) says which graph it is
/// in. `comments` go first, one `//` line each. Node ids are `g<cluster>_n<node>`.
pub fn write(title: &str, comments: &[String], clusters: &[Cluster]) -> String {
    let mut out = String::new();
    for c in comments {
        for line in c.lines() {
            let _ = writeln!(out, "// {line}");
        }
    }
    let _ = writeln!(out, "digraph {} {{", quoted(title));
    out.push_str("  graph [fontname=\"monospace\", compound=true];\n");
    out.push_str("  node [shape=box, fontname=\"monospace\", fontsize=10];\n");
    for (g, c) in clusters.iter().enumerate() {
        let _ = writeln!(out, "  subgraph cluster_{g} {{");
        let _ = writeln!(out, "    label={};", quoted(&c.label));
        if c.nodes.nodes.is_empty() {
            // Graphviz draws no cluster without a node.
            let what = c.nodes.note.as_deref().unwrap_or("an empty graph");
            let _ = writeln!(
                out,
                "    g{g}_empty [shape=plaintext, label={}, tooltip={}];",
                quoted(what),
                quoted(&c.label)
            );
        } else if let Some(note) = &c.nodes.note {
            let _ = writeln!(
                out,
                "    g{g}_note [shape=note, label={}, tooltip={}];",
                quoted(note),
                quoted(&c.label)
            );
        }
        for (i, n) in c.nodes.nodes.iter().enumerate() {
            let label = match n.name.as_str() {
                "" => n.kind.to_string(),
                name => format!("{}\n{name}", n.kind),
            };
            let _ = writeln!(
                out,
                "    g{g}_n{i} [label={}, tooltip={}];",
                quoted(&label),
                quoted(&c.label)
            );
        }
        let n = c.nodes.nodes.len() as u32;
        for &(a, b) in c.nodes.edges.iter().filter(|&&(a, b)| a < n && b < n) {
            let _ = writeln!(out, "    g{g}_n{a} -> g{g}_n{b};");
        }
        out.push_str("  }\n");
    }
    out.push_str("}\n");
    out
}

/// `s` as a DOT string: quoted, with quotes and backslashes escaped,
/// newlines as `\n` and other control characters dropped.
fn quoted(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for ch in s.chars() {
        match ch {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            c if c.is_control() => {}
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clusters_nodes_and_edges() {
        let a = Cluster {
            label: "callable 'fc' (0), forward".into(),
            nodes: Nodes::in_order(vec![Node::new("kernel", "gemm"), Node::new("memcpy", "")]),
        };
        let b = Cluster {
            label: "step 0".into(),
            nodes: Nodes::unknown("the driver cannot list them"),
        };
        let text = write("session 'net'", &["two graphs".into()], &[a, b]);
        assert!(
            text.starts_with("// two graphs\ndigraph \"session 'net'\" {\n"),
            "{text}"
        );
        assert!(text.contains("subgraph cluster_0 {\n    label=\"callable 'fc' (0), forward\";"));
        assert!(text
            .contains("g0_n0 [label=\"kernel\\ngemm\", tooltip=\"callable 'fc' (0), forward\"];"));
        assert!(text.contains("g0_n1 [label=\"memcpy\""), "{text}");
        assert!(text.contains("g0_n0 -> g0_n1;"));
        assert!(text.contains("g1_empty [shape=plaintext, label=\"the driver cannot list them\""));
        assert!(text.ends_with("  }\n}\n"));
    }

    #[test]
    fn text_is_escaped_and_edges_stay_inside() {
        let c = Cluster {
            label: "a \"quoted\\\" name\nand a line".into(),
            nodes: Nodes {
                nodes: vec![Node::new("kernel", "k\u{1}x")],
                edges: vec![(0, 5)],
                note: Some("partial".into()),
            },
        };
        let text = write("t", &[], &[c]);
        assert!(
            text.contains("label=\"a \\\"quoted\\\\\\\" name\\nand a line\";"),
            "{text}"
        );
        assert!(text.contains("label=\"kernel\\nkx\""), "{text}");
        assert!(
            text.contains("g0_note [shape=note, label=\"partial\""),
            "{text}"
        );
        assert!(
            !text.contains("->"),
            "an edge to a node that does not exist: {text}"
        );
    }
}
