"""make_graphed_step(ddp=...): the data-parallel all-reduce inside the
step's graph.

Everywhere (no torch needed): DDP's bucket plan and the comparison of the
ranks' manifests (_collectives), a mismatch named on both sides.

Where torch is installed (CPU): the bucket plan equals torch's own
(_compute_bucket_assignment_by_size); the refusals at make (ddp without
torch.distributed initialised, a gloo group, bad arguments); with two real
ranks over gloo, in child processes with a time limit: the manifests
exchanged (an all_gather of pickled bytes) and compared (equal, different, a rank
that failed), and the all-reduce itself, run eagerly on the CPU, leaving
every grad as eager DistributedDataParallel with no_sync() leaves it, bit
for bit.

On a GPU (world size 1, NCCL, as test_distributed.py): the all-reduce
captured in the step's graph; grads without an optimizer, and weights,
grads and AdamW state with one, equal eager DDP's bit for bit over 100
iterations (1 and 4 microbatches, unrolled and looped, fp32 and bf16
autocast), and with a GradScaler (fp16, forced overflows) too; the
collectives the step reports. Teardown in either order is in
test_distributed.py."""
import os
import subprocess
import sys
import textwrap

import pytest

from _support import needs_gpu, needs_torch, torch
from graphed.torch._collectives import Collective, first_difference, mismatch_message, plan_buckets
from graphed.torch._errors import CollectiveMismatchError

if torch is not None:
    import torch.distributed as dist
    import torch.nn as nn

    import graphed.torch as gt

# ---- the pure parts (no torch) ---------------------------------------------------------------


def entry(bucket, numel=256, dtype="torch.float32", params=("Linear_0.weight",), scale=1.0):
    return tuple(Collective("all_reduce", "sum", dtype, numel, numel * 4, bucket, tuple(params), scale))


def test_buckets_close_at_their_cap_the_first_cap_first():
    # 4 tensors of 600 KiB, then 2 MiB, in the order their grads are ready.
    kib = 1024
    entries = [(3, 600 * kib, "f32"), (2, 600 * kib, "f32"), (1, 600 * kib, "f32"), (0, 2048 * kib, "f32")]
    assert plan_buckets(entries, [1024 * kib, 25 * 1024 * kib]) == [
        ([3, 2], 1024 * kib),  # the first bucket closes at 1 MiB
        ([1, 0], 25 * 1024 * kib),  # the others at 25 MiB: still open at the end
    ]
    assert plan_buckets(entries, [1]) == [([3], 1), ([2], 1), ([1], 1), ([0], 1)]


def test_buckets_hold_one_dtype_each_in_the_order_their_dtype_appeared():
    entries = [(0, 8, "bf16"), (1, 8, "f32"), (2, 8, "bf16"), (3, 8, "f32"), (4, 8, "bf16")]
    assert plan_buckets(entries, [16]) == [([0, 2], 16), ([1, 3], 16), ([4], 16)]
    with pytest.raises(ValueError, match="positive byte counts"):
        plan_buckets(entries, [0])


def test_equal_manifests_have_no_difference():
    m = [entry(0), entry(1, numel=512)]
    assert first_difference([m, list(m), list(m)]) is None
    assert mismatch_message([m]) is None


def test_a_different_size_is_named_on_both_sides():
    a = [entry(0), entry(1, numel=512, params=("Linear_0.weight", "Linear_0.bias"))]
    b = [entry(0), entry(1, numel=640, params=("Linear_0.weight", "Linear_0.bias"))]
    assert first_difference([a, a, b]) == (1, 0, a[1], 2, b[1])
    msg = mismatch_message([a, a, b])
    assert "Collective 1 (they differ in numel, nbytes)" in msg
    assert "rank 0 records all_reduce (sum, each grad times 1.0) of 512 torch.float32 elements (2048 bytes)" in msg
    assert "rank 2 records all_reduce (sum, each grad times 1.0) of 640 torch.float32 elements (2560 bytes)" in msg
    assert "'Linear_0.weight', 'Linear_0.bias'" in msg
    assert "rank 0: 2, rank 1: 2, rank 2: 2" in msg


