"""Variable-length training of a BATCH-FIRST model with buckets on the time
dimension (issue 40 part 4; docs/benchmarks.md section 13, "Batch-first"):
nanoGPT's blocks (examples/torch_extension/nanogpt.py, unchanged: [B, T, C],
causal self-attention, GELU MLP, pre-LayerNorm) in its GPT with a tied
embedding, bf16 autocast and fused AdamW, each step's length T drawn from 1
to the largest bucket; every block graphed with `graphed.torch.Buckets` on
T (dimension 1), by default 8 buckets (64, 128, ..., 512). Two
configurations in one process, each with every measure below: a
compute-bound one (--compute, 6 blocks of n_embd 1024, batch 64) and a
launch-bound one (--launch, 6 blocks of n_embd 64, batch 2).

Per configuration:

- step time, the same lengths for every way, in interleaved rounds after a
  warm-up pass: eager on the exact length; graphed with buckets; eager
  padded to the bucket (zeros after the embeddings, the loss on the real
  positions: the blocks compute what the graphs compute);
- at each bucket's own length: graphed with buckets against the blocks
  graphed at exactly that length (make_graphed_callables with a plain
  sample: one shape, no buckets), what bucketing itself costs, and eager at
  that length;
- memory: graphed's accounting (memory_report: static and scratch bytes,
  the PyTorch tensors kept for the graphs, PyTorch's private pool) and the
  driver's (torch.cuda.mem_get_info around the make and one forward and
  backward, the cache emptied first and last), 8 buckets against the
  largest bucket captured alone;
- the ratios against issue 40's targets: at most 1.10x eager on exact
  lengths (compute-bound), at least 1.3x faster than eager (launch-bound),
  at most 1.05x the graph of exactly the bucket's length, memory at most
  1.10x the largest bucket alone.

Step time: CUDA events around zero_grad, forward, loss, backward and the
optimizer step (torch_accumulate.event_ms; the device synchronized after
each step), medians over the steps of a round, then the median of the
rounds; the variants' order rotates between rounds. Host time: the wall
time of the Python call enqueueing the step (a step whose host time is
close to its event time is bound by its launches).

    python3 benches/torch_varlen_bt.py --out torch_varlen_bt.md
    python3 benches/torch_varlen_bt.py --only launch --launch 12,128,4,4
    python3 benches/torch_varlen_bt.py --dry-run     # CPU: the plan and the step code, no figures
"""
import argparse
import gc
import math
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "torch_extension"))
import nanogpt  # noqa: E402
from torch_accumulate import event_ms, report  # noqa: E402
from torch_buckets import taken  # noqa: E402
from torch_varlen import ratio  # noqa: E402

import graphed.torch as gt  # noqa: E402
from graphed.torch import _buckets  # noqa: E402

# Issue 40 part 4's targets.
COMPUTE_AT_MOST = 1.10  # graphed / eager on exact lengths, compute-bound
LAUNCH_AT_LEAST = 1.30  # eager / graphed, launch-bound
BUCKET_AT_MOST = 1.05  # graphed with buckets / graphed at exactly the bucket's length
MEMORY_AT_MOST = 1.10  # 8 buckets / the largest bucket alone


