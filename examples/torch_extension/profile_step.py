"""Where the device time of one training step goes, per variant: the 4-layer
MLP of compare.py's step-time table (H=4096, B=4096, bf16 by default) under
torch.profiler, every variant in this process. For each variant it prints
the step time (CUDA events, median of interleaved runs), the device time the
profiler saw per step by kind (matrix products, copies, other kernels) with
counts, the idle time between them, and the largest entries; for graphed's
variants, which inputs and incoming grads capture rebound. Needs the
graphed package installed (python/README.md).

    python3 examples/torch_extension/profile_step.py [--h 4096] [--b 4096] [--fp32] [--copy]
"""
import argparse
import collections
import copy
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402  (the step, the model and the variants)
import graphed.torch as gt  # noqa: E402


def kind(name):
    low = name.lower()
    if "memcpy" in low:
        return "copy"
    if "memset" in low:
        return "memset"
    if any(k in low for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")):
        return "matmul"
    return "other"


def device_events(prof):
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            yield e.name, e.time_range.elapsed_us()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--b", type=int, default=4096)
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--copy", action="store_true", help="also graphed CLONE with rebind_inputs=False")
    a = ap.parse_args()
    dtype = torch.float32 if a.fp32 else torch.bfloat16
    dev = compare.DEV
    base = compare.make_mlp(a.h, 4, dtype, 3)
    x = torch.randn(a.b, a.h, device=dev, dtype=dtype)
    t = torch.randn(a.b, a.h, device=dev, dtype=dtype)
    fns, keep = {}, []
    eager = copy.deepcopy(base)
    opt = torch.optim.SGD(compare.params(eager), lr=1e-3)
    fns["eager"] = lambda: compare.step(eager, opt, x, t)
    variants = list(compare.VARIANTS)
    if a.copy:
        variants.append(("graphed owned (default), inputs copied", lambda m, s: gt.make_graphed_callables(m, s, rebind_inputs=False)))
    for name, graph in variants:
        mods = list(graph(tuple(copy.deepcopy(base)), compare.sample_args(a.h, a.b, 4, dtype)))
        if hasattr(mods[0], "session_stats"):
            st = mods[0].session_stats()
            print(f"{name}: inputs rebound {st['inputs_rebound']}, refused {st['inputs_rebind_refused']}, "
                  f"node updates {st['rebind_nodes']}")
            for line in mods[0].session_plan().splitlines():
                if "at replay" in line:
                    print("   ", line)
        o = torch.optim.SGD(compare.params(mods), lr=1e-3)
        keep.append(mods)
        fns[name] = lambda mods=mods, o=o: compare.step(mods, o, x, t)
    times = compare.interleaved(fns, 50, 9)
    print(f"# H={a.h} B={a.b} {dtype}: step time (ms, median of 9 interleaved runs of 50 steps)")
    for name, ms in times.items():
        print(f"  {name:40s} {ms:.3f}")
    for name, fn in fns.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                fn()
            torch.cuda.synchronize()
        by_kind = collections.defaultdict(lambda: [0, 0.0])
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for ev_name, us in device_events(prof):
            by_kind[kind(ev_name)][0] += 1
            by_kind[kind(ev_name)][1] += us
            by_name[ev_name][0] += 1
            by_name[ev_name][1] += us
        busy = sum(v[1] for v in by_kind.values()) / a.steps
        print(f"\n## {name}: step {times[name] * 1000:.1f} us, device busy {busy:.1f} us, "
              f"idle {times[name] * 1000 - busy:.1f} us (per step)")
        for k, (n, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
            print(f"  {k:8s} {n / a.steps:6.1f} per step  {us / a.steps:9.1f} us")
        for ev_name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]:
            print(f"    {n / a.steps:5.1f}x {us / a.steps:8.1f} us  {ev_name[:110]}")
    for mods in keep:
        compare.reset(mods)


if __name__ == "__main__":
    main()