def test_a_missing_collective_is_named():
    a = [entry(0), entry(1)]
    msg = mismatch_message([a, a[:1]])
    assert "Collective 1: rank 0 records all_reduce" in msg
    assert "rank 1 records nothing there (it captured 1 collectives)" in msg


def test_long_parameter_lists_are_shortened():
    names = [f"Block_{k}.weight" for k in range(10)]
    msg = mismatch_message([[entry(0, params=names)], [entry(0, params=names, dtype="torch.bfloat16")]])
    assert "(they differ in dtype)" in msg and "and 6 more" in msg and "Block_9" not in msg


def test_check_manifests_raises_the_named_error():
    from graphed.torch._collectives import check_manifests

    check_manifests([[entry(0)], [entry(0)]])
    with pytest.raises(CollectiveMismatchError, match=r"graphed step: the ranks captured different collectives"):
        check_manifests([[entry(0)], [entry(0, scale=0.5)]])
    assert issubclass(CollectiveMismatchError, RuntimeError)


# ---- with torch, on the CPU ------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("limits", [[1024, 4096], [1 << 20], [1]])
def test_the_plan_equals_torchs_bucket_assignment(limits):
    """One dtype (torch orders leftover buckets of several dtypes by hash)."""
    torch.manual_seed(0)
    tensors = [torch.zeros(int(n)) for n in torch.randint(1, 700, (40,))]
    ready = list(reversed(range(len(tensors))))
    want, caps = dist._compute_bucket_assignment_by_size(
        [tensors[k] for k in ready], limits, [False] * len(tensors), ready
    )
    got = plan_buckets([(k, tensors[k].numel() * 4, "f32") for k in ready], limits)
    assert [b for b, _ in got] == [list(b) for b in want]
    assert [c for _, c in got] == list(caps)


def _tiny():
    return [nn.Linear(4, 4)], (lambda y, t: ((y - t) ** 2).sum()), torch.zeros(2, 4), torch.zeros(2, 4)


@needs_torch
def test_ddp_without_torch_distributed_initialised_is_refused():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    layers, loss, x, t = _tiny()
    with pytest.raises(RuntimeError, match=r"ddp=True, but torch.distributed is not initialised: call "
                                           r"init_process_group\('nccl'"):
        gt.make_graphed_step(layers, loss, x, t, ddp=True)


@needs_torch
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(ddp=3), TypeError, r"ddp must be True \(the default process group\), a torch.distributed ProcessGroup"),
        (dict(bucket_cap_mb=1), ValueError, r"bucket_cap_mb is for the data-parallel all-reduce; it needs ddp"),
    ],
)
def test_bad_ddp_arguments_are_refused(kw, exc, match):
    layers, loss, x, t = _tiny()
    with pytest.raises(exc, match=match):
        gt.make_graphed_step(layers, loss, x, t, **kw)


@pytest.fixture
def gloo_group():
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@needs_torch
@pytest.mark.parametrize("how", ["True", "group"])
def test_a_gloo_group_is_refused_the_all_reduce_belongs_outside_the_graph(gloo_group, how):
    layers, loss, x, t = _tiny()
    with pytest.raises(RuntimeError, match=r"backend is gloo, not NCCL; a CUDA graph can hold NCCL collectives only.*"
                                           r"DistributedDataParallel \(docs/distributed.md\)"):
        gt.make_graphed_step(layers, loss, x, t, ddp=True if how == "True" else gloo_group)


@needs_torch
def test_a_bad_bucket_cap_is_refused(gloo_group):
    layers, loss, x, t = _tiny()
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a positive number of MiB"):
        gt.make_graphed_step(layers, loss, x, t, ddp=True, bucket_cap_mb=0)


