"""Where the host time of one graphed step call from Python goes
(graphed.torch.make_graphed_step, docs/benchmarks.md section 21): the 24-layer
small MLP (Linear(64) + ReLU, batch 8, fp32, one microbatch,
param_grads="set") timed with its parts taken away one at a time, all in
this process, against torch's hand-captured whole-step graph:

- the call as a user makes it: `step(x, t)`;
- without the Python wrapper's checks of each parameter's `.grad`
  (`step._impl.replay`, what the wrapper calls after them);
- the same with `rebind_params=False` (no per-callable lookup of each
  parameter in its module, no comparison with what the graphs read);
- torch.cuda.CUDAGraph.replay of the hand-captured step (the floor: one
  launch, nothing checked, the data copied in beforehand).

Host time: wall time of the call that enqueues one step, the device
synchronized between samples, median over `--iters` calls after warm-up,
the variants interleaved over `--rounds` rounds (median of the round
medians). The grads of each graphed variant are checked against eager's
first (bit for bit). Writes a markdown table.

    python3 benches/torch_step_host.py [--layers 24] [--width 64] [--batch 8] [--out host.md]
"""
import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_accumulate import accumulate, grads, host_us, loss_of, mlp, report, whole_step_graph  # noqa: E402

import graphed.torch as gt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(1, args.batch, args.width, device=dev)
    t = 0.1 * torch.randn(1, args.batch, args.width, device=dev)

    eager = mlp(args.layers, args.width, dev)
    accumulate(eager, x, t)
    want = grads(eager)

    def graphed(rebind):
        model = mlp(args.layers, args.width, dev)
        step = gt.make_graphed_step(list(model), loss_of, (x[0],), (t[0],), param_grads="set", rebind_params=rebind)
        step(x, t)
        got = grads(model)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            sys.exit(f"graphed step (rebind_params={rebind}): grads differ from eager's")
        return model, step

    m1, s1 = graphed(True)
    m2, s2 = graphed(False)
    hand_model = mlp(args.layers, args.width, dev)
    graph, _, _ = whole_step_graph(hand_model, x, t)
    graph.replay()
    torch.cuda.synchronize()
    if not all(torch.equal(a, b) for a, b in zip(grads(hand_model), want)):
        sys.exit("the hand-captured step's grads differ from eager's")

    data = [x, t]
    variants = {
        "step(x, t) (the call as made)": lambda: s1(x, t),
        "step._impl.replay (no .grad checks in Python)": lambda: s1._impl.replay(data, 0),
        "step._impl.replay, rebind_params=False": lambda: s2._impl.replay(data, 0),
        "step(x, t), rebind_params=False": lambda: s2(x, t),
        "torch.cuda.CUDAGraph.replay (hand-captured step)": graph.replay,
    }
    for fn in variants.values():
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    per = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            per[name].append(host_us(fn, args.iters))
    res = {name: statistics.median(v) for name, v in per.items()}
    floor = res["torch.cuda.CUDAGraph.replay (hand-captured step)"]
    full = res["step(x, t) (the call as made)"]
    lines = [
        f"Host time of one step call, {args.layers} x (Linear({args.width}) + ReLU), batch {args.batch}, fp32, "
        f'param_grads="set"; median of {args.rounds} interleaved rounds of {args.iters} calls '
        f"({torch.cuda.get_device_name()}, torch {torch.__version__}).",
        "",
        "| variant | host us per call | against the call as made | against torch's hand-captured replay |",
        "|---|---|---|---|",
    ]
    for name, us in res.items():
        lines.append(f"| {name} | {us:.1f} | {us / full:.2f}x | {us / floor:.1f}x |")
    lines.append("")
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
