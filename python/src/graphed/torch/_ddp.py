"""The data-parallel all-reduce in a step's graph (make_graphed_step's
`ddp` and `bucket_cap_mb`): after the last microbatch's backward, in the
main graph (never in the conditional node a GradScaler's apply phase runs
in: NCCL cannot run there), before clipping, unscaling and the optimizer,
each parameter's grad as eager DistributedDataParallel leaves it:

- the grads in DDP's buckets: per dtype, in the order grads become ready
  (the step's parameters last to first), a bucket closing once it holds
  its cap (1 MiB for the first, then 25 MiB, as DDP; or bucket_cap_mb);
- per bucket, as DDP's reducer: the grads copied into one flat tensor and
  multiplied by 1 / world size (skipped for one rank, where it changes no
  bit), all_reduce (sum) over the group, then copied back into the grads.

With gradient accumulation this is DDP with no_sync() for microbatches 1
to N-1: the step sums the microbatches' grads into .grad (or the
accumulate attribute) and the all-reduce runs once, on that sum.

Only NCCL groups are captured (a gloo all-reduce runs on the host). Before
the first replay every rank's manifest of the collectives it captured is
compared with every other's (_collectives); destroy_process_group() first
releases the steps whose graphs hold the group's collectives, and so does
the interpreter's exit (atexit), before torch's groups are torn down."""
import atexit
import functools
import time
import weakref

import torch

from ._collectives import Collective, check_manifests

# DDP's default bucket cap, and its first bucket's (dist._DEFAULT_FIRST_BUCKET_BYTES).
DEFAULT_BUCKET_CAP_MB = 25
_FIRST_BUCKET_BYTES = 1024 * 1024
# How long a make waits, after its eager warm-up all-reduce finished, for
# the process group's watchdog thread to drop that work: the watchdog
# queries its works' events, which a capture in CUDA's global mode (the
# step's) forbids on any thread (torch's own capture_begin waited on a
# count of pending queries for this).
_WATCHDOG_DRAIN_S = 0.3


def _dist():
    import torch.distributed as dist

    return dist


def check_bucket_cap(bucket_cap_mb, ddp):
    if bucket_cap_mb is None:
        return
    if ddp is None or ddp is False:
        raise ValueError("make_graphed_step: bucket_cap_mb is for the data-parallel all-reduce; it needs ddp=...")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"make_graphed_step: bucket_cap_mb must be a positive number of MiB, not {bucket_cap_mb!r}")


def _is_nccl(group):
    """(whether `group` runs CUDA tensors' collectives through NCCL, its
    backend's name)."""
    dist = _dist()
    name = str(dist.get_backend(group))
    try:
        backend = type(group._get_backend(torch.device("cuda"))).__name__
    except Exception:  # no backend for CUDA devices, or another layout
        backend = ""
    nccl = backend == "ProcessGroupNCCL" or name == "nccl" or "cuda:nccl" in name
    return nccl, name


