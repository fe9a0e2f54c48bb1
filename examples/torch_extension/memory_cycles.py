"""Memory over repeated make / train / drop cycles, graphed.torch against
torch.cuda.make_graphed_callables, side by side in this process: nanoGPT's
transformer blocks (nanogpt.py; n_embd 384, 6 heads, batch 64 x 256 tokens
by default, bf16 autocast), graphed as a user graphs them, one AdamW step,
then every callable, module and optimizer dropped (no reset()), the garbage
collected and PyTorch's cache emptied. After each cycle it reads the
device's used memory (torch.cuda.mem_get_info), PyTorch's reserved and
allocated bytes, and graphed's own accounting of the device memory it holds
(graphed.torch.memory_report(), every live session). A library that frees
its graphs with the last reference comes back to the same figures each
cycle. Needs the graphed package installed (python/README.md).

    python3 examples/torch_extension/memory_cycles.py [--cycles 20] [--blocks 6] [--out memory.md]
"""
import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import graphed.torch as gt  # noqa: E402
from nanogpt import Block  # noqa: E402

MIB = 2**20


def footprint():
    """(device used, torch reserved, torch allocated, graphed's bytes) after
    the garbage is collected and PyTorch's cache emptied."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    ours = gt.memory_report()["total_bytes"] if hasattr(gt, "memory_report") else -1
    return total - free, torch.cuda.memory_reserved(), torch.cuda.memory_allocated(), ours


def cycle(variant, args):
    """Makes the graphs, trains one step, drops everything."""
    blocks = [Block(args.embd, 6, 0.1).cuda() for _ in range(args.blocks)]
    shape = (args.batch, args.seq, args.embd)
    samples = tuple((torch.randn(shape, device="cuda", requires_grad=i > 0),) for i in range(args.blocks))
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        if variant == "torch":
            torch.cuda.make_graphed_callables(tuple(blocks), samples)
        else:
            gt.make_graphed_callables(tuple(blocks), samples)
    opt = torch.optim.AdamW([p for b in blocks for p in b.parameters()], lr=1e-4)
    x = torch.randn(shape, device="cuda")
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        for b in blocks:
            x = b(x)
    x.float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = footprint()
    rows = {}
    for variant in ("torch", "graphed"):
        seen = []
        for k in range(args.cycles):
            cycle(variant, args)
            seen.append(footprint())
            if k in (0, args.cycles - 1):
                used, reserved, allocated, ours = seen[-1]
                print(f"{variant:8s} cycle {k + 1:2d}: device used {used / MIB:8.1f} MiB, torch reserved "
                      f"{reserved / MIB:8.1f}, allocated {allocated / MIB:8.1f}, graphed {ours} bytes", flush=True)
        rows[variant] = seen
    lines = [
        f"# Memory over make / train / drop cycles ({torch.cuda.get_device_name()}, torch {torch.__version__})",
        "",
        f"{args.blocks} nanoGPT blocks (n_embd {args.embd}, batch {args.batch} x {args.seq} tokens, bf16 autocast), "
        f"{args.cycles} cycles per variant, torch's first; MiB after each cycle (garbage collected, cache emptied), "
        f"relative to the process before the first cycle (device used {base[0] / MIB:.1f} MiB).",
        "",
        "| variant | device used, cycle 1 | device used, last cycle | growth per cycle after the first | "
        "torch reserved, last | graphed's bytes, last |",
        "|---|---|---|---|---|---|",
    ]
    for variant, seen in rows.items():
        first, last = seen[0], seen[-1]
        growth = (last[0] - first[0]) / max(len(seen) - 1, 1)
        lines.append(
            f"| {variant} | {(first[0] - base[0]) / MIB:.1f} | {(last[0] - base[0]) / MIB:.1f} | "
            f"{growth / MIB:+.1f} | {(last[1] - base[1]) / MIB:.1f} | {last[3]} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    # graphed comes back: no growth after the first cycle, and none of its bytes held.
    g = rows["graphed"]
    ok = g[-1][3] <= 0 and g[-1][0] <= g[0][0]
    print("graphed frees what it made:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
