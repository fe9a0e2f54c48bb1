"""PyTorch's side of the buckets benchmark (docs/benchmarks.md section 12):
the same MLP as graphed_bench --buckets (8 Linear(1024) + ReLU layers, the
last without ReLU, fp32), its batch taking 8 sizes (32, 64, ..., 256), a
training step (forward, the squared-error loss, backward) run three ways:

- eager, as the reference;
- torch.compile(mode="reduce-overhead"): CUDA graphs recorded per shape
  (cudagraph trees; dynamic=False so that each shape gets its own graph, as
  torch does unless told to pad), every size warmed up and recorded;
- torch.cuda.make_graphed_callables, one graphed model per shape.

Memory: the device memory each way took (torch.cuda.mem_get_info before and
after, torch's cache emptied first) and torch's reserved bytes. Time: the
step of 200 rows padded to 224 (the bucket graphed runs) for the recorded
ways, and of 200 rows eagerly. Checked first: each way's grads at 224 rows
agree with eager's (to rounding: cuBLAS may pick other kernels in a graph).

    python3 benches/torch_buckets.py --out torch_buckets.md
"""
import argparse

import torch

from torch_accumulate import gpu_ms, loss_of, report

SIZES = [32, 64, 96, 128, 160, 192, 224, 256]


def mlp(layers, width):
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods).cuda()


def step(model, x, t):
    loss_of(model(x), t).backward()


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def zero(model):
    for p in model.parameters():
        p.grad = None


def taken(build):
    """What `build` leaves on the device: (driver MiB, torch reserved MiB)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info()
    res0 = torch.cuda.memory_reserved()
    out = build()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    res1 = torch.cuda.memory_reserved()
    return out, (free0 - free1) / 2**20, (res1 - res0) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    L, W = a.layers, a.width
    data = {n: (torch.randn(n, W, device="cuda"), torch.randn(n, W, device="cuda")) for n in SIZES}
    rows = []

    # Eager reference at 224 rows.
    eager = mlp(L, W)
    x224, t224 = data[224]
    step(eager, x224, t224)
    want = grads(eager)
    zero(eager)

    def check(model, name):
        zero(model)
        fn(model)
        torch.cuda.synchronize()
        got = grads(model)
        worst = max(float((g - w).abs().max() / (w.abs().max() + 1e-30)) for g, w in zip(got, want))
        print(f"{name}: grads at 224 rows, largest relative difference from eager {worst:.3g}")
        return worst

    # torch.compile, reduce-overhead: one recording per shape.
    def compiled():
        model = mlp(L, W)
        cm = torch.compile(model, mode="reduce-overhead", dynamic=False)
        for n in SIZES:
            x, t = data[n]
            for _ in range(3):
                zero(model)
                step(cm, x, t)
        return model, cm

    try:
        (c_model, c_fn), c_drv, c_res = taken(compiled)

        def fn(model):
            step(c_fn, x224, t224)

        c_diff = check(c_model, "torch.compile reduce-overhead")
        c_ms = gpu_ms(lambda: (zero(c_model), step(c_fn, x224, t224)), 50, 5)
        rows.append(("torch.compile(mode=\"reduce-overhead\"), 8 shapes", c_drv, c_res, c_ms, c_diff))
    except Exception as e:  # no Triton, no compiler: say so in the table
        print(f"torch.compile: not measured: {type(e).__name__}: {e}")
        rows.append((f"torch.compile: not measured ({type(e).__name__})", float("nan"), float("nan"),
                     float("nan"), float("nan")))

    # torch.cuda.make_graphed_callables, one graphed wrapper per shape around
    # the same layers (it replaces the forward of the module it is given).
    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    def graphed():
        model = mlp(L, W)
        per = {}
        for n in SIZES:
            x, _ = data[n]
            per[n] = torch.cuda.make_graphed_callables(Wrap(model), (x.clone(),))
        return model, per

    (g_model, g_per), g_drv, g_res = taken(graphed)

    def fn(model):  # noqa: F811 (the check's step for this way)
        step(g_per[224], x224, t224)

    g_diff = check(g_model, "make_graphed_callables per shape")
    g_ms = gpu_ms(lambda: (zero(g_model), step(g_per[224], x224, t224)), 50, 5)
    rows.append(("torch make_graphed_callables, one per shape", g_drv, g_res, g_ms, g_diff))

    e_ms = gpu_ms(lambda: (zero(eager), step(eager, *data[224])), 50, 5)
    x200, t200 = x224[:200].contiguous(), t224[:200].contiguous()
    e200_ms = gpu_ms(lambda: (zero(eager), step(eager, x200, t200)), 50, 5)

    dev = torch.cuda.get_device_name()
    out = [
        f"torch {torch.__version__} on {dev}: {L} Linear({W}) layers, fp32, sizes {SIZES}.",
        "",
        "| way | driver MiB | torch reserved MiB | GPU ms, a step of 224 rows | grads vs eager (max rel. diff) |",
        "|---|---|---|---|---|",
    ]
    for name, drv, res, ms, diff in rows:
        out.append(f"| {name} | {drv:.1f} | {res:.1f} | {ms:.4f} | {diff:.3g} |")
    out.append(f"| eager | - | - | {e_ms:.4f} (200 rows: {e200_ms:.4f}) | 0 |")
    text = "\n".join(out) + "\n"
    report(text, a.out)


if __name__ == "__main__":
    main()
