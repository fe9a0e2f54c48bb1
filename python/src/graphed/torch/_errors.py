"""Exceptions of graphed.torch, importable without the compiled extension."""


class AliasHeldError(RuntimeError):
    """Strict leases: a replay would overwrite an alias (an output, an input
    grad, an aliased parameter grad) that is still alive. Nothing was
    replayed; the message names the callable, the slot and the tensors still
    alive. Raised as such by forward calls and backward_dw(); a backward
    replay run by autograd surfaces as RuntimeError with the same message."""
