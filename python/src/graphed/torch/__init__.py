"""graphed for PyTorch: make_graphed_callables with safe gradient lifetimes,
signature-compatible with Transformer Engine's (and torch's).

    import graphed.torch
    layers = graphed.torch.make_graphed_callables(tuple(layers), sample_args)

Modules come back with their forward replaced by graph replays (plain
callables come back as graphed callables; with `_order`, one graphed callable
per sample_args entry), and autograd works as in eager PyTorch. Parameter
grads are owned by default (written into fresh memory of PyTorch's
allocator at each backward), so a retained or accumulated grad is never
overwritten by the next replay (PyTorch issue 181723). The graphs and their
memory go with the last reference to them, or with reset().
`memory_report()` says what graphed holds.

`python -m graphed.torch.check` prints versions, the library in use, the
driver, and runs a one-layer self-test.
"""
import importlib

from ._errors import AliasHeldError, CollectiveMismatchError, ParamMovedError

# Imported on first use, so that the pure-Python parts (the schedule, hook
# and option checks) import without torch.
_LAZY = {
    "Buckets": "_buckets",
    "make_graphed_callables": "_make",
    "graph_pool_handle": "_make",
    "make_graphed_step": "_step",
    "memory_report": "_make",
    "export_dot": "_make",
    "GraphedStep": "_step",
    "register_generator": "_rng",
    "registered_generators": "_rng",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AliasHeldError",
    "Buckets",
    "CollectiveMismatchError",
    "GraphedStep",
    "ParamMovedError",
    "graph_pool_handle",
    "make_graphed_callables",
    "export_dot",
    "make_graphed_step",
    "memory_report",
    "register_generator",
    "registered_generators",
]
