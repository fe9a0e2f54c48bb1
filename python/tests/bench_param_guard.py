"""Host cost of the parameter guard (rebind_params): what one graphed call
costs on the host with rebind_params=True (the default) and False, and what
a call that finds N parameters moved costs. Not a test (pytest does not
collect it); run it on a GPU machine with the package installed:

    python3 python/tests/bench_param_guard.py [--calls 1000] [--params 2,16,64,256] [--out guard.md]

The model is a stack of L `nn.Linear(64, 64)` (N = 2L parameters), batch
16, fp32, graphed as one module. Every call is timed alone
(time.perf_counter_ns around the call, after torch.cuda.synchronize(), so
the device never holds the host back): the median and the 90th percentile
over `--calls` calls after `--warmup`. Rows:

- forward: `with torch.no_grad(): model(x)`;
- forward + backward: `model(x).backward(g)` through autograd;
- forward, N moved: a forward whose N parameters all moved since the last
  call (each parameter's .data alternates between two tensors of its own,
  set outside the timed region), so the graphs are pointed at new
  addresses at every call (graphed's param_moves counts them);
- torch.cuda.make_graphed_callables and eager, for reference.

Every variant runs in this process, interleaved over `--rounds` rounds;
the table gives the median of the rounds' medians.
"""
import argparse
import copy
import statistics
import time

import torch

import graphed.torch as gt

W, B = 64, 16


def stack(layers, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(W, W) for _ in range(layers)]).cuda()


def timed(calls, warmup, body, before=None):
    """Per-call host nanoseconds of body() over `calls` calls after `warmup`."""
    out = []
    for i in range(warmup + calls):
        if before is not None:
            before(i)
        torch.cuda.synchronize()
        t = time.perf_counter_ns()
        body()
        t = time.perf_counter_ns() - t
        if i >= warmup:
            out.append(t)
    return out


def summary(ns):
    ns = sorted(ns)
    return statistics.median(ns) / 1e3, ns[int(0.9 * (len(ns) - 1))] / 1e3


class Variant:
    def __init__(self, name, layers, kind, moves=False):
        self.name, self.kind, self.moves = name, kind, moves
        base = stack(layers)
        sample = torch.randn(B, W, device="cuda", requires_grad=True)
        self.model = copy.deepcopy(base)
        if kind == "graphed":
            gt.make_graphed_callables(self.model, (sample,), rebind_params=True)
        elif kind == "graphed, rebind_params=False":
            gt.make_graphed_callables(self.model, (sample,), rebind_params=False)
        elif kind == "torch":
            self.model = torch.cuda.make_graphed_callables(self.model, (sample,))
        self.x = torch.randn(B, W, device="cuda", requires_grad=True)
        self.g = torch.randn(B, W, device="cuda")
        params = list(self.model.parameters())
        # Two homes per parameter: .data alternates between them.
        self.homes = [(p.data, p.data.clone()) for p in params] if moves else None
        self.params = params

    def move(self, i):
        for p, homes in zip(self.params, self.homes):
            p.data = homes[i % 2]

    def run(self, what, calls, warmup):
        model, x, g = self.model, self.x, self.g
        if what == "forward":
            def body():
                with torch.no_grad():
                    model(x)
        else:
            def body():
                model(x).backward(g)
        return timed(calls, warmup, body, self.move if self.moves else None)

    def reset(self):
        if self.kind.startswith("graphed"):
            self.model.reset()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--params", default="2,16,64,256")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    say(f"## Host cost of the parameter guard ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    say()
    say(f"A stack of nn.Linear({W}, {W}) (N parameters), batch {B}, fp32, graphed as one module; host time of one "
        f"call after torch.cuda.synchronize(), median (and p90) over {a.calls} calls, median of {a.rounds} rounds.")
    say()
    say("| N params | call | variant | median (µs) | p90 (µs) | moves per call |")
    say("|---|---|---|---|---|---|")
    for n in [int(v) for v in a.params.split(",")]:
        layers = max(n // 2, 1)
        variants = [
            ("forward", "eager", False),
            ("forward", "torch", False),
            ("forward", "graphed, rebind_params=False", False),
            ("forward", "graphed", False),
            ("forward", "graphed", True),
            ("forward + backward", "eager", False),
            ("forward + backward", "torch", False),
            ("forward + backward", "graphed, rebind_params=False", False),
            ("forward + backward", "graphed", False),
            ("forward + backward", "graphed", True),
        ]
        built = [Variant(f"{k}{', N moved' if m else ''}", layers, k, m) for _, k, m in variants]
        runs = {i: [] for i in range(len(variants))}
        for _ in range(a.rounds):
            for i, ((what, _, _), v) in enumerate(zip(variants, built)):
                runs[i].append(summary(v.run(what, a.calls, a.warmup)))
        for i, ((what, _, moves), v) in enumerate(zip(variants, built)):
            med = statistics.median(r[0] for r in runs[i])
            p90 = statistics.median(r[1] for r in runs[i])
            per_call = ""
            if v.kind.startswith("graphed"):
                st = v.model.session_stats()
                total = a.rounds * (a.calls + a.warmup)
                per_call = f"{st['param_moves'] / total:.1f}"
            say(f"| {2 * layers} | {what} | {v.name} | {med:.1f} | {p90:.1f} | {per_call} |")
            v.reset()
        del built
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