class Config:
    """One model shape: `kind` is "compute" or "launch" (which speed target
    applies)."""

    def __init__(self, kind, spec):
        try:
            self.layers, self.n_embd, self.n_head, self.batch = (int(v) for v in spec.split(","))
        except ValueError:
            raise SystemExit(f"--{kind} takes LAYERS,N_EMBD,N_HEAD,BATCH (got {spec!r})")
        if self.n_embd % self.n_head:
            raise SystemExit(f"--{kind}: n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        self.kind = kind

    @property
    def title(self):
        bound = "compute-bound" if self.kind == "compute" else "launch-bound"
        return (f"{bound}: {self.layers} blocks, n_embd {self.n_embd}, {self.n_head} heads, "
                f"batch {self.batch}")


class Run:
    """A GPT of one configuration and its AdamW (every way gets its own,
    from the same seed)."""

    def __init__(self, cfg, a, device="cuda"):
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.gpt = nanogpt.GPT(vocab=a.vocab, block_size=a.sizes[-1], n_layer=cfg.layers, n_head=cfg.n_head,
                               n_embd=cfg.n_embd, dropout=a.dropout).to(self.device)
        self.opt = torch.optim.AdamW(self.gpt.parameters(), lr=1e-4, weight_decay=0.1,
                                     fused=self.device.type == "cuda")

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)

    def forward_backward(self, idx, tgt, pad_to=None):
        """The loss of tokens `idx` [B, t] against `tgt` [B, t], backward
        done. With `pad_to`, the embeddings are padded with zeros to that
        length before the blocks and the loss is taken on the real
        positions (eager padded to the bucket)."""
        with self.autocast():
            t = idx.shape[1]
            if pad_to is None or pad_to == t:
                loss = self.gpt(idx, tgt)
            else:
                x = F.pad(nanogpt.embed(self.gpt, idx), (0, 0, 0, pad_to - t))
                for blk in self.gpt.blocks:
                    x = blk(x)
                loss = nanogpt.head(self.gpt, x[:, :t], tgt)
        loss.backward()
        return loss

    def step(self, idx, tgt, pad_to=None):
        """One training step; the loss (not synchronized)."""
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward_backward(idx, tgt, pad_to)
        self.opt.step()
        return loss

    def graph(self, cfg, lengths):
        """Graphs the blocks in place (each one callable of one
        make_graphed_callables call, under autocast): with buckets on T over
        `lengths`, or, given one length, with a plain sample of it."""

        def sample(t):
            return (torch.randn(cfg.batch, t, cfg.n_embd, device=self.device, requires_grad=True),)

        if len(lengths) == 1:
            samples = tuple(sample(lengths[0]) for _ in self.gpt.blocks)
        else:
            samples = tuple(gt.Buckets(*[sample(t) for t in lengths]) for _ in self.gpt.blocks)
        with self.autocast():
            gt.make_graphed_callables(tuple(self.gpt.blocks), samples)

    def ungraph(self):
        for blk in self.gpt.blocks:
            blk.reset()

    def stats(self):
        return self.gpt.blocks[0].session_stats()


def tokens(cfg, a, t, device="cuda"):
    """(idx, tgt) of length t, contiguous."""
    return (torch.randint(0, a.vocab, (cfg.batch, t), device=device),
            torch.randint(0, a.vocab, (cfg.batch, t), device=device))


def bucket_of(t, sizes):
    return next(s for s in sizes if s >= t)


def released():
    """Frees what dropped references held: sessions in cycles (a graphed
    module and its forward), then PyTorch's cache."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def timed(fn, items):
    """Per item: (GPU ms by CUDA events around fn(item), host ms of the
    call)."""
    out = []
    for it in items:
        host = []

        def call(it=it):
            t0 = time.perf_counter()
            fn(it)
            host.append(time.perf_counter() - t0)

        out.append((event_ms(call), host[0] * 1e3))
    return out


def rounds(ways, items, n_rounds, warmup):
    """Each way (name -> fn of one item) over the same items, warm-up
    first (`warmup` items each), then `n_rounds` rounds in a rotating order.
    Per way: {"median": the median of the rounds' median GPU ms, "mean":
    the median of the rounds' mean GPU ms, "host": the median of the rounds'
    median host ms}."""
    names = list(ways)
    for name in names:
        for it in items[:warmup]:
            ways[name](it)
    torch.cuda.synchronize()
    per = {name: [] for name in names}
    for r in range(n_rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            per[name].append(timed(ways[name], items))
    return {
        name: {
            "median": statistics.median(statistics.median(g for g, _ in rd) for rd in per[name]),
            "mean": statistics.median(statistics.fmean(g for g, _ in rd) for rd in per[name]),
            "host": statistics.median(statistics.median(h for _, h in rd) for rd in per[name]),
        }
        for name in names
    }


def session_memory():
    """graphed's figures of the one live session (memory_report)."""
    live = [s for s in gt.memory_report()["sessions"] if not s["reset"]]
    if len(live) != 1:
        raise SystemExit(f"expected one live graphed session, found {len(live)}")
    s = live[0]
    return {
        "static": s["static_bytes"],
        "scratch": s["scratch_bytes"],
        "torch_bytes": sum(c["torch_bytes"] for c in s["callables"]),
        "pool": s["torch_pool_reserved"],
        "graphs": s["graphs"],
    }


