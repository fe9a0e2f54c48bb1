"""nanoGPT-style training on variable-length batches (docs/benchmarks.md
section 13): causal pre-LayerNorm transformer blocks over (seq, batch,
hidden), a tied embedding, bf16 autocast, AdamW; each step's sequence
length drawn from 1 to the largest bucket. Three ways, in this process:

- eager on the actual length (the reference for the loss);
- eager padded to the largest length (what one captured shape forces);
- graphed.torch with buckets: each block graphed with `graphed.torch.Buckets`
  over the bucket lengths, a step running the smallest bucket holding it.

Reported: the median step time (CUDA events around forward, backward and the
optimizer step, after warm-up, over the same lengths for every way), the
loss of the first steps against eager on the actual tokens (equal to
rounding: the kernels differ by shape), and the memory: graphed's own
accounting for the buckets against one bucket (the largest) alone, and the
driver's (torch.cuda.mem_get_info around each capture).

    python3 benches/torch_varlen.py --out torch_varlen.md
"""
import argparse
import os
import random
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))
from _models import CausalBlock  # noqa: E402
from torch_accumulate import event_ms, report  # noqa: E402
from torch_buckets import taken  # noqa: E402

import graphed.torch as gt  # noqa: E402


class Model:
    def __init__(self, a, seed=0):
        torch.manual_seed(seed)
        self.blocks = [CausalBlock(a.hidden, a.heads).cuda() for _ in range(a.layers)]
        self.emb = nn.Embedding(a.vocab, a.hidden).cuda()
        self.calls = list(self.blocks)
        params = [p for b in self.blocks for p in b.parameters()] + list(self.emb.parameters())
        self.opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)

    def step(self, seq, pad_to=None):
        """One training step on tokens `seq` [t + 1, batch]; the loss."""
        t = seq.shape[0] - 1
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            h = self.emb(seq[:-1])
            if pad_to:
                h = torch.cat([h, h.new_zeros((pad_to - t,) + tuple(h.shape[1:]))])
            for blk in self.calls:
                h = blk(h)
            logits = h[:t] @ self.emb.weight.t()
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), seq[1:].reshape(-1))
        loss.backward()
        self.opt.step()
        return loss


def ratio(a, b):
    """a / b as "1.234x", or "-" where b is 0 (PyTorch's memory, not graphed's)."""
    return f"{a / b:.3f}x" if b else "-"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--buckets", default="64,128,192,256,320,384,448,512")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out")
    a = ap.parse_args()
    sizes = [int(s) for s in a.buckets.split(",")]
    largest = sizes[-1]
    rng = random.Random(0)
    lengths = [rng.randint(1, largest) for _ in range(a.steps)]
    torch.manual_seed(1)
    data = [torch.randint(0, a.vocab, (t + 1, a.batch), device="cuda") for t in lengths]

    eager, padded = Model(a), Model(a)
    graphed = Model(a)

    def capture(bucket_sizes):
        samples = [(torch.randn(s, a.batch, a.hidden, device="cuda", requires_grad=True),) for s in bucket_sizes]
        sample = gt.Buckets(*samples) if len(samples) > 1 else samples[0]
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            return gt.make_graphed_callables(tuple(graphed.blocks), tuple(sample for _ in graphed.blocks))

    # One shape (the largest) first, for the memory comparison, then released.
    one, one_mib, _ = taken(lambda: capture([largest]))
    one_stats = one[0].session_stats()
    for m in one:
        m.reset()
    del one
    calls, buckets_mib, _ = taken(lambda: capture(sizes))
    graphed.calls = list(calls)
    stats = calls[0].session_stats()

    # The first steps' losses (before the weights drift apart by rounding).
    diffs = []
    for seq in data[:3]:
        le, lg = eager.step(seq), graphed.step(seq)
        diffs.append(abs(le.item() - lg.item()) / abs(le.item()))

    def timed(model, pad):
        for seq in data[:5]:
            model.step(seq, pad_to=largest if pad else None)
        torch.cuda.synchronize()
        return statistics.median(event_ms(lambda s=seq: model.step(s, largest if pad else None)) for seq in data)

    rows = []
    for rnd in range(3):  # interleaved rounds; the median of each way's medians
        rows.append((timed(eager, False), timed(padded, True), timed(graphed, False)))
    e_ms, p_ms, g_ms = (statistics.median(r[i] for r in rows) for i in range(3))

    dev = torch.cuda.get_device_name()
    out = [
        f"torch {torch.__version__} on {dev}: {a.layers} causal blocks, hidden {a.hidden}, {a.heads} heads, batch "
        f"{a.batch}, vocab {a.vocab}, bf16 autocast, AdamW; lengths drawn from 1 to {largest} over {a.steps} steps; "
        f"buckets {sizes}.",
        "",
        "| way | step ms (median) | vs eager on the actual length |",
        "|---|---|---|",
        f"| eager, actual length | {e_ms:.3f} | 1.00x |",
        f"| eager, padded to {largest} | {p_ms:.3f} | {p_ms / e_ms:.2f}x |",
        f"| graphed.torch, {len(sizes)} buckets | {g_ms:.3f} | {g_ms / e_ms:.2f}x |",
        "",
        f"Loss of the first 3 steps against eager on the actual tokens: largest relative difference "
        f"{max(diffs):.2e}.",
        "",
        "| memory | graphed static bytes (library) | graphed scratch bytes | driver MiB (capture) |",
        "|---|---|---|---|",
        f"| one shape ({largest}) | {one_stats['static_bytes']} | {one_stats['scratch_bytes']} | {one_mib:.1f} |",
        f"| {len(sizes)} buckets | {stats['static_bytes']} | {stats['scratch_bytes']} | {buckets_mib:.1f} |",
        f"| ratio | {ratio(stats['static_bytes'], one_stats['static_bytes'])} | "
        f"{ratio(stats['scratch_bytes'], one_stats['scratch_bytes'])} | {ratio(buckets_mib, one_mib)} |",
    ]
    text = "\n".join(out) + "\n"
    report(text, a.out)


if __name__ == "__main__":
    main()
