"""reset() releases one callable, the others keep replaying; the last
reset frees the graphs and their buffers: PyTorch's allocated memory and
the driver's free memory come back to where they were."""
import gc

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt


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


def test_reset_of_one_callable_leaves_the_other_replaying():
    torch.manual_seed(0)
    eager = [torch.nn.Linear(256, 256, device="cuda") for _ in range(2)]
    layers = [torch.nn.Linear(256, 256, device="cuda") for _ in range(2)]
    for a, b in zip(layers, eager):
        a.load_state_dict(b.state_dict())
    samples = tuple((torch.randn(32, 256, device="cuda", requires_grad=True),) for _ in layers)
    a, b = gt.make_graphed_callables(tuple(layers), samples)
    held = settle()
    a.reset()
    assert "forward" not in a.__dict__ and "forward" in b.__dict__
    assert settle() == held  # the graphs share one plan: nothing is freed yet
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
    freed = settle()
    # the last reset frees the graphs and their buffers
    assert freed[0] < still[0] or freed[1] > still[1], f"nothing freed: {still} -> {freed}"