def made(run, cfg, a, lengths, call_len):
    """Graphs `run`'s blocks over `lengths` and makes one forward and
    backward at `call_len` (no optimizer step), measured: (graphed's
    figures, driver MiB, PyTorch reserved MiB)."""

    def build():
        run.graph(cfg, lengths)
        run.forward_backward(*tokens(cfg, a, call_len))
        run.opt.zero_grad(set_to_none=True)
        released()  # the samples and the call's activations back to the driver

    _, drv, res = taken(build)
    return dict(session_memory(), driver_mib=drv, reserved_mib=res)


def measure(cfg, a, log):
    """Every figure of one configuration."""
    sizes, largest = a.sizes, a.sizes[-1]
    rng = random.Random(a.seed)
    lengths = [rng.randint(1, a.max_len) for _ in range(a.steps)]
    torch.manual_seed(a.seed)
    data = [tokens(cfg, a, t) for t in lengths]
    eager, padded, graphed = Run(cfg, a), Run(cfg, a), Run(cfg, a)

    # Kernels loaded, cuBLAS set up, and a throwaway capture, so that one-time
    # costs land in neither memory figure.
    for t in (sizes[0], largest):
        eager.step(*tokens(cfg, a, t))
    throwaway = Run(cfg, a)
    throwaway.graph(cfg, [sizes[0]])
    throwaway.forward_backward(*tokens(cfg, a, sizes[0]))
    throwaway.ungraph()
    del throwaway
    released()

    # Memory: the largest bucket alone (then released), then the buckets
    # (kept: the graphed way below). A padded call for the buckets.
    one_run = Run(cfg, a)
    one = made(one_run, cfg, a, [largest], largest)
    one_run.ungraph()
    del one_run
    released()
    many = made(graphed, cfg, a, sizes, max(1, largest - 5))
    graphs_after_first_call = graphed.stats()["graph_count"]
    log(f"  memory: one shape {one}, {len(sizes)} buckets {many}")

    # The first steps' losses (the same weights and tokens): graphed against
    # eager padded to the bucket (the same kernels on the same shapes) and
    # eager on the exact length (rounding).
    loss_pad, loss_exact = [], []
    if a.dropout == 0.0:
        for idx, tgt in data[:3]:
            t = idx.shape[1]
            le, lp, lg = (eager.step(idx, tgt).item(), padded.step(idx, tgt, bucket_of(t, sizes)).item(),
                          graphed.step(idx, tgt).item())
            loss_pad.append(abs(lg - lp) / abs(lp))
            loss_exact.append(abs(lg - le) / abs(le))

    # Step time over the same lengths.
    ways = {
        "eager": lambda d: eager.step(*d),
        "graphed": lambda d: graphed.step(*d),
        "padded": lambda d: padded.step(*d, pad_to=bucket_of(d[0].shape[1], sizes)),
    }
    main = rounds(ways, data, a.rounds, warmup=len(data))
    log(f"  steps: {main}")

    # At each bucket's own length: buckets against one shape captured there.
    per_bucket = []
    for b in sizes:
        exact = Run(cfg, a)
        released()
        exact.graph(cfg, [b])
        items = [tokens(cfg, a, b) for _ in range(a.bucket_steps)]
        got = rounds({
            "graphed": lambda d: graphed.step(*d),
            "exact": lambda d: exact.step(*d),
            "eager": lambda d: eager.step(*d),
        }, items, a.rounds, warmup=3)
        exact.ungraph()
        del exact
        per_bucket.append((b, got))
        log(f"  bucket {b}: {got}")
    released()
    recaptured = graphed.stats()["graph_count"] - graphs_after_first_call
    graphed.ungraph()
    return {
        "cfg": cfg, "lengths": lengths, "one": one, "many": many, "main": main, "per_bucket": per_bucket,
        "loss_pad": loss_pad, "loss_exact": loss_exact, "recaptured": recaptured,
    }


def met(ok):
    return "yes" if ok else "**no**"


def gib(n):
    return f"{n / 2**30:.3f} GiB"


