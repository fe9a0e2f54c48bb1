"""reset() frees the graphs and their buffers: PyTorch's allocated memory
and the driver's free memory come back to where they were."""
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
    g[0].reset()
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
