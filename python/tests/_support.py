"""What the tests need and why they skip: torch, the compiled extension, a
CUDA GPU. Test modules set `pytestmark` from here, so a run without them
lists each skip with its reason."""
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
        from graphed import _torch_ext  # noqa: F401
    except ImportError as e:
        return f"the compiled extension graphed._torch_ext is not built or does not load ({e})"
    return None


def gpu_error():
    err = extension_error()
    if err:
        return err
    if not torch.cuda.is_available():
        return "no CUDA GPU here: graphed.torch captures CUDA graphs"
    return None


needs_torch = pytest.mark.skipif(torch is None, reason=NO_TORCH)
needs_extension = pytest.mark.skipif(extension_error() is not None, reason=str(extension_error()))
needs_gpu = pytest.mark.skipif(gpu_error() is not None, reason=str(gpu_error()))
