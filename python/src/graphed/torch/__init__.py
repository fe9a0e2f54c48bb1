"""graphed for PyTorch: make_graphed_callables with safe gradient lifetimes,
signature-compatible with Transformer Engine's (and torch's).

    import graphed.torch
    layers = graphed.torch.make_graphed_callables(tuple(layers), sample_args)

Modules come back with their forward replaced by graph replays (plain
callables come back as graphed callables; with `_order`, one graphed callable
per sample_args entry), and autograd works as in eager PyTorch. Parameter
grads are owned clones by default, so a retained or accumulated grad is
never overwritten by the next replay (PyTorch issue 181723).

`python -m graphed.torch.check` prints versions, the library in use, the
driver, and runs a one-layer self-test.
"""
from ._errors import AliasHeldError
from ._make import graph_pool_handle, make_graphed_callables
from ._rng import register_generator, registered_generators

__all__ = [
    "AliasHeldError",
    "graph_pool_handle",
    "make_graphed_callables",
    "register_generator",
    "registered_generators",
]
