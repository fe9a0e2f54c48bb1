"""What the tests need and why they skip: torch, the compiled extension, a
CUDA GPU. Test modules set `pytestmark` from here, so a run without them
lists each skip with its reason."""
import importlib.util
import os

import pytest

try:
    import torch
except ImportError:
    torch = None

NO_TORCH = "torch is not installed: the graphed.torch tests need it"


def extension_error():
    if torch is None:
        return NO_TORCH
    try:
        missing = importlib.util.find_spec("graphed._torch_ext") is None
    except ModuleNotFoundError as e:  # no graphed package at all
        return f"the compiled extension graphed._torch_ext is not built ({e})"
    if missing:
        # From the sources (python/src), `from graphed import _torch_ext`
        # raises a plain ImportError ("cannot import name"): not a failure.
        return "the compiled extension graphed._torch_ext is not built (no graphed/_torch_ext*.so)"
    from graphed import _torch_ext  # noqa: F401
    # Any other import error (a library and header of different versions, an
    # undefined symbol) is a failure of the tests, not a reason to skip them.
    return None


def gpu_error():
    err = extension_error()
    if err is None and not torch.cuda.is_available():
        err = "no CUDA GPU here: graphed.torch captures CUDA graphs"
    # On the GPU machine (python/gpu-test.sh) a missing GPU or extension is
    # a failure: every GPU test skipping would pass.
    if err and os.environ.get("GRAPHED_REQUIRE_GPU") == "1":
        raise RuntimeError(f"GRAPHED_REQUIRE_GPU=1, but {err}")
    return err


needs_torch = pytest.mark.skipif(torch is None, reason=NO_TORCH)
needs_extension = pytest.mark.skipif(extension_error() is not None, reason=str(extension_error()))
needs_gpu = pytest.mark.skipif(gpu_error() is not None, reason=str(gpu_error()))
