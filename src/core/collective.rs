//! A step's collective manifest: the collectives its graph records (each
//! communicator, operation, bytes, element type and the point of the step
//! where it was recorded), their fixed-size wire form that ranks exchange
//! before the first replay, and the comparison that names the first entry
//! two ranks disagree on. No CUDA, no C: the caller's all-gather moves the
//! bytes.

use super::dtype::DType;

/// The operation a collective performs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectiveOp {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Other,
}

const OPS: [CollectiveOp; 5] = [
    CollectiveOp::AllReduce,
    CollectiveOp::AllGather,
    CollectiveOp::ReduceScatter,
    CollectiveOp::Broadcast,
    CollectiveOp::Other,
];

impl CollectiveOp {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::Other => "other",
        }
    }
}

/// Where in a step's graph a collective was recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectivePoint {
    /// Once, after the last microbatch's backward, with every grad.
    AfterBackward,
    /// After the grad pass of the step's callable of this index (the
    /// session's callable index) in the last microbatch.
    Callable(u32),
}

/// One collective a step's callback declared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveEntry {
    pub communicator: u64,
    pub op: CollectiveOp,
    pub bytes: u64,
    pub dtype: DType,
    pub point: CollectivePoint,
}

/// The dtypes in their wire order (a rank reads another's entries).
const DTYPES: [DType; 9] = [
    DType::F32,
    DType::F16,
    DType::Bf16,
    DType::F64,
    DType::I8,
    DType::U8,
    DType::I32,
    DType::I64,
    DType::Bool,
];

/// Bytes of one entry on the wire.
pub const ENTRY_BYTES: usize = 32;
/// Bytes of a rank's header on the wire.
pub const HEADER_BYTES: usize = 24;
/// The first four bytes of every header ("grcm").
pub const HEADER_MAGIC: u32 = 0x6d63_7267;
/// The point of an entry recorded after the whole backward, on the wire.
const AFTER_BACKWARD: u32 = u32::MAX;

/// What a rank says about its capture of a step before the entries are
/// exchanged: its rank, the step, whether its capture succeeded, and how
/// many entries it recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub rank: u32,
    pub step: u32,
    pub ok: bool,
    pub count: u32,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.rank.to_le_bytes());
        b[8..12].copy_from_slice(&self.step.to_le_bytes());
        b[12..16].copy_from_slice(&(self.ok as u32).to_le_bytes());
        b[16..20].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    /// The header in `b` (HEADER_BYTES), or what is wrong with it.
    pub fn decode(b: &[u8]) -> Result<Header, String> {
        let word = |k: usize| u32::from_le_bytes([b[k], b[k + 1], b[k + 2], b[k + 3]]);
        if b.len() != HEADER_BYTES {
            return Err(format!("{} bytes instead of {HEADER_BYTES}", b.len()));
        }
        if word(0) != HEADER_MAGIC {
            return Err(format!(
                "it does not start with graphed's magic (0x{:08x}): the all-gather did not put each \
                 rank's bytes at rank * bytes",
                word(0)
            ));
        }
        Ok(Header {
            rank: word(4),
            step: word(8),
            ok: word(12) != 0,
            count: word(16),
        })
    }
}

impl CollectiveEntry {
    pub fn encode(&self) -> [u8; ENTRY_BYTES] {
        let mut b = [0u8; ENTRY_BYTES];
        let op = OPS.iter().position(|&o| o == self.op).unwrap_or(0) as u32;
        let dtype = DTYPES.iter().position(|&d| d == self.dtype).unwrap_or(0) as u32;
        let point = match self.point {
            CollectivePoint::AfterBackward => AFTER_BACKWARD,
            CollectivePoint::Callable(c) => c,
        };
        b[0..8].copy_from_slice(&self.communicator.to_le_bytes());
        b[8..16].copy_from_slice(&self.bytes.to_le_bytes());
        b[16..20].copy_from_slice(&op.to_le_bytes());
        b[20..24].copy_from_slice(&dtype.to_le_bytes());
        b[24..28].copy_from_slice(&point.to_le_bytes());
        b
    }

