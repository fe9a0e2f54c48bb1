"""Transformer Engine's _order: its checks (pure Python), and the schedule
graphed derives from it (the compiled extension; no GPU needed)."""
import pytest

from _support import needs_extension
from graphed.torch._schedule import check_order, from_order

TE_ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def ext():
    from graphed import _torch_ext

    return _torch_ext


def schedule(order, layers, callables, samples):
    return from_order(order, check_order(order, layers, callables, samples), callables, ext())


@needs_extension
def test_te_scenario_converts_to_steps():
    FORWARD, BACKWARD = ext().PASS_FORWARD, ext().PASS_BACKWARD
    s = schedule(TE_ORDER, None, callables=2, samples=6)
    assert s.microbatches == 3 and s.layers_per_chunk == [1, 1] and s.prefix == [0, 1]
    assert s.steps[:6] == [(FORWARD, 0), (FORWARD, 1), (FORWARD, 0), (FORWARD, 1), (BACKWARD, 1), (BACKWARD, 0)]
    # sample_args (and the result) go chunk by chunk, microbatch by microbatch.
    assert s.entries() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert s.sample_index(1, 2, 0) == 5


@needs_extension
def test_layers_per_chunk_int_and_list():
    order = [1, 2, -2, -1]
    assert schedule(order, 2, 4, 4).layers_per_chunk == [2, 2]
    s = schedule(order, [1, 3], 4, 4)
    assert s.prefix == [0, 1]
    assert s.entries() == [(0, 0), (1, 0), (2, 0), (3, 0)]


@needs_extension
def test_weight_grad_steps():
    FORWARD, BACKWARD, WGRAD = ext().PASS_FORWARD, ext().PASS_BACKWARD, ext().PASS_WGRAD
    order = [1, 2, -2, -2.5, -1, -1.5]
    s = schedule(order, [1, 1], 2, 2)
    assert s.steps == [(FORWARD, 0), (FORWARD, 1), (BACKWARD, 1), (WGRAD, 1), (BACKWARD, 0), (WGRAD, 0)]


@needs_extension
@pytest.mark.parametrize(
    "order, layers, callables, match",
    [
        ([1, 2, -1, -2], None, 2, "comes before the backward of chunk 1"),
        ([1, 2, -2, -1], [0, 2], 2, "every chunk needs at least one layer"),
    ],
)
def test_graphed_rules_come_from_the_library(order, layers, callables, match):
    with pytest.raises(ValueError, match=match):
        schedule(order, layers, callables, callables)


@pytest.mark.parametrize(
    "order, layers, callables, samples, error, match",
    [
        ([1, 2, -2, -1, 1], None, 2, 2, ValueError, "dimension mismatch"),
        ([1, -1, -1.5], None, 1, 1, ValueError, "must be provided"),
        ([1, 2, -2, -2.5, -1, -1.5], [2, 1], 3, 3, ValueError, "only one layer"),
        ([1, -1, -1.25], [1], 1, 1, ValueError, "must be 0.5"),
        ([1, 2, -2, -1], [1, 1, 1], 2, 2, ValueError, "list of 2 integers"),
        ([1, 2, -2, -1], None, 3, 2, ValueError, "Callables should have"),
        ([1, 2, -2, -1], [1, 1], 2, 3, ValueError, "Expected 2 args"),
        ([1, -1, -1.5, -1.5], [1], 1, 1, RuntimeError, "doesn't match"),
        ([0, 1, -1], None, 1, 1, ValueError, "count from 1"),
    ],
)
def test_te_checks(order, layers, callables, samples, error, match):
    with pytest.raises(error, match=match):
        check_order(order, layers, callables, samples)


def test_te_checks_pass_the_layers_on():
    assert check_order([1.0, -1], None, 1, 1) is None
    assert check_order([1, 2, -2, -1], 2, 4, 4) == [2, 2]
    assert check_order([1, 2, -2, -1], [1, 3], 4, 4) == [1, 3]


def test_fractional_forward_is_refused():
    with pytest.raises(TypeError, match="integer"):
        check_order([1.5, -1], None, 1, 1)