def render(r, a):
    """One configuration's tables."""
    cfg, sizes, largest = r["cfg"], a.sizes, a.sizes[-1]
    m = r["main"]
    e, g, p = m["eager"], m["graphed"], m["padded"]
    host_share = e["host"] / e["median"] if e["median"] else float("nan")
    out = [
        f"### {cfg.title}",
        "",
        f"vocab {a.vocab}, dropout {a.dropout}, bf16 autocast, fused AdamW; {a.steps} lengths drawn from 1 to "
        f"{a.max_len} (seed {a.seed}), the same for every way; buckets {sizes} on T (dimension 1); "
        f"{a.rounds} interleaved rounds after a warm-up pass. Eager's host time to enqueue a step is "
        f"{host_share:.2f} of its step time ({'launch-bound' if host_share > 0.8 else 'the GPU bounds it'}).",
        "",
        "| way | step ms (median) | step ms (mean) | host ms (median) | median vs eager on the exact length |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("eager", "eager, exact length"), ("graphed", f"graphed.torch, {len(sizes)} buckets"),
                        ("padded", "eager, padded to the bucket")):
        w = m[name]
        out.append(f"| {label} | {w['median']:.3f} | {w['mean']:.3f} | {w['host']:.3f} | "
                   f"{ratio(w['median'], e['median'])} |")
    out += [
        "",
        "At each bucket's own length (no padding): graphed with buckets against the blocks graphed at exactly "
        f"that length (a plain sample), {a.bucket_steps} steps a round:",
        "",
        "| T | graphed, buckets ms | graphed, exactly T ms | buckets / exactly T | eager ms |",
        "|---|---|---|---|---|",
    ]
    worst = 0.0
    for b, got in r["per_bucket"]:
        q = got["graphed"]["median"] / got["exact"]["median"] if got["exact"]["median"] else float("nan")
        worst = max(worst, q) if not math.isnan(q) else q
        out.append(f"| {b} | {got['graphed']['median']:.3f} | {got['exact']['median']:.3f} | {q:.3f}x | "
                   f"{got['eager']['median']:.3f} |")
    one, many = r["one"], r["many"]
    keys = ("static", "scratch", "torch_bytes", "pool", "driver_mib")
    out += [
        f"| max | | | {worst:.3f}x | |",
        "",
        "| memory | graphed static | graphed scratch | torch tensors kept | torch pool reserved | driver MiB | "
        "graphs |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, s in ((f"largest bucket ({largest}) alone", one), (f"{len(sizes)} buckets", many)):
        out.append(f"| {label} | {gib(s['static'])} | {gib(s['scratch'])} | {gib(s['torch_bytes'])} | "
                   f"{gib(s['pool'])} | {s['driver_mib']:.1f} | {s['graphs']} |")
    out.append("| ratio | " + " | ".join(ratio(many[k], one[k]) for k in keys) + " | "
               f"{ratio(many['graphs'], one['graphs'])} |")
    out.append("")
    if r["loss_pad"]:
        out.append(f"Loss of the first {len(r['loss_pad'])} steps, graphed against eager padded to the bucket: "
                   f"largest relative difference {max(r['loss_pad']):.2e}; against eager on the exact length "
                   f"{max(r['loss_exact']):.2e}.")
    out.append(f"Graphs captured after the first call: {r['recaptured']}.")
    out += ["", "| issue 40 target | measured | met |", "|---|---|---|"]
    q = g["median"] / e["median"] if e["median"] else float("nan")
    if cfg.kind == "compute":
        note = "" if host_share <= 0.8 else " (eager's host time is most of its step: not compute-bound here)"
        out.append(f"| graphed at most {COMPUTE_AT_MOST:.2f}x eager on exact lengths{note} | {q:.3f}x | "
                   f"{met(q <= COMPUTE_AT_MOST)} |")
    else:
        s = e["median"] / g["median"] if g["median"] else float("nan")
        out.append(f"| graphed at least {LAUNCH_AT_LEAST:.2f}x faster than eager on exact lengths | {s:.3f}x "
                   f"faster | {met(s >= LAUNCH_AT_LEAST)} |")
    out.append(f"| at a bucket's length, at most {BUCKET_AT_MOST:.2f}x the graph of exactly that length (max) | "
               f"{worst:.3f}x | {met(worst <= BUCKET_AT_MOST)} |")
    for k, label in (("driver_mib", "driver"), ("torch_bytes", "torch tensors kept"), ("pool", "torch pool reserved"),
                     ("static", "graphed static")):
        q = many[k] / one[k] if one[k] else float("nan")
        out.append(f"| memory at most {MEMORY_AT_MOST:.2f}x the largest bucket alone: {label} | {q:.3f}x | "
                   f"{met(q <= MEMORY_AT_MOST)} |")
    return "\n".join(out) + "\n"


def header(a):
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return (f"torch {torch.__version__} on {dev}: nanoGPT's batch-first blocks with buckets on T "
            f"(benches/torch_varlen_bt.py).\n\n")


def dry_run(a, configs):
    """Without CUDA: the plan, the buckets read from batch-first samples,
    and every configuration's step code (exact and padded) on the CPU with
    a small length; the tables rendered from placeholder figures (NaN)."""
    sizes = a.sizes
    rng = random.Random(a.seed)
    lengths = [rng.randint(1, a.max_len) for _ in range(a.steps)]
    per = {b: sum(1 for t in lengths if bucket_of(t, sizes) == b) for b in sizes}
    print(f"dry run (CPU, no figures): buckets {sizes}, {a.steps} lengths 1 to {a.max_len}, per bucket {per}")
    _, _, grid = _buckets.plan(gt.Buckets(*[(torch.zeros(2, t, 8),) for t in sizes]), {}, "sample_args[0]")
    assert grid.sizes == sizes and grid.dims == [(1, None)], grid
    print(f"Buckets read from [B, T, C] samples: sizes {grid.sizes}, dimension {grid.dims[0][0]}")
    nan = float("nan")
    way = {"median": nan, "mean": nan, "host": nan}
    mem = {"static": 0, "scratch": 0, "torch_bytes": 0, "pool": 0, "graphs": 0, "driver_mib": nan}
    text = header(a)
    for cfg in configs:
        small = Config(cfg.kind, f"{cfg.layers},{min(cfg.n_embd, 64)},{min(cfg.n_head, 4)},{min(cfg.batch, 2)}")
        run = Run(small, a, device="cpu")
        for t, pad in ((5, None), (5, bucket_of(5, sizes)), (sizes[0], sizes[0])):
            loss = run.step(*tokens(small, a, t, device="cpu"), pad_to=pad)
            assert torch.isfinite(loss), (t, pad, loss)
        print(f"{cfg.kind}: {cfg.title}; step code ran on the CPU at n_embd {small.n_embd}, batch {small.batch}")
        text += render({
            "cfg": cfg, "lengths": lengths, "one": mem, "many": mem,
            "main": {"eager": way, "graphed": way, "padded": way},
            "per_bucket": [(b, {"graphed": way, "exact": way, "eager": way}) for b in sizes],
            "loss_pad": [], "loss_exact": [], "recaptured": 0,
        }, a) + "\n"
    print(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compute", default="6,1024,16,64", help="LAYERS,N_EMBD,N_HEAD,BATCH of the compute-bound "
                    "configuration (default %(default)s)")
    ap.add_argument("--launch", default="6,64,4,2", help="LAYERS,N_EMBD,N_HEAD,BATCH of the launch-bound "
                    "configuration (default %(default)s)")
    ap.add_argument("--only", choices=("compute", "launch"), help="run one configuration")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--buckets", default="64,128,192,256,320,384,448,512", help="bucket lengths on T")
    ap.add_argument("--max-len", type=int, help="lengths drawn from 1 to this (default: the largest bucket)")
    ap.add_argument("--steps", type=int, default=64, help="lengths (steps) per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-steps", type=int, default=10, help="steps per round at each bucket's length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="the markdown report")
    ap.add_argument("--dry-run", action="store_true", help="no CUDA: the plan and the step code on the CPU")
    a = ap.parse_args()
    a.sizes = sorted(int(s) for s in a.buckets.split(","))
    a.max_len = a.max_len or a.sizes[-1]
    if len(a.sizes) < 2 or a.max_len > a.sizes[-1]:
        raise SystemExit("--buckets takes at least two lengths, and --max-len at most the largest")
    # The launch-bound configuration first: it is quick, and its figures are
    # written before the larger one runs.
    configs = [Config(k, getattr(a, k)) for k in ("launch", "compute") if a.only in (None, k)]
    if a.dry_run:
        dry_run(a, configs)
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (--dry-run runs the CPU parts)")

    def log(msg):
        print(msg, flush=True)

    text = header(a)
    for cfg in configs:
        log(f"== {cfg.title}")
        t0 = time.perf_counter()
        r = measure(cfg, a, log)
        released()
        text += render(r, a) + "\n"
        log(f"  {time.perf_counter() - t0:.1f} s")
        if a.out:  # what is measured so far, should a later configuration fail
            with open(a.out, "w") as f:
                f.write(text)
    report(text, a.out)


if __name__ == "__main__":
    main()
