"""A training step from Python in one launch (graphed.torch.make_graphed_step)
against PyTorch, side by side in one process (docs/benchmarks.md section 21;
the C API's counterpart is section 11), on one of two models:

- `--model mlp`: Linear + ReLU layers, fp32, the loss 0.5 * |y - t|^2;
- `--model gpt`: nanoGPT (examples/torch_extension/nanogpt.py, untied):
  the embeddings, transformer blocks (LayerNorm, causal attention through
  scaled_dot_product_attention, GELU MLP) and the head with its
  cross-entropy, bf16 parameters, dropout 0 (`--dropout`), torch's
  deterministic algorithms on (a precaution: the bit-for-bit checks need
  eager accumulation to repeat itself, which the script checks first);

N microbatches accumulated into .grad per optimizer step (the optimizer
left out), seven ways:

- eager accumulation;
- torch.cuda.make_graphed_callables per layer, driven from Python;
- one graph captured by hand with torch.cuda.graph around all N
  microbatches' forward and backward (grads zeroed inside the graph);
- graphed's step, unrolled (every microbatch captured), grads added into
  .grad (set to None before the checked step, as eager's; timed without
  that, the grads adding up, so that the time is the step's alone: the
  Python loop setting .grad to None and the zeros the next step creates
  cost the host a few hundred microseconds that the GPU would wait for,
  printed apart as "graphed step parts"), and with
  param_grads="set" (.grad set to the step's grads, no zeroing: what the
  hand-captured graph does);
- graphed's step, looped (one microbatch in a conditional WHILE node);
- graphed's one-microbatch step called N times (what the N-microbatch
  step replaces).

Every variant's grads are checked against eager's first, bit for bit (the
script exits non-zero where a graphed variant differs). GPU time: CUDA-event
medians per step, the variants interleaved over several rounds; host time:
wall time of the Python call that enqueues one step, the device
synchronized between samples; capture: wall time of make_graphed_step (or
of the hand capture); driver MiB: the device memory the capture took
(torch.cuda.mem_get_info around it, torch's cache emptied on both sides);
graphed bytes: the step session's static + scratch bytes (session_stats).
Writes markdown tables.

    python3 benches/torch_step.py --layers 24 --width 64 --batch 8 --counts 1 --out step_small.md
    python3 benches/torch_step.py --layers 24 --width 256 --batch 64 --counts 1,4,16,64 --out step_n.md
    python3 benches/torch_step.py --model gpt --counts 1,4,16,64 --out step_gpt.md
"""
import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples", "torch_extension"))
from nanogpt import GPT, step_parts  # noqa: E402
from torch_accumulate import (  # noqa: E402
    accumulate, event_ms, grads, host_us, loss_of, mlp, none_grads, per_layer_graphs, report, whole_step_graph,
)

import graphed.torch as gt  # noqa: E402

SEED = 1234


class Workload:
    """The benchmark's model: `build()` gives a fresh copy (the same weights
    each time) as (an nn.Sequential of the step's layers, the loss);
    `data(n)` the inputs and targets of n microbatches."""

    def __init__(self, args, dev):
        self.args, self.dev = args, dev
        if args.model == "mlp":
            self.text = (f"{args.layers} x Linear({args.width}) + ReLU, batch {args.batch} per microbatch, fp32, "
                         "the loss 0.5 * |y - t|^2")
        else:
            self.text = (f"nanoGPT, {args.layers} blocks, n_embd {args.width}, {args.heads} heads, "
                         f"{args.batch} x {args.seq} tokens per microbatch, vocab {args.vocab}, {args.dtype} parameters, "
                         f"dropout {args.dropout}, untied head, cross-entropy in fp32, deterministic algorithms")

    def build(self):
        a = self.args
        if a.model == "mlp":
            return mlp(a.layers, a.width, self.dev), loss_of
        torch.manual_seed(0)
        g = GPT(a.vocab, a.seq, a.layers, a.heads, a.width, dropout=a.dropout, tie=False)
        layers, head = step_parts(g.to(self.dev, getattr(torch, a.dtype)))
        return torch.nn.Sequential(*layers), head

    def data(self, n, seed=1):
        a = self.args
        torch.manual_seed(seed)
        if a.model == "mlp":
            return (torch.randn(n, a.batch, a.width, device=self.dev),
                    0.1 * torch.randn(n, a.batch, a.width, device=self.dev))
        return tuple(torch.randint(0, a.vocab, (n, a.batch, a.seq), device=self.dev) for _ in range(2))


def interleaved(fns, rounds, iters, warmup):
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    per = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            per[k] += [event_ms(fn) for _ in range(iters)]
    return {k: statistics.median(v) for k, v in per.items()}


