"""Buckets: one callable captured at several sizes of its inputs' first
dimension, all in one memory plan. `Buckets` holds the capture samples (one
per size); `plan` reads them into the sizes and which flat inputs are
dynamic; `Rows` checks a call's size and, above the largest bucket, runs the
callable eagerly (warning once) or raises, as asked."""
import warnings

import torch

from ._binding import Binding

OVERFLOW = ("eager", "raise")


class Buckets:
    """Capture samples of one callable at several sizes, given in place of
    its entry of `sample_args` (and, where keyword arguments change with the
    size too, of `sample_kwargs`):

        Buckets((x_64,), (x_128,), (x_256,))

    Each sample is the callable's positional arguments (a tuple; a single
    tensor stands for a 1-tuple), or its keyword arguments (a dict) in
    `sample_kwargs`. The tensors whose first dimension differs between the
    samples are the dynamic ones: in each sample they share that size (the
    bucket's), and nothing else about them differs. Every bucket is captured;
    a call of n rows replays the smallest bucket holding n on the actual
    rows (the rest zeroed) and returns n rows of each output whose first
    dimension follows the bucket."""

    def __init__(self, *samples):
        if len(samples) < 1:
            raise ValueError("Buckets needs at least one sample")
        self.samples = tuple(s if isinstance(s, (tuple, dict)) else (s,) for s in samples)

    def __len__(self):
        return len(self.samples)

    def __repr__(self):
        return f"Buckets({len(self.samples)} samples)"


def plan(args, kwargs, where):
    """(the largest bucket's args and kwargs, bucket sizes ascending, per
    flat input whether it is dynamic) of one callable's sample entries,
    either of which may be a Buckets; (args, kwargs, None, None) when
    neither is. ValueError naming `where` for samples that do not make
    buckets."""
    if not isinstance(args, Buckets) and not isinstance(kwargs, Buckets):
        return args, kwargs, None, None
    n = len(args) if isinstance(args, Buckets) else len(kwargs)
    if isinstance(args, Buckets) and isinstance(kwargs, Buckets) and len(kwargs) != n:
        raise ValueError(f"{where}: {n} bucket samples in sample_args and {len(kwargs)} in sample_kwargs")
    pairs = [
        (
            args.samples[b] if isinstance(args, Buckets) else args,
            kwargs.samples[b] if isinstance(kwargs, Buckets) else kwargs,
        )
        for b in range(n)
    ]
    for a, k in pairs:
        if not isinstance(a, tuple) or not isinstance(k, dict):
            raise TypeError(f"{where}: a bucket's sample_args entry is a tuple and its sample_kwargs entry a dict")
    bindings = [Binding(a, k) for a, k in pairs]
    first = bindings[0]
    for b, other in enumerate(bindings[1:], 1):
        first.check_structure(other, f"{where}: bucket sample {b}", "bucket sample 0")
    dynamic = []
    for i, name in enumerate(first.names):
        ts = [bd.samples[i] for bd in bindings]
        t0 = ts[0]
        for b, t in enumerate(ts[1:], 1):
            if t.dtype != t0.dtype or t.device != t0.device or t.requires_grad != t0.requires_grad:
                raise ValueError(
                    f"{where}: {name} is {t.dtype} on {t.device}, requires_grad={t.requires_grad} in bucket sample "
                    f"{b}, and {t0.dtype} on {t0.device}, requires_grad={t0.requires_grad} in bucket sample 0: only "
                    "the first dimension changes between buckets"
                )
        same = all(t.shape == t0.shape for t in ts)
        if not same and (
            any(t.dim() == 0 for t in ts) or any(t.dim() != t0.dim() or t.shape[1:] != t0.shape[1:] for t in ts)
        ):
            raise ValueError(
                f"{where}: {name} has the shapes {[list(t.shape) for t in ts]} in the bucket samples: a dynamic "
                "tensor differs in its first dimension only"
            )
        dynamic.append(not same)
    if not any(dynamic):
        if n == 1:
            raise ValueError(
                f"{where}: one bucket sample makes no buckets (no tensor's first dimension changes): give the sample "
                "itself, or several"
            )
        raise ValueError(f"{where}: the bucket samples are all the same shape: no tensor's first dimension changes")
    sizes = []
    for b, bd in enumerate(bindings):
        rows = {int(bd.samples[i].shape[0]) for i in range(len(dynamic)) if dynamic[i]}
        if len(rows) != 1:
            raise ValueError(
                f"{where}: the dynamic tensors of bucket sample {b} have the first dimensions {sorted(rows)}; "
                "they share one (the bucket's size)"
            )
        sizes.append(rows.pop())
    order = sorted(range(n), key=lambda b: sizes[b])
    if len(set(sizes)) != n:
        raise ValueError(f"{where}: two bucket samples have the same size ({sorted(sizes)})")
    largest = order[-1]
    return pairs[largest][0], pairs[largest][1], [sizes[b] for b in order], dynamic


class Rows:
    """What a call of a bucketed callable checks before its replay: its size
    (the first dimension of its first dynamic input) against the largest
    bucket, and what happens above it."""

    __slots__ = ("first", "largest", "overflow", "name", "warned")

    def __init__(self, first, largest, overflow, name):
        self.first = first
        self.largest = largest
        self.overflow = overflow
        self.name = name
        self.warned = False

    def above(self, flat):
        """Whether the call's size is above the largest bucket (it then runs
        eagerly, having warned once, or raises ValueError)."""
        x = flat[self.first]
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] <= self.largest:
            return False
        if self.overflow == "raise":
            raise ValueError(
                f"graphed callable '{self.name}': a call of {x.shape[0]} rows, above its largest bucket "
                f"({self.largest}); nothing was replayed (bucket_overflow='raise')"
            )
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"graphed callable '{self.name}': a call of {x.shape[0]} rows is above its largest bucket "
                f"({self.largest}): it runs eagerly (bucket_overflow='eager'; this warning is shown once per callable)",
                stacklevel=3,
            )
        return True
