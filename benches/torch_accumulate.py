"""PyTorch's side of the microbatch-step benchmark (docs/benchmarks.md
section 11): the same small MLP as graphed_bench --microbatches (Linear +
ReLU layers, fp32, the squared-error loss 0.5 * |y - t|^2), N microbatches
accumulated into .grad per optimizer step (the optimizer left out), three
ways: eager; torch.cuda.make_graphed_callables per layer, driven from
Python; and one graph captured by hand with torch.cuda.graph around all N
microbatches' forward and backward (grads zeroed inside the graph, then
accumulated in place). Checked first: the hand-captured graph's grads equal
eager accumulation's bit for bit. Writes a markdown table.

    python3 benches/torch_accumulate.py --counts 1,4,16,64 --out torch_accumulate.md

GPU time: CUDA-event medians over many optimizer steps after warm-up. Host
time: wall time of the Python call that enqueues one optimizer step, the
device synchronized between samples. Capture: torch.cuda.graph's capture
and instantiate wall time. Memory: torch.cuda.memory_allocated growth while
capturing (the graph's private pool).
"""
import argparse
import statistics
import time

import torch


def mlp(layers, width, device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)]
    ).to(device)


def loss_of(y, t):
    return 0.5 * ((y - t) ** 2).sum()


def accumulate(model, xs, ts, loss=loss_of):
    for x, t in zip(xs, ts):
        loss(model(x), t).backward()


def report(text, path):
    """Prints a bench's report and writes it to `path` (when given)."""
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


def event_ms(fn):
    """GPU time of one call of fn (CUDA events around it), in ms."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def gpu_ms(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn) for _ in range(iters))


def host_us(fn, iters):
    times = []
    for _ in range(iters):
        a = time.perf_counter()
        fn()
        times.append((time.perf_counter() - a) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def params(model, loss=None):
    """The parameters of `model`, then those of `loss` where it is a module."""
    out = list(model.parameters())
    return out + (list(loss.parameters()) if isinstance(loss, torch.nn.Module) else [])


def grads(model, loss=None):
    return [p.grad.clone() for p in params(model, loss)]


def none_grads(model, loss=None):
    for p in params(model, loss):
        p.grad = None


def per_layer_graphs(model, x, loss=loss_of, t=None):
    """`model`'s layers (an nn.Sequential) each graphed by
    torch.cuda.make_graphed_callables, the loss too where it is a module,
    the samples taken from one eager pass over `x` (every sample but the
    first requiring grad): (the graphed layers chained, the loss)."""
    layers, samples, h = list(model), [], x
    with torch.no_grad():
        for k, layer in enumerate(layers):
            samples.append((h.detach().clone().requires_grad_(k > 0),))
            h = layer(h)
    callables = tuple(layers)
    if isinstance(loss, torch.nn.Module):
        callables += (loss,)
        # A copy: torch's graphed callable copies each call's inputs into
        # its samples (a view of the caller's targets would be overwritten).
        samples.append((h.detach().clone().requires_grad_(), t.clone()))
    graphed = torch.cuda.make_graphed_callables(callables, tuple(samples))
    return torch.nn.Sequential(*graphed[: len(layers)]), (graphed[-1] if len(graphed) > len(layers) else loss)


def whole_step_graph(model, xs, ts, loss=loss_of):
    """One graph captured by hand around the N microbatches' forward and
    backward, grads zeroed inside it (after 3 warm-up steps on a side
    stream): (the graph, capture and instantiate ms, the pool's bytes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            none_grads(model, loss)
            accumulate(model, xs, ts, loss)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    before = torch.cuda.memory_allocated()
    a = time.perf_counter()
    with torch.cuda.graph(g):
        for p in params(model, loss):
            p.grad.zero_()
        accumulate(model, xs, ts, loss)
    torch.cuda.synchronize()
    return g, (time.perf_counter() - a) * 1e3, torch.cuda.memory_allocated() - before


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--counts", default="1,4,16,64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for n in [int(c) for c in args.counts.split(",")]:
        xs = torch.randn(n, args.batch, args.width, device=dev)
        ts = 0.1 * torch.randn(n, args.batch, args.width, device=dev)
        eager = mlp(args.layers, args.width, dev)

        def eager_step():
            none_grads(eager)
            accumulate(eager, xs, ts)

        eager_ms = gpu_ms(eager_step, args.iters, args.warmup)
        eager_host = host_us(eager_step, args.iters)
        eager_step()
        want = grads(eager)

        per_layer = mlp(args.layers, args.width, dev)
        graphed, _ = per_layer_graphs(per_layer, xs[0])

        def per_layer_step():
            none_grads(per_layer)
            accumulate(graphed, xs, ts)

        per_layer_ms = gpu_ms(per_layer_step, args.iters, args.warmup)
        per_layer_host = host_us(per_layer_step, args.iters)

        whole = mlp(args.layers, args.width, dev)
        g, capture_ms, pool_bytes = whole_step_graph(whole, xs, ts)
        g.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(grads(whole), want))
        if not same:
            raise SystemExit(f"CHECK FAILED: the hand-captured graph's grads differ from eager's (N={n})")
        whole_ms = gpu_ms(g.replay, args.iters, args.warmup)
        whole_host = host_us(g.replay, args.iters)
        rows.append((n, eager_ms, per_layer_ms, whole_ms, eager_host, per_layer_host, whole_host, capture_ms, pool_bytes))
        print(f"N={n}: eager {eager_ms:.3f} ms, per-layer graphs {per_layer_ms:.3f} ms, whole-step graph "
              f"{whole_ms:.3f} ms; host {eager_host:.0f} / {per_layer_host:.0f} / {whole_host:.1f} us; "
              f"capture {capture_ms:.1f} ms, pool {pool_bytes} bytes", flush=True)
    text = (
        f"torch {torch.__version__} on {torch.cuda.get_device_name()}: {args.layers} x Linear({args.width}) + ReLU, "
        f"batch {args.batch} per microbatch, fp32; the hand-captured graph's grads equal eager's bit for bit.\n\n"
        "| N | GPU ms, eager | GPU ms, per-layer graphs | GPU ms, whole-step graph | host us, eager | "
        "host us, per-layer graphs | host us, whole-step graph | capture ms, whole-step graph | "
        "pool bytes, whole-step graph |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        text += "| {} | {:.4f} | {:.4f} | {:.4f} | {:.0f} | {:.0f} | {:.1f} | {:.1f} | {} |\n".format(*r)
    report(text, args.out)


if __name__ == "__main__":
    main()
