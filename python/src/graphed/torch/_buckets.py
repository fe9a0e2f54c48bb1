"""Buckets: one callable captured at several sizes of its inputs, on any
dimension, or on a grid of two sizes (batch and length), all in one memory
plan. `Buckets` holds the capture samples (one per size, or per pair of
sizes); `plan` reads them into a `Grid` (the sizes, and for each flat input
the dimension that follows each size); `Rows` reads a call's sizes from
its arguments and, above the largest bucket, runs the callable eagerly
(warning once) or raises, as asked."""
import warnings

import torch

from ._binding import Binding

OVERFLOW = ("eager", "raise")


class Buckets:
    """Capture samples of one callable at several sizes, given in place of
    its entry of `sample_args` (and, where keyword arguments change with the
    size too, of `sample_kwargs`):

        Buckets((x_64,), (x_128,), (x_256,))          # [T, H] on T
        Buckets(*[(torch.randn(B, t, H),) for t in (64, 128, 256)])    # [B, T, H] on T
        Buckets(*[(torch.randn(b, t, H),) for b in (4, 8) for t in (64, 128)])  # a grid of B and T

    Each sample is the callable's positional arguments (a tuple; a single
    tensor stands for a 1-tuple), or its keyword arguments (a dict) in
    `sample_kwargs`. The dimensions that differ between the samples are the
    dynamic ones, each following one of at most two sizes (the bucket's):
    one size makes a list of buckets, two a grid, which the samples must
    cover (every pair). Every bucket is captured; a call replays the
    smallest bucket holding its sizes on its actual data (the rest zeroed)
    and returns outputs and input grads of the actual sizes."""

    def __init__(self, *samples):
        if len(samples) < 1:
            raise ValueError("Buckets needs at least one sample")
        self.samples = tuple(s if isinstance(s, (tuple, dict)) else (s,) for s in samples)

    def __len__(self):
        return len(self.samples)

    def __repr__(self):
        return f"Buckets({len(self.samples)} samples)"


class Grid:
    """What the bucket samples of one callable say: `sizes` (ascending), and
    with a grid `sizes2` (ascending; empty without), and per flat input
    `dims[i]` = (the dimension that follows the first size, the one that
    follows the second), None where it follows none; (None, None) for an
    input of one shape."""

    __slots__ = ("sizes", "sizes2", "dims")

    def __init__(self, sizes, sizes2, dims):
        self.sizes, self.sizes2, self.dims = list(sizes), list(sizes2), list(dims)

    @property
    def dynamic(self):
        """Per flat input: whether it follows a size."""
        return [d != (None, None) for d in self.dims]

    def __repr__(self):
        return f"Grid(sizes={self.sizes}, sizes2={self.sizes2}, dims={self.dims})"


def _pairs_of(args, kwargs, where):
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
    return pairs


def _varying(where, name, ts):
    """The dimensions of tensor `name` (one per sample in `ts`) whose size
    differs between the samples; ValueError for anything else that does."""
    t0 = ts[0]
    for b, t in enumerate(ts[1:], 1):
        if t.dtype != t0.dtype or t.device != t0.device or t.requires_grad != t0.requires_grad:
            raise ValueError(
                f"{where}: {name} is {t.dtype} on {t.device}, requires_grad={t.requires_grad} in bucket sample "
                f"{b}, and {t0.dtype} on {t0.device}, requires_grad={t0.requires_grad} in bucket sample 0: only "
                "sizes change between buckets"
            )
        if t.dim() != t0.dim():
            raise ValueError(
                f"{where}: {name} has the shapes {[list(x.shape) for x in ts]} in the bucket samples: a dynamic "
                "tensor keeps its number of dimensions"
            )
    return [d for d in range(t0.dim()) if len({int(t.shape[d]) for t in ts}) > 1]


def _one_axis(seq_a, seq_b):
    """Whether two per-sample size sequences change together (equal sizes
    in one exactly where equal in the other): the same size, read twice."""
    return all((seq_a[i] == seq_a[j]) == (seq_b[i] == seq_b[j]) for i in range(len(seq_a)) for j in range(i))


def _axes(where, names, varying, shapes):
    """The sizes each sample has (one or two per sample) and per input the
    dimension following each, from the dimensions that vary."""
    axes = []  # [per-sample sizes, (name, dim) that first showed it]
    dims = []
    for i, name in enumerate(names):
        got = [None, None]
        for d in varying[i]:
            seq = tuple(int(s[i][d]) for s in shapes)
            k = next((k for k, (a, _) in enumerate(axes) if a == seq), None)
            if k is None:
                for a, (oname, od) in axes:
                    if _one_axis(a, seq):
                        raise ValueError(
                            f"{where}: {name} has {list(seq)} on dimension {d} in the bucket samples and {oname} "
                            f"{list(a)} on dimension {od}: they change together but differ; the dynamic dimensions "
                            "share the bucket's size (or, for a grid of two sizes, the samples cover every pair)"
                        )
                if len(axes) == 2:
                    raise ValueError(
                        f"{where}: {name} has {list(seq)} on dimension {d} in the bucket samples: a third size "
                        f"besides {list(axes[0][0])} and {list(axes[1][0])}; buckets vary on at most two sizes"
                    )
                axes.append((seq, (name, d)))
                k = len(axes) - 1
            if got[k] is not None:
                raise ValueError(
                    f"{where}: {name} varies on dimensions {got[k]} and {d} with the same sizes {list(seq)}: a "
                    "tensor follows each bucket size on one dimension"
                )
            got[k] = d
        dims.append(tuple(got))
    return [a for a, _ in axes], dims