def resolve_group(ddp):
    """The process group `ddp` names (None: no all-reduce in the graph), or
    an error saying why the step cannot hold its all-reduce."""
    if ddp is None or ddp is False:
        return None
    dist = _dist()
    if not dist.is_available():
        raise RuntimeError("make_graphed_step: ddp needs torch.distributed, which this torch was built without")
    if ddp is True:
        if not dist.is_initialized():
            raise RuntimeError(
                "make_graphed_step: ddp=True, but torch.distributed is not initialised: call "
                "init_process_group('nccl', ...) first (the step's graph records the all-reduce over that group)"
            )
        group = dist.distributed_c10d._get_default_group()
    elif isinstance(ddp, dist.ProcessGroup):
        group = ddp
        if not dist.is_initialized():
            raise RuntimeError("make_graphed_step: ddp names a process group, but torch.distributed is not initialised")
    else:
        raise TypeError(
            f"make_graphed_step: ddp must be True (the default process group), a torch.distributed ProcessGroup or "
            f"None, not {type(ddp).__name__}"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("make_graphed_step: this rank is not a member of the ddp process group")
    if not _alive(group):
        raise ValueError("make_graphed_step: the ddp process group was destroyed (or never registered)")
    nccl, name = _is_nccl(group)
    if not nccl:
        raise RuntimeError(
            f"make_graphed_step: ddp: the process group's backend is {name}, not NCCL; a CUDA graph can hold NCCL "
            f"collectives only ({name} runs its all-reduce on the host). Keep the all-reduce outside the graph: wrap "
            "the layers made with make_graphed_callables in DistributedDataParallel (docs/distributed.md), or make "
            "the step with an NCCL group"
        )
    return group


def _alive(group):
    dist = _dist()
    if not dist.is_initialized():
        return False
    try:
        return dist.distributed_c10d._world.pg_map.get(group) is not None
    except AttributeError:  # pragma: no cover - another layout: trust it
        return True


def exchange(payload, group):
    """Every rank's `payload` (a list of manifest entries, or an error
    string), gathered over `group`, rank by rank: pickled, the lengths
    gathered, then the bytes padded to the longest (all_gather of uint8
    tensors, on the current CUDA device for NCCL, else on the CPU; unlike
    all_gather_object, without NumPy)."""
    import pickle

    dist = _dist()
    dev = torch.device("cuda", torch.cuda.current_device()) if _is_nccl(group)[0] else torch.device("cpu")
    n = dist.get_world_size(group)
    data = pickle.dumps(payload)
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(x.item()) for x in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    return [pickle.loads(bytes(b[:k].cpu().tolist())) for b, k in zip(bufs, lengths)]


def check_exchanged(gathered, where, mine_failed=False):
    """Raises on every rank when one rank failed (its payload a string) or
    the manifests differ (_collectives.check_manifests)."""
    failed = [(r, p) for r, p in enumerate(gathered) if isinstance(p, str)]
    if failed and not mine_failed:
        r, p = failed[0]
        from ._errors import CollectiveMismatchError

        raise CollectiveMismatchError(
            f"{where}: rank {r} of the ddp group failed to make its step ({p}); no rank replays it"
        )
    if not failed:
        check_manifests([[tuple(e) for e in p] for p in gathered], where)


# The steps whose graphs hold collectives, for destroy_process_group.
_steps = weakref.WeakSet()


def register(step):
    _steps.add(step)
    _wrap_destroy()


def _at_exit():
    try:
        release_steps()
    except Exception:  # the device may already be gone at exit
        pass


def release_steps(group=None):
    """Resets every live step whose graphs hold collectives of `group`
    (None: of any group), waiting for their device work first: NCCL may
    not be torn down under a graph that holds its collectives (PyTorch
    issue 115388)."""
    for step in list(_steps):
        d = step._ddp
        if d is None or step.is_reset or (group is not None and d.group is not group):
            continue
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        d.released_by_group = True
        step.reset()


def _wrap_destroy():
    """torch.distributed.destroy_process_group, wrapped once so that the
    steps holding a group's collectives go before the group does."""
    c10d = _dist().distributed_c10d
    orig = c10d.destroy_process_group
    if getattr(orig, "_graphed_original", None) is not None:
        return
    # At exit too: the process groups left go after atexit's functions.
    atexit.register(_at_exit)

    @functools.wraps(orig)
    def destroy_process_group(group=None, *args, **kwargs):
        default = None
        try:
            default = c10d._get_default_group() if c10d.is_initialized() else None
        except Exception:
            pass
        # The default group (or None) takes every group with it.
        release_steps(None if group is None or group is default else group)
        return orig(group, *args, **kwargs)

    destroy_process_group._graphed_original = orig
    c10d.destroy_process_group = destroy_process_group
    dist = _dist()
    if getattr(dist, "destroy_process_group", None) is orig:
        dist.destroy_process_group = destroy_process_group


def first_in_main_graph(step, record):
    """Puts `record` first in the step's update (`step`: the dict the
    extension's make_step reads) in the phase captured in the main graph:
    the check phase with a grad scaler (the apply phase is then the body
    of a conditional IF node, where NCCL cannot run), else the apply phase
    (before the optimizer, or alone without one)."""
    phase = "update_check" if step.get("update_check") is not None else "update_apply"
    step[phase] = _then(record, step.get(phase))


def _then(first, second):
    """An update phase running `first`, then `second` where given."""
    if second is None:
        return first

    def phase(slot, grads, scalars, flag):
        first(slot, grads, scalars, flag)
        second(slot, grads, scalars, flag)

    return phase


class StepAllReduce:
    """The all-reduce of one step: planned and agreed between the ranks
    before capture, recorded by `record` under capture (the first phase of
    the step's update), its record compared between the ranks after."""

    def __init__(self, group, params, bucket_cap_mb, device):
        dist = _dist()
        self.group = group
        self.device = device
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.scale = 1.0 / self.world
        self.released_by_group = False
        self.names = [name for name, _ in params]
        # The parameters that take a grad, each once (a tied parameter is
        # in two callables, with one destination), in the order grads
        # become ready: the step's order reversed.
        seen, ready = set(), []
        for k in reversed(range(len(params))):
            name, p = params[k]
            if not p.requires_grad or id(p) in seen:
                continue
            if p.device != device or p.layout != torch.strided:
                raise ValueError(
                    f"make_graphed_step: ddp: parameter '{name}' is {p.layout} on {p.device}; the step's all-reduce "
                    f"takes dense parameters on {device}"
                )
            seen.add(id(p))
            ready.append(k)
        # Entries of the same parameter (tied) keep the first one the step lists.
        first = {}
        for k, (_, p) in enumerate(params):
            first.setdefault(id(p), k)
        ready = [first[id(params[k][1])] for k in ready]
        if bucket_cap_mb is None:
            first_cap = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", _FIRST_BUCKET_BYTES)
            limits = [first_cap, DEFAULT_BUCKET_CAP_MB * 1024 * 1024]
        else:
            limits = [int(bucket_cap_mb * 1024 * 1024) or 1]
        from ._collectives import plan_buckets

        entries = [(k, params[k][1].numel() * params[k][1].element_size(), str(params[k][1].dtype)) for k in ready]
        self.buckets = []  # (flat, views, step indices)
        self.manifest = []
        for b, (ks, _cap) in enumerate(plan_buckets(entries, limits)):
            ps = [params[k][1] for k in ks]
            numel = sum(p.numel() for p in ps)
            flat = torch.zeros(numel, dtype=ps[0].dtype, device=device)
            views, off = [], 0
            for p in ps:
                views.append(flat[off : off + p.numel()].view(p.shape))
                off += p.numel()
            self.buckets.append((flat, views, ks))
            self.manifest.append(self._entry(b))
        self.recorded = []

    @classmethod
    def agreed(cls, group, params, bucket_cap_mb, device, where="make_graphed_step (before capture)"):
        """The all-reduce planned and the plans compared between the ranks
        (exchange over `group`): a rank whose plan failed sends
        its error, so that every rank raises, none waits."""
        failure, made = None, None
        try:
            made = cls(group, params, bucket_cap_mb, device)
        except BaseException as e:
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            payload = failure if failure is not None else [tuple(e) for e in made.manifest]
            check_exchanged(exchange(payload, group), where, mine_failed=failure is not None)
        return made

    def _entry(self, b):
        flat, _, ks = self.buckets[b]
        return Collective(
            "all_reduce", "sum", str(flat.dtype), flat.numel(), flat.numel() * flat.element_size(), b,
            tuple(self.names[k] for k in ks), self.scale,
        )

    @property
    def nbytes(self):
        return sum(f.numel() * f.element_size() for f, _, _ in self.buckets)

    def warm_up(self):
        """The all-reduce once, eagerly, on the buckets (the grads
        untouched): NCCL's communicator made and its kernels loaded, so the
        capture does neither; then the watchdog given time to drop the work."""
        dist = _dist()
        works = []
        for flat, views, _ in self.buckets:
            torch._foreach_copy_(views, [torch.zeros_like(v) for v in views])
            if self.world > 1:
                flat.mul_(self.scale)
            works.append(dist.all_reduce(flat, group=self.group, async_op=True))
        for (flat, views, _), w in zip(self.buckets, works):
            w.wait()
            torch._foreach_copy_([torch.empty_like(v) for v in views], views)
            flat.zero_()
        torch.cuda.synchronize(self.device)
        time.sleep(_WATCHDOG_DRAIN_S)

    def record(self, slot, grads, scalars=None, flag=None):
        """Under the step's capture (its update's first phase): each
        bucket's grads copied in and scaled, its all-reduce, the grads
        copied back; each all-reduce noted in `recorded`."""
        if slot != 0:
            raise RuntimeError(f"make_graphed_step: ddp: an update captured for clone slot {slot}; the step has one graph")
        dist = _dist()
        works = []
        for b, (flat, views, ks) in enumerate(self.buckets):
            srcs = [grads[k] for k in ks]
            for k, g in zip(ks, srcs):
                if g is None:
                    raise RuntimeError(f"make_graphed_step: ddp: parameter '{self.names[k]}' has no grad in the step")
            torch._foreach_copy_(views, srcs)
            if self.world > 1:
                flat.mul_(self.scale)
            works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            self.recorded.append(self._entry(b))
        for (flat, views, ks), w in zip(self.buckets, works):
            w.wait()
            torch._foreach_copy_([grads[k] for k in ks], views)

    def verify(self, failure=None, where="make_graphed_step"):
        """After capture (or its failure, `failure` its message): the
        ranks' records exchanged and compared, so that every rank raises
        alike, before any replay."""
        mine = failure if failure is not None else [tuple(e) for e in self.recorded]
        gathered = exchange(mine, self.group)
        check_exchanged(gathered, where, mine_failed=failure is not None)
        if failure is None and [tuple(e) for e in self.recorded] != [tuple(e) for e in self.manifest]:
            raise RuntimeError(
                f"{where}: ddp: the capture recorded {len(self.recorded)} all-reduces where {len(self.manifest)} "
                "were planned (the update ran more than once?)"
            )

    def alive(self):
        return _alive(self.group)
