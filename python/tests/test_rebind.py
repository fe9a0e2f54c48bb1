"""Inputs and incoming grads read where they are (rebind_inputs=True, the
default): capture verifies that the graphs can be pointed at the caller's
tensors, replays then copy nothing into the static buffers; results stay
bit-identical to eager whatever buffers the caller passes (alternating,
misaligned, non-contiguous); a rebound input modified in place before its
backward raises, as autograd does for saved tensors; rebind_inputs=False
copies, as before."""
import copy

import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt
    from _models import assert_all_equal

W, B = 64, 32


def mlp(seed):
    torch.manual_seed(seed)
    return [
        torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.GELU()).cuda(),
        torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.GELU()).cuda(),
        torch.nn.Linear(W, W).cuda(),
    ]


def samples():
    return tuple((torch.randn(B, W, device="cuda", requires_grad=i > 0),) for i in range(3))


def train(layers, inputs, targets):
    """SGD steps; returns every output and the final weights."""
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.05)
    outs = []
    for x, t in zip(inputs, targets):
        opt.zero_grad(set_to_none=True)
        y = x
        for m in layers:
            y = m(y)
        torch.nn.functional.mse_loss(y, t).backward()
        opt.step()
        outs.append(y.detach().clone())
    return outs, [p.detach().clone() for m in layers for p in m.parameters()]


def inputs_of_every_kind(n):
    """Fresh tensors each step, one reused, a misaligned view, a
    non-contiguous one: the graphs must follow every one."""
    torch.manual_seed(77)
    reused = torch.randn(B, W, device="cuda")
    big = torch.randn(B * W + 1, device="cuda")
    wide = torch.randn(B, 2 * W, device="cuda")
    kinds = [
        lambda: torch.randn(B, W, device="cuda"),
        lambda: reused,
        lambda: big[1:].view(B, W),  # 4 bytes past an allocation: copied
        lambda: wide[:, ::2],  # non-contiguous: read from a contiguous copy
    ]
    return [kinds[k % len(kinds)]() for k in range(n)]


def plan_lines(module):
    return [line for line in module.session_plan().splitlines() if "at replay" in line]


def train_graphed_against_eager(seed, steps, rebind):
    """Trains the MLP eagerly and graphed on the same inputs of every kind;
    asserts every output and final weight equal; returns the graphed
    session's stats and the plan's rebinding lines."""
    base = mlp(seed)
    xs = inputs_of_every_kind(steps)
    ts = [torch.randn(B, W, device="cuda") for _ in xs]
    want = train(copy.deepcopy(base), xs, ts)
    layers = list(gt.make_graphed_callables(tuple(copy.deepcopy(base)), samples(), rebind_inputs=rebind))
    stats, lines = layers[0].session_stats(), plan_lines(layers[0])
    got = train(layers, xs, ts)
    for layer in layers:
        layer.reset()
    assert_all_equal(got[0], want[0])  # the output of every step
    assert_all_equal(got[1], want[1])  # the final parameters
    return stats, lines


def test_inputs_and_grads_are_rebound_and_training_matches_eager():
    st, lines = train_graphed_against_eager(3, 8, rebind=True)
    # Three inputs and three incoming grads asked; torch's GEMMs and
    # elementwise kernels take addresses as arguments, so all are rebound.
    assert st["inputs_rebound"] + st["inputs_rebind_refused"] == 6, lines
    assert st["inputs_rebound"] == 6, lines
    assert st["rebind_nodes"] >= 6, lines


def test_rebinding_is_the_default():
    torch.manual_seed(4)
    g = gt.make_graphed_callables(torch.nn.Linear(W, W).cuda(), (torch.randn(B, W, device="cuda", requires_grad=True),))
    st = g.session_stats()
    assert st["inputs_rebound"] >= 1 and st["rebind_nodes"] >= 1, plan_lines(g)
    g.reset()


class CopiesItsInput(torch.nn.Module if torch is not None else object):
    """Its forward clones the input (a device-to-device copy node in the
    graph, whose parameters hold the input's address) before a Linear."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(W, W)

    def forward(self, x):
        return self.lin(x.clone()) + x.clone().mul(0.5)


def test_a_copy_node_reading_the_input_is_rebound_and_matches_eager():
    torch.manual_seed(8)
    base = CopiesItsInput().cuda()
    eager, layer = copy.deepcopy(base), copy.deepcopy(base)
    g = gt.make_graphed_callables(layer, (torch.randn(B, W, device="cuda", requires_grad=True),))
    st = g.session_stats()
    assert st["inputs_rebound"] + st["inputs_rebind_refused"] >= 1, plan_lines(g)
    for i in range(3):
        x = torch.randn(B, W, device="cuda", requires_grad=True)
        xe = x.detach().clone().requires_grad_(True)
        dy = torch.randn(B, W, device="cuda")
        y, ye = g(x), eager(xe)
        y.backward(dy)
        ye.backward(dy)
        assert_all_equal([y, x.grad, layer.lin.weight.grad], [ye, xe.grad, eager.lin.weight.grad])
        layer.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    g.reset()


def test_rebinding_off_copies_and_matches_eager():
    st, _ = train_graphed_against_eager(5, 4, rebind=False)
    assert (st["inputs_rebound"], st["inputs_rebind_refused"], st["rebind_nodes"]) == (0, 0, 0)


def test_a_rebound_input_modified_in_place_before_backward_raises():
    torch.manual_seed(9)
    layer = torch.nn.Linear(W, W).cuda()
    g = gt.make_graphed_callables(layer, (torch.randn(B, W, device="cuda", requires_grad=True),), rebind_inputs=True)
    assert g.session_stats()["inputs_rebound"] >= 1, plan_lines(g)
    x = torch.randn(B, W, device="cuda", requires_grad=True)
    y = g(x)
    with torch.no_grad():
        x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        y.backward(torch.ones_like(y))
    # Unmodified, the same call works and matches eager.
    x2 = torch.randn(B, W, device="cuda", requires_grad=True)
    y2 = g(x2)
    y2.backward(torch.ones_like(y2))
    layer.reset()
    x3 = x2.detach().clone().requires_grad_(True)
    ref = copy.deepcopy(layer)
    ref.zero_grad(set_to_none=True)
    ref(x3).backward(torch.ones_like(y2))
    assert torch.equal(x2.grad, x3.grad)


def test_with_copies_an_input_modified_after_the_forward_does_not_matter():
    torch.manual_seed(11)
    layer = torch.nn.Linear(W, W).cuda()
    eager = copy.deepcopy(layer)
    g = gt.make_graphed_callables(layer, (torch.randn(B, W, device="cuda", requires_grad=True),), rebind_inputs=False)
    x = torch.randn(B, W, device="cuda", requires_grad=True)
    x0 = x.detach().clone().requires_grad_(True)
    y = g(x)
    with torch.no_grad():
        x.add_(1.0)
    y.backward(torch.ones_like(y))  # the graph read its own copy
    eager(x0).backward(torch.ones_like(y))
    assert torch.equal(layer.weight.grad, eager.weight.grad)
    layer.reset()
