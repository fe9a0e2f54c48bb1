"""The Python side of make_graphed_callables with the extension replaced by
a stand-in that runs the callables eagerly through the same closures (torch
on the CPU): what reaches the extension, and what comes back to the caller."""
import contextlib

import pytest

from _support import needs_extension, needs_torch, torch

pytestmark = needs_torch

if torch is not None:
    import graphed.torch as gt
    from graphed.torch import _make, _rng


class FakeImpl:
    def __init__(self, spec, microbatch, session):
        self.spec, self.microbatch, self.session = spec, microbatch, session

    def replay(self, flat, stream, event):
        self.session.replays.append((self.spec["name"], self.microbatch, stream, event))
        return self.spec["forward"](list(flat))

    def reset(self):
        self.session.resets += 1

    def release(self):
        if self.session.refuse_release:
            raise RuntimeError("graphed: a lease is still held")
        self.session.released.append((self.spec["name"], self.microbatch))

    def backward_dw(self):
        pass

    def session_stats(self):
        return {"microbatches": 1}


class FakeExt:
    """Runs one warmup iteration of forwards (with the hooks) as the adapter would."""

    # Stand-ins for graphed's constants, which the package takes from the
    # extension.
    PASS_FORWARD, PASS_BACKWARD, PASS_WGRAD = "forward", "backward", "wgrad"
    PARAM_FLAGS_DELAYED_WGRAD = 0x100

    def __init__(self):
        self.replays, self.resets, self.calls, self.released = [], 0, [], []
        self.refuse_release = False
        self.microbatches = 1

    def schedule(self, order, layers_per_chunk, num_callables):
        # graphed's own reading of the schedule: the one part not stood in for.
        from graphed import _torch_ext

        s = _torch_ext.schedule(order, layers_per_chunk, num_callables)
        self.microbatches = s["microbatches"]
        return s

    def make(self, specs, options):
        self.specs, self.options = specs, options
        microbatches = self.microbatches
        for s in specs:
            flat = list(s["samples"])
            if s["hook"]:
                s["hook"](True, self.PASS_FORWARD, False, 0, flat, None, None, None)
            out = s["forward"](flat)
            if s["hook"]:
                s["hook"](False, self.PASS_FORWARD, False, 0, flat, out, None, None)
        return [[FakeImpl(s, m, self) for m in range(microbatches)] for s in specs]


@pytest.fixture
def fake(monkeypatch):
    ext = FakeExt()
    monkeypatch.setattr(_make, "extension", lambda: ext)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_make, "_device_of", lambda *a: torch.device("cuda", 0))
    monkeypatch.setattr(_rng, "save", lambda device, gens: [])
    return ext


class Block(torch.nn.Module if torch is not None else object):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.lin.weight.skip_backward_post_hook = True

    def forward(self, x, mask=None, scale=1.0):
        return self.lin(x) * scale + (0 if mask is None else mask)


def test_module_forward_is_replaced_and_restored(fake):
    m = Block()
    want = m(torch.ones(2, 4), mask=torch.ones(2, 4), scale=2.0)
    out = gt.make_graphed_callables(m, (torch.zeros(2, 4),), sample_kwargs={"mask": torch.zeros(2, 4), "scale": 2.0})
    assert out is m and "forward" in m.__dict__
    spec = fake.specs[0]
    assert spec["name"] == "Block_0"
    assert spec["input_names"] == ["argument 0", "keyword argument 'mask'"]
    assert spec["param_names"] == ["lin.weight", "lin.bias"] and spec["param_flags"] == [FakeExt.PARAM_FLAGS_DELAYED_WGRAD, 0]
    assert torch.equal(m(torch.ones(2, 4), mask=torch.ones(2, 4)), want)
    with pytest.raises(ValueError, match="'scale' is 3.0"):
        m(torch.ones(2, 4), mask=torch.ones(2, 4), scale=3.0)
    m.eval()
    eager_calls = len(fake.replays)
    m(torch.ones(2, 4), mask=torch.ones(2, 4), scale=5.0)  # eval: eager, any scale
    assert len(fake.replays) == eager_calls
    m.train()
    m.reset()
    assert fake.resets == 1 and "forward" not in m.__dict__
    m.reset()  # a no-op that holds no session
    assert fake.resets == 1 and m.__dict__["reset"].__closure__ is None


@needs_extension
def test_options_reach_the_extension(fake, monkeypatch):
    gen = object()
    monkeypatch.setattr(_rng, "generators_for", lambda device, extra: list(extra or []))
    layers = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    samples = tuple((torch.zeros(2, 4),) for _ in range(6))
    g = gt.make_graphed_callables(
        layers, samples, 3, True, None, _order=[1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1], pool=(1, 2),
        retain_graph_in_backward=True, _reuse_graph_input_output_buffers=True, clone_param_grads_on_return=False,
        strict_leases=True, generators=[gen],
    )
    o = fake.options
    assert o["steps"][:3] == [(0, 0), (0, 1), (0, 0)] and o["layers_per_chunk"] == [1, 1]
    assert o["pool"] == (1, 2) and o["reuse_buffers"] and o["retain_graph_in_backward"] and o["allow_unused_input"]
    assert not o["clone_param_grads_on_return"] and o["strict_leases"] and o["generators"] == [gen]
    assert len(g) == 6
    # one graphed callable per sample_args entry: chunk by chunk, microbatch by microbatch
    assert [(i._impl.spec["name"], i._impl.microbatch) for i in g] == [
        ("Linear_0", 0), ("Linear_0", 1), ("Linear_0", 2), ("Linear_1", 0), ("Linear_1", 1), ("Linear_1", 2)
    ]
    assert "forward" not in layers[0].__dict__  # with _order the modules stay as they are


