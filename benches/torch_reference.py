"""PyTorch's side of the step-graph and memory benchmarks: the same small
MLP (Linear + ReLU layers, fp32) that benches/step_bench.cpp and
memory_bench.cpp graph with graphed, here graphed layer by layer with
torch.cuda.make_graphed_callables and driven from Python, as users of torch
do. Prints one JSON object that graphed_bench merges into its report
(--torch-json), and a summary.

    python3 benches/torch_reference.py --layers 24 --width 256 --batch 64

Times are CUDA-event medians over many iterations after warm-up; memory is
torch.cuda.memory_allocated before and after graphing (the graphs' private
pool holds every static input, output and grad of every layer).
"""
import argparse
import json
import statistics

import torch


def mlp(layers, width, device):
    torch.manual_seed(0)
    return [
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()).to(device)
        for _ in range(layers)
    ]


def step_times(layers, x, gy, iters, warmup):
    """Median ms of one forward + backward over the layers (no optimizer)."""

    def step():
        h = x
        for layer in layers:
            h = layer(h)
        h.backward(gy)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(args.batch, args.width, device=dev, requires_grad=True)
    gy = torch.randn(args.batch, args.width, device=dev)

    eager = mlp(args.layers, args.width, dev)
    eager_ms = step_times(eager, x, gy, args.iters, args.warmup)

    layers = mlp(args.layers, args.width, dev)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    samples = [(torch.randn(args.batch, args.width, device=dev, requires_grad=True),) for _ in layers]
    graphed = torch.cuda.make_graphed_callables(tuple(layers), tuple(samples))
    torch.cuda.synchronize()
    graphed_bytes = torch.cuda.memory_allocated() - before
    graphed_ms = step_times(list(graphed), x, gy, args.iters, args.warmup)

    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "eager_ms": eager_ms,
        "per_layer_graphs_ms": graphed_ms,
        "per_layer_graphs_bytes": graphed_bytes,
    }
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(
        f"# torch {torch.__version__}: {args.layers} x Linear({args.width}) + ReLU, batch {args.batch}: "
        f"eager {eager_ms:.3f} ms, make_graphed_callables per layer {graphed_ms:.3f} ms, "
        f"graph memory {graphed_bytes} bytes"
    )


if __name__ == "__main__":
    main()
