"""Arguments and outputs, flattened and matched at replay (torch on the CPU)."""
import pytest

from _support import needs_torch, torch

pytestmark = needs_torch

if torch is not None:
    from graphed.torch._binding import Binding, Outputs


def t(*shape, **kw):
    return torch.zeros(*shape, **kw)


def test_positional_tensors_are_the_simple_case():
    b = Binding((t(2, 3), t(3)), {})
    assert b.simple and b.names == ["argument 0", "argument 1"]
    args, kwargs = b.unflatten(["a", "b"])
    assert args == ("a", "b") and kwargs == {}


def test_keyword_tensors_are_inputs_and_other_values_are_fixed():
    mask = t(2, 2, dtype=torch.bool)
    b = Binding((t(2, 3),), {"attention_mask": mask, "causal": True, "pair": (t(1), 3)})
    assert not b.simple
    assert b.names == ["argument 0", "keyword argument 'attention_mask'", "keyword argument 'pair'[0]"]
    args, kwargs = b.unflatten(["x", "m", "p"])
    assert args == ("x",) and kwargs == {"attention_mask": "m", "causal": True, "pair": ("p", 3)}
    x, m, p = t(2, 3), t(2, 2, dtype=torch.bool), t(1)
    assert b.match((x,), {"attention_mask": m, "causal": True, "pair": (p, 3)}) == [x, m, p]
    # a fixed value left out is the captured one; a keyword may come positionally (Transformer Engine)
    assert b.match((x, m), {"pair": (p, 3)}) == [x, m, p]


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((), {}, TypeError, "takes 1 positional"),
        (("X",), {"causal": True}, TypeError, "missing keyword argument 'attention_mask'"),
        (("X",), {"attention_mask": "M", "causal": False}, ValueError, "'causal' is False; it was captured with True"),
        (("X",), {"attention_mask": "M", "other": 1}, TypeError, "unexpected keyword arguments \\['other'\\]"),
        (("X", "M", True, "Z"), {}, TypeError, "takes 1 positional"),
    ],
)
def test_match_errors(args, kwargs, error, match):
    b = Binding((t(1),), {"attention_mask": t(1), "causal": True})
    with pytest.raises(error, match=match):
        b.match(args, dict(kwargs))


def test_nested_positional_structure_is_checked():
    b = Binding(((t(1), t(2)),), {})
    assert not b.simple and b.names == ["argument 0[0]", "argument 0[1]"]
    with pytest.raises(ValueError, match="structure"):
        b.match(([t(1)],), {})


def test_positional_non_tensor_samples_are_refused():
    with pytest.raises(TypeError, match="only Tensors"):
        Binding((t(1), 3), {})


def test_other_microbatches_must_share_the_signature():
    b = Binding((t(2, 3, requires_grad=True),), {})
    b.check_same((t(2, 3, requires_grad=True),), {}, "sample_args[1]")
    with pytest.raises(ValueError, match="sample_args\\[1\\]: argument 0 has shape \\[2, 4\\]"):
        b.check_same((t(2, 4, requires_grad=True),), {}, "sample_args[1]")
    with pytest.raises(ValueError, match="requires_grad=False"):
        b.check_same((t(2, 3),), {}, "sample_args[1]")


def test_outputs_structure():
    o = Outputs("f")
    y = t(2)
    assert o.flatten(y) == [y] and o.unflatten(["y"]) == "y"
    o = Outputs("g")
    assert o.flatten((y, y)) == [y, y] and o.unflatten(["a", "b"]) == ("a", "b")
    o = Outputs("h")
    assert o.flatten({"a": y, "b": [y]}) == [y, y] and o.unflatten(["p", "q"]) == {"a": "p", "b": ["q"]}
    with pytest.raises(RuntimeError, match="returned the structure"):
        o.flatten((y, y))
    with pytest.raises(TypeError, match="returned a int"):
        Outputs("k").flatten((y, 3))