@needs_torch
@pytest.mark.parametrize("update", ["none", "optimizer", "optimizer+scaler"])
def test_the_all_reduce_goes_first_in_the_phase_of_the_main_graph(update):
    """Never in the apply phase of a step with a scaler (a conditional IF
    node's body, where NCCL cannot run): in its check phase, before
    unscale_; else first in the apply phase, before the optimizer."""
    from graphed.torch import _ddp

    ran = []
    step = {}
    if update != "none":
        step["update_apply"] = lambda *a: ran.append("apply")
    if update == "optimizer+scaler":
        step["update_check"] = lambda *a: ran.append("check")
    _ddp.first_in_main_graph(step, lambda *a: ran.append("all_reduce"))
    if step.get("update_check") is not None:
        step["update_check"](0, [], None, None)
    step["update_apply"](0, [], None, None)
    assert ran == {"none": ["all_reduce"], "optimizer": ["all_reduce", "apply"],
                   "optimizer+scaler": ["all_reduce", "check", "apply"]}[update]
    if update == "optimizer+scaler":
        ran.clear()
        step["update_apply"](0, [], None, None)
        assert ran == ["apply"]  # the conditional phase holds no collective


class FakeStep:
    """What _ddp.release_steps reads of a step."""

    def __init__(self, group):
        self._ddp = type("D", (), dict(group=group, device=torch.device("cpu"), released_by_group=False))()
        self.is_reset = False

    def reset(self):
        self.is_reset = True


