//! Recording a step's collectives into the capture of its graph: the
//! callback called on the capturing stream, never inside a conditional
//! node, at the step's point (after the whole backward of the last
//! microbatch, or after each callable's grad pass in it), with each
//! parameter and where this graph leaves its accumulated grad (the
//! update's view of them, update.rs); what it declares goes into the
//! step's manifest. At the end of the step's capture the manifests of its
//! graphs are compared with each other and, through the caller's
//! all-gather, across ranks (exchange).

use super::super::context::Inputs;
use super::run::Runner;
use super::steps::Sequence;
use crate::backend::DevPtr;
use crate::core::collective::{
    compare_ranks, encode_padded, first_difference, CollectiveEntry, CollectivePoint, Header,
    ENTRY_BYTES, HEADER_BYTES,
};
use crate::error::{Error, Result};
use crate::orchestrate::spec::{CollectiveAt, CollectiveSpec, CollectiveView};

impl Runner<'_> {
    /// Records the step's collectives for `instance` (None: after the
    /// whole backward) when that is the step's point; nothing otherwise.
    pub(super) fn record_collective(
        &mut self,
        seq: &Sequence,
        block: &dyn Fn(usize) -> Option<DevPtr>,
        slot: u32,
        instance: Option<usize>,
    ) -> Result<()> {
        let Some(spec) = seq.collective else {
            return Ok(());
        };
        match (spec.at, instance) {
            (CollectiveAt::AfterBackward, None) | (CollectiveAt::PerCallable, Some(_)) => {}
            _ => return Ok(()),
        }
        let params = self.update_params(seq, block, instance);
        let callable = instance.map(|i| self.placed[i].callable as u32);
        let stream = self.stream;
        let view = CollectiveView {
            step: seq.step as u32,
            stream,
            slot,
            callable,
            params: &params.ptrs,
            grads: &params.grads,
            bytes: &params.bytes,
            dtypes: &params.dtypes,
        };
        let what = || match callable {
            Some(c) => format!(
                "the collective callback of step {} after callable '{}' backward",
                seq.step, self.s.callables[c as usize].name
            ),
            None => format!(
                "the collective callback of step {} after the last microbatch's backward",
                seq.step
            ),
        };
        let ran = (spec.callback)(&view);
        if self.s.backend.capture_invalidated(stream)? {
            let mut detail = format!("{} invalidated the capture of the step's graph", what());
            if let Err((code, _)) = &ran {
                detail.push_str(&format!("; the callback then returned {code}"));
            }
            return Err(Error::IllegalUnderCapture(detail));
        }
        let records = ran.map_err(|(code, said)| Error::CollectiveFailed {
            what: what(),
            code,
            said,
        })?;
        let point = match callable {
            Some(c) => CollectivePoint::Callable(c),
            None => CollectivePoint::AfterBackward,
        };
        seq.manifest
            .borrow_mut()
            .extend(records.into_iter().map(|r| CollectiveEntry {
                communicator: r.communicator,
                op: r.op,
                bytes: r.bytes,
                dtype: r.dtype,
                point,
            }));
        Ok(())
    }

    /// "'name'" of the session's callable `c`, for manifests' messages.
    pub(super) fn callable_name(&self, c: u32) -> String {
        callable_name(self.s, c)
    }
}

/// "'name'" of the session's callable `c`, for manifests' messages.
fn callable_name(s: &Inputs, c: u32) -> String {
    match s.callables.get(c as usize) {
        Some(spec) => format!("'{}'", spec.name),
        None => c.to_string(),
    }
}

/// Takes part, as a rank whose capture failed, in the exchange of every
/// step from `from` on that has one (in step order, as every rank runs
/// them): a capture that failed before it reached those steps' exchanges
/// (its warmup, a pass, an earlier step) still tells the other ranks, who
/// then fail with "rank R's capture of the step failed" instead of
/// waiting in the all-gather for it. Their own errors are dropped: this
/// rank's failure is the error it reports.
pub(super) fn abandon_exchanges(s: &Inputs, from: usize) {
    for (si, step) in s.steps.iter().enumerate().skip(from) {
        if let Some(spec) = &step.collective {
            let _ = exchange(s, si, spec, false, &[]);
        }
    }
}

/// The most bytes one round of a manifest exchange may gather (every
/// rank's share together).
const MAX_EXCHANGE_BYTES: usize = 1 << 30;

/// `per_rank * ranks`, where that is at most MAX_EXCHANGE_BYTES.
fn exchange_bytes(per_rank: usize, ranks: usize) -> Option<usize> {
    per_rank
        .checked_mul(ranks)
        .filter(|&b| b <= MAX_EXCHANGE_BYTES)
}

