"""make_graphed_callables refuses what Transformer Engine refuses, before it
needs a GPU (torch on the CPU)."""
import pytest

from _support import needs_extension, needs_torch, torch

pytestmark = needs_torch

if torch is not None:
    import graphed.torch as gt


def lin():
    return torch.nn.Linear(4, 4)


def x():
    return (torch.zeros(2, 4, requires_grad=True),)


# Transformer Engine's messages, as its graph.py words them.
TE_HOOKS = (
    "Modules must not have hooks registered at the time they are passed. However, registering hooks on modules "
    "after passing them through make_graphed_callables is allowed. If you have to use hooks during capture time, "
    "you can provide them in the capture_time_hooks argument, and they will be executed outside the CUDA graph "
    "capture context, meaning they will not be recorded into the graph and will not be replayed."
)
TE_BUFFERS = (
    "In any :class:`~torch.nn.Module` passed to :func:`~make_graphed_callables`, only parameters may be trainable. "
    "All buffers must have ``requires_grad=False``."
)


def test_modules_with_hooks_are_refused():
    m = lin()
    m.register_forward_pre_hook(lambda *a: None)
    with pytest.raises(RuntimeError) as e:
        gt.make_graphed_callables(m, x())
    assert str(e.value) == TE_HOOKS


def test_trainable_buffers_are_refused():
    m = lin()
    m.register_buffer("b", torch.zeros(1, requires_grad=True))
    with pytest.raises(RuntimeError) as e:
        gt.make_graphed_callables(m, x())
    assert str(e.value) == TE_BUFFERS


def test_one_sample_kwargs_per_callable_or_sample():
    with pytest.raises(ValueError) as e:
        gt.make_graphed_callables((lin(), lin()), (x(), x()), sample_kwargs=({},))
    assert str(e.value) == (
        "Expected sample_kwargs to have the same length as callables, but got 1 sample_kwargs for 2 callables"
    )
    with pytest.raises(ValueError) as e:
        gt.make_graphed_callables((lin(),), (x(), x()), sample_kwargs=({},), _order=[1, 1, -1, -1])
    assert str(e.value) == (
        "Pipeline-parallel schedule requires sample_kwargs and sample_args to have the same length, but got 1 "
        "sample_kwargs for 2 sample_args"
    )


def test_mixed_training_modes_are_refused():
    a, b = lin(), lin().eval()
    with pytest.raises(RuntimeError, match="all in training or all in inference"):
        gt.make_graphed_callables((a, b), (x(), x()))


def test_one_sample_per_callable():
    with pytest.raises(ValueError, match="same length as callables"):
        gt.make_graphed_callables((lin(), lin()), (x(),))


def test_reuse_needs_order():
    with pytest.raises(ValueError, match="_order"):
        gt.make_graphed_callables((lin(),), (x(),), _reuse_graph_input_output_buffers=True)


def test_reuse_needs_training():
    with pytest.raises(RuntimeError, match="only available in training"):
        gt.make_graphed_callables((lin().eval(),), (x(),), _order=[1, -1], _reuse_graph_input_output_buffers=True)


def test_order_is_checked():
    with pytest.raises(ValueError, match="Expected 4 args"):
        gt.make_graphed_callables((lin(), lin()), (x(), x()), _order=[1, 2, 1, 2, -2, -1, -2, -1], _num_layers_per_chunk=1)
    with pytest.raises(ValueError, match="dimension mismatch"):
        gt.make_graphed_callables((lin(),), (x(),), _order=[1, -1, 1])


def test_capture_time_hooks_one_per_callable():
    with pytest.raises(ValueError, match="capture_time_hooks"):
        gt.make_graphed_callables(lin(), x(), capture_time_hooks=[None, None])


def test_fp8_is_refused():
    with pytest.raises(NotImplementedError, match="graphed does not do FP8"):
        gt.make_graphed_callables(lin(), x(), enabled=True)


@needs_extension  # the schedule that maps sample_args to microbatches is graphed's
def test_other_microbatches_must_match_the_first():
    with pytest.raises(ValueError, match="sample_args\\[1\\]"):
        gt.make_graphed_callables((lin(),), (x(), (torch.zeros(3, 4, requires_grad=True),)), _order=[1, 1, -1, -1])


def test_without_a_gpu_the_error_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        gt.make_graphed_callables(lin(), x())