    /// The entry in `b` (ENTRY_BYTES), or what is wrong with it.
    pub fn decode(b: &[u8]) -> Result<CollectiveEntry, String> {
        if b.len() != ENTRY_BYTES {
            return Err(format!("{} bytes instead of {ENTRY_BYTES}", b.len()));
        }
        let u64_at = |k: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[k..k + 8]);
            u64::from_le_bytes(w)
        };
        let u32_at = |k: usize| u32::from_le_bytes([b[k], b[k + 1], b[k + 2], b[k + 3]]);
        let op = *OPS
            .get(u32_at(16) as usize)
            .ok_or_else(|| format!("operation {} is unknown", u32_at(16)))?;
        let dtype = *DTYPES
            .get(u32_at(20) as usize)
            .ok_or_else(|| format!("dtype {} is unknown", u32_at(20)))?;
        let point = match u32_at(24) {
            AFTER_BACKWARD => CollectivePoint::AfterBackward,
            c => CollectivePoint::Callable(c),
        };
        Ok(CollectiveEntry {
            communicator: u64_at(0),
            op,
            bytes: u64_at(8),
            dtype,
            point,
        })
    }

    /// "all_reduce of 4096 bytes f32 on communicator 7 as collective 3
    /// (after callable 'x' backward)", with `name` naming callables.
    pub fn describe(&self, index: usize, name: &dyn Fn(u32) -> String) -> String {
        let at = match self.point {
            CollectivePoint::AfterBackward => "after the last microbatch's backward".to_string(),
            CollectivePoint::Callable(c) => format!("after callable {} backward", name(c)),
        };
        format!(
            "{} of {} bytes {} on communicator {} as collective {index} ({at})",
            self.op.name(),
            self.bytes,
            self.dtype.name(),
            self.communicator
        )
    }
}

/// Each entry's wire form, one after another, padded with zero entries to
/// `count` entries.
pub fn encode_padded(entries: &[CollectiveEntry], count: usize) -> Vec<u8> {
    let mut v: Vec<u8> = entries.iter().flat_map(|e| e.encode()).collect();
    v.resize(count.max(entries.len()) * ENTRY_BYTES, 0);
    v
}

/// The first difference between two manifests, as "`a_name` records
/// ...; `b_name` records ..." (None: they are equal).
pub fn first_difference(
    (a_name, a): (&str, &[CollectiveEntry]),
    (b_name, b): (&str, &[CollectiveEntry]),
    name: &dyn Fn(u32) -> String,
) -> Option<String> {
    let k = a.iter().zip(b).position(|(x, y)| x != y);
    let k = match k {
        Some(k) => k,
        None if a.len() == b.len() => return None,
        None => a.len().min(b.len()),
    };
    let side = |who: &str, m: &[CollectiveEntry]| match m.get(k) {
        Some(e) => format!("{who} records {}", e.describe(k, name)),
        None => format!(
            "{who} records no collective {k} (it records {} in all)",
            m.len()
        ),
    };
    Some(format!("{}; {}", side(a_name, a), side(b_name, b)))
}

