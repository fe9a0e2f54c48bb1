"""reset() releases one callable, the others keep replaying; the last
reset frees the graphs and their buffers: PyTorch's allocated memory and
the driver's free memory come back to where they were. Graphs dropped
without a reset (the callables, modules and steps let go of, as garbage)
are freed the same way, on every path that makes them."""
import gc

import pytest
from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt
    from _models import CausalBlock


def cycle(reuse):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512, device="cuda") for _ in range(2)]
    if reuse:
        order = [1, 2, 1, 2, -2, -1, -2, -1]
        samples = tuple((torch.randn(64, 512, device="cuda", requires_grad=i >= 2),) for i in range(4))
        g = gt.make_graphed_callables(tuple(layers), samples, _order=order, _reuse_graph_input_output_buffers=True)
        # replays follow the order: both forwards, then both backwards
        y0 = g[2](g[0](torch.randn(64, 512, device="cuda")))
        y1 = g[3](g[1](torch.randn(64, 512, device="cuda")))
        y0.sum().backward()
        y1.sum().backward()
        del y0, y1
    else:
        samples = ((torch.randn(64, 512, device="cuda"),), (torch.randn(64, 512, device="cuda", requires_grad=True),))
        g = gt.make_graphed_callables(tuple(layers), samples)
        g[1](g[0](torch.randn(64, 512, device="cuda"))).sum().backward()
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    for c in g:  # the graphs are freed with the last
        c.reset()
    del g, samples, layers


def settle():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]


def test_reset_returns_memory():
    for reuse in (False, True):
        cycle(reuse)  # first use: lazily loaded kernels, cuBLAS workspaces of the capture stream
        allocated, free = settle()
        cycle(reuse)
        allocated_after, free_after = settle()
        assert allocated_after == allocated, f"reuse={reuse}: torch allocated {allocated_after - allocated} bytes more"
        assert free_after == free, f"reuse={reuse}: the driver has {free - free_after} bytes less free memory"


def test_reset_of_one_callable_frees_its_memory_while_the_other_replays():
    """Transformer Engine's per-callable reset: a.reset() frees a's graphs,
    graphed's static buffers only a uses and the PyTorch tensors kept for
    a's graphs (PyTorch's allocated bytes drop by at least those, graphed's
    by at least a's own static bytes), while b keeps replaying, equal to
    eager; b.reset() then frees the rest."""
    torch.manual_seed(0)
    eager = [torch.nn.Linear(256, 256, device="cuda") for _ in range(2)]
    layers = [torch.nn.Linear(256, 256, device="cuda") for _ in range(2)]
    for a, b in zip(layers, eager):
        a.load_state_dict(b.state_dict())
    samples = tuple((torch.randn(32, 256, device="cuda", requires_grad=True),) for _ in layers)
    a, b = gt.make_graphed_callables(tuple(layers), samples)
    held = settle()
    before = gt.memory_report()
    mine = [s for s in before["sessions"] if [c["name"] for c in s["callables"]] == ["Linear_0", "Linear_1"]][-1]
    a_held = mine["callables"][0]
    assert a_held["graphs"] > 0 and a_held["torch_bytes"] > 0 and not a_held["released"], a_held
    a.reset()
    assert "forward" not in a.__dict__ and "forward" in b.__dict__
    freed = settle()
    after = gt.memory_report()
    assert held[0] - freed[0] >= a_held["torch_bytes"], f"PyTorch freed {held[0] - freed[0]} of {a_held['torch_bytes']}"
    assert before["total_bytes"] - after["total_bytes"] >= a_held["own_static_bytes"]
    assert before["graphs"] - after["graphs"] >= a_held["graphs"]
    a_after = [s for s in after["sessions"] if s["callables"][0]["name"] == "Linear_0"][-1]["callables"][0]
    assert a_after["released"] and a_after["graphs"] == 0 and a_after["own_static_bytes"] == 0, a_after
    assert a_after["torch_bytes"] == 0, a_after
    for _ in range(3):
        x = torch.randn(32, 256, device="cuda", requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        y, ye = b(a(x)), eager[1](eager[0](xe))  # a eagerly, b replayed
        y.square().sum().backward()
        ye.square().sum().backward()
        assert torch.equal(y, ye) and torch.equal(x.grad, xe.grad)
    for p, q in zip([*a.parameters(), *b.parameters()], [*eager[0].parameters(), *eager[1].parameters()]):
        assert torch.equal(p.grad, q.grad)
    assert b.session_stats()["graph_count"] > 0
    del x, xe, y, ye
    still = settle()
    b.reset()
    assert "forward" not in b.__dict__
    gone = settle()
    # the last reset frees the graphs and their buffers
    assert gone[0] < still[0] or gone[1] > still[1], f"nothing freed: {still} -> {gone}"


# ---- graphs freed with the last reference --------------------------------------------------

HIDDEN, HEADS, SEQ, BATCH = 256, 4, 64, 8


def blocks(n=2):
    return [CausalBlock(HIDDEN, HEADS).cuda() for _ in range(n)]


def tokens(requires_grad=False):
    return torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=requires_grad)


