"""capture_time_hooks: Transformer Engine's checks and call signatures (pure Python)."""
import functools

import pytest

from graphed.torch import _hooks


def test_canonicalize_fills_every_key():
    out = _hooks.canonicalize(2, [None, {"forward_pre_hooks": {1: print}}])
    assert set(out[0]) == set(_hooks.KEYS) and _hooks.is_empty(out[0])
    assert out[1]["forward_pre_hooks"] == {1: print} and not _hooks.is_empty(out[1])


@pytest.mark.parametrize(
    "hooks, error, match",
    [
        ([None, None], ValueError, "capture_time_hooks has 2 entries, but there are 1 callables."),
        (["x"], TypeError, "dicts or None"),
        ([{"forward_hook": {}}], ValueError, r"Found unexpected keys in capture_time_hooks \({'forward_hook'}\)."),
        ([{"forward_hooks": [print]}], TypeError, "must be a dict"),
    ],
)
def test_canonicalize_errors(hooks, error, match):
    with pytest.raises(error, match=match):
        _hooks.canonicalize(1, hooks)


def test_dispatcher_signatures_and_order():
    calls = []
    module = object()
    hooks = _hooks.canonicalize(
        1,
        [
            {
                "forward_pre_hooks": {1: lambda m, a: calls.append(("pre", m is module, a)),
                                      2: lambda m, a, k: calls.append(("pre_kw", a, k))},
                "forward_pre_hooks_with_kwargs": {2: True},
                "forward_hooks": {3: lambda m, a, o: calls.append(("fwd", a, o)),
                                  4: lambda m, a, k, o: calls.append(("fwd_kw", a, k, o))},
                "forward_hooks_with_kwargs": {4: True},
                "backward_pre_hooks": {5: lambda m, go: calls.append(("bwd_pre", go))},
                "backward_hooks": {6: lambda m, gi, go: calls.append(("bwd", gi, go))},
            }
        ],
    )[0]
    # The pass codes are whatever the adapter's events carry (graphed's, from
    # the extension); any three distinct values here.
    FWD, BWD, WGRAD = 10, 11, 12
    d = _hooks.Dispatcher(
        module, hooks, lambda flat: (tuple(flat[:1]), {"scale": flat[1]}), lambda flat: flat[0], FWD, BWD
    )
    d(True, FWD, False, 0, ["x", "s"], None, None, None)
    d(False, FWD, False, 0, ["x", "s"], ["y"], None, None)
    d(True, BWD, True, 0, None, None, ["dy"], None)
    d(False, BWD, True, 0, None, None, ["dy"], ["dx", None])
    d(True, WGRAD, True, 0, None, None, ["dy"], None)  # weight-grad passes run no hooks
    assert calls == [
        ("pre", True, ("x",)),
        ("pre_kw", ("x",), {"scale": "s"}),
        ("fwd", ("x",), "y"),
        ("fwd_kw", ("x",), {"scale": "s"}, "y"),
        ("bwd_pre", ("dy",)),
        ("bwd", ("dx", None), ("dy",)),
    ]


def test_a_hook_returning_a_value_is_refused():
    hooks = _hooks.canonicalize(1, [{"forward_pre_hooks": {1: lambda m, a: a}}])[0]
    d = _hooks.Dispatcher(None, hooks, lambda flat: (tuple(flat), {}), lambda flat: flat, 0, 1)
    with pytest.raises(RuntimeError, match=r"^capture_time_hooks forward_pre_hooks must not return a value\.$"):
        d(True, 0, False, 0, ["x"], None, None, None)


def test_transformer_engines_form_is_called_with_the_module_only():
    # Transformer Engine's tests write every capture-time hook as
    # hook(module) (tests/pytorch/test_cuda_graphs.py, _make_capture_time_hooks).
    records = []
    module = object()

    def make_hook(name):
        def hook(m):
            assert m is module
            records.append(name)

        return hook

    names = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
    hooks = _hooks.canonicalize(1, [{name: {0: make_hook(name)} for name in names}])[0]
    FWD, BWD = 0, 1
    d = _hooks.Dispatcher(module, hooks, lambda flat: (tuple(flat), {}), lambda flat: flat[0], FWD, BWD)
    d(True, FWD, True, 0, ["x"], None, None, None)
    d(False, FWD, True, 0, ["x"], ["y"], None, None)
    d(True, BWD, True, 0, None, None, ["dy"], None)
    d(False, BWD, True, 0, None, None, ["dy"], ["dx"])
    assert records == list(names)


def test_module_only_hooks_in_the_with_kwargs_keys_get_the_module_too():
    calls = []
    hooks = _hooks.canonicalize(
        1,
        [
            {
                "forward_pre_hooks": {7: lambda m: calls.append(("pre", m))},
                "forward_pre_hooks_with_kwargs": {7: True},
                "forward_hooks": {8: lambda m: calls.append(("fwd", m))},
                "forward_hooks_with_kwargs": {8: True},
            }
        ],
    )[0]
    d = _hooks.Dispatcher("mod", hooks, lambda flat: (tuple(flat), {"k": 1}), lambda flat: flat[0], 0, 1)
    d(True, 0, False, 0, ["x"], None, None, None)
    d(False, 0, False, 0, ["x"], ["y"], None, None)
    assert calls == [("pre", "mod"), ("fwd", "mod")]


def _one(m):
    return None


def _two(m, args):
    return None


def _rest(m, *rest):
    return None


def _defaulted(m, args=None):
    return None


def _keyword_only(m, *, scale=1):
    return None


class _CallableObject:
    def __call__(self, m):
        return None

    def method(self, m, args):
        return None


@pytest.mark.parametrize(
    "hook, n, expected",
    [
        (_one, 1, True),
        (_one, 2, False),
        (_keyword_only, 1, True),
        (_CallableObject(), 1, True),
        (_CallableObject().method, 2, True),
        (_CallableObject().method, 3, False),
        (functools.partial(_two, "bound"), 1, True),
        (functools.partial(_two, "bound"), 2, False),
        (_two, 2, True),
        (_rest, 4, True),
        (_defaulted, 1, True),
        (_defaulted, 2, True),
        (_defaulted, 3, False),
        (lambda *anything: None, 5, True),
    ],
)
def test_accepts_reads_the_signature(hook, n, expected):
    assert _hooks.accepts(hook, n) is expected


def test_a_hook_with_an_optional_second_argument_gets_what_it_can_take():
    calls = []

    def hook(m, args=None):
        calls.append((m, args))

    hooks = _hooks.canonicalize(1, [{"forward_pre_hooks": {0: hook}, "forward_hooks": {0: hook}}])[0]
    d = _hooks.Dispatcher("mod", hooks, lambda flat: (tuple(flat), {}), lambda flat: flat[0], 0, 1)
    d(True, 0, False, 0, ["x"], None, None, None)  # torch's pre-hook arguments fit: (module, args)
    d(False, 0, False, 0, ["x"], ["y"], None, None)  # (module, args, output) does not: hook(module)
    assert calls == [("mod", ("x",)), ("mod", None)]


def test_a_hook_of_the_wrong_arity_fails_with_pythons_error():
    hooks = _hooks.canonicalize(1, [{"backward_hooks": {0: lambda a, b, c, d: None}}])[0]
    d = _hooks.Dispatcher(None, hooks, lambda flat: (tuple(flat), {}), lambda flat: flat, 0, 1)
    with pytest.raises(TypeError):
        d(False, 1, True, 0, None, None, ["dy"], ["dx"])