@needs_torch
def test_destroying_a_group_resets_the_steps_holding_its_collectives_first():
    """destroy_process_group, wrapped: the steps of the group destroyed
    (all of them for the default group) are reset before it goes."""
    from graphed.torch import _ddp

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("no torch.distributed, or a process group already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sub = dist.new_group([0], backend="gloo")
        on_world, on_sub = FakeStep(dist.group.WORLD), FakeStep(sub)
        _ddp.register(on_world)
        _ddp.register(on_sub)
        wrapped = dist.destroy_process_group
        assert wrapped._graphed_original is not None
        _ddp.register(on_world)
        assert dist.destroy_process_group is wrapped  # wrapped once
        dist.destroy_process_group(sub)
        assert on_sub.is_reset and on_sub._ddp.released_by_group and not on_world.is_reset
        dist.destroy_process_group()
        assert on_world.is_reset
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Two gloo ranks on the CPU, each a child process (a rank stuck in a
# collective would hang the test; the parent kills it after the limit).
RANK = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist, torch.nn as nn
    from graphed.torch import _ddp
    from graphed.torch._collectives import Collective
    from graphed.torch._errors import CollectiveMismatchError
    mode, rank, store_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    g = dist.group.WORLD

    def entry(b, numel):
        return tuple(Collective("all_reduce", "sum", "torch.float32", numel, 4 * numel, b, ("Linear_0.weight",), 0.5))

    try:
        if mode == "equal":
            _ddp.check_exchanged(_ddp.exchange([entry(0, 64), entry(1, 32)], g), "test")
            print("agreed")
        elif mode == "differ":
            mine = [entry(0, 64), entry(1, 32 if rank == 0 else 48)]
            try:
                _ddp.check_exchanged(_ddp.exchange(mine, g), "test")
                print("no error")
            except CollectiveMismatchError as e:
                print("raised:", e)
        elif mode == "failed":
            payload = "ValueError: a capture failed" if rank == 1 else [entry(0, 64)]
            try:
                _ddp.check_exchanged(_ddp.exchange(payload, g), "test", mine_failed=rank == 1)
                print("no error")
            except CollectiveMismatchError as e:
                print("raised:", e)
        elif mode == "plan-failed":
            # Rank 1's plan fails (its parameters are not on the step's
            # device): it raises its own error, rank 0 hears of it.
            params = [("Linear_0.weight", nn.Parameter(torch.zeros(4, 4)))]
            try:
                _ddp.StepAllReduce.agreed(g, params, None, torch.device("cpu" if rank == 0 else "meta"))
                print("no error")
            except (CollectiveMismatchError, ValueError) as e:
                print("raised:", type(e).__name__, e)
        elif mode.startswith("ddp"):
            # The all-reduce run eagerly on the CPU (gloo) on grads
            # accumulated over 3 microbatches, against eager DDP with
            # no_sync() for the first 2: every grad equal bit for bit.
            cap = None if mode == "ddp" else 0.0005  # several buckets
            def model():
                torch.manual_seed(3)
                return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
            eager, mine = model(), model()
            ddp = nn.parallel.DistributedDataParallel(eager, bucket_cap_mb=cap or 25)
            torch.manual_seed(10 + rank)  # each rank its own data
            xs, ts = torch.randn(3, 4, 16), torch.randn(3, 4, 8)
            for i in range(3):
                if i < 2:
                    with ddp.no_sync():
                        ((ddp(xs[i]) - ts[i]) ** 2).mean().backward()
                else:
                    ((ddp(xs[i]) - ts[i]) ** 2).mean().backward()
                ((mine(xs[i]) - ts[i]) ** 2).mean().backward()
            params = [(f"Sequential_0.{n}", p) for n, p in mine.named_parameters()]
            ar = _ddp.StepAllReduce.agreed(g, params, cap, torch.device("cpu"))
            ar.record(0, [p.grad for _, p in params])
            same = all(torch.equal(a.grad, b.grad) for a, b in zip(mine.parameters(), eager.parameters()))
            print(f"buckets {len(ar.buckets)} equal {same} scale {ar.scale}")
    finally:
        dist.barrier()  # neither rank tears gloo down under the other
        dist.destroy_process_group()
    """
)


def two_ranks(mode, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [_src(), os.environ.get("PYTHONPATH")] if p))
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, mode, str(r), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"two gloo ranks ({mode}) ran past 120 s")
        assert p.returncode == 0, f"exit status {p.returncode}\n{out}\n{err[-3000:]}"
        outs.append(out.strip().splitlines()[-1])
    return outs


def _src():
    import graphed

    return os.path.dirname(os.path.dirname(os.path.abspath(graphed.__file__)))


@needs_torch
def test_two_ranks_with_equal_manifests_agree(tmp_path):
    assert two_ranks("equal", tmp_path) == ["agreed", "agreed"]


@needs_torch
def test_two_ranks_with_different_manifests_both_raise_naming_both_sides(tmp_path):
    for out in two_ranks("differ", tmp_path):
        assert out.startswith("raised: test: the ranks captured different collectives"), out
        assert "Collective 1 (they differ in numel, nbytes)" in out
        assert "rank 0 records all_reduce (sum, each grad times 0.5) of 32 torch.float32 elements (128 bytes)" in out
        assert "rank 1 records all_reduce (sum, each grad times 0.5) of 48 torch.float32 elements (192 bytes)" in out


@needs_torch
def test_a_rank_that_failed_to_capture_stops_the_other(tmp_path):
    r0, r1 = two_ranks("failed", tmp_path)
    assert r0 == "raised: test: rank 1 of the ddp group failed to make its step (ValueError: a capture failed); no " \
                 "rank replays it"
    assert r1 == "no error"  # the failed rank raises its own error (make_graphed_step re-raises it)


@needs_torch
def test_a_rank_whose_plan_failed_stops_the_other_before_any_all_reduce(tmp_path):
    r0, r1 = two_ranks("plan-failed", tmp_path)
    assert r0.startswith("raised: CollectiveMismatchError make_graphed_step (before capture): rank 1 of the ddp "
                         "group failed to make its step (ValueError: make_graphed_step: ddp: parameter "
                         "'Linear_0.weight' is torch.strided on cpu"), r0
    assert r1.startswith("raised: ValueError make_graphed_step: ddp: parameter 'Linear_0.weight'"), r1


@needs_torch
@pytest.mark.parametrize("mode", ["ddp", "ddp-small-buckets"])
def test_the_all_reduce_leaves_the_grads_eager_ddp_leaves(tmp_path, mode):
    outs = two_ranks(mode, tmp_path)
    for out in outs:
        assert out.endswith("equal True scale 0.5"), out
    buckets = int(outs[0].split()[1])
    assert buckets == (1 if mode == "ddp" else 3), outs[0]


# ---- on a GPU: NCCL, world size 1 -------------------------------------------------------------

WIDTH, BATCH, ITERS = 32, 8, 100


@pytest.fixture
def group():
    from test_distributed import nccl_or_skip

    nccl_or_skip()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Layer(nn.Module if torch is not None else object):
    def __init__(self, autocast=None):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.autocast = autocast

    def forward(self, x):
        with torch.autocast("cuda", dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            return torch.relu(self.lin(x)).float()


class Loss(nn.Module if torch is not None else object):
    def __init__(self, autocast=None):
        super().__init__()
        self.head = nn.Linear(WIDTH, WIDTH)
        self.autocast = autocast

    def forward(self, y, t):
        with torch.autocast("cuda", dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            out = self.head(y)
        return 0.5 * ((out.float() - t) ** 2).mean()


class Whole(nn.Module if torch is not None else object):
    """The layers and the loss as one module, for eager DDP."""

    def __init__(self, mods):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x, t):
        *layers, loss = self.mods
        for m in layers:
            x = m(x)
        return loss(x, t)


def model(autocast=None, layers=3, seed=5):
    torch.manual_seed(seed)
    return [m.cuda() for m in [*(Layer(autocast) for _ in range(layers)), Loss(autocast)]]


def params_of(mods):
    return [p for m in mods for p in m.parameters()]


def eager_ddp_step(ddp, xs, ts, n, scaler=None):
    """One eager DDP iteration's backward: microbatches 1..n-1 under no_sync()."""
    losses = []
    for i in range(n):
        if i < n - 1:
            with ddp.no_sync():
                lo = ddp(xs[i], ts[i])
                (scaler.scale(lo) if scaler else lo).backward()
        else:
            lo = ddp(xs[i], ts[i])
            (scaler.scale(lo) if scaler else lo).backward()
        losses.append(lo.detach())
    return torch.stack(losses).reshape(-1)


def count_of(it, n, loop):
    return (it % n) + 1 if loop else n


@needs_gpu
@pytest.mark.parametrize("dest", ["grad", "main_grad", "set"])
@pytest.mark.parametrize("loop", [False, True], ids=["unrolled", "looped"])
@pytest.mark.parametrize("n", [1, 4])
def test_grads_equal_eager_ddp_without_an_optimizer(group, n, loop, dest):
    """No optimizer: the step's stage is the all-reduce alone; .grad (or
    .main_grad, Megatron's; or .grad set each call, param_grads="set")
    holds what eager DDP leaves in .grad (zeroed between iterations)."""
    eager, graphed = model(), model()
    ddp = nn.parallel.DistributedDataParallel(Whole(eager))
    gen = torch.Generator(device="cuda").manual_seed(1)
    iters = 10
    xs = torch.randn(iters, n, BATCH, WIDTH, device="cuda", generator=gen)
    ts = torch.randn(iters, n, BATCH, WIDTH, device="cuda", generator=gen)
    *layers, loss = graphed
    attr = "main_grad" if dest == "main_grad" else "grad"
    if dest == "main_grad":
        for p in params_of(graphed):
            p.main_grad = torch.zeros_like(p)
    step = gt.make_graphed_step(layers, loss, (xs[0, 0],), (ts[0, 0],), microbatches=n, loop=loop, ddp=True,
                                accumulate_param_grads_into=attr, param_grads="set" if dest == "set" else "add")
    assert step.process_group is group and len(step.collectives) == 1
    for it in range(iters):
        k = count_of(it, n, loop)
        want = eager_ddp_step(ddp, xs[it], ts[it], k)
        got = step(xs[it, :k] if n > 1 or loop else xs[it, 0], ts[it, :k] if n > 1 or loop else ts[it, 0])
        assert torch.equal(got, want), f"iteration {it}: losses"
        for a, b in zip(params_of(graphed), params_of(eager)):
            assert torch.equal(getattr(a, attr), b.grad), f"iteration {it}: grads"
        for m in eager:
            m.zero_grad(set_to_none=False)
        if dest != "set":
            for p in params_of(graphed):
                getattr(p, attr).zero_()


@needs_gpu
@pytest.mark.parametrize("autocast", [None, "bf16"])
@pytest.mark.parametrize("loop", [False, True], ids=["unrolled", "looped"])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("kind", ["adamw-fused", "adamw-foreach"])
def test_weights_grads_and_adamw_state_equal_eager_ddp(group, kind, n, loop, autocast):
    """100 iterations: all-reduce, clip, AdamW, zero_grad in the graph
    against eager DDP (no_sync() for all but the last microbatch), then
    clip, AdamW (its lr a CUDA tensor: the graph's float32 device lr),
    zero_grad. Small buckets: several all-reduces per step."""
    ac = torch.bfloat16 if autocast else None
    eager, graphed = model(ac), model(ac)
    ddp = nn.parallel.DistributedDataParallel(Whole(eager), bucket_cap_mb=0.004)
    fused = kind.endswith("fused")

    def opt(params, lr):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=None if fused else True,
                                 fused=fused or None, capturable=not fused)

    e_opt, g_opt = opt(params_of(eager), torch.tensor(1e-2, device="cuda")), opt(params_of(graphed), 1e-2)
    gen = torch.Generator(device="cuda").manual_seed(11)
    xs = torch.randn(ITERS, n, BATCH, WIDTH, device="cuda", generator=gen)
    ts = torch.randn(ITERS, n, BATCH, WIDTH, device="cuda", generator=gen)
    *layers, loss = graphed
    step = gt.make_graphed_step(layers, loss, (xs[0, 0],), (ts[0, 0],), microbatches=n, loop=loop, optimizer=g_opt,
                                clip_grad_norm=1.0, ddp=group, bucket_cap_mb=0.004)
    assert len(step.collectives) > 1
    for it in range(ITERS):
        k = count_of(it, n, loop)
        want = eager_ddp_step(ddp, xs[it], ts[it], k)
        torch.nn.utils.clip_grad_norm_(params_of(eager), 1.0, foreach=True)
        e_opt.step()
        e_opt.zero_grad(set_to_none=False)
        got = step(xs[it, :k] if n > 1 or loop else xs[it, 0], ts[it, :k] if n > 1 or loop else ts[it, 0])
        assert torch.equal(got, want), f"iteration {it}: losses"
        for a, b in zip(params_of(graphed), params_of(eager)):
            assert torch.equal(a, b), f"iteration {it}: weights"
            assert torch.equal(a.grad, b.grad), f"iteration {it}: grads (zeroed)"
        for pg, pe in zip(params_of(graphed), params_of(eager)):
            sg, se = g_opt.state[pg], e_opt.state[pe]
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(sg[key], se[key]), f"iteration {it}: optimizer state {key}"


@needs_gpu
@pytest.mark.parametrize("n", [1, 2])
def test_with_a_grad_scaler_the_all_reduce_comes_before_the_unscale(group, n):
    """fp16 with a GradScaler: the all-reduce in the check phase (main
    graph), before unscale_ and the inf check; forced overflows skip
    exactly those iterations, as eager DDP + GradScaler."""
    eager, graphed = model(torch.float16), model(torch.float16)
    ddp = nn.parallel.DistributedDataParallel(Whole(eager))
    e_opt = torch.optim.AdamW(params_of(eager), lr=torch.tensor(1e-2, device="cuda"), fused=True)
    g_opt = torch.optim.AdamW(params_of(graphed), lr=1e-2, fused=True)
    e_sc = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=10)
    g_sc = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=10)
    iters = 30
    gen = torch.Generator(device="cuda").manual_seed(3)
    xs = torch.randn(iters, n, BATCH, WIDTH, device="cuda", generator=gen)
    ts = torch.randn(iters, n, BATCH, WIDTH, device="cuda", generator=gen)
    overflow = {3, 17}
    for it in overflow:
        xs[it, n - 1] *= 1e6
    *layers, loss = graphed
    step = gt.make_graphed_step(layers, loss, (xs[0, 0],), (ts[0, 0],), microbatches=n, optimizer=g_opt,
                                clip_grad_norm=1.0, grad_scaler=g_sc, ddp=True)
    skipped = []
    for it in range(iters):
        eager_ddp_step(ddp, xs[it], ts[it], n, scaler=e_sc)
        e_sc.unscale_(e_opt)
        torch.nn.utils.clip_grad_norm_(params_of(eager), 1.0, foreach=True)
        e_sc.step(e_opt)
        e_sc.update()
        e_opt.zero_grad(set_to_none=False)
        step(xs[it] if n > 1 else xs[it, 0], ts[it] if n > 1 else ts[it, 0])
        if step.skipped():
            skipped.append(it)
        assert torch.equal(g_sc._scale, e_sc._scale), f"iteration {it}: scale"
        for a, b in zip(params_of(graphed), params_of(eager)):
            assert torch.equal(a, b), f"iteration {it}: weights"
    assert set(skipped) == overflow


