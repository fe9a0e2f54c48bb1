"""Random numbers inside graphed callables are drawn afresh at each replay,
from the default CUDA generator and from generators the caller registers
(as Transformer Engine's RNG tracker does); with the same seeds, graphed
training equals eager training; a generator graphed was not told about is a
clear error, not repeated numbers."""
import copy

import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt
    from _models import assert_all_equal


def test_dropout_masks_differ_across_replays():
    drop = torch.nn.Dropout(0.5)
    g = gt.make_graphed_callables(drop, (torch.ones(1 << 16, device="cuda", requires_grad=True),))
    x = torch.ones(1 << 16, device="cuda", requires_grad=True)
    masks = [(g(x) != 0).clone() for _ in range(4)]
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), f"replays {j} and {i} drew the same mask"
    kept = torch.stack(masks).float().mean().item()
    assert 0.49 < kept < 0.51, f"dropout kept {kept:.4f} of the elements, expected 0.5"
    g.reset()


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 64), torch.nn.Dropout(0.1)
    ).cuda()


def train(model, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(42)
    outs = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(32, 64, device="cuda")
        y = model(x)
        outs.append(y.detach().clone())
        y.square().mean().backward()
        opt.step()
    return outs, [p.detach().clone() for p in model.parameters()]


def test_training_with_dropout_equals_eager_with_the_same_seed():
    torch.manual_seed(0)
    base = mlp()
    want_out, want_w = train(copy.deepcopy(base))
    model = copy.deepcopy(base)
    gt.make_graphed_callables(model, (torch.randn(32, 64, device="cuda"),))
    got_out, got_w = train(model)
    assert_all_equal(got_out, want_out)
    assert_all_equal(got_w, want_w)
    model.reset()


def test_capture_leaves_the_generator_where_it_was():
    before = torch.cuda.get_rng_state()
    g = gt.make_graphed_callables(torch.nn.Dropout(0.5), (torch.ones(1024, device="cuda", requires_grad=True),))
    assert torch.equal(torch.cuda.get_rng_state(), before)
    g.reset()


class TrackedDropout(torch.nn.Module if torch is not None else object):
    """Draws from another generator state, swapped into the default CUDA
    generator for the forward, as Transformer Engine's RNG tracker does."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def forward(self, x):
        default = torch.cuda.default_generators[x.device.index]
        original = default.graphsafe_get_state()
        default.graphsafe_set_state(self.state)
        try:
            return torch.nn.functional.dropout(x, 0.5)
        finally:
            default.graphsafe_set_state(original)


def test_registered_generator_states_draw_fresh_numbers_like_eager():
    def run(graphed):
        state = torch.cuda.default_generators[0].clone_state()
        state.manual_seed(123)
        m = TrackedDropout(state)
        if graphed:
            gt.make_graphed_callables(m, (torch.ones(4096, device="cuda", requires_grad=True),), generators=[state])
            state.manual_seed(123)
        x = torch.ones(4096, device="cuda", requires_grad=True)
        out = [m(x).detach().clone() for _ in range(3)]
        if graphed:
            m.reset()
        return out

    eager, graphed = run(False), run(True)
    assert not torch.equal(graphed[0], graphed[1])
    assert_all_equal(graphed, eager)


def test_register_generator_applies_to_later_calls():
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)

    def noisy(x):
        return x + torch.rand(x.shape, device=x.device, generator=gen)

    gt.register_generator(gen)
    try:
        g = gt.make_graphed_callables(noisy, (torch.zeros(256, device="cuda"),))
        a, b = g(torch.zeros(256, device="cuda")).clone(), g(torch.zeros(256, device="cuda")).clone()
        assert not torch.equal(a, b)
        g.reset()
    finally:
        from graphed.torch import _rng

        _rng._registered.remove(gen)


def test_unknown_generator_is_a_clear_error():
    gen = torch.Generator(device="cuda")

    def noisy(x):
        return x + torch.rand(x.shape, device=x.device, generator=gen)

    with pytest.raises(RuntimeError, match="register_generator"):
        gt.make_graphed_callables(noisy, (torch.zeros(256, device="cuda"),))