def test_torch_positional_pool(fake):
    gt.make_graphed_callables(torch.nn.Linear(4, 4), (torch.zeros(2, 4),), 2, False, (7, 8))
    assert fake.options["pool"] == (7, 8) and fake.options["num_warmup_iters"] == 2


def test_clone_alias_name_of_the_standalone_runtime(fake):
    gt.make_graphed_callables(torch.nn.Linear(4, 4), (torch.zeros(2, 4),), _clone_param_grads_on_return=False)
    assert not fake.options["clone_param_grads_on_return"]


def test_capture_time_hooks_are_wired(fake):
    seen = []
    m = torch.nn.Linear(4, 4)
    gt.make_graphed_callables(
        m, (torch.zeros(2, 4),),
        capture_time_hooks=[{"forward_pre_hooks": {0: lambda mod, args: seen.append(("pre", mod is m, len(args)))},
                             "forward_hooks": {0: lambda mod, args, out: seen.append(("post", tuple(out.shape)))}}],
    )
    assert seen == [("pre", True, 1), ("post", (2, 4))]


def test_per_call_keywords(fake):
    m = torch.nn.Linear(4, 4)
    gt.make_graphed_callables(m, (torch.zeros(2, 4),))

    class S:
        cuda_stream, device_index = 123, 0

    class E:
        cuda_event = 456

    m(torch.zeros(2, 4), cuda_graph_stream=S(), cuda_graph_event=E(), is_first_microbatch=False)
    assert fake.replays[-1][2:] == ((123, 0), 456)


def test_reset_releases_only_the_selected_callable(fake):
    # Transformer Engine's reset(): the callable reset runs eagerly and its
    # module gets its own forward back, its graphs and memory released (the
    # extension's release of that callable); the other keeps replaying; the
    # rest is freed (the extension's reset) with the last one.
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    gt.make_graphed_callables((a, b), ((torch.zeros(2, 4),), (torch.zeros(2, 4),)))
    x = torch.ones(2, 4)
    a.reset()
    assert fake.released == [("Linear_0", 0)]
    assert fake.resets == 0 and "forward" not in a.__dict__ and "forward" in b.__dict__
    assert "session_stats" not in a.__dict__ and "session_stats" in b.__dict__
    replays = len(fake.replays)
    assert torch.equal(a(x), torch.nn.functional.linear(x, a.weight, a.bias))  # eager: no replay
    assert len(fake.replays) == replays
    b(x)
    assert fake.replays[-1][0] == "Linear_1" and len(fake.replays) == replays + 1  # still graphed
    a.reset()  # a second reset does nothing
    assert fake.resets == 0 and fake.released == [("Linear_0", 0)]
    b.reset()
    assert fake.resets == 1 and "forward" not in b.__dict__
    assert fake.released == [("Linear_0", 0)], "the last one resets the whole session instead"
    b.reset()
    assert fake.resets == 1


def test_a_refused_release_changes_nothing(fake):
    # The extension refuses the release (a strict lease held): the reset
    # raises, the module keeps its graphed forward, and a later reset works.
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    gt.make_graphed_callables((a, b), ((torch.zeros(2, 4),), (torch.zeros(2, 4),)))
    fake.refuse_release = True
    with pytest.raises(RuntimeError, match="a lease is still held"):
        a.reset()
    assert "forward" in a.__dict__ and not a.forward.is_reset and fake.released == []
    replays = len(fake.replays)
    a(torch.ones(2, 4))
    assert len(fake.replays) == replays + 1  # still graphed
    fake.refuse_release = False
    a.reset()
    assert fake.released == [("Linear_0", 0)] and "forward" not in a.__dict__
    b.reset()
    assert fake.resets == 1


def test_reset_of_plain_callables(fake):
    fns = (lambda x: x * 2, lambda x: x + 1)
    g = gt.make_graphed_callables(fns, ((torch.zeros(2, 4),), (torch.zeros(2, 4),)))
    g[1].reset()
    assert g[1].is_reset and not g[0].is_reset and fake.resets == 0
    replays = len(fake.replays)
    assert torch.equal(g[1](torch.ones(2, 4)), torch.full((2, 4), 2.0))  # eager
    g[0](torch.ones(2, 4))
    assert len(fake.replays) == replays + 1 and "(reset)" in repr(g[1]) and "(reset)" not in repr(g[0])
    g[0].reset()
    assert fake.resets == 1 and g[0].is_reset


@needs_extension
def test_with_order_every_microbatchs_callable_counts(fake):
    layers = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    samples = tuple((torch.zeros(2, 4),) for _ in range(4))
    g = gt.make_graphed_callables(layers, samples, _order=[1, 2, 1, 2, -2, -1, -2, -1])
    # g: layer 0's microbatches 0 and 1, then layer 1's; a layer's graphs go
    # once both of its microbatches' graphed callables are reset.
    released = [[], ["Linear_0"], ["Linear_0"]]
    for i, c in enumerate(g):
        assert fake.resets == 0, f"freed after {i} of {len(g)} resets"
        assert [name for name, _ in fake.released] == released[i - 1] if i else not fake.released
        c.reset()
    assert fake.resets == 1


def test_a_module_given_twice_without_order_is_refused(fake):
    m = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="callable 1 is a module given before"):
        gt.make_graphed_callables((m, m), ((torch.zeros(2, 4),), (torch.zeros(2, 4),)))
    assert "forward" not in m.__dict__
