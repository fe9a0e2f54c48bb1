"""Debug mode and the graphs as DOT from PyTorch: `debug=True` (every
replay pass by pass, each checked for a device error) trains a model with
LayerNorm, GELU and dropout equal to eager bit for bit, as without it;
`export_dot()` of a graphed callable, and `graphed.torch.export_dot(path)`
of every live session, label each graph by callable, pass, microbatch and
bucket; a reset session's graphs are gone from it."""
import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import torch.nn as nn

    import graphed.torch as gt


def block(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 64)).cuda()


@pytest.mark.parametrize("debug", [False, True])
def test_debug_mode_trains_as_eager(debug):
    eager, graphed_model = block(0), block(0)
    graphed = gt.make_graphed_callables(
        graphed_model, (torch.randn(16, 64, device="cuda", requires_grad=True),), debug=debug
    )
    for step in range(3):
        x = torch.randn(16, 64, device="cuda")
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(100 + step)
        ye = eager(xe)
        torch.manual_seed(100 + step)
        yg = graphed(xg)
        ye.square().sum().backward()
        yg.square().sum().backward()
        assert torch.equal(yg, ye) and torch.equal(xg.grad, xe.grad)
    for p, q in zip(graphed_model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)
    graphed.reset()


def test_export_dot_labels_every_graph(tmp_path):
    model = block(1)
    graphed = gt.make_graphed_callables(model, (torch.randn(16, 64, device="cuda", requires_grad=True),))
    text = graphed.export_dot()
    # One comment line naming the library and the session, then the graph.
    first, second = text.splitlines()[:2]
    assert first.startswith("// graphed ") and second.startswith("digraph"), text[:200]
    for want in ("callable 'Sequential_0' (index 0), forward, microbatch 0, no buckets, main graph",
                 "callable 'Sequential_0' (index 0), backward, microbatch 0"):
        assert want in text, text[:2000]
    everything = gt.export_dot(tmp_path / "graphs.dot")
    assert text in everything
    assert (tmp_path / "graphs.dot").read_text() == everything
    buckets = gt.make_graphed_callables(
        block(2), gt.Buckets(*[(torch.randn(n, 64, device="cuda", requires_grad=True),) for n in (8, 16)])
    )
    assert "bucket 1 (16 rows)" in buckets.export_dot()
    graphed.reset()
    buckets.reset()
    assert text not in gt.export_dot()
    assert not hasattr(model, "export_dot")
