"""Transformer Engine's FP8 arguments: accepted when off, refused when they would need FP8 (pure Python);
make_graphed_callables' keyword defaults are the C++ adapter's (graphed_torch::Options)."""
import inspect

import pytest

from _support import needs_extension
from graphed.torch._options import check_fp8


@needs_extension
def test_keyword_defaults_are_the_adapters():
    from graphed import _torch_ext
    from graphed.torch import _make

    signature = inspect.signature(_make.make_graphed_callables).parameters
    defaults = _torch_ext.default_options()
    assert defaults, "the extension names no option"
    for name, value in defaults.items():
        assert signature[name].default == value, (
            f"make_graphed_callables({name}={signature[name].default!r}) but graphed_torch::Options defaults it to "
            f"{value!r}"
        )


def test_off_values_are_accepted():
    check_fp8(2)
    check_fp8(2, enabled=False, calibrating=False, cache_quantized_params=False)
    check_fp8(2, fp8_enabled=(False, False), fp8_recipe=None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(enabled=True), "enabled=True"),
        (dict(fp8_enabled=(False, True)), "enabled=\\(False, True\\)"),
        (dict(recipe="DelayedScaling"), "recipe"),
        (dict(fp8_weight_caching=True), "cache_quantized_params=True"),
        (dict(calibrating=True), "calibrating=True"),
        (dict(amax_reduction_group=object()), "amax_reduction_group"),
    ],
)
def test_values_that_need_fp8_are_refused(kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        check_fp8(2, **kwargs)


def test_old_and_new_names_together_are_refused():
    with pytest.raises(ValueError, match="but both kwargs are set"):
        check_fp8(1, fp8_enabled=False, enabled=False)


def test_enabled_tuple_length():
    with pytest.raises(ValueError, match="must match modules length"):
        check_fp8(3, enabled=(False, False))