@needs_gpu
def test_the_step_reports_its_collectives_in_ddp_buckets(group):
    graphed = model()
    x, t = torch.randn(BATCH, WIDTH, device="cuda"), torch.randn(BATCH, WIDTH, device="cuda")
    *layers, loss = graphed
    # Each Linear: a weight of 4 KiB and a bias of 128 B; a cap of 4 KiB
    # closes a bucket at every weight, from the loss's head backwards.
    step = gt.make_graphed_step(layers, loss, (x,), (t,), ddp=True, bucket_cap_mb=4096 / 2**20)
    got = [(c.op, c.reduce, c.dtype, c.numel, c.bucket, c.params, c.scale) for c in step.collectives]
    assert got == [
        ("all_reduce", "sum", "torch.float32", WIDTH + WIDTH * WIDTH, 0, ("Loss_3.head.bias", "Loss_3.head.weight"), 1.0),
        ("all_reduce", "sum", "torch.float32", WIDTH + WIDTH * WIDTH, 1, ("Layer_2.lin.bias", "Layer_2.lin.weight"), 1.0),
        ("all_reduce", "sum", "torch.float32", WIDTH + WIDTH * WIDTH, 2, ("Layer_1.lin.bias", "Layer_1.lin.weight"), 1.0),
        ("all_reduce", "sum", "torch.float32", WIDTH + WIDTH * WIDTH, 3, ("Layer_0.lin.bias", "Layer_0.lin.weight"), 1.0),
    ]
    step(x, t)


