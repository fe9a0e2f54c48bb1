"""Strict leases: an alias held past its window raises AliasHeldError
naming the tensor instead of being overwritten; dropping it (on any
thread) releases it."""
import threading

import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt


def model(**kw):
    m = torch.nn.Linear(16, 16, device="cuda")
    gt.make_graphed_callables(m, (torch.randn(4, 16, device="cuda", requires_grad=True),), strict_leases=True, **kw)
    return m


def x():
    return torch.randn(4, 16, device="cuda", requires_grad=True)


def test_a_held_output_stops_the_next_forward():
    m = model()
    y = m(x())
    with pytest.raises(gt.AliasHeldError, match="output 0"):
        m(x())
    del y
    m(x())  # the dropped output freed its lease
    m.reset()


def test_a_held_aliased_grad_stops_the_next_backward():
    m = model(clone_param_grads_on_return=False)
    y = m(x())
    y.sum().backward()
    del y
    y = m(x())  # weight.grad (an alias) is still held: accumulating into it would corrupt it
    with pytest.raises(RuntimeError, match="weight.grad"):
        y.sum().backward()
    del y
    m.zero_grad(set_to_none=True)
    m(x()).sum().backward()
    m.reset()


def test_owned_grads_need_no_lease():
    m = model()
    for _ in range(3):
        y = m(x())
        y.sum().backward()
        del y
    assert m.weight.grad is not None
    m.reset()


def test_releases_from_other_threads_while_a_backward_runs():
    # An output of `a` dies on another thread while autograd's thread replays
    # `b`'s backward in the same session: the release is never lost.
    layers = tuple(torch.nn.Linear(16, 16, device="cuda") for _ in range(2))
    a, b = gt.make_graphed_callables(layers, ((x(),), (x(),)), strict_leases=True)
    box, ready, dropped = [], threading.Event(), threading.Event()

    def drop():
        for _ in range(100):
            if not ready.wait(timeout=30):
                return
            ready.clear()
            box.clear()  # the last reference: the deleter releases the lease here
            dropped.set()

    t = threading.Thread(target=drop, daemon=True)
    t.start()
    for _ in range(100):
        box.append(a(x()))
        ready.set()
        b(x()).sum().backward()
        assert dropped.wait(timeout=30), "the other thread did not drop the output"
        dropped.clear()
    t.join(timeout=30)
    a(x())  # every lease of `a` was released
    a.reset()
    b.reset()
