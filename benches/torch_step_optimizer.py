"""The whole training iteration from Python, the optimizer inside:
graphed.torch.make_graphed_step(..., optimizer=opt, clip_grad_norm=1.0)
against PyTorch, side by side in one process (issue 39, part 4), on one of
two models:

- `--model mlp`: 24 x (Linear(64) + ReLU), batch 8, fp32, the loss
  0.5 * |y - t|^2, one microbatch (`--counts`);
- `--model gpt`: nanoGPT (examples/torch_extension/nanogpt.py, 6 blocks,
  untied, bf16 parameters), 4 microbatches.

AdamW (capturable, foreach: torch's whole-iteration graph needs it; the
graphed step runs the same), clip_grad_norm_(1.0) inside, grads zeroed.
Variants:

- "torch whole-iteration graph": torch.cuda.graph captured by hand around
  zero_grad, the N microbatches' forward and backward, clipping and
  optimizer.step() (3 warm-up iterations on a side stream first, as
  torch's docs do);
- "graphed step + optimizer": make_graphed_step(..., optimizer=,
  clip_grad_norm=): one launch, the lr copied in at each call;
- "graphed step + eager AdamW": make_graphed_step without optimizer, then
  clip_grad_norm_ and a fused AdamW eagerly, zero_grad;
- "graphed per layer + eager AdamW": graphed.torch.make_graphed_callables
  per layer, driven from Python, then the same eager update.

GPU time: CUDA-event medians per iteration, the variants interleaved over
rounds; host time: wall time of the Python call that enqueues one
iteration, the device synchronized between samples. The targets of issue
39 are printed beside: the graphed step with the optimizer inside at most
1.05x torch's whole-iteration graph and at most 10 us of host time
(mlp); at most 0.90x of graphed per layer + eager AdamW (gpt).

`--ddp` (issue 42) adds the data-parallel all-reduce to every variant,
over a world-size-1 NCCL group made by the script (NCCL_NVLS_ENABLE=0):
in torch's whole-iteration graph, a hand-written DDP all-reduce (the grads
copied into 25 MiB buckets, last parameter first, dist.all_reduce per
bucket, copied back) captured between the backward and the clipping; the
graphed steps made with ddp=True (the all-reduce in their graph); graphed
per layer, the same hand-written all-reduce run eagerly. Target (issue 42,
on two GPUs): the graphed step at most 1.02x torch's whole-iteration graph.

    python3 benches/torch_step_optimizer.py --model mlp --out step_opt_mlp.md
    python3 benches/torch_step_optimizer.py --model gpt --counts 4 --out step_opt_gpt.md
    python3 benches/torch_step_optimizer.py --model mlp --ddp --out step_opt_ddp.md
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
from torch_accumulate import accumulate, event_ms, host_us, loss_of, mlp, report  # noqa: E402

import graphed.torch as gt  # noqa: E402


def build(args, dev):
    """(the step's layers, the loss, every parameter): a fresh copy, the
    same weights each time."""
    if args.model == "mlp":
        model = mlp(args.layers, args.width, dev)
        layers, loss = list(model), loss_of
        return layers, loss, list(model.parameters())
    torch.manual_seed(0)
    g = GPT(args.vocab, args.seq, args.layers, args.heads, args.width, dropout=0.0, tie=False)
    layers, head = step_parts(g.to(dev, getattr(torch, args.dtype)))
    return list(layers), head, list(g.parameters())


def data(args, n, dev, seed=1):
    torch.manual_seed(seed)
    if args.model == "mlp":
        return (torch.randn(n, args.batch, args.width, device=dev),
                0.1 * torch.randn(n, args.batch, args.width, device=dev))
    return tuple(torch.randint(0, args.vocab, (n, args.batch, args.seq), device=dev) for _ in range(2))


def adamw(params, dev, fused=False):
    if fused:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    return torch.optim.AdamW(params, lr=torch.tensor(1e-4, device=dev), weight_decay=0.1, foreach=True,
                             capturable=True)


DDP = False  # --ddp: the all-reduce in every variant


def hand_allreduce(params, cap_bytes=25 * 1024 * 1024):
    """DDP's all-reduce by hand (None without --ddp): the grads copied
    into flat buckets of one dtype (last parameter first, a bucket closing
    at `cap_bytes`), all_reduce each, copy back; capturable."""
    if not DDP:
        return None
    import torch.distributed as dist

    buckets, cur, size = [], [], 0
    for p in reversed(params):
        if cur and (cur[0].dtype != p.dtype or size >= cap_bytes):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel() * p.element_size()
    if cur:
        buckets.append(cur)
    flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device) for b in buckets]
    views = []
    for f, b in zip(flats, buckets):
        off, vs = 0, []
        for p in b:
            vs.append(f[off : off + p.numel()].view(p.shape))
            off += p.numel()
        views.append(vs)
    scale = 1.0 / dist.get_world_size()

    def allreduce():
        for f, vs, b in zip(flats, views, buckets):
            torch._foreach_copy_(vs, [p.grad for p in b])
            if scale != 1.0:
                f.mul_(scale)
            dist.all_reduce(f)
            torch._foreach_copy_([p.grad for p in b], vs)

    return allreduce


def run(layers, loss, xs, ts):
    """Eager forward and backward of every microbatch."""
    for x, t in zip(xs, ts):
        h = x
        for m in layers:
            h = m(h)
        loss(h, t).backward()


def torch_whole_iteration(args, dev, xs, ts):
    layers, loss, params = build(args, dev)
    opt = adamw(params, dev)
    reduce = hand_allreduce(params)

    def iteration():
        opt.zero_grad(set_to_none=False)
        run(layers, loss, xs, ts)
        if reduce is not None:
            reduce()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for p in params:
            p.grad = torch.zeros_like(p)
        for _ in range(3):
            iteration()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if reduce is not None:
        time.sleep(0.3)  # the process group's watchdog drops the warm-up's works before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        iteration()
    torch.cuda.synchronize()
    return g.replay


def graphed_with_optimizer(args, dev, xs, ts, n):
    layers, loss, params = build(args, dev)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True, capturable=True)
    step = gt.make_graphed_step(layers, loss, (xs[0],), (ts[0],), microbatches=n, optimizer=opt,
                                clip_grad_norm=1.0, ddp=DDP or None)
    return lambda: step(xs if n > 1 else xs[0], ts if n > 1 else ts[0])


def graphed_then_eager(args, dev, xs, ts, n):
    layers, loss, params = build(args, dev)
    opt = adamw(params, dev, fused=True)
    step = gt.make_graphed_step(layers, loss, (xs[0],), (ts[0],), microbatches=n, ddp=DDP or None)

    def iteration():
        step(xs if n > 1 else xs[0], ts if n > 1 else ts[0])
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return iteration


def per_layer_then_eager(args, dev, xs, ts):
    layers, loss, params = build(args, dev)
    opt = adamw(params, dev, fused=True)
    samples, h = [], xs[0]
    for m in layers:
        samples.append((h.detach().requires_grad_(h.is_floating_point() and len(samples) > 0),))
        with torch.no_grad():
            h = m(h)
    graphed = gt.make_graphed_callables(tuple(layers), tuple(samples))
    reduce = hand_allreduce(params)

    def iteration():
        run(graphed, loss, xs, ts)
        if reduce is not None:
            reduce()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return iteration


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--counts", default=None)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ddp", action="store_true", help="the all-reduce in every variant (world size 1, NCCL)")
    args = ap.parse_args()
    global DDP
    DDP = args.ddp
    if DDP:
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    gpt = args.model == "gpt"
    args.layers = args.layers or (6 if gpt else 24)
    args.width = args.width or (384 if gpt else 64)
    args.batch = args.batch or 8
    counts = [int(c) for c in (args.counts or ("4" if gpt else "1")).split(",")]
    dev = torch.device("cuda")
    what = " and the DDP all-reduce (world size 1, NCCL)" if DDP else ""
    lines = [f"# The whole iteration with AdamW and clipping{what} inside ({args.model})", "",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.layers} layers, width "
             f"{args.width}, batch {args.batch}", "",
             "| N | variant | GPU ms (median) | host us (median) | vs torch whole-iteration graph | vs graphed per layer + eager |",
             "|---|---|---|---|---|---|"]
    for n in counts:
        xs, ts = data(args, n, dev)
        fns = {
            "torch whole-iteration graph": torch_whole_iteration(args, dev, xs, ts),
            "graphed step + optimizer": graphed_with_optimizer(args, dev, xs, ts, n),
            "graphed step + eager AdamW": graphed_then_eager(args, dev, xs, ts, n),
            "graphed per layer + eager AdamW": per_layer_then_eager(args, dev, xs, ts),
        }
        gpu = interleaved(fns, args.rounds, args.iters, args.warmup)
        host = {k: host_us(fn, args.iters) for k, fn in fns.items()}
        base, per_layer = gpu["torch whole-iteration graph"], gpu["graphed per layer + eager AdamW"]
        for k in fns:
            lines.append(f"| {n} | {k} | {gpu[k]:.4f} | {host[k]:.1f} | {gpu[k] / base:.3f}x | {gpu[k] / per_layer:.3f}x |")
        mine = gpu["graphed step + optimizer"]
        if DDP:
            lines.append(f"\ntarget (ddp, N={n}; issue 42 sets it on two GPUs): graphed step + optimizer at most "
                         f"1.02x torch's whole-iteration graph: {mine / base:.3f}x "
                         f"{'met' if mine <= 1.02 * base else 'NOT MET'}")
        elif gpt:
            lines.append(f"\ntarget (gpt, N={n}): graphed step + optimizer at most 0.90x of graphed per layer + "
                         f"eager AdamW: {mine / per_layer:.3f}x {'met' if mine <= 0.90 * per_layer else 'NOT MET'}")
        else:
            h = host["graphed step + optimizer"]
            lines.append(f"\ntarget (mlp, N={n}): at most 1.05x torch's whole-iteration graph: {mine / base:.3f}x "
                         f"{'met' if mine <= 1.05 * base else 'NOT MET'}; host at most 10 us: {h:.1f} us "
                         f"{'met' if h <= 10 else 'NOT MET'}")
    report("\n".join(lines) + "\n", args.out)
    if DDP:
        import torch.distributed as dist

        torch.cuda.synchronize()
        fns.clear()  # the steps' graphs go before the group
        import gc

        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
