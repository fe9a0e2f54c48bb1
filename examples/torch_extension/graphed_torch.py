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


def _schedule(order, num_layers_per_chunk, num_callables):
    """Transformer Engine's _order (+c forward, -c backward of chunk c, from
    1) as graphed's (pass, chunk) steps, and the layers of each chunk."""
    steps = []
    for o in order:
        if o != int(o):
            raise NotImplementedError(
                "weight-grad steps (-c - 0.5) need delayed weight-gradient callables, "
                "which this adapter does not offer yet (the C API does)"
            )
        steps.append((0 if o > 0 else 1, abs(int(o)) - 1))
    chunks = max(int(o) for o in order)
    if num_layers_per_chunk is None:
        layers = [num_callables // chunks] * chunks
    elif isinstance(num_layers_per_chunk, int):
        layers = [num_layers_per_chunk] * chunks
    else:
        layers = list(num_layers_per_chunk)
    microbatches = sum(1 for o in order if o > 0) // max(chunks, 1)
    return steps, layers, microbatches


def make_graphed_callables(
    modules,
    sample_args,
    *,
    num_warmup_iters=3,
    clone_param_grads_on_return=True,
    clones_from_torch_allocator=True,
    _order=None,
    _num_layers_per_chunk=None,
    _reuse_graph_input_output_buffers=False,
):
    """Graph `modules` (a module or callable, or a tuple of them) with one
    tuple of sample args each. Returns what it was given, graphed.

    With Transformer Engine's `_order` (and `_num_layers_per_chunk`), the
    modules are the layers in chunk order and `sample_args` holds one tuple
    per (layer, microbatch), chunk by chunk, microbatch by microbatch, layer
    by layer; the result is one graphed callable per entry of `sample_args`,
    in the same order, as Transformer Engine returns them.
    `_reuse_graph_input_output_buffers` shares memory between graphed's own
    static buffers whose lifetimes do not overlap."""
    single = not isinstance(modules, (tuple, list))
    mods = (modules,) if single else tuple(modules)
    args = (sample_args,) if single else tuple(sample_args)
    for m in mods:
        if isinstance(m, torch.nn.Module) and any(b.requires_grad for b in m.buffers()):
            raise ValueError("graphed modules may only have trainable parameters, not trainable buffers")
    steps, layers, prefix, microbatches = [], [], [], 1
    if _order is not None:
        steps, layers, microbatches = _schedule(_order, _num_layers_per_chunk, len(mods))
        if len(args) != len(mods) * microbatches:
            raise ValueError(
                f"expected {len(mods) * microbatches} sample args (layers x microbatches), got {len(args)}"
            )
        for n in layers:
            prefix.append(sum(layers[: len(prefix)]))
        # graphed registers each layer once: its microbatch-0 sample.
        args = tuple(
            args[prefix[c] * microbatches + l] for c, n in enumerate(layers) for l in range(n)
        )
    elif _reuse_graph_input_output_buffers:
        raise ValueError("_reuse_graph_input_output_buffers needs _order")
    graphed = _ext.make_graphed_callables(
        list(mods),
        [tuple(a) for a in args],
        num_warmup_iters,
        clone_param_grads_on_return,
        clones_from_torch_allocator,
        steps,
        layers,
        _reuse_graph_input_output_buffers,
    )
    if _order is not None:
        return tuple(
            graphed[prefix[c] + l][m] for c, n in enumerate(layers) for m in range(microbatches) for l in range(n)
        )
    out = []
    for m, g in zip(mods, graphed):
        g = g[0]
        if isinstance(m, torch.nn.Module):
            m.forward = g.__call__
            m._graphed = g  # keeps the session alive with the module
            out.append(m)
        else:
            out.append(g)
    return out[0] if single else tuple(out)
