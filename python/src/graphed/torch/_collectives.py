"""The collectives a step's graph records (make_graphed_step's `ddp`), as
plain data: DDP's bucket plan for the grads, each rank's manifest of what
it captured, and the comparison of the ranks' manifests that must pass
before the first replay. Pure Python (no torch), so that it is tested
anywhere; the exchange itself (an all_gather of pickled bytes) is `_ddp.exchange`.

A replay runs the collectives its graph holds, in the order captured, with
no host in the loop: ranks whose graphs hold different collectives (another
count, size, dtype, order) would hang in NCCL or sum unrelated grads. So
every rank sends its manifest to every other after capture, and a
difference is an error on every rank, naming the first differing entry
and what each side recorded there."""
from collections import namedtuple

from ._errors import CollectiveMismatchError

# One captured collective. op: "all_reduce"; reduce: "sum"; dtype: the
# tensor's dtype as torch prints it ("torch.float32"); numel and nbytes: its
# elements and bytes; bucket: the bucket's index (the order of the
# all-reduces); params: the qualified names of the parameters whose grads
# the bucket holds, in the bucket's order; scale: what each grad is
# multiplied by before the sum (1 / world size, as DDP divides).
Collective = namedtuple("Collective", "op reduce dtype numel nbytes bucket params scale")

# How many parameter names a message lists for one collective.
_NAMES_SHOWN = 4


def plan_buckets(entries, limits):
    """DDP's bucket assignment (torch's _compute_bucket_assignment_by_size
    with tensor indices, as DDP's reducer rebuilds its buckets in the order
    grads become ready): `entries` are (index, nbytes, key) in that order,
    key any hashable value naming the tensor's dtype and device; `limits`
    the bucket size caps in bytes, the first for each key's first bucket
    (DDP: 1 MiB, then bucket_cap_mb), the last repeated. A bucket closes
    when it holds at least its cap; open buckets follow, in the order their
    key first appeared. Returns [(indices, cap)] in all-reduce order."""
    limits = [int(x) for x in limits]
    if not limits or any(x <= 0 for x in limits):
        raise ValueError(f"bucket size limits must be positive byte counts, not {limits!r}")
    open_ = {}  # key -> [indices, bytes, cap]; insertion order = first appearance
    at = {}  # key -> which limit its next bucket takes
    out = []
    for index, nbytes, key in entries:
        if key not in open_:
            open_[key] = [[], 0, None]
            at.setdefault(key, 0)
        b = open_[key]
        b[0].append(index)
        b[1] += int(nbytes)
        b[2] = limits[at[key]]
        if b[1] >= b[2]:
            out.append((b[0], b[2]))
            del open_[key]
            at[key] = min(at[key] + 1, len(limits) - 1)
    out += [(b[0], b[2]) for b in open_.values() if b[0]]
    return out


def describe(entry):
    """One manifest entry in words."""
    if entry is None:
        return "nothing"
    c = Collective(*entry)
    names = list(c.params)
    shown = ", ".join(repr(n) for n in names[:_NAMES_SHOWN])
    if len(names) > _NAMES_SHOWN:
        shown += f" and {len(names) - _NAMES_SHOWN} more"
    return (
        f"{c.op} ({c.reduce}, each grad times {c.scale!r}) of {c.numel} {c.dtype} elements ({c.nbytes} bytes), "
        f"bucket {c.bucket} of {len(names)} parameter grad{'s' if len(names) != 1 else ''}: {shown}"
    )


def first_difference(manifests):
    """The first place where the ranks' manifests (`manifests[r]`: rank r's
    list of entries, in capture order) differ: (position, rank a, its entry
    or None, rank b, its entry or None), rank a being rank 0 or the lowest
    rank that differs from it there; None when all are equal."""
    manifests = [[tuple(e) for e in m] for m in manifests]
    if len(manifests) < 2:
        return None
    longest = max(len(m) for m in manifests)
    for i in range(longest):
        ref = manifests[0][i] if i < len(manifests[0]) else None
        for r in range(1, len(manifests)):
            mine = manifests[r][i] if i < len(manifests[r]) else None
            if mine != ref:
                return i, 0, ref, r, mine
    return None


def mismatch_message(manifests, where="graphed step"):
    """The error message for the ranks' manifests, or None if they agree."""
    d = first_difference(manifests)
    if d is None:
        return None
    i, a, ea, b, eb = d
    counts = ", ".join(f"rank {r}: {len(m)}" for r, m in enumerate(manifests))

    def side(rank, entry):
        if entry is None:
            return f"rank {rank} records nothing there (it captured {len(manifests[rank])} collectives)"
        return f"rank {rank} records {describe(entry)}"

    what = ""
    if ea is not None and eb is not None:
        fields = [f for f, x, y in zip(Collective._fields, ea, eb) if x != y]
        what = f" (they differ in {', '.join(fields)})"
    return (
        f"{where}: the ranks captured different collectives, which a replay would run without a check (a hang in "
        f"NCCL, or grads summed with unrelated ones); nothing was replayed. Collective {i}{what}: {side(a, ea)}; "
        f"{side(b, eb)}. Collectives captured per rank: {counts}. Every rank must make the same step: the same "
        "layers with parameters of the same shapes and dtypes in the same order, the same bucket_cap_mb"
    )


def check_manifests(manifests, where="graphed step"):
    """Raises CollectiveMismatchError naming the first difference between
    the ranks' manifests (`manifests[r]` rank r's), on every rank alike."""
    msg = mismatch_message(manifests, where)
    if msg is not None:
        raise CollectiveMismatchError(msg)
