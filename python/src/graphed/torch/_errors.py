"""Exceptions of graphed.torch, importable without the compiled extension."""


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
