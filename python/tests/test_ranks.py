"""Two ranks, each with its own make_graphed_callables call, through
torch.distributed (examples/torch_extension/ranks.py, gloo on one GPU):
an interleaved pipeline (with and without buffer reuse, clones and delayed
weight-grads) and DDP equal to the same model run eagerly, bit for bit;
teardown in either order without a hang or a leak; a rank dying mid-step
makes the other fail with an error, not a hang. Each run is a pair of
child processes with a time limit. The schedule alone (eager ranks on the
CPU) runs wherever torch is installed."""
import os
import subprocess
import sys

import pytest

from _support import needs_gpu, needs_torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch_extension", "ranks.py")


def ranks(*args):
    try:
        r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks.py {' '.join(args)} ran past 300 s (its own limit is 180 s)")
    lines = r.stdout.strip().splitlines()
    if os.environ.get("OUT"):  # the GPU run's log folder: the summaries go into its record
        with open(os.path.join(os.environ["OUT"], "ranks.log"), "a") as f:
            f.write("\n".join(lines[-2:]) + "\n")
    assert r.returncode == 0 and lines and lines[-1] == "ok", f"{r.stdout}\n{r.stderr[-4000:]}"
    return lines


@needs_torch
@pytest.mark.parametrize("args", [["pipeline"], ["pipeline", "--wgrad"]], ids=" ".join)
def test_the_schedule_itself_with_eager_ranks_on_the_cpu(args):
    ranks(*args, "--device", "cpu", "--eager")


@needs_torch
def test_a_rank_dying_mid_step_is_an_error_on_the_other_cpu():
    out = ranks("pipeline", "--device", "cpu", "--eager", "--fail-rank", "1")
    assert "rank 1 died mid-step: rank 0 exit status 3" in out[-2]


@needs_gpu
@pytest.mark.parametrize("args", [[], ["--reuse"], ["--reuse", "--aliases"], ["--aliases"], ["--wgrad"]],
                         ids=lambda a: " ".join(a) or "default")
def test_interleaved_pipeline_over_two_ranks_matches_one_eager_process(args):
    out = ranks("pipeline", *args)
    assert "equal one eager process bit for bit" in out[-2]


@needs_gpu
@pytest.mark.parametrize("args", [[], ["--accumulate"]], ids=lambda a: " ".join(a) or "owned grads")
def test_ddp_over_two_ranks_matches_eager_ddp(args):
    out = ranks("ddp", *args)
    assert "equal eager DDP bit for bit" in out[-2]


@needs_gpu
@pytest.mark.parametrize("order", ["group_first", "graphs_first"])
def test_teardown_on_two_ranks_in_either_order(order):
    out = ranks("teardown", "--order", order)
    assert "as after the first cycle" in out[-2]


@needs_gpu
@pytest.mark.parametrize("rank,event", [(1, 3), (0, 5)])
def test_a_rank_dying_mid_step_is_an_error_on_the_other(rank, event):
    out = ranks("pipeline", "--fail-rank", str(rank), "--fail-event", str(event))
    assert f"rank {rank} died mid-step: rank {1 - rank} exit status 3" in out[-2]
