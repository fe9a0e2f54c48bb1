"""Transformer Engine's `capture_time_hooks`: per-callable hooks that run
during warmup and capture, outside stream capture, and never at replay.
Checked (its entries' types by graphed) and called as Transformer Engine
does. Pure Python: no torch.

Each entry (one per callable; None for none) is a dict of dicts, hook id to
function. Transformer Engine calls every hook as hook(module); graphed
calls a hook with the arguments of torch's module hooks when it takes
them, as the frameworks that pass torch-style hooks (and the `_with_kwargs`
keys) expect, and as hook(module) when it takes only that:
    forward_pre_hooks    hook(module, args), or hook(module, args, kwargs)
                         when the id is in forward_pre_hooks_with_kwargs
    forward_hooks        hook(module, args, output), or
                         hook(module, args, kwargs, output) when the id is in
                         forward_hooks_with_kwargs
    backward_pre_hooks   hook(module, grad_output)
    backward_hooks       hook(module, grad_input, grad_output)
A hook must return None.
"""
import inspect
from typing import Any, Callable, Dict, List, Optional

KEYS = (
    "forward_pre_hooks",
    "forward_pre_hooks_with_kwargs",
    "forward_hooks",
    "forward_hooks_with_kwargs",
    "backward_pre_hooks",
    "backward_hooks",
)


def empty() -> Dict[str, Dict[Any, Any]]:
    return {key: {} for key in KEYS}


def canonicalize(num_callables: int, capture_time_hooks: Optional[List[Optional[Dict[str, Dict]]]]):
    """One dict of every key per callable. Transformer Engine's checks with
    its messages (the number of entries, unknown keys), and graphed's of
    the entries' types."""
    if capture_time_hooks is None:
        return [empty() for _ in range(num_callables)]
    if len(capture_time_hooks) != num_callables:
        raise ValueError(
            f"capture_time_hooks has {len(capture_time_hooks)} entries, but there are {num_callables} callables."
        )
    out = []
    for i, hooks in enumerate(capture_time_hooks):
        if hooks is None:
            out.append(empty())
            continue
        if not isinstance(hooks, dict):
            raise TypeError(
                f"capture_time_hooks entries must be dicts or None, but entry {i} has type {type(hooks).__name__}"
            )
        unexpected_keys = set(hooks) - set(KEYS)
        if unexpected_keys:
            raise ValueError(f"Found unexpected keys in capture_time_hooks ({unexpected_keys}).")
        entry = empty()
        for key in KEYS:
            value = hooks.get(key) or {}
            if not isinstance(value, dict):
                raise TypeError(f"capture_time_hooks[{i}][{key!r}] must be a dict, but got {type(value).__name__}")
            entry[key] = dict(value)
        out.append(entry)
    return out


def is_empty(hooks: Dict[str, Dict]) -> bool:
    return not any(hooks[k] for k in ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks"))


def accepts(hook, n: int) -> Optional[bool]:
    """Whether `hook` can be called with `n` positional arguments; None when
    its signature cannot be read (a builtin, say)."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*([None] * n))
        return True
    except TypeError:
        return False


def _call(hook, module, *args):
    """hook(module, *args) when the hook takes them (torch's arguments);
    hook(module), Transformer Engine's form, when it takes only that; a
    hook whose signature cannot be read gets torch's arguments."""
    if accepts(hook, 1 + len(args)) is False and accepts(hook, 1):
        return hook(module)
    return hook(module, *args)


def _returned_nothing(value, name: str):
    if value is not None:
        raise RuntimeError(f"capture_time_hooks {name} must not return a value.")


class Dispatcher:
    """Calls one callable's capture-time hooks from the adapter's hook events.

    `unflatten_inputs(flat) -> (args, kwargs)` and
    `unflatten_outputs(flat) -> output` rebuild what the callable receives
    and returns from the flat tensor lists the adapter passes; `forward`
    and `backward` are the codes of those passes in its events (graphed's
    GRAPHED_PASS_FORWARD and _BACKWARD, from the compiled extension).
    """

    def __init__(
        self,
        module: Any,
        hooks: Dict[str, Dict],
        unflatten_inputs: Callable,
        unflatten_outputs: Callable,
        forward: int,
        backward: int,
    ):
        self.module = module
        self.hooks = hooks
        self.unflatten_inputs = unflatten_inputs
        self.unflatten_outputs = unflatten_outputs
        self.forward = forward
        self.backward = backward

    def __call__(self, before, pass_, capture, microbatch, inputs, outputs, grad_outputs, grads):
        h = self.hooks
        if pass_ == self.forward:
            args, kwargs = self.unflatten_inputs(inputs)
            if before:
                for hid, hook in h["forward_pre_hooks"].items():
                    if hid in h["forward_pre_hooks_with_kwargs"]:
                        _returned_nothing(_call(hook, self.module, args, kwargs), "forward_pre_hooks")
                    else:
                        _returned_nothing(_call(hook, self.module, args), "forward_pre_hooks")
            else:
                output = self.unflatten_outputs(outputs)
                for hid, hook in h["forward_hooks"].items():
                    if hid in h["forward_hooks_with_kwargs"]:
                        _returned_nothing(_call(hook, self.module, args, kwargs, output), "forward_hooks")
                    else:
                        _returned_nothing(_call(hook, self.module, args, output), "forward_hooks")
        elif pass_ == self.backward:
            grad_output = tuple(grad_outputs)
            if before:
                for hook in h["backward_pre_hooks"].values():
                    _returned_nothing(_call(hook, self.module, grad_output), "backward_pre_hooks")
            else:
                for hook in h["backward_hooks"].values():
                    _returned_nothing(_call(hook, self.module, tuple(grads), grad_output), "backward_hooks")
        # Weight-grad passes run no hooks, as in Transformer Engine.