/// Compares every rank's manifest (`all[r]` is rank r's) with rank
/// `mine`'s: the first rank that differs, with the first entry, named on
/// both sides (None: every rank records the same collectives).
pub fn compare_ranks(
    all: &[Vec<CollectiveEntry>],
    mine: usize,
    name: &dyn Fn(u32) -> String,
) -> Option<String> {
    let own = all.get(mine)?;
    all.iter().enumerate().find_map(|(r, m)| {
        if r == mine {
            return None;
        }
        // Lower rank first, so that every rank words it alike.
        let (lo, hi) = match r < mine {
            true => ((r, m.as_slice()), (mine, own.as_slice())),
            false => ((mine, own.as_slice()), (r, m.as_slice())),
        };
        first_difference(
            (&format!("rank {}", lo.0), lo.1),
            (&format!("rank {}", hi.0), hi.1),
            name,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(bytes: u64, point: CollectivePoint) -> CollectiveEntry {
        CollectiveEntry {
            communicator: 7,
            op: CollectiveOp::AllReduce,
            bytes,
            dtype: DType::F32,
            point,
        }
    }

    fn names(c: u32) -> String {
        format!("'c{c}'")
    }

    #[test]
    fn entries_and_headers_round_trip() {
        for e in [
            entry(4096, CollectivePoint::AfterBackward),
            CollectiveEntry {
                communicator: u64::MAX,
                op: CollectiveOp::Other,
                bytes: 1,
                dtype: DType::Bool,
                point: CollectivePoint::Callable(3),
            },
        ] {
            assert_eq!(CollectiveEntry::decode(&e.encode()), Ok(e));
        }
        let h = Header {
            rank: 1,
            step: 2,
            ok: true,
            count: 5,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let err = Header::decode(&[0u8; HEADER_BYTES]).unwrap_err();
        assert!(err.contains("does not start with graphed's magic"), "{err}");
        assert!(Header::decode(&[0u8; 3]).is_err());
        let mut bad = entry(1, CollectivePoint::AfterBackward).encode();
        bad[16] = 9;
        assert_eq!(
            CollectiveEntry::decode(&bad),
            Err("operation 9 is unknown".into())
        );
    }

    #[test]
    fn padding_adds_zero_entries() {
        let e = [entry(8, CollectivePoint::AfterBackward)];
        let v = encode_padded(&e, 3);
        assert_eq!(v.len(), 3 * ENTRY_BYTES);
        assert_eq!(&v[..ENTRY_BYTES], &e[0].encode());
        assert!(v[ENTRY_BYTES..].iter().all(|&b| b == 0));
    }

    #[test]
    fn equal_manifests_have_no_difference() {
        let m = vec![
            entry(8, CollectivePoint::Callable(1)),
            entry(16, CollectivePoint::Callable(0)),
        ];
        assert_eq!(compare_ranks(&[m.clone(), m.clone(), m], 1, &names), None);
        assert_eq!(compare_ranks(&[vec![], vec![]], 0, &names), None);
    }

    #[test]
    fn the_first_differing_entry_is_named_on_both_sides() {
        let a = vec![
            entry(8, CollectivePoint::Callable(1)),
            entry(4096, CollectivePoint::AfterBackward),
        ];
        let mut b = a.clone();
        b[1].bytes = 2048;
        let want = "rank 0 records all_reduce of 4096 bytes f32 on communicator 7 as collective 1 \
                    (after the last microbatch's backward); rank 1 records all_reduce of 2048 bytes \
                    f32 on communicator 7 as collective 1 (after the last microbatch's backward)";
        let all = [a.clone(), b.clone()];
        assert_eq!(compare_ranks(&all, 0, &names).as_deref(), Some(want));
        // Rank 1 words it alike.
        assert_eq!(compare_ranks(&all, 1, &names).as_deref(), Some(want));
        b[0].point = CollectivePoint::Callable(0);
        let got = compare_ranks(&[a, b], 1, &names).unwrap();
        assert!(got.contains("as collective 0 (after callable 'c1' backward); rank 1"));
        assert!(
            got.ends_with("as collective 0 (after callable 'c0' backward)"),
            "{got}"
        );
    }

    #[test]
    fn one_more_collective_is_named() {
        let a = vec![entry(8, CollectivePoint::AfterBackward)];
        let mut b = a.clone();
        b.push(CollectiveEntry {
            op: CollectiveOp::Broadcast,
            ..a[0]
        });
        let got = compare_ranks(&[a, b], 0, &names).unwrap();
        assert_eq!(
            got,
            "rank 0 records no collective 1 (it records 1 in all); rank 1 records broadcast of 8 \
             bytes f32 on communicator 7 as collective 1 (after the last microbatch's backward)"
        );
    }

    #[test]
    fn the_first_rank_that_differs_is_named() {
        let a = vec![entry(8, CollectivePoint::AfterBackward)];
        let b = vec![entry(4, CollectivePoint::AfterBackward)];
        let got = compare_ranks(&[a.clone(), a.clone(), b], 1, &names).unwrap();
        assert!(got.starts_with("rank 1 records all_reduce of 8"), "{got}");
        assert!(got.contains("; rank 2 records all_reduce of 4"), "{got}");
    }
}
