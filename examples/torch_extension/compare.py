"""graphed.torch against torch.cuda.make_graphed_callables, on a GPU, every
variant in this process: the PyTorch issue 181723 reproduction, training
equality, step times, the host time of one graphed layer call, and
Transformer Engine's interleaved pipeline scenario. Writes the markdown
report that docs/benchmarks.md sections 15 to 19 are made from. Needs the
graphed package installed (python/README.md).

    python3 examples/torch_extension/compare.py --out report.md [--commit SHA]
"""
import argparse
import copy
import datetime
import statistics
import sys
import time

import torch
import torch.nn as nn

import graphed.torch as gt

DEV = torch.device("cuda")
lines = []
failures = []


def say(s=""):
    print(s, flush=True)
    lines.append(s)


def check(ok, what):
    if not ok:
        failures.append(what)
        print("CHECK FAILED:", what, flush=True)


def torch_graph(mods, args):
    return torch.cuda.make_graphed_callables(mods, args)


def ours(clones, accumulate=None, lazy=True):
    def graph(mods, args):
        return gt.make_graphed_callables(mods, args, clone_param_grads_on_return=clones,
                                         accumulate_param_grads_into=accumulate, lazy_clones=lazy)

    return graph


VARIANTS = [
    ("torch.cuda.make_graphed_callables", torch_graph),
    ("graphed (default: owned, written in place)", ours(True)),
    ("graphed (opt-out: aliases)", ours(False)),
    ("graphed (accumulate into .grad)", ours(True, "grad")),
    ("graphed (owned, copied: lazy_clones=False)", ours(True, lazy=False)),
]


def reset(graphed):
    for g in graphed if isinstance(graphed, (list, tuple)) else [graphed]:
        # graphed.torch's modules carry reset() in their __dict__, its graphed
        # callables in their class; torch's have none.
        if "reset" in getattr(g, "__dict__", {}) or type(g).__module__.startswith("graphed."):
            g.reset()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ---- 1. PyTorch issue 181723 ------------------------------------------------------


def issue_181723(h=1024, b=64):
    say("## 1. PyTorch issue 181723: grads kept across replays\n")
    say(
        f"One `nn.Linear({h}, {h})` graphed by each variant (fp32, batch {b}). (a) Retained grad: after "
        "backward 1, keep `weight.grad`, set `weight.grad = None` (as `zero_grad()` does), run backward 2; "
        "is the kept tensor unchanged? (b) Accumulation: two backward passes without zeroing; `weight.grad` "
        "against eager g1 + g2.\n"
    )
    say("| variant | (a) kept grad unchanged | (a) kept grad shares memory with the new grad | (b) relative error of g1 + g2 |")
    say("|---|---|---|---|")
    torch.manual_seed(1)
    base = nn.Linear(h, h).to(DEV)
    x1, x2 = torch.randn(b, h, device=DEV), torch.randn(b, h, device=DEV)
    ref = copy.deepcopy(base)
    ref(x1).sum().backward()
    g1 = ref.weight.grad.clone()
    ref.weight.grad = None
    ref(x2).sum().backward()
    g2 = ref.weight.grad.clone()
    results = {}
    for name, graph in VARIANTS:
        lin = copy.deepcopy(base)
        g = graph(lin, (torch.randn(b, h, device=DEV),))
        g(x1).sum().backward()
        kept = lin.weight.grad
        kept_then = kept.clone()
        lin.weight.grad = None
        g(x2).sum().backward()
        torch.cuda.synchronize()
        intact = torch.equal(kept, kept_then)
        shares = kept.data_ptr() == lin.weight.grad.data_ptr()
        lin.weight.grad = None
        g(x1).sum().backward()
        g(x2).sum().backward()
        err = rel(lin.weight.grad, g1 + g2)
        results[name] = (intact, err)
        say(f"| {name} | {'yes' if intact else '**no**'} | {'**yes**' if shares else 'no'} | {err:.3g} |")
        reset(g)
    say()
    t_intact, t_err = results[VARIANTS[0][0]]
    o_intact, o_err = results[VARIANTS[1][0]]
    check(not t_intact and t_err > 0.5, "torch's graphed grads are corrupted (issue 181723 reproduced)")
    check(o_intact and o_err < 1e-6, "graphed's default grads are exact")
    say(
        f"torch.cuda.make_graphed_callables: the kept grad is overwritten and the accumulated grad has relative "
        f"error {t_err:.3f} (it holds 2·g2). graphed by default: kept grad intact, accumulation error {o_err:.3g}. "
        "The opt-out reproduces torch's behaviour, as documented.\n"
    )


