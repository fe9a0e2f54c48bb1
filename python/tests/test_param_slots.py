"""Where make_graphed_callables finds each parameter of a module at every
call (rebind_params): its owning module's `_parameters` dict and key, so
that a Parameter replaced there (load_state_dict(assign=True)) is the one
the graphs read; None where named_parameters() names something that is not
there (the registered tensor is then used). Needs torch, no GPU."""
from _support import needs_torch, torch

pytestmark = needs_torch

if torch is not None:
    import torch.nn as nn

    from graphed.torch._make import _param_slot


def slots(module):
    return {name: _param_slot(module, name, p) for name, p in module.named_parameters()}


def test_nested_parameters_are_found_in_their_owners_dict():
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 1)))
    found = slots(model)
    assert set(found) == {"0.weight", "0.bias", "1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias"}
    d, key = found["1.1.weight"]
    assert d is model[1][1]._parameters and key == "weight"
    # A Parameter replaced as load_state_dict(assign=True) does is what the slot holds.
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    assert d[key] is model[1][1].weight and d[key] is not None


def test_a_module_parameter_of_the_top_module():
    m = nn.Linear(2, 2)
    d, key = _param_slot(m, "bias", m.bias)
    assert d is m._parameters and key == "bias"


def test_parametrized_parameters_are_found():
    m = nn.Linear(3, 3)
    torch.nn.utils.parametrize.register_parametrization(m, "weight", _Sym())
    found = slots(m)
    d, key = found["parametrizations.weight.original"]
    assert key == "original" and d[key] is m.parametrizations.weight.original


def test_a_name_that_is_not_in_its_owner_gives_none():
    m = nn.Linear(2, 2)
    assert _param_slot(m, "weight", nn.Parameter(torch.zeros(2, 2))) is None  # another object
    assert _param_slot(m, "nowhere.weight", m.weight) is None


class _Sym(nn.Module if torch is not None else object):
    def forward(self, w):
        return w + w.t()
