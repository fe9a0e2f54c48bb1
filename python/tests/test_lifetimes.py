"""Parameter grads returned by a backward replay are owned by default
(Transformer Engine PR 2937, PyTorch issue 181723): a retained grad survives
the next replay, accumulation is exact; delayed-wgrad parameters
(skip_backward_post_hook) and the opt-out keep aliasing; the policy is
frozen at capture."""
import copy

import pytest
from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt


def linear(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 4, bias=False, device="cuda"), torch.randn(2, 4, device="cuda")


def step(model, x, dy):
    model(x).backward(dy)
    torch.cuda.synchronize()


def hooked(param):
    seen = []
    return seen, param.register_hook(lambda g: seen.append(g) or g)


def two_steps(model):
    """The weight grads two steps hand to autograd, the first as it was
    right after its step, and the first as it is after the second step
    (which must keep the address it had: a kept grad never moves)."""
    seen, hook = hooked(model.weight)
    step(model, rand(), rand())
    snapshot = seen[0].clone()
    address = seen[0].data_ptr()
    model.zero_grad(set_to_none=True)
    step(model, rand(), rand())
    hook.remove()
    assert len(seen) == 2
    assert seen[0].data_ptr() == address, "the kept grad was moved by the second step"
    return seen[0], snapshot, seen[1]


def rand():
    return torch.randn(2, 4, device="cuda")


# Owned grads both ways: written into fresh memory (the default) and copied
# at every backward.
OWNED = pytest.mark.parametrize("lazy", [True, False], ids=["fresh", "copied"])


@OWNED
def test_returned_grads_are_owned(lazy):
    model, sample = linear(501)
    gt.make_graphed_callables(model, (sample,), allow_unused_input=True, lazy_clones=lazy)
    assert model.session_stats()["lazy_clones"] == lazy
    first, snapshot, second = two_steps(model)
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first, snapshot)
    model.reset()


@OWNED
def test_accumulation_is_exact(lazy):
    model, sample = linear(502)
    eager = copy.deepcopy(model)
    gt.make_graphed_callables(model, (sample,), allow_unused_input=True, lazy_clones=lazy)
    for _ in range(2):
        x, dy = rand(), rand()
        step(model, x, dy)
        step(eager, x, dy)
    assert torch.equal(model.weight.grad, eager.weight.grad)
    model.reset()


def test_delayed_wgrad_parameters_keep_aliasing():
    model, sample = linear(503)
    model.weight.skip_backward_post_hook = True
    gt.make_graphed_callables(model, (sample,), allow_unused_input=True)
    first, _, second = two_steps(model)
    assert second.data_ptr() == first.data_ptr()
    model.reset()


def test_opt_out_returns_aliases_and_shows_the_hazard():
    model, sample = linear(504)
    eager = copy.deepcopy(model)
    gt.make_graphed_callables(model, (sample,), allow_unused_input=True, clone_param_grads_on_return=False)
    first, snapshot, second = two_steps(model)
    assert second.data_ptr() == first.data_ptr() and not torch.equal(first, snapshot)
    # Two accumulated backwards: the alias held as .grad is overwritten (2*g2), as documented.
    model.zero_grad(set_to_none=True)
    x1, x2, d1, d2 = rand(), rand(), rand(), rand()
    step(model, x1, d1)
    step(model, x2, d2)
    step(eager, x1, d1)
    step(eager, x2, d2)
    assert not torch.allclose(model.weight.grad, eager.weight.grad)
    model.reset()


def test_policy_is_frozen_at_capture():
    model, sample = linear(505)
    gt.make_graphed_callables(model, (sample,), allow_unused_input=True)
    model.weight.skip_backward_post_hook = True  # too late: the grad stays owned
    first, snapshot, second = two_steps(model)
    assert second.data_ptr() != first.data_ptr() and torch.equal(first, snapshot)
    model.reset()


def test_retain_graph_in_backward_and_no_clone_from_graphed_pool():
    model, sample = linear(506)
    eager = copy.deepcopy(model)
    gt.make_graphed_callables(model, (sample,), retain_graph_in_backward=True, clones_from_torch_allocator=False)
    for _ in range(3):
        x, dy = rand(), rand()
        step(model, x, dy)
        step(eager, x, dy)
    assert torch.equal(model.weight.grad, eager.weight.grad)
    model.weight.grad = None
    torch.cuda.synchronize()
    assert model.session_stats()["clone_bytes_outstanding"] == 0
    model.reset()
