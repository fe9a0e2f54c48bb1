"""make_graphed_step's argument checks, which run before anything touches
a GPU (so they run wherever torch is installed): each bad argument raises
with a message naming it. The step itself is tested on a GPU
(test_step.py)."""
import pytest

from _support import needs_torch, torch

pytestmark = needs_torch

if torch is not None:
    import graphed.torch as gt


def layers(n=2):
    return [torch.nn.Linear(4, 4) for _ in range(n)]


def loss(y, t):
    return ((y - t) ** 2).sum()


def sample():
    return torch.zeros(2, 4), torch.zeros(2, 4)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(param_grads="sum"), r"param_grads must be 'add' or 'set'"),
        (dict(accumulate_param_grads_into=None), r"accumulate_param_grads_into must name a parameter attribute"),
        (dict(accumulate_param_grads_into="main grad"), r"accumulate_param_grads_into must name"),
    ],
)
def test_bad_options_are_refused(kw, match):
    x, t = sample()
    with pytest.raises(ValueError, match=match):
        gt.make_graphed_step(layers(), loss, (x,), (t,), **kw)


def test_no_layers_and_a_module_given_twice_are_refused():
    x, t = sample()
    with pytest.raises(ValueError, match=r"no layers"):
        gt.make_graphed_step([], loss, (x,), (t,))
    one = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"a module is given twice"):
        gt.make_graphed_step([one, one], loss, (x,), (t,))


def test_a_module_in_eval_mode_is_refused():
    x, t = sample()
    mods = layers()
    mods[1].eval()
    with pytest.raises(RuntimeError, match=r"a step trains; every module must be in training mode"):
        gt.make_graphed_step(mods, loss, (x,), (t,))


def test_a_module_with_hooks_is_refused_as_torch_refuses_it():
    x, t = sample()
    mods = layers()
    mods[0].register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match=r"Modules must not have hooks registered"):
        gt.make_graphed_step(mods, loss, (x,), (t,))