impl Runner<'_> {
    /// Checks that the graph of clone slot `slot` recorded the collectives of
    /// the step's first graph (`first`).
    pub(super) fn same_in_every_graph(
        &self,
        step: usize,
        first: &[CollectiveEntry],
        this: &[CollectiveEntry],
        slot: usize,
    ) -> Result<()> {
        let name = |c: u32| self.callable_name(c);
        let name: &dyn Fn(u32) -> String = &name;
        match first_difference(("clone slot 0", first), (&format!("clone slot {slot}"), this), name) {
        None => Ok(()),
        Some(d) => Err(Error::CollectiveMismatch(format!(
            "step {step}'s collective callback records other collectives in the graph of clone slot \
             {slot} than in the first: {d}"
        ))),
    }
    }

    /// Compares this rank's manifest of step `step` with every rank's
    /// (see `exchange`), recording that this rank took part in it.
    pub(super) fn exchange(
        &self,
        step: usize,
        spec: &CollectiveSpec,
        ok: bool,
        mine: &[CollectiveEntry],
    ) -> Result<()> {
        self.exchanged.set(step + 1);
        exchange(self.s, step, spec, ok, mine)
    }
}

/// Compares this rank's manifest of step `step` with every rank's
/// through the step's exchange: first every rank's header (its rank,
/// whether its capture succeeded, its count), then, when every capture
/// succeeded, the entries padded to the largest count. `ok` is whether
/// this rank's capture succeeded (a failed rank still exchanges, so that
/// the others fail with a message instead of waiting for it).
fn exchange(
    s: &Inputs,
    step: usize,
    spec: &CollectiveSpec,
    ok: bool,
    mine: &[CollectiveEntry],
) -> Result<()> {
    let name = |c: u32| callable_name(s, c);
    let name: &dyn Fn(u32) -> String = &name;
    let Some(gather) = &spec.exchange else {
        return Ok(());
    };
    let ranks = spec.ranks as usize;
    let failed = |round: &str, (code, said): (i32, String)| Error::CollectiveFailed {
        what: format!("the collective exchange of step {step} ({round})"),
        code,
        said,
    };
    let header = Header {
        rank: spec.rank,
        step: step as u32,
        ok,
        count: u32::try_from(mine.len()).unwrap_or(u32::MAX),
    };
    let Some(header_bytes) = exchange_bytes(HEADER_BYTES, ranks) else {
        return Err(Error::invalid(format!(
            "step {step}: collective_ranks {ranks}: the exchange's headers alone would take more \
             than the {MAX_EXCHANGE_BYTES} bytes graphed gives an exchange"
        )));
    };
    let mut all = vec![0u8; header_bytes];
    gather(&header.encode(), &mut all).map_err(|e| failed("the headers", e))?;
    let mut headers = Vec::with_capacity(ranks);
    for (r, b) in all.chunks_exact(HEADER_BYTES).enumerate() {
        let h = Header::decode(b).map_err(|e| {
            Error::CollectiveMismatch(format!(
                "step {step}: the exchange's header of rank {r} is not graphed's: {e}"
            ))
        })?;
        if h.rank as usize != r || h.step as usize != step {
            return Err(Error::CollectiveMismatch(format!(
                "step {step}: the exchange put rank {}'s header of step {} where rank {r}'s of step \
                 {step} goes (each rank's bytes at rank * bytes, the ranks capturing their steps in \
                 the same order)",
                h.rank, h.step
            )));
        }
        headers.push(h);
    }
    if let Some(h) = headers.iter().find(|h| !h.ok) {
        return Err(Error::CollectiveMismatch(format!(
            "step {step}: rank {}'s capture of the step failed (its own error says why); rank {} \
             abandons its capture too",
            h.rank, spec.rank
        )));
    }
    let most = headers.iter().map(|h| h.count as usize).max().unwrap_or(0);
    // Every rank reads the same headers, so every rank refuses a count
    // too large to exchange (a corrupted or foreign header) alike, before
    // the second all-gather, instead of trying to allocate for it.
    let total = most
        .checked_mul(ENTRY_BYTES)
        .and_then(|b| exchange_bytes(b, ranks));
    let Some(total) = total else {
        let h = headers.iter().max_by_key(|h| h.count).expect("ranks >= 1");
        return Err(Error::CollectiveMismatch(format!(
            "step {step}: rank {} says it records {} collectives: {ranks} ranks' manifests of that \
             length would take more than the {MAX_EXCHANGE_BYTES} bytes graphed gives an exchange \
             (is its header graphed's?)",
            h.rank, h.count
        )));
    };
    let mut manifests = vec![Vec::new(); ranks];
    if most > 0 {
        let bytes = most * ENTRY_BYTES;
        let mut all = vec![0u8; total];
        gather(&encode_padded(mine, most), &mut all).map_err(|e| failed("the manifests", e))?;
        for (r, (m, h)) in manifests.iter_mut().zip(&headers).enumerate() {
            let theirs = &all[r * bytes..][..h.count as usize * ENTRY_BYTES];
            for (k, e) in theirs.chunks_exact(ENTRY_BYTES).enumerate() {
                m.push(CollectiveEntry::decode(e).map_err(|e| {
                    Error::CollectiveMismatch(format!(
                        "step {step}: rank {r}'s collective {k} cannot be read: {e}"
                    ))
                })?);
            }
        }
    }
    match compare_ranks(&manifests, spec.rank as usize, name) {
        None => Ok(()),
        Some(d) => Err(Error::CollectiveMismatch(format!(
            "step {step}: the ranks record different collectives: {d}"
        ))),
    }
}
