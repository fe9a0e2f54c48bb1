"""graphed for PyTorch: make_graphed_callables with safe gradient lifetimes.

    import graphed_torch
    layers = graphed_torch.make_graphed_callables(layers, sample_args)

Same shape as torch.cuda.make_graphed_callables: modules come back with
their forward replaced by graph replays (callables come back as graphed
callables), and autograd works as in eager PyTorch. Differences: parameter
grads are owned clones by default (clone_param_grads_on_return=True), so a
retained or accumulated grad is never overwritten by the next replay.

The C++ extension is built on first import with torch.utils.cpp_extension,
against libgraphed.so: set GRAPHED_LIBRARY to its path (default: the
repository's target/release/libgraphed.so).
"""
import os
import pathlib

import torch
from torch.utils import cpp_extension

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent.parent
_LIB = pathlib.Path(os.environ.get("GRAPHED_LIBRARY", _ROOT / "target" / "release" / "libgraphed.so")).resolve()

_ext = cpp_extension.load(
    name="graphed_torch_ext",
    sources=[str(_HERE / "extension.cpp"), str(_HERE / "graphed_torch.cpp")],
    extra_include_paths=[str(_ROOT / "include"), str(_HERE)],
    extra_ldflags=[str(_LIB), f"-Wl,-rpath,{_LIB.parent}"],
    with_cuda=True,
    verbose=bool(os.environ.get("GRAPHED_VERBOSE_BUILD")),
)


def make_graphed_callables(
    modules,
    sample_args,
    *,
    num_warmup_iters=3,
    clone_param_grads_on_return=True,
    clones_from_torch_allocator=True,
):
    """Graph `modules` (a module or callable, or a tuple of them) with one
    tuple of sample args each. Returns what it was given, graphed."""
    single = not isinstance(modules, (tuple, list))
    mods = (modules,) if single else tuple(modules)
    args = (sample_args,) if single else tuple(sample_args)
    for m in mods:
        if isinstance(m, torch.nn.Module) and any(p.requires_grad for p in m.buffers()):
            raise ValueError("graphed modules may only have trainable parameters, not trainable buffers")
    graphed = _ext.make_graphed_callables(
        list(mods),
        [tuple(a) for a in args],
        num_warmup_iters,
        clone_param_grads_on_return,
        clones_from_torch_allocator,
    )
    out = []
    for m, g in zip(mods, graphed):
        if isinstance(m, torch.nn.Module):
            m.forward = g.__call__
            m._graphed = g  # keeps the session alive with the module
            out.append(m)
        else:
            out.append(g)
    return out[0] if single else tuple(out)