# ---- 2. training equality ---------------------------------------------------------


def make_mlp(h, depth, dtype, seed):
    torch.manual_seed(seed)
    layers = []
    for i in range(depth):
        lin = nn.Linear(h, h).to(DEV, dtype)
        layers.append(nn.Sequential(lin, nn.ReLU()) if i + 1 < depth else lin)
    return layers


def sample_args(h, b, depth, dtype):
    return tuple((torch.randn(b, h, device=DEV, dtype=dtype, requires_grad=i > 0),) for i in range(depth))


def step(layers, opt, x, t):
    opt.zero_grad(set_to_none=True)
    y = x
    for layer in layers:
        y = layer(y)
    loss = nn.functional.mse_loss(y, t)
    loss.backward()
    opt.step()
    return loss


def params(layers):
    return [p for layer in layers for p in layer.parameters()]


def training(h=512, b=64, depth=4, steps=5):
    say("## 2. A 4-layer MLP trained for 5 steps\n")
    say(
        f"Linear+ReLU layers of width {h}, batch {b}, fp32, SGD (lr 0.1), each layer graphed separately; final "
        "weights against eager.\n"
    )
    say("| variant | final weights bit-identical to eager | max abs difference |")
    say("|---|---|---|")
    base = make_mlp(h, depth, torch.float32, 7)
    data = [(torch.randn(b, h, device=DEV), torch.randn(b, h, device=DEV)) for _ in range(steps)]
    eager = copy.deepcopy(base)
    opt = torch.optim.SGD(params(eager), lr=0.1)
    for x, t in data:
        step(eager, opt, x, t)
    want = params(eager)
    for name, graph in VARIANTS:
        mods = list(graph(tuple(copy.deepcopy(base)), sample_args(h, b, depth, torch.float32)))
        opt = torch.optim.SGD(params(mods), lr=0.1)
        for x, t in data:
            step(mods, opt, x, t)
        got = params(mods)
        exact = all(torch.equal(a, c) for a, c in zip(got, want))
        diff = max((a - c).abs().max().item() for a, c in zip(got, want))
        say(f"| {name} | {'yes' if exact else 'no'} | {diff:.3g} |")
        if name.startswith("graphed"):
            check(exact, f"{name}: training is bit-identical to eager")
        reset(mods)
    say()


# ---- 3. step time ---------------------------------------------------------------------


