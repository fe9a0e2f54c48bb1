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
    "order, layers, callables, samples, match",
    [
        ([1, 2, -1, -2], None, 2, 2, "comes before the backward of chunk 1"),
        ([1, 2, -2, -1], [0, 2], 2, 2, "every chunk needs at least one layer"),
        ([], None, 1, 1, "the schedule has no steps"),
        ([1, 0, -1, 0], None, 1, 2, r"order\[1\] is 0: Transformer Engine's order holds c"),
        ([-1, -1], None, 1, 1, "chunk 0 has 0 forward and 2 backward steps"),
    ],
)
def test_graphed_rules_come_from_the_library(order, layers, callables, samples, match):
    with pytest.raises(ValueError, match=match):
        schedule(order, layers, callables, samples)


@needs_extension
def test_callables_that_do_not_split_into_the_chunks_are_graphed_s_to_refuse():
    with pytest.raises(ValueError, match="3 callables cannot be split evenly into 2 chunks; give layers_per_chunk"):
        from_order([1, 2, -2, -1], None, 3, ext())


@pytest.mark.parametrize(
    "order, layers, callables, samples, error, match",
    [
        (
            [1, 2, -2, -1, 1],
            None,
            2,
            2,
            ValueError,
            r"^Pipeline-parallel order dimension mismatch: num_model_chunks \(2\) \* num_microbatches \(1\) \* 2 = 4, "
            r"but len\(_order_without_wgrad\) = 5$",
        ),
        (
            [1, -1, -1.5],
            None,
            1,
            1,
            ValueError,
            "^'_num_layers_per_chunk' must be provided when delay_wgrad_compute is True.$",
        ),
        (
            [1, 2, -2, -2.5, -1, -1.5],
            [2, 1],
            3,
            3,
            ValueError,
            "^Each model chunk must have only one layer when delay_wgrad_compute is True, but got 2 layers.$",
        ),
        ([1, -1, -1.25], [1], 1, 1, ValueError, r"^The order diff of wgrad and dgrad must be 0.5, get 0.25.$"),
        ([1, 2, -2, -1], [1, 1, 1], 2, 2, ValueError, r"list of 2 integers, but got \[1, 1, 1\].$"),
        ([1, 2, -2, -1], None, 3, 3, ValueError, "^3 \\* 2 >= 4 and 3 \\* 2 % 4 == 0$"),
        ([1, 2, -2, -1], [1, 2], 2, 3, ValueError, r"^Callables should have \(3\) entries when order input"),
        ([1, 2, -2, -1], [1, 1], 2, 3, ValueError, "^Expected 2 args tuple, but got 3.$"),
        (
            [1, -1, -1.5, -1.5],
            [1],
            1,
            1,
            RuntimeError,
            r"^Number of wgrad graph\(2\) doesn't match number of dgrad graphs \(1\) for chunk -1.$",
        ),
        # 0 is no chunk, but that is graphed's to say (from_order); here the
        # order only fails Transformer Engine's count.
        ([0, 1, -1], None, 1, 1, ValueError, "dimension mismatch"),
    ],
)
def test_te_checks(order, layers, callables, samples, error, match):
    with pytest.raises(error, match=match):
        check_order(order, layers, callables, samples)


def test_orders_te_cannot_read_are_left_to_graphed():
    assert check_order([], None, 1, 1) is None
    assert check_order([-1, -1], [1], 1, 1) == [1]


def test_te_checks_pass_the_layers_on():
    assert check_order([1.0, -1], None, 1, 1) is None
    assert check_order([1, 2, -2, -1], 2, 4, 4) == [2, 2]
    assert check_order([1, 2, -2, -1], [1, 3], 4, 4) == [1, 3]


def test_fractional_forward_is_refused():
    with pytest.raises(TypeError, match="^Forward order value must be an integer, but got float.$"):
        check_order([1.5, -1], None, 1, 1)