def autocast():
    return torch.autocast("cuda", torch.bfloat16, cache_enabled=False)


def train(calls, models, steps=2):
    """A few AdamW steps through `calls` in turn (graphed), with bf16 autocast."""
    opt = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-3)
    for _ in range(steps):
        y = tokens()
        with autocast():
            for f in calls:
                y = f(y)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def drop_modules():
    models = blocks()
    with autocast():
        gt.make_graphed_callables(tuple(models), ((tokens(),), (tokens(True),)))
    train(models, models)


def drop_callables():
    models = blocks()

    def first(x):  # a plain function over a module
        return models[0](x)

    with autocast():
        g = gt.make_graphed_callables((first, models[1]), ((tokens(),), (tokens(True),)))
    train(g, models)


def drop_with_hooks():
    models, seen = blocks(1), []
    hooks = [{"forward_hooks": {1: lambda module, args, out: seen.append(module)}}]
    gt.make_graphed_callables(
        models[0], (tokens(),), capture_time_hooks=hooks, pre_warmup_hook=lambda: seen.append(models)
    )
    train(models, models)
    assert seen


def drop_aliases(**opts):
    """Aliased grads (the opt-out) left in .grad when everything is dropped."""
    models = blocks()
    gt.make_graphed_callables(
        tuple(models), ((tokens(),), (tokens(True),)), clone_param_grads_on_return=False, **opts
    )
    train(models, models)
    y = tokens()
    for m in models:
        y = m(y)
    y.square().mean().backward()
    assert models[0].qkv.weight.grad is not None


def drop_buckets():
    models = blocks(1)
    samples = [(torch.randn(n, BATCH, HIDDEN, device="cuda"),) for n in (16, 32, SEQ)]
    gt.make_graphed_callables(models[0], gt.Buckets(*samples))
    for n in (16, 40, SEQ):
        models[0](torch.randn(n, BATCH, HIDDEN, device="cuda")).square().mean().backward()


def drop_schedule():
    models = blocks()
    order = [1, 2, 1, 2, -2, -1, -2, -1]
    samples = tuple((tokens(i >= 2),) for i in range(4))
    g = gt.make_graphed_callables(tuple(models), samples, _order=order)
    y0 = g[2](g[0](tokens()))
    y1 = g[3](g[1](tokens()))
    y0.square().mean().backward()
    y1.square().mean().backward()


def drop_step():
    models = blocks()
    step = gt.make_graphed_step(models, torch.nn.MSELoss(), (tokens(),), (tokens(),), microbatches=2)
    opt = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-3)
    for _ in range(2):
        step((torch.stack([tokens(), tokens()]),), (torch.stack([tokens(), tokens()]),))
        opt.step()
        opt.zero_grad(set_to_none=True)


DROPPED = {
    "modules": drop_modules,
    "callables": drop_callables,
    "hooks": drop_with_hooks,
    "aliases": drop_aliases,
    "leased aliases": lambda: drop_aliases(strict_leases=True),
    "buckets": drop_buckets,
    "schedule": drop_schedule,
    "step": drop_step,
}


def footprint():
    """PyTorch's allocated and reserved bytes, the driver's used bytes, and
    graphed's own (its device bytes and live sessions), after the garbage is
    collected and PyTorch's cache emptied."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    ours = gt.memory_report()
    return (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), total - free, ours["total_bytes"],
            ours["live_sessions"])


@pytest.mark.parametrize("path", sorted(DROPPED))
def test_dropped_graphs_are_freed(path):
    """Made, trained and dropped without reset(), three times: every byte
    comes back each time (the first cycle loads kernels and workspaces)."""
    cycle = DROPPED[path]
    cycle()
    base = footprint()
    for k in range(3):
        cycle()
        now = footprint()
        assert now == base, (
            f"{path}, cycle {k + 2}: allocated, reserved, driver-used and graphed's bytes and graphed's live "
            f"sessions went from {base} to {now} "
            f"(+{(now[2] - base[2]) / 2**20:.1f} MiB on the device)"
        )
