"""Capture time of graphed.torch.make_graphed_callables against
torch.cuda.make_graphed_callables, side by side in this process: the
transformer blocks of nanoGPT (nanogpt.py; n_embd 384, 6 heads, batch 64 x
256 tokens by default, bf16 autocast, dropout), each block one callable of
one call, as a user graphs them. For every variant and block count it
prints the median host time of the whole call over fresh copies of the
blocks, and, for graphed, where the median call's time went (the phases
of graphed_session_capture from the session's stats; "package" is the time
of the call outside the library: argument handling, discovery, the
adapter's setup). Needs the graphed package installed (python/README.md).

    python3 examples/torch_extension/capture_time.py [--blocks 6,24] [--rounds 3] [--out capture.md]
"""
import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import graphed.torch as gt  # noqa: E402
from nanogpt import Block  # noqa: E402

PHASES = ["plan", "warmup", "record", "instantiate", "upload", "slots", "steps", "rebind_plan", "rebind_verify"]

VARIANTS = {
    "torch.cuda.make_graphed_callables": None,
    "graphed (default)": {},
    "graphed, rebind_inputs=False": {"rebind_inputs": False},
    "graphed, clone_param_grads_on_return=False": {"clone_param_grads_on_return": False},
}


def capture(name, blocks, samples):
    """Graphs `blocks` with variant `name`; returns (seconds, stats, graphed)."""
    opts = VARIANTS[name]
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        if opts is None:
            out = torch.cuda.make_graphed_callables(tuple(blocks), samples)
        else:
            out = gt.make_graphed_callables(tuple(blocks), samples, **opts)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    stats = out[0].session_stats() if opts is not None else None
    return seconds, stats, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="6,24")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    lines, results = [], {}
    say = lambda s="": (print(s, flush=True), lines.append(s))  # noqa: E731
    say(f"## Capture time: nanoGPT blocks (n_embd {a.embd}, {a.heads} heads, batch {a.batch} x {a.seq} tokens, "
        f"bf16 autocast, dropout {a.dropout})")
    say()
    say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host time of the whole call, median of "
        f"{a.rounds} rounds (variants interleaved, fresh copies of the blocks each time); phases of the median "
        "graphed call in ms; the graph templates it keeps (those rebinding plans need).")
    say()
    say("| blocks | variant | seconds | vs torch | package | " + " | ".join(PHASES)
        + " | rebound / refused | templates kept / graphs |")
    say("|---|---|---|---|---|" + "---|" * len(PHASES) + "---|---|")
    for n in [int(x) for x in a.blocks.split(",")]:
        base = [Block(a.embd, a.heads, a.dropout).cuda() for _ in range(n)]
        x = torch.randn(a.batch, a.seq, a.embd, device="cuda")
        runs = {name: [] for name in VARIANTS}
        # One untimed capture of each variant first: cuBLAS and kernel loads stay out.
        for r in range(a.rounds + 1):
            for name in VARIANTS:
                blocks = copy.deepcopy(base)
                samples = tuple((x.clone().requires_grad_(),) for _ in blocks)
                seconds, stats, out = capture(name, blocks, samples)
                if r > 0:
                    runs[name].append((seconds, stats))
                if VARIANTS[name] is not None:
                    for c in out:  # the graphs are freed with the last
                        c.reset()
                del out, blocks, samples
                gc.collect()
        torch_s = statistics.median(s for s, _ in runs["torch.cuda.make_graphed_callables"])
        for name, rs in runs.items():
            rs.sort(key=lambda r: r[0])
            seconds, stats = rs[len(rs) // 2]
            row = f"| {n} | {name} | {seconds:.3f} | {seconds / torch_s:.2f}x |"
            if stats is None:
                row += " |" + " |" * len(PHASES) + " | |"
            else:
                lib = stats["capture_ns"] / 1e9
                row += f" {1e3 * (seconds - lib):.0f} |"
                row += "".join(f" {stats['capture_' + p + '_ns'] / 1e6:.0f} |" for p in PHASES)
                row += f" {stats['inputs_rebound']} / {stats['inputs_rebind_refused']} |"
                graphs = stats["graph_count"] + stats["slot_graphs"] + stats["step_graphs"]
                row += f" {stats['templates_kept']} / {graphs} |"
            say(row)
            results[f"{n}/{name}"] = {"seconds": seconds, "runs": [s for s, _ in rs], "stats": stats}
        del base
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
