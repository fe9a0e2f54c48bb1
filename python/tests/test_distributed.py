"""graphed layers under torch.distributed with NCCL, on one GPU (world size
1): DistributedDataParallel over graphed layers must train exactly like DDP over
the same layers run eagerly, and the process group and the graphs can be
torn down in either order without a hang (PyTorch issue 115388) or a leak,
also when the graph is a step holding the group's all-reduce
(make_graphed_step with ddp=True; its exactness: test_step_ddp.py).
The runs with two ranks are described in docs/distributed.md."""
import os
import subprocess
import sys
import textwrap

import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import torch.distributed as dist

    import graphed.torch as gt
    from _models import assert_all_equal

H, B = 256, 32


def nccl_or_skip():
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")


@pytest.fixture
def group():
    nccl_or_skip()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield
    finally:
        dist.destroy_process_group()


def train_ddp(graphed):
    torch.manual_seed(7)
    layers = [torch.nn.Sequential(torch.nn.Linear(H, H, device="cuda"), torch.nn.ReLU()) for _ in range(3)]
    if graphed:
        layers = [
            gt.make_graphed_callables(m, (torch.randn(B, H, device="cuda", requires_grad=i > 0),))
            for i, m in enumerate(layers)
        ]
    # Small buckets: several all-reduces per backward, each started by the
    # grads the graphed backward hands to autograd.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(8)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        # Two microbatches accumulated: the first without the all-reduce.
        x, dy = torch.randn(B, H, device="cuda"), torch.randn(B, H, device="cuda")
        with model.no_sync():
            model(x).backward(dy)
        x, dy = torch.randn(B, H, device="cuda"), torch.randn(B, H, device="cuda")
        model(x).backward(dy)
        opt.step()
    out = [p.detach().clone() for p in model.parameters()] + [p.grad.clone() for p in model.parameters()]
    if graphed:
        for m in layers:
            m.reset()
    return out


def test_ddp_over_graphed_layers_matches_eager_ddp(group):
    want = train_ddp(graphed=False)
    got = train_ddp(graphed=True)
    assert_all_equal(got, want)  # parameters, then grads


TEARDOWN = textwrap.dedent(
    """
    import gc, sys, torch, torch.distributed as dist
    import graphed.torch as gt
    order = sys.argv[1]
    dev = torch.device("cuda", 0)

    def held():
        gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    def cycle():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
        layer = torch.nn.Linear(256, 256, device="cuda")
        g = gt.make_graphed_callables(layer, (torch.randn(32, 256, device="cuda"),))
        model = torch.nn.parallel.DistributedDataParallel(g)
        model(torch.randn(32, 256, device="cuda")).sum().backward()
        torch.cuda.synchronize()
        if order == "group_first":
            dist.destroy_process_group()
            g.reset()
        else:
            g.reset()
            dist.destroy_process_group()
        del model, g, layer

    cycle()  # first use: NCCL and cuBLAS initialise
    before = held()
    cycle()
    after = held()
    print("held", before, after)
    sys.exit(0 if after == before else 3)
    """
)


def run_teardown(script, order):
    nccl_or_skip()
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    try:
        r = subprocess.run([sys.executable, "-c", script, order], env=env, capture_output=True, text=True,
                           timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tearing down ({order}) hung for 120 s")
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.parametrize("order", ["group_first", "graphs_first"])
def test_teardown_in_either_order_neither_hangs_nor_leaks(order):
    run_teardown(TEARDOWN, order)


# A step whose graph holds the group's all-reduce (make_graphed_step with
# ddp=True): NCCL may not be torn down under a graph holding its
# collectives, so destroy_process_group() resets such steps first
# ("group_first"); "graphs_first" resets the step, then destroys the group;
# "dropped" drops the step (no reset) before destroying the group. Each
# order twice, the memory PyTorch holds after the second cycle equal to
# that after the first; with the group gone first, a call is refused.
# "exit" tears neither down: the process must still exit, in time.
TEARDOWN_STEP = textwrap.dedent(
    """
    import gc, sys, torch, torch.distributed as dist
    import graphed.torch as gt
    order = sys.argv[1]
    dev = torch.device("cuda", 0)

    def held():
        gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(256, 256, device="cuda")

        def forward(self, y, t):
            return ((self.head(y) - t) ** 2).mean()

    def cycle():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
        layer, loss = torch.nn.Linear(256, 256, device="cuda"), Loss()
        opt = torch.optim.AdamW([*layer.parameters(), *loss.parameters()], lr=1e-3, fused=True)
        x, t = torch.randn(32, 256, device="cuda"), torch.randn(32, 256, device="cuda")
        step = gt.make_graphed_step([layer], loss, (x,), (t,), optimizer=opt, ddp=True, bucket_cap_mb=0.1)
        for _ in range(3):
            step(x, t)
        torch.cuda.synchronize()
        if order == "group_first":
            dist.destroy_process_group()
            assert step.is_reset, "destroy_process_group left the step's graphs"
            try:
                step(x, t)
                sys.exit("a call after the group was destroyed ran")
            except RuntimeError as e:
                assert "process group was destroyed" in str(e), e
            step.reset()
        elif order == "graphs_first":
            step.reset()
            dist.destroy_process_group()
        else:
            del step
            gc.collect()
            dist.destroy_process_group()
        del layer, loss, opt

    if order == "exit":
        # Neither torn down: the interpreter's exit resets the step
        # (atexit) before torch's process groups go.
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
        layer, loss = torch.nn.Linear(256, 256, device="cuda"), Loss()
        x, t = torch.randn(32, 256, device="cuda"), torch.randn(32, 256, device="cuda")
        step = gt.make_graphed_step([layer], loss, (x,), (t,), ddp=True)
        step(x, t)
        print("exiting")
        sys.exit(0)
    cycle()  # first use: NCCL and cuBLAS initialise
    before = held()
    cycle()
    after = held()
    print("held", before, after)
    sys.exit(0 if after == before else 3)
    """
)


@pytest.mark.parametrize("order", ["group_first", "graphs_first", "dropped", "exit"])
def test_a_step_holding_the_all_reduce_tears_down_in_either_order(order):
    run_teardown(TEARDOWN_STEP, order)
