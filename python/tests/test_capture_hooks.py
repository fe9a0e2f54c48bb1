"""capture_time_hooks and pre/post warmup hooks run during warmup and
capture, outside stream capture, in Transformer Engine's order, and never at
replay; with and without _order."""
import weakref

import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt


def not_capturing():
    assert not torch.cuda.is_current_stream_capturing()


class ScaleLinear(torch.nn.Module if torch is not None else object):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, device="cuda")

    def forward(self, x, scale):
        return self.linear(x) * scale


def test_hooks_run_at_warmup_and_capture_only():
    model = ScaleLinear()
    calls = {"pre": 0, "pre_kwargs": 0, "fwd": 0, "fwd_kwargs": 0, "bwd_pre": 0, "bwd": 0}
    log = []

    def count(name, check):
        def hook(*args):
            not_capturing()
            assert args[0] is model
            check(*args[1:])
            calls[name] += 1
            log.append(name)

        return hook

    hooks = {
        "forward_pre_hooks": {1: count("pre", lambda args: len(args) == 1 or pytest.fail("args")),
                              2: count("pre_kwargs", lambda args, kw: "scale" in kw or pytest.fail("kwargs"))},
        "forward_pre_hooks_with_kwargs": {2: True},
        "forward_hooks": {3: count("fwd", lambda args, out: torch.is_tensor(out) or pytest.fail("out")),
                          4: count("fwd_kwargs", lambda args, kw, out: "scale" in kw or pytest.fail("kwargs"))},
        "forward_hooks_with_kwargs": {4: True},
        "backward_pre_hooks": {5: count("bwd_pre", lambda go: len(go) == 1 or pytest.fail("grad_output"))},
        "backward_hooks": {6: count("bwd", lambda gi, go: len(gi) > 0 or pytest.fail("grad_input"))},
    }

    def pre_warmup():
        not_capturing()
        log.append("pre_warmup")

    def post_warmup():
        not_capturing()
        log.append("post_warmup")

    sample = torch.randn(2, 4, device="cuda", requires_grad=True)
    graphed = gt.make_graphed_callables(
        model, (sample,), sample_kwargs={"scale": torch.ones(2, 4, device="cuda")}, allow_unused_input=True,
        num_warmup_iters=2, capture_time_hooks=[hooks], pre_warmup_hook=pre_warmup, post_warmup_hook=post_warmup,
    )
    assert calls == {name: 3 for name in calls}  # 2 warmup iterations + the capture
    per_iteration = ["pre", "pre_kwargs", "fwd", "fwd_kwargs", "bwd_pre", "bwd"]
    assert log == ["pre_warmup"] + per_iteration * 2 + ["post_warmup"] + per_iteration
    x = torch.randn(2, 4, device="cuda", requires_grad=True)
    graphed(x, scale=torch.full((2, 4), 2.0, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    assert calls == {name: 3 for name in calls}
    graphed.reset()


def test_hooks_follow_the_order():
    layers = [torch.nn.Linear(4, 4, device="cuda") for _ in range(2)]
    samples = tuple((torch.randn(2, 4, device="cuda", requires_grad=True),) for _ in range(4))
    log = []

    def hook(kind, i):
        def f(module, *rest):
            not_capturing()
            assert module is layers[i]
            log.append((kind, i))

        return f

    forwards = gt.make_graphed_callables(
        tuple(layers), samples, allow_unused_input=True, num_warmup_iters=1, _order=[1, 2, 1, 2, -2, -1, -2, -1],
        capture_time_hooks=[{"forward_pre_hooks": {1: hook("fwd", i)}, "backward_hooks": {2: hook("bwd", i)}}
                            for i in range(2)],
    )
    # one warmup iteration and the capture, each in the order's sequence
    once = [("fwd", 0), ("fwd", 1), ("fwd", 0), ("fwd", 1), ("bwd", 1), ("bwd", 0), ("bwd", 1), ("bwd", 0)]
    assert log == once * 2
    x = torch.randn(2, 4, device="cuda", requires_grad=True)
    forwards[2](forwards[0](x)).sum().backward()
    torch.cuda.synchronize()
    assert len(log) == 16
    for f in forwards:
        f.reset()


@pytest.mark.parametrize("with_order", [False, True])
def test_transformer_engines_module_only_hooks(with_order):
    # Transformer Engine's scenario: every hook written hook(module), two
    # layers, two warmup iterations, with and without _order.
    layers = (torch.nn.Linear(8, 8, device="cuda"), torch.nn.Linear(8, 8, device="cuda"))
    samples = tuple((torch.ones(4, 8, device="cuda", requires_grad=True),) for _ in layers)
    records = []

    def make(i, name):
        def hook(module):
            assert module is layers[i]
            not_capturing()
            records.append((i, name))

        return hook

    names = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
    graphed = gt.make_graphed_callables(
        layers, samples, num_warmup_iters=2, _order=[1, 2, -2, -1] if with_order else None,
        capture_time_hooks=[{name: {0: make(i, name)} for name in names} for i in range(2)],
    )
    once = [(0, "forward_pre_hooks"), (0, "forward_hooks"), (1, "forward_pre_hooks"), (1, "forward_hooks"),
            (1, "backward_pre_hooks"), (1, "backward_hooks"), (0, "backward_pre_hooks"), (0, "backward_hooks")]
    assert records == once * 3  # two warmup iterations and the capture
    for g in graphed:
        x = torch.randn(4, 8, device="cuda", requires_grad=True)
        y = g(x)
        y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    assert records == once * 3  # never at replay
    for g in graphed:
        g.reset()


def test_hook_errors_abort_capture_with_their_message():
    def bad(module, args):
        raise ValueError("hook says no")

    with pytest.raises(RuntimeError, match="hook says no"):
        gt.make_graphed_callables(torch.nn.Linear(4, 4, device="cuda"), (torch.randn(2, 4, device="cuda"),),
                                  capture_time_hooks=[{"forward_pre_hooks": {1: bad}}])


def test_hooks_registered_on_modules_after_graphing_run_eagerly_around_replays():
    model = torch.nn.Linear(4, 4, device="cuda")
    gt.make_graphed_callables(model, (torch.randn(2, 4, device="cuda", requires_grad=True),))
    seen = []
    model.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    model(torch.randn(2, 4, device="cuda", requires_grad=True))
    assert seen == [torch.Size([2, 4])]
    model.reset()


@pytest.mark.parametrize("training", [False, True])
def test_warmup_outputs_are_released_once_consumed(training):
    # Transformer Engine releases a warmup forward's outputs as soon as its
    # backward has consumed them, and in inference at once: nothing of one
    # warmup iteration is alive when the next begins.
    model = torch.nn.Linear(64, 64, device="cuda").train(training)
    outputs, alive_at_next = [], []

    def pre(module, args):
        alive_at_next.append([r() is not None for r in outputs])

    def post(module, args, output):
        outputs.append(weakref.ref(output))

    gt.make_graphed_callables(
        model, (torch.randn(8, 64, device="cuda", requires_grad=training),), num_warmup_iters=3,
        capture_time_hooks=[{"forward_pre_hooks": {0: pre}, "forward_hooks": {0: post}}],
    )
    assert len(outputs) == 4  # three warmup iterations and the capture
    for i, alive in enumerate(alive_at_next):
        assert not any(alive), f"before forward {i}: outputs of earlier warmup forwards still alive: {alive}"
    model.reset()