def driver_used():
    """Device bytes in use (the driver's count), torch's unused cache emptied."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def graphed_step(work, n, loop, param_grads="add"):
    """A fresh model and its graphed step: (the model, its loss, the step,
    capture ms, driver MiB the capture took)."""
    model, loss = work.build()
    xs, ts = work.data(1, seed=2)
    before = driver_used()
    t0 = time.perf_counter()
    step = gt.make_graphed_step(
        list(model), loss, (xs[0],), (ts[0],), microbatches=n, loop=loop, param_grads=param_grads
    )
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    return model, loss, step, ms, (driver_used() - before) / 2**20


def hand_captured(work, xs, ts):
    """torch.cuda.graph around the whole step: (the model, its loss, the
    graph, capture ms, driver MiB the warm-up and capture took)."""
    model, loss = work.build()
    before = driver_used()
    g, ms, _ = whole_step_graph(model, xs, ts, loss)
    return model, loss, g, ms, (driver_used() - before) / 2**20


def check(name, model, loss, want):
    """Whether the grads equal eager accumulation's bit for bit; a graphed
    variant that differs ends the run. torch's per-layer graphs differ from
    2 microbatches on: the grad autograd takes from the first replay is the
    graph's static buffer, which the next replay overwrites (PyTorch issue
    181723); reported, not fatal."""
    got = grads(model, loss)
    if all(torch.equal(a, b) for a, b in zip(got, want)):
        return True
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    where = [(k, (a.float() - b.float()).abs().max().item(), b.float().abs().max().item(), tuple(b.shape))
             for k, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    print(f"{name}: grads differ from eager accumulation's (max abs {diff:.3g}); "
          f"{len(where)} of {len(want)} differ (index, max abs diff, max abs eager, shape): {where[:6]}", flush=True)
    if name.startswith("graphed"):
        raise SystemExit(f"CHECK FAILED: {name}")
    return False


def measure(work, n, args):
    """One row: every variant for n microbatches, checked, then timed."""
    xs, ts = work.data(n)
    eager, eager_loss = work.build()

    def seeded(fn):
        """fn() from the same generator state (every checked run draws the
        same dropout masks as eager's)."""
        torch.manual_seed(SEED)
        return fn()

    def eager_step():
        none_grads(eager, eager_loss)
        accumulate(eager, xs, ts, eager_loss)

    seeded(eager_step)
    want = grads(eager, eager_loss)
    seeded(eager_step)
    if not check(f"eager run again (N={n})", eager, eager_loss, want):
        print("eager accumulation is not reproducible here: the comparisons below cannot be bit for bit", flush=True)

    per_layer, per_layer_loss = work.build()
    chained, chained_loss = per_layer_graphs(per_layer, xs[0], per_layer_loss, ts[0])
    whole, whole_loss, g, cap_whole, mib_whole = hand_captured(work, xs, ts)
    unrolled, unrolled_loss, step_u, cap_u, mib_u = graphed_step(work, n, False)
    setting, setting_loss, step_s, _, _ = graphed_step(work, n, False, "set")
    single, single_loss, step_1, _, _ = graphed_step(work, 1, False)
    fns = {
        "eager": eager_step,
        "torch per-layer graphs": lambda: (none_grads(per_layer, per_layer_loss),
                                           accumulate(chained, xs, ts, chained_loss)),
        "torch whole-step graph": g.replay,
        "graphed step": lambda: (none_grads(unrolled, unrolled_loss), step_u(xs, ts)),
        "graphed step, set": lambda: step_s(xs, ts),
        "graphed 1-microbatch step x N": lambda: (
            none_grads(single, single_loss), [step_1(xs[i:i + 1], ts[i:i + 1]) for i in range(n)]),
    }
    models = {
        "torch per-layer graphs": (per_layer, per_layer_loss),
        "torch whole-step graph": (whole, whole_loss),
        "graphed step": (unrolled, unrolled_loss),
        "graphed step, set": (setting, setting_loss),
        "graphed 1-microbatch step x N": (single, single_loss),
    }
    cap_l = mib_l = None
    if not args.no_loop:
        looped, looped_loss, step_l, cap_l, mib_l = graphed_step(work, n, True)
        fns["graphed looped step"] = lambda: (none_grads(looped, looped_loss), step_l(xs, ts))
        models["graphed looped step"] = (looped, looped_loss)
    for fn in fns.values():
        seeded(fn)
    torch.cuda.synchronize()
    wrong = {k for k, (m, lf) in models.items() if not check(f"{k} (N={n})", m, lf, want)}
    # Timed without setting .grad to None: the step (or steps) alone.
    fns["graphed step"] = lambda: step_u(xs, ts)
    fns["graphed 1-microbatch step x N"] = lambda: [step_1(xs[i:i + 1], ts[i:i + 1]) for i in range(n)]
    if not args.no_loop:
        fns["graphed looped step"] = lambda: step_l(xs, ts)
    iters = max(2, args.iters * 4 // max(n, 4))
    gpu = interleaved(fns, args.rounds, iters, args.warmup)
    host = {k: host_us(fn, iters * args.rounds) for k, fn in fns.items()}
    parts = {
        "p.grad = None x params": lambda: none_grads(unrolled, unrolled_loss),
        "destinations checked (all set)": step_s._destinations_ready,
        "replay (copies in, launch, losses)": lambda: step_s._impl.replay([xs, ts], 0),
    }
    if not args.no_loop:
        parts["looped replay"] = lambda: step_l._impl.replay([xs, ts], n)
    print("host us, graphed step parts: "
          + ", ".join(f"{k} {host_us(fn, iters * args.rounds):.1f}" for k, fn in parts.items()), flush=True)
    st = step_u.session_stats()
    row = dict(n=n, gpu=gpu, host=host, wrong=wrong, capture=(cap_u, cap_l, cap_whole),
               mib=(mib_u, mib_l, mib_whole), lib_bytes=st["static_bytes"] + st["scratch_bytes"])
    print(f"N={n}: GPU ms {gpu}; host us {host}; capture ms {row['capture']}; driver MiB {row['mib']}; "
          f"graphed bytes {row['lib_bytes']}", flush=True)
    return row


def tables(rows, work, args):
    names = list(rows[0]["gpu"])
    loop = not args.no_loop
    text = (
        f"torch {torch.__version__} on {torch.cuda.get_device_name()}: {work.text}; grads accumulated into "
        "`.grad` over N microbatches; every variant's grads equal eager's bit for bit unless marked wrong. "
        f"GPU time per step (ms, CUDA-event medians, variants interleaved over {args.rounds} rounds).\n\n"
        "| N | " + " | ".join(names) + " | set / torch whole-step | torch per-layer / graphed step | "
        "graphed step / 1-microbatch x N" + (" | looped / 1-microbatch x N" if loop else "") + " |\n"
        "|" + "---|" * (len(names) + 4 + loop) + "\n"
    )
    for r in rows:
        gpu = r["gpu"]
        one = gpu["graphed 1-microbatch step x N"]
        text += (
            f"| {r['n']} | " + " | ".join(f"{gpu[k]:.4f}" + (" (wrong grads)" if k in r["wrong"] else "") for k in names)
            + f" | {gpu['graphed step, set'] / gpu['torch whole-step graph']:.2f}x"
            + f" | {gpu['torch per-layer graphs'] / gpu['graphed step']:.1f}x"
            + f" | {gpu['graphed step'] / one:.3f}x" + (f" | {gpu['graphed looped step'] / one:.3f}x" if loop else "")
            + " |\n"
        )
    text += (
        "\nHost time per step (us, median wall time of the call(s) enqueuing it); capture (ms) and the driver "
        "memory it took (MiB) for graphed's unrolled step" + (", its looped step" if loop else "")
        + " and torch's hand-captured graph (with its warm-up); graphed's own static + scratch bytes.\n\n"
        "| N | " + " | ".join(f"host us, {k}" for k in names) + " | capture ms | driver MiB | graphed bytes |\n"
        "|" + "---|" * (len(names) + 4) + "\n"
    )
    for r in rows:
        cap = " / ".join(f"{c:.0f}" for c in r["capture"] if c is not None)
        mib = " / ".join(f"{m:.0f}" for m in r["mib"] if m is not None)
        text += (f"| {r['n']} | " + " | ".join(f"{r['host'][k]:.0f}" for k in names)
                 + f" | {cap} | {mib} | {r['lib_bytes']} |\n")
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    ap.add_argument("--layers", type=int, default=None, help="layers or blocks (24 for mlp, 6 for gpt)")
    ap.add_argument("--width", type=int, default=None, help="layer width or n_embd (64 for mlp, 384 for gpt)")
    ap.add_argument("--batch", type=int, default=None, help="rows or sequences per microbatch (8 for mlp, 4 for gpt)")
    ap.add_argument("--seq", type=int, default=256, help="gpt: tokens per sequence")
    ap.add_argument("--heads", type=int, default=6, help="gpt: attention heads")
    ap.add_argument("--vocab", type=int, default=512, help="gpt: vocabulary")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="gpt: parameter dtype")
    ap.add_argument("--dropout", type=float, default=0.0, help="gpt: dropout (each checked run seeded alike)")
    ap.add_argument("--counts", default="1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="steps per round up to N = 4, scaled as 4/N above")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-loop", action="store_true", help="leave out the looped step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpt = args.model == "gpt"
    if gpt:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    args.layers = args.layers or (6 if gpt else 24)
    args.width = args.width or (384 if gpt else 64)
    args.batch = args.batch or (4 if gpt else 8)
    work = Workload(args, torch.device("cuda"))
    rows = []
    for n in [int(c) for c in args.counts.split(",")]:
        rows.append(measure(work, n, args))
        torch.cuda.empty_cache()
    text = tables(rows, work, args)
    report(text, args.out)


if __name__ == "__main__":
    main()