def _check_pitch(where, names, dims, shape):
    """A tensor that follows both sizes holds one element in every
    dimension before the first of the two (graphed copies its data as rows
    of one pitch)."""
    for i, (d1, d2) in enumerate(dims):
        if d1 is None or d2 is None:
            continue
        first = min(d1, d2)
        if any(int(shape[i][d]) != 1 for d in range(first)):
            raise ValueError(
                f"{where}: {names[i]} (shape {list(shape[i])}) varies on dimensions {d1} and {d2} after a dimension "
                "of more than one element: its data would not be rows of one pitch; put the two first (a view), "
                "or bucket one of them"
            )


def plan(args, kwargs, where):
    """(the largest bucket's args and kwargs, its Grid) of one callable's
    sample entries, either of which may be a Buckets; (args, kwargs, None)
    when neither is. ValueError naming `where` and the argument for samples
    that do not make buckets."""
    if not isinstance(args, Buckets) and not isinstance(kwargs, Buckets):
        return args, kwargs, None
    pairs = _pairs_of(args, kwargs, where)
    n = len(pairs)
    bindings = [Binding(a, k) for a, k in pairs]
    first = bindings[0]
    for b, other in enumerate(bindings[1:], 1):
        first.check_structure(other, f"{where}: bucket sample {b}", "bucket sample 0")
    names = first.names
    varying = [_varying(where, name, [bd.samples[i] for bd in bindings]) for i, name in enumerate(names)]
    if not any(varying):
        if n == 1:
            raise ValueError(
                f"{where}: one bucket sample makes no buckets (no tensor's size changes): give the sample itself, "
                "or several"
            )
        raise ValueError(f"{where}: the bucket samples are all the same shape: no tensor's size changes")
    shapes = [[tuple(t.shape) for t in bd.samples] for bd in bindings]
    axes, dims = _axes(where, names, varying, shapes)
    per_sample = list(zip(*axes))  # per sample: its size (or pair of sizes)
    if len(set(per_sample)) != n:
        seen = {}
        for b, s in enumerate(per_sample):
            if s in seen:
                raise ValueError(
                    f"{where}: bucket samples {seen[s]} and {b} have the same size{'s' if len(s) > 1 else ''} "
                    f"{s[0] if len(s) == 1 else list(s)}"
                )
            seen[s] = b
    sizes = sorted(set(axes[0]))
    sizes2 = sorted(set(axes[1])) if len(axes) == 2 else []
    if sizes2:
        missing = [(a, b) for a in sizes for b in sizes2 if (a, b) not in set(per_sample)]
        if missing:
            who = axes_names(names, dims)
            raise ValueError(
                f"{where}: the bucket samples make a grid of {who[0]} {sizes} by {who[1]} {sizes2}, but miss the "
                f"pairs {[list(p) for p in missing]}: give a sample for every pair"
            )
    largest = max(range(n), key=lambda b: per_sample[b])
    _check_pitch(where, names, dims, shapes[largest])
    return pairs[largest][0], pairs[largest][1], Grid(sizes, sizes2, dims)


def axes_names(names, dims):
    """How messages name each size: "<input> dimension <d>" of the first
    input following it."""
    out = []
    for k in range(2):
        i = next((i for i, d in enumerate(dims) if d[k] is not None), None)
        out.append("sizes" if i is None else f"{names[i]} dimension {dims[i][k]}")
    return out


class Rows:
    """What a call of a bucketed callable checks before its replay: its
    sizes (read from its first input that follows each bucket size, on the
    dimension it follows) against the largest bucket, and what happens
    above it."""

    __slots__ = ("reads", "largest", "overflow", "name", "warned")

    def __init__(self, grid, overflow, name):
        self.reads = []  # per size: (flat input, dimension)
        for k in range(2 if grid.sizes2 else 1):
            i = next(i for i, d in enumerate(grid.dims) if d[k] is not None)
            self.reads.append((i, grid.dims[i][k]))
        self.largest = (grid.sizes[-1], grid.sizes2[-1]) if grid.sizes2 else (grid.sizes[-1],)
        self.overflow = overflow
        self.name = name
        self.warned = False

    def sizes(self, flat):
        """The call's sizes, None where an argument does not say (the
        extension then refuses it, naming it)."""
        got = []
        for i, d in self.reads:
            x = flat[i]
            if not isinstance(x, torch.Tensor) or x.dim() <= d:
                return None
            got.append(int(x.shape[d]))
        return tuple(got)

    def above(self, flat):
        """Whether the call's size is above the largest bucket (it then runs
        eagerly, having warned once, or raises ValueError)."""
        got = self.sizes(flat)
        if got is None or all(n <= m for n, m in zip(got, self.largest)):
            return False
        said = f"{got[0]} rows" if len(got) == 1 else f"sizes {list(got)}"
        largest = f"{self.largest[0]}" if len(got) == 1 else f"{list(self.largest)}"
        if self.overflow == "raise":
            raise ValueError(
                f"graphed callable '{self.name}': a call of {said}, above its largest bucket ({largest}); nothing "
                "was replayed (bucket_overflow='raise')"
            )
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"graphed callable '{self.name}': a call of {said} is above its largest bucket ({largest}): it runs "
                "eagerly (bucket_overflow='eager'; this warning is shown once per callable)",
                stacklevel=3,
            )
        return True
