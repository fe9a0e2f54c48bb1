"""Exceptions of graphed.torch, importable without the compiled extension,
and where the code that raised one in a callback was issued."""

import os
import traceback

# Frames in these folders are the libraries', not the caller's.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (os.path.dirname(os.path.abspath(__file__)),)
)


def _library_frame(filename):
    dirs = _LIBRARY_DIRS
    try:
        import torch

        dirs = dirs + (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,)
    except ImportError:
        pass
    return os.path.abspath(filename).startswith(dirs)


def failure_site(tb):
    """Where the caller's code issued what raised the exception whose
    traceback is `tb`: "model.py:12 in forward: y = x.item()", from the
    last frame outside torch and graphed (the last frame when every one is
    theirs); "" for no frame. A capture error names it (docs/pytorch.md,
    "When a capture fails")."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return ""
    user = [f for f in frames if not _library_frame(f.filename)]
    f = (user or frames)[-1]
    where = f"{f.filename}:{f.lineno} in {f.name}"
    return f"{where}: {f.line}" if f.line else where


class AliasHeldError(RuntimeError):
    """Strict leases: a replay would overwrite an alias (an output, an input
    grad, an aliased parameter grad) that is still alive. Nothing was
    replayed; the message names the callable, the slot and the tensors still
    alive. Raised as such by forward calls and backward_dw(); a backward
    replay run by autograd surfaces as RuntimeError with the same message."""


class ParamMovedError(RuntimeError):
    """A call found a module's parameter where or as its graphs cannot read
    it: at another address they cannot follow (`rebind_params=False`, a
    parameter capture could not verify, or memory less aligned than at
    capture), with another shape, dtype, device or layout, or gone from its
    module. The message names the callable, the parameter's qualified name
    ("blocks.0.attn.c_attn.weight") and, for a move, both addresses.
    Nothing was replayed."""


class CollectiveMismatchError(RuntimeError):
    """make_graphed_step(ddp=...): the ranks' graphs would hold different
    collectives (another count, size, dtype or order), found by comparing
    every rank's manifest before the first replay. The message names the
    first differing collective and what each of the two ranks recorded
    there. Raised on every rank alike; no replay ran."""