@needs_gpu
def test_a_call_after_the_group_is_destroyed_is_refused(group):
    graphed = model()
    x, t = torch.randn(BATCH, WIDTH, device="cuda"), torch.randn(BATCH, WIDTH, device="cuda")
    *layers, loss = graphed
    step = gt.make_graphed_step(layers, loss, (x,), (t,), ddp=True)
    step(x, t)
    dist.destroy_process_group()  # resets the step first (its graph holds the group's all-reduce)
    assert step.is_reset
    with pytest.raises(RuntimeError, match=r"it was reset when its process group was destroyed"):
        step(x, t)


# ---- on two GPUs: two NCCL ranks, one per GPU -------------------------------------------------

needs_two_gpus = pytest.mark.skipif(
    torch is None or not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (NCCL: one rank per GPU)",
)

# One rank: "exact" trains the same model with the step (ddp=True, AdamW,
# clipping, 4 microbatches) and with eager DDP (no_sync() for the first 3),
# each rank its own data, and compares weights every iteration; "mismatch"
# makes rank 1's last layer wider, so the ranks' plans differ.
STEP_RANK = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist, torch.nn as nn
    import graphed.torch as gt
    from graphed.torch import CollectiveMismatchError
    mode, rank, store_path, iters = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2, device_id=dev)
    W, B, N = 64, 8, 4

    class Loss(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.head = nn.Linear(width, W)

        def forward(self, y, t):
            return 0.5 * ((self.head(y) - t) ** 2).mean()

    class Whole(nn.Module):
        def __init__(self, mods):
            super().__init__()
            self.mods = nn.ModuleList(mods)

        def forward(self, x, t):
            *layers, loss = self.mods
            for m in layers:
                x = m(x)
            return loss(x, t)

    def model(last=W):
        torch.manual_seed(5)
        return [nn.Sequential(nn.Linear(W, W), nn.ReLU()).to(dev), nn.Sequential(nn.Linear(W, last), nn.ReLU()).to(dev),
                Loss(last).to(dev)]

    def params(mods):
        return [p for m in mods for p in m.parameters()]

    try:
        if mode == "mismatch":
            mods = model(W if rank == 0 else 2 * W)
            x, t = torch.randn(B, W, device=dev), torch.randn(B, W, device=dev)
            try:
                gt.make_graphed_step(mods[:-1], mods[-1], (x,), (t,), ddp=True, bucket_cap_mb=0.01)
                print("no error")
            except CollectiveMismatchError as e:
                print("raised:", e)
        else:
            eager, graphed = model(), model()
            ddp = nn.parallel.DistributedDataParallel(Whole(eager), bucket_cap_mb=0.01)
            e_opt = torch.optim.AdamW(params(eager), lr=torch.tensor(1e-2, device=dev), fused=True)
            g_opt = torch.optim.AdamW(params(graphed), lr=1e-2, fused=True)
            gen = torch.Generator(device=dev).manual_seed(10 + rank)
            xs = torch.randn(iters, N, B, W, device=dev, generator=gen)
            ts = torch.randn(iters, N, B, W, device=dev, generator=gen)
            step = gt.make_graphed_step(graphed[:-1], graphed[-1], (xs[0, 0],), (ts[0, 0],), microbatches=N,
                                        optimizer=g_opt, clip_grad_norm=1.0, ddp=True, bucket_cap_mb=0.01)
            for it in range(iters):
                for i in range(N):
                    if i < N - 1:
                        with ddp.no_sync():
                            ddp(xs[it, i], ts[it, i]).backward()
                    else:
                        ddp(xs[it, i], ts[it, i]).backward()
                torch.nn.utils.clip_grad_norm_(params(eager), 1.0, foreach=True)
                e_opt.step()
                e_opt.zero_grad(set_to_none=False)
                step(xs[it], ts[it])
                for a, b in zip(params(graphed), params(eager)):
                    if not torch.equal(a, b):
                        sys.exit(f"rank {rank}: iteration {it}: weights differ from eager DDP")
            # The other rank's weights: the same (DDP keeps replicas equal).
            mine = torch.cat([p.detach().reshape(-1) for p in params(graphed)])
            other = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(other, mine)
            print(f"equal eager DDP over {iters} iterations; replicas equal {torch.equal(other[0], other[1])}; "
                  f"{len(step.collectives)} all-reduces")
            step.reset()
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group()
    """
)


def two_gpu_ranks(mode, tmp_path, iters=100):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join(p for p in [_src(), os.environ.get("PYTHONPATH")] if p))
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", STEP_RANK, mode, str(r), store, str(iters)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"two NCCL ranks ({mode}) ran past 300 s")
        assert p.returncode == 0, f"exit status {p.returncode}\n{out}\n{err[-3000:]}"
        outs.append(out.strip().splitlines()[-1])
    return outs


@needs_gpu
@needs_two_gpus
def test_two_nccl_ranks_equal_eager_ddp(tmp_path):
    for out in two_gpu_ranks("exact", tmp_path):
        assert out.startswith("equal eager DDP over 100 iterations; replicas equal True"), out


@needs_gpu
@needs_two_gpus
def test_two_nccl_ranks_with_different_steps_both_raise_before_capture(tmp_path):
    for out in two_gpu_ranks("mismatch", tmp_path):
        assert out.startswith("raised: make_graphed_step (before capture): the ranks captured different"), out
        assert "rank 0 records all_reduce" in out and "rank 1 records all_reduce" in out