def interleaved(fns, steps, runs, warmup=10):
    """Device time per call of each fn (CUDA events), runs interleaved across
    the variants (A B C D, A B C D, ...) so drift hits all alike; medians."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    per = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(steps):
                fn()
            z.record()
            z.synchronize()
            per[name].append(a.elapsed_time(z) / steps)
    return {name: statistics.median(v) for name, v in per.items()}


def step_times(runs=9, steps=50):
    say("## 3. Step time\n")
    say(
        f"Time per training step (zero_grad, forward, MSE loss, backward, SGD step) of a 4-layer MLP, CUDA events "
        f"over {steps} steps after 10 warm-up steps, median of {runs} runs interleaved across the variants, all in "
        "this process.\n"
    )
    say("| config | eager (ms) | torch graphed (ms) | graphed owned, in place (default) (ms) | graphed ALIAS (ms) | graphed ACCUMULATE_INTO .grad (ms) | graphed owned, copied (lazy_clones=False) (ms) | owned / torch graphed | owned / eager | ACCUMULATE_INTO / eager | copied / eager |")
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    for h, b, dtype in ((512, 32, torch.float32), (4096, 4096, torch.bfloat16)):
        base = make_mlp(h, 4, dtype, 3)
        x = torch.randn(b, h, device=DEV, dtype=dtype)
        t = torch.randn(b, h, device=DEV, dtype=dtype)
        fns, keep = {}, []
        eager = copy.deepcopy(base)
        opt = torch.optim.SGD(params(eager), lr=1e-3)
        fns["eager"] = lambda eager=eager, opt=opt: step(eager, opt, x, t)
        for name, graph in VARIANTS:
            mods = list(graph(tuple(copy.deepcopy(base)), sample_args(h, b, 4, dtype)))
            o = torch.optim.SGD(params(mods), lr=1e-3)
            keep.append(mods)
            fns[name] = lambda mods=mods, o=o: step(mods, o, x, t)
        res = interleaved(fns, steps, runs)
        tg, oc, oa, ai, ol = (res[VARIANTS[k][0]] for k in range(5))
        cfg = f"H={h} B={b} {'fp32' if dtype == torch.float32 else 'bf16'}"
        e = res["eager"]
        say(f"| {cfg} | {e:.3f} | {tg:.3f} | {oc:.3f} | {oa:.3f} | {ai:.3f} | {ol:.3f} | {oc / tg:.3f}x | {oc / e:.3f}x "
            f"| {ai / e:.3f}x | {ol / e:.3f}x |")
        print(f"step times {cfg}: {res}", flush=True)
        for mods in keep:
            reset(mods)
        del keep, fns
        torch.cuda.empty_cache()
    say()


# ---- 4. host time of one graphed layer call ------------------------------------------


def host_time(runs=9, calls=2000, h=64, b=16):
    say("## 4. Host time of one layer call\n")
    say(
        f"Host time per forward and backward of one `nn.Linear({h}, {h})` (batch {b}, fp32) through autograd: "
        f"`y = layer(x); y.backward(g)`, {calls} calls per run, median of {runs} runs interleaved across the "
        "variants (wall-clock; the device work is a few microseconds, so the host is the bottleneck).\n"
    )
    say("| variant | host time per call, forward + backward (µs) | against torch graphed |")
    say("|---|---|---|")
    torch.manual_seed(0)
    base = nn.Linear(h, h).to(DEV)
    x = torch.randn(b, h, device=DEV, requires_grad=True)
    g = torch.randn(b, h, device=DEV)
    layers = {"eager": copy.deepcopy(base)}
    for name, graph in VARIANTS:
        layers[name] = graph(copy.deepcopy(base), (torch.randn(b, h, device=DEV, requires_grad=True),))

    def call(layer):
        layer(x).backward(g)

    for layer in layers.values():
        for _ in range(50):
            call(layer)
    torch.cuda.synchronize()
    per = {name: [] for name in layers}
    for _ in range(runs):
        for name, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                call(layer)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            per[name].append((t1 - t0) / calls * 1e6)
    res = {name: statistics.median(v) for name, v in per.items()}
    tg = res[VARIANTS[0][0]]
    for name, us in res.items():
        say(f"| {name} | {us:.1f} | {us / tg:.2f}x |")
    say()
    for name, layer in layers.items():
        if name != "eager":
            reset(layer)
    return res


# ---- 5. interleaved pipeline schedule ---------------------------------------------------

TE_ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def run_schedule(fwd, params_, data, lr=0.1):
    """Training iterations following TE_ORDER, as Megatron drives them: chunk
    1's input is chunk 0's output, detached (it arrives from another pipeline
    stage); chunk 0's backward takes the grad of that input. fwd[c][m] runs
    chunk c for microbatch m. Returns every forward output and the final
    parameters."""
    outputs = []
    opt = torch.optim.SGD(params_, lr=lr)
    for xs, dys in data:
        opt.zero_grad(set_to_none=True)
        nf, nb, link, out = [0, 0], [0, 0], {}, {}
        for o in TE_ORDER:
            c = abs(o) - 1
            if o > 0:
                m = nf[c]
                nf[c] += 1
                y = fwd[c][m](xs[m] if c == 0 else link[m])
                out[(c, m)] = y
                outputs.append(y.detach().clone())
                if c == 0:
                    link[m] = y.detach().requires_grad_()
            else:
                m = nb[c]
                nb[c] += 1
                out[(c, m)].backward(dys[m] if c == 1 else link[m].grad)
        opt.step()
    return outputs, [p.detach().clone() for p in params_]


def pipeline(h=64, b=16, iters=3):
    say("## 5. Interleaved pipeline schedule (Transformer Engine's scenario)\n")
    say(
        f"2 chunks of one `nn.Linear({h}, {h})`, 3 microbatches, order `{', '.join(map(str, TE_ORDER))}`, batch {b}, "
        f"{iters} SGD steps, driven as Megatron does (chunk 1's input is chunk 0's output, detached); graphed with "
        "`_order` and, or not, `_reuse_graph_input_output_buffers`, with and without clones. Every forward output "
        "and the final weights against eager; memory held by the graphs: graphed's static buffers, and PyTorch "
        "memory (outputs, grads, saved tensors in the graphs' pool) after capture.\n"
    )
    say("| dtype | clones | reuse | outputs bit-identical | final weights bit-identical | graphed static bytes (without reuse) | PyTorch bytes held |")
    say("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.float16):
        torch.manual_seed(5)
        base = [nn.Linear(h, h).to(DEV, dtype) for _ in range(2)]
        data = [
            ([torch.randn(b, h, device=DEV, dtype=dtype) for _ in range(3)],
             [torch.randn(b, h, device=DEV, dtype=dtype) for _ in range(3)])
            for _ in range(iters)
        ]
        eager = copy.deepcopy(base)
        want_out, want_w = run_schedule([[eager[0]] * 3, [eager[1]] * 3], params(eager), data)
        for clones in (True, False):
            for reuse in (False, True):
                mods = copy.deepcopy(base)
                samples = tuple((torch.randn(b, h, device=DEV, dtype=dtype, requires_grad=c == 1),)
                                for c in (0, 1) for _ in range(3))
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                g = gt.make_graphed_callables(
                    tuple(mods), samples, _order=TE_ORDER, _reuse_graph_input_output_buffers=reuse,
                    clone_param_grads_on_return=clones,
                )
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated() - before
                got_out, got_w = run_schedule([list(g[0:3]), list(g[3:6])], params(mods), data)
                same_out = all(torch.equal(a, c) for a, c in zip(got_out, want_out))
                same_w = all(torch.equal(a, c) for a, c in zip(got_w, want_w))
                st = g[0].session_stats()
                name = "fp32" if dtype == torch.float32 else "fp16"
                say(
                    f"| {name} | {'yes' if clones else 'no'} | {'yes' if reuse else 'no'} | {'yes' if same_out else 'no'} | "
                    f"{'yes' if same_w else 'no'} | {st['static_bytes']} ({st['static_bytes_without_reuse']}) | {held} |"
                )
                check(len(got_out) == len(want_out) and same_w and same_out, f"pipeline {name} clones={clones} reuse={reuse}")
                for c in g:  # the graphs are freed with the last
                    c.reset()
                del g, mods
    say()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="pytorch-report.md")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--only", default="", help="comma-separated sections (181723,training,steps,host,pipeline)")
    a = ap.parse_args()
    sections = {
        "181723": issue_181723, "training": training, "steps": step_times, "host": host_time, "pipeline": pipeline,
    }
    chosen = [s for s in a.only.split(",") if s] or list(sections)
    say("# graphed and PyTorch, side by side\n")
    say(
        f"Commit {a.commit}, {datetime.date.today().isoformat()}, {torch.cuda.get_device_name()} with PyTorch "
        f"{torch.__version__} (CUDA {torch.version.cuda}). Produced by `examples/torch_extension/compare.py` with the "
        "graphed package (`python/`); every variant runs in the same process.\n"
    )
    for name in chosen:
        sections[name]()
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    if failures:
        print("FAILED:", failures)
        sys.exit(1)


if __name__ == "__main__":
    main()
