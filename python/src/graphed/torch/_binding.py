"""A graphed callable's arguments and outputs, flattened: the positional
args and keyword args of the capture sample become the flat list of tensors
graphed captures (non-tensor keyword values are fixed at capture), and a
call's arguments are matched against that sample (structure, fixed values)
before the extension checks each tensor's shape, dtype, device and
requires_grad by the names given here."""
import torch
from torch.utils import _pytree as pytree

_TENSOR = object()  # marks a tensor leaf among a keyword argument's fixed values


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _leaves(value):
    leaves, spec = pytree.tree_flatten_with_path(value)
    return [(pytree.keystr(path), leaf) for path, leaf in leaves], spec


class Binding:
    """Built from one capture sample (positional args, keyword args)."""

    def __init__(self, sample_args, sample_kwargs):
        self.names = []  # one per flat tensor, for messages
        self.samples = []  # the flat tensors
        self.arg_specs = []
        for i, arg in enumerate(tuple(sample_args)):
            leaves, spec = _leaves(arg)
            for path, leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    raise TypeError(
                        "In the beta API, sample_args for each callable must contain only Tensors. Other types are "
                        f"not allowed (argument {i}{path} is a {type(leaf).__name__}; pass non-tensors in sample_kwargs)."
                    )
                self.names.append(f"argument {i}{path}")
                self.samples.append(leaf)
            self.arg_specs.append(spec)
        self.kw_keys = list(sample_kwargs or {})
        self.kw_specs = []
        self.kw_values = []  # per key: per leaf, _TENSOR or the fixed value
        for key in self.kw_keys:
            leaves, spec = _leaves(sample_kwargs[key])
            values = []
            for path, leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    self.names.append(f"keyword argument '{key}'{path}")
                    self.samples.append(leaf)
                    values.append(_TENSOR)
                else:
                    values.append(leaf)
            self.kw_specs.append(spec)
            self.kw_values.append(values)
        self.num_args = len(self.arg_specs)
        # Calls with plain tensors as positional args need no matching here.
        self.simple = not self.kw_keys and all(s.is_leaf() for s in self.arg_specs)

    # -- capture side: the callable's arguments from the flat tensors --

    def unflatten(self, flat):
        it = iter(flat)
        args = tuple(pytree.tree_unflatten([next(it) for _ in range(s.num_leaves)], s) for s in self.arg_specs)
        kwargs = {}
        for key, spec, values in zip(self.kw_keys, self.kw_specs, self.kw_values):
            kwargs[key] = pytree.tree_unflatten([next(it) if v is _TENSOR else v for v in values], spec)
        return args, kwargs

    # -- replay side: a call's flat tensors --

    def match(self, args, kwargs):
        """The flat tensors of a call; `kwargs` is consumed. TypeError for
        missing or unexpected arguments, ValueError for a different
        structure or a different fixed value."""
        if len(args) < self.num_args:
            raise TypeError(f"graphed callable takes {self.num_args} positional arguments, got {len(args)}")
        flat = []
        for i, spec in enumerate(self.arg_specs):
            if spec.is_leaf():
                flat.append(args[i])
                continue
            leaves, got = pytree.tree_flatten(args[i])
            if got != spec:
                raise ValueError(f"argument {i} has the structure {got}; it was captured with {spec}")
            flat.extend(leaves)
        extra = list(args[self.num_args:])
        for key, spec, values in zip(self.kw_keys, self.kw_specs, self.kw_values):
            if key in kwargs:
                value = kwargs.pop(key)
            elif extra:
                value = extra.pop(0)
            elif _TENSOR in values:
                raise TypeError(f"graphed callable: missing keyword argument '{key}' (it was captured with a tensor)")
            else:
                continue  # the fixed value it was captured with
            leaves, got = pytree.tree_flatten(value)
            if got != spec:
                raise ValueError(f"keyword argument '{key}' has the structure {got}; it was captured with {spec}")
            for leaf, fixed in zip(leaves, values):
                if fixed is _TENSOR:
                    flat.append(leaf)
                elif not _same(leaf, fixed):
                    raise ValueError(
                        f"keyword argument '{key}' is {leaf!r}; it was captured with {fixed!r} (non-tensor values are "
                        "fixed at capture: make another graphed callable for another value)"
                    )
        if extra:
            raise TypeError(f"graphed callable takes {self.num_args} positional arguments "
                            f"(and {len(self.kw_keys)} keyword arguments), got {self.num_args + len(extra)}")
        if kwargs:
            raise TypeError(f"graphed callable got unexpected keyword arguments {sorted(kwargs)}; it was captured "
                            f"with {self.kw_keys}")
        return flat

    def check_structure(self, other, where: str, than: str):
        """`other` (another Binding) has this one's structure and fixed
        keyword values, else ValueError naming `where` and `than`."""
        if other.arg_specs != self.arg_specs or other.kw_keys != self.kw_keys or other.kw_specs != self.kw_specs:
            raise ValueError(f"{where} has another structure than {than}")
        for key, va, vb in zip(self.kw_keys, self.kw_values, other.kw_values):
            for x, y in zip(va, vb):
                if (x is _TENSOR) != (y is _TENSOR) or (x is not _TENSOR and not _same(x, y)):
                    raise ValueError(f"{where}: keyword argument '{key}' differs from {than}")

    def check_same(self, sample_args, sample_kwargs, where: str):
        """Another sample of the same callable (another microbatch) must
        have the same signature: graphed captures one per callable."""
        other = Binding(sample_args, sample_kwargs)
        self.check_structure(other, where, "the layer's first microbatch")
        for name, a, b in zip(self.names, self.samples, other.samples):
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or a.requires_grad != b.requires_grad:
                raise ValueError(
                    f"{where}: {name} has shape {list(b.shape)}, {b.dtype}, {b.device}, requires_grad="
                    f"{b.requires_grad}; the layer's first microbatch has shape {list(a.shape)}, {a.dtype}, "
                    f"{a.device}, requires_grad={a.requires_grad} (graphed captures one signature per layer)"
                )


class Outputs:
    """The structure of a callable's outputs, learnt at its first call."""

    def __init__(self, name: str):
        self.name = name
        self.spec = None
        self.kind = None  # "one", "tuple" or "tree"

    def flatten(self, out):
        leaves, spec = pytree.tree_flatten(out)
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"{self.name} returned a {type(leaf).__name__} (output {i}); graphed callables "
                                "return tensors, or tuples, lists and dicts of them")
        if self.spec is None:
            self.spec = spec
            if isinstance(out, torch.Tensor):
                self.kind = "one"
            elif type(out) is tuple and all(isinstance(x, torch.Tensor) for x in out):
                self.kind = "tuple"
            else:
                self.kind = "tree"
        elif spec != self.spec:
            raise RuntimeError(f"{self.name} returned the structure {spec}; it returned {self.spec} before")
        return leaves

    def unflatten(self, flat):
        if self.kind == "one":
            return flat[0]
        if self.kind == "tuple":
            return tuple(flat)
        return pytree.tree_unflatten(list(flat), self.spec)
