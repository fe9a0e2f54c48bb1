"""Two ranks, one graphed.torch call each, exchanging tensors between
replays through torch.distributed: an interleaved pipeline, DDP, and
teardown (also with a rank that dies mid-step). On one GPU both ranks share
it and the gloo backend moves the tensors through host memory; on two GPUs
pass --backend nccl (each rank then takes its own device). The launcher
starts the ranks as child processes with a time limit, so nothing can hang,
then checks them against the same model run eagerly in one process.

    python3 examples/torch_extension/ranks.py pipeline [--reuse] [--aliases] [--wgrad]
    python3 examples/torch_extension/ranks.py ddp [--accumulate]
    python3 examples/torch_extension/ranks.py teardown --order group_first|graphs_first
    python3 examples/torch_extension/ranks.py pipeline --fail-rank 1

Exit status 0 when every check passed. --eager runs the ranks without
graphed (on the CPU with --device cpu): it checks the schedule itself.
"""
import argparse
import copy
import datetime
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

H, B, M, ITERS, STAGES, WORLD = 64, 16, 4, 3, 4, 2
LIMIT_S = 180


def owner(s):
    """Stage s lives on rank s % 2 as its local chunk s // 2 (interleaved:
    rank 0 holds stages 0 and 2, rank 1 stages 1 and 3)."""
    return s % WORLD


def global_order(wgrad):
    """The events (kind, stage, microbatch) in the order one process would
    run them: two microbatches in flight, then one backward for each new
    forward (1F1B), each backward through every stage; with `wgrad` each
    backward is followed by that stage's delayed weight-grad ("W")."""
    def fwd(m):
        return [("F", s, m) for s in range(STAGES)]

    def bwd(m):
        out = []
        for s in reversed(range(STAGES)):
            out.append(("B", s, m))
            if wgrad:
                out.append(("W", s, m))
        return out

    ev = fwd(0) + fwd(1)
    for m in range(2, M):
        ev += bwd(m - 2) + fwd(m)
    return ev + bwd(M - 2) + bwd(M - 1)


def local_order(rank, order):
    """A rank's `_order` for make_graphed_callables (Transformer Engine's
    form: chunk c + 1 forward, -(c + 1) backward, -(c + 1) - 0.5 weight-grad)."""
    out = []
    for kind, s, _ in order:
        if owner(s) != rank:
            continue
        c = s // WORLD + 1
        out.append(c if kind == "F" else -c if kind == "B" else -c - 0.5)
    return out


def tag(kind, s, m):
    return (0 if kind == "F" else 1) * 10000 + s * 100 + m


class Local:
    """Sends and receives inside one process (the eager reference)."""

    def __init__(self):
        self.box = {}

    def send(self, t, dst, key):
        self.box[key] = t.detach().cpu()

    def recv(self, src, key, dev):
        return self.box.pop(key).to(dev)

    def wait(self):
        pass


class Ranks:
    """Sends (asynchronous, through host memory) and blocking receives over
    the process group. Every rank posts its sends and receives in the order
    of the one global schedule, and sends never block: deadlock-free."""

    def __init__(self):
        self.pending = []

    def send(self, t, dst, key):
        host = t.detach().cpu()
        self.pending.append((dist.isend(host, dst, tag=tag(*key)), host))

    def recv(self, src, key, dev):
        host = torch.empty(B, H)
        dist.recv(host, src, tag=tag(*key))
        return host.to(dev)

    def wait(self):
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def run_schedule(rank, stages, fwd, dw, data, order, comm, dev, fail_at=None):
    """Trains the stages this rank owns (`stages`: stage -> module) over
    `data` following `order`. fwd[s][m] runs stage s for microbatch m;
    dw[s][m] its delayed weight-grad (None: backward computes it). Returns
    every forward output {(iteration, stage, microbatch): cpu tensor} and
    the stages' final parameters."""
    params = [p for s in sorted(stages) for p in stages[s].parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    outputs = {}
    events = 0
    for it, (xs, dys) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        out, inp = {}, {}
        for kind, s, m in order:
            if s not in stages:
                continue
            events += 1
            if fail_at is not None and events == fail_at:
                print(f"rank {rank}: exiting abruptly at event {events} ({kind}{s}.{m})", flush=True)
                os._exit(17)
            if kind == "F":
                x = xs[m].to(dev) if s == 0 else comm.recv(owner(s - 1), ("F", s - 1, m), dev).requires_grad_()
                inp[(s, m)] = x
                y = fwd[s][m](x)
                out[(s, m)] = y
                outputs[(it, s, m)] = y.detach().cpu()
                if s + 1 < STAGES:
                    comm.send(y, owner(s + 1), ("F", s, m))
            elif kind == "B":
                dy = dys[m].to(dev) if s == STAGES - 1 else comm.recv(owner(s + 1), ("B", s + 1, m), dev)
                out.pop((s, m)).backward(dy)
                x = inp.pop((s, m))
                if s > 0:
                    comm.send(x.grad, owner(s - 1), ("B", s, m))
            elif dw is not None:
                dw[s][m]()
        comm.wait()
        opt.step()
    return outputs, {s: [p.detach().cpu() for p in stages[s].parameters()] for s in stages}


def pipeline_rank(rank, a, dev, base, data):
    stages = {s: copy.deepcopy(base[s]).to(dev) for s in range(STAGES) if owner(s) == rank}
    order = global_order(a.wgrad)
    fwd = {s: [stages[s]] * M for s in stages}
    dw = None
    if not a.eager:
        import graphed.torch as gt

        mine = sorted(stages)
        samples = tuple((torch.randn(B, H, device=dev, requires_grad=s > 0),) for s in mine for _ in range(M))
        extra = {"_num_layers_per_chunk": [1] * len(mine)} if a.wgrad else {}
        g = gt.make_graphed_callables(tuple(stages[s] for s in mine), samples, _order=local_order(rank, order),
                                      allow_unused_input=True, _reuse_graph_input_output_buffers=a.reuse,
                                      clone_param_grads_on_return=not a.aliases, **extra)
        fwd = {s: list(g[i * M:(i + 1) * M]) for i, s in enumerate(mine)}
        if a.wgrad:
            dw = {s: [f.backward_dw for f in fwd[s]] for s in mine}
    fail_at = a.fail_event if a.fail_rank == rank else None
    got = run_schedule(rank, stages, fwd, dw, data, order, Ranks(), dev, fail_at)
    if not a.eager:
        torch.cuda.synchronize()
        for f in g:
            f.reset()
    return got


def ddp_train(dev, graphed, rank, backend, accumulate=False):
    """Three Linear + ReLU layers under DDP (small buckets: several
    all-reduces per backward), two microbatches per step, the first under
    no_sync(); each rank its own data. `accumulate`: the grads live in the
    reducer's bucket views (gradient_as_bucket_view=True) and the graphed
    layers add into them (accumulate_param_grads_into="grad")."""
    torch.manual_seed(7)
    layers = [torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.ReLU()).to(dev) for _ in range(3)]
    if graphed:
        import graphed.torch as gt

        into = "grad" if accumulate else None
        layers = [gt.make_graphed_callables(m, (torch.randn(B, H, device=dev, requires_grad=i > 0),),
                                            accumulate_param_grads_into=into)
                  for i, m in enumerate(layers)]
    ids = [dev.index] if dev.type == "cuda" and backend == "nccl" else None
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), device_ids=ids,
                                                      bucket_cap_mb=0.01, gradient_as_bucket_view=accumulate)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        x, dy = torch.randn(B, H, generator=gen).to(dev), torch.randn(B, H, generator=gen).to(dev)
        with model.no_sync():
            model(x).backward(dy)
        x, dy = torch.randn(B, H, generator=gen).to(dev), torch.randn(B, H, generator=gen).to(dev)
        model(x).backward(dy)
        opt.step()
    got = [p.detach().cpu() for p in model.parameters()] + [p.grad.cpu() for p in model.parameters()]
    if graphed:
        torch.cuda.synchronize()
        for m in layers:
            m.reset()
    return got


def teardown_rank(rank, a, dev):
    """Two cycles of: a graphed layer under DDP, one step, then the process
    group and the graphs destroyed in the order asked. Memory held after the
    second cycle must equal that after the first."""
    import gc

    import graphed.torch as gt

    def held():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated(dev)

    def cycle(first):
        if not first:
            init_group(rank, a, a.port2)  # a new store: the first cycle's went with its group
        g = gt.make_graphed_callables(torch.nn.Linear(H, H).to(dev), (torch.randn(B, H, device=dev),))
        model = torch.nn.parallel.DistributedDataParallel(g)
        model(torch.randn(B, H, device=dev)).sum().backward()
        torch.cuda.synchronize()
        if a.order == "group_first":
            dist.destroy_process_group()
            g.reset()
        else:
            g.reset()
            dist.destroy_process_group()

    cycle(True)
    before = held()
    cycle(False)
    after = held()
    if after != before:
        raise RuntimeError(f"memory held after the second cycle {after} bytes, after the first {before}")
    return {"held": after}


def init_group(rank, a, port=None):
    port = port or a.port
    dist.init_process_group(a.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))


def rank_main(rank, a, path):
    """One rank: its process group, its work, its result saved to `path`."""
    try:
        dev = torch.device("cpu") if a.device == "cpu" else torch.device(
            "cuda", rank if a.backend == "nccl" else 0)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        init_group(rank, a)
        if a.mode == "pipeline":
            base, data = torch.load(os.path.join(a.work, "inputs.pt"), weights_only=False)
            result = pipeline_rank(rank, a, dev, base, data)
        elif a.mode == "ddp":
            result = {"eager": ddp_train(dev, False, rank, a.backend, a.accumulate),
                      "graphed": ddp_train(dev, True, rank, a.backend, a.accumulate)}
        else:
            result = teardown_rank(rank, a, dev)
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.save(result, path)
    except Exception as e:  # reported to the launcher through the file and the exit status
        traceback.print_exc()
        torch.save({"error": f"{type(e).__name__}: {e}"}, path)
        sys.exit(3)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a):
    """Starts both ranks and waits for them, at most LIMIT_S seconds.
    Returns each rank's (exit code, result)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, a, os.path.join(a.work, f"rank{r}.pt"))) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + LIMIT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        raise SystemExit(f"FAILED: ranks {hung} still running after {LIMIT_S} s (killed)")
    out = []
    for r, p in enumerate(procs):
        f = os.path.join(a.work, f"rank{r}.pt")
        out.append((p.exitcode, torch.load(f, weights_only=False) if os.path.exists(f) else None))
    return out


def same(got, want):
    return len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["pipeline", "ddp", "teardown"])
    ap.add_argument("--reuse", action="store_true", help="graph input and output buffers reused")
    ap.add_argument("--aliases", action="store_true", help="parameter grads not cloned on return")
    ap.add_argument("--wgrad", action="store_true", help="delayed weight-grad passes")
    ap.add_argument("--accumulate", action="store_true",
                    help="ddp: grads added into the reducer's bucket views (gradient_as_bucket_view)")
    ap.add_argument("--order", default="group_first", choices=["group_first", "graphs_first"])
    ap.add_argument("--fail-rank", type=int, default=None, help="this rank exits abruptly mid-step")
    ap.add_argument("--fail-event", type=int, default=3, help="at its n-th event of the schedule")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--eager", action="store_true", help="ranks without graphed (checks the schedule)")
    a = ap.parse_args()
    if a.device == "cpu" and not a.eager:
        raise SystemExit("--device cpu needs --eager: graphed's graphs need a GPU")
    if a.eager and a.mode != "pipeline":
        raise SystemExit(f"--eager checks the pipeline's schedule; {a.mode} with eager ranks would compare "
                         "eager with eager")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    a.port, a.port2 = free_port(), free_port()
    what = f"{a.mode} ({a.backend}, {a.device}{', eager ranks' if a.eager else ''}"
    what += "".join(f", {k}" for k in ("reuse", "aliases", "wgrad", "accumulate") if getattr(a, k)) + ")"
    with tempfile.TemporaryDirectory() as work:
        a.work = work
        dev = torch.device(a.device)
        if a.mode == "pipeline":
            torch.manual_seed(5)
            base = [torch.nn.Linear(H, H) for _ in range(STAGES)]
            data = [([torch.randn(B, H) for _ in range(M)], [torch.randn(B, H) for _ in range(M)])
                    for _ in range(ITERS)]
            torch.save((base, data), os.path.join(work, "inputs.pt"))
        results = launch(a)
        failed = False
        if a.fail_rank is not None:
            # The failing rank exits with 17; the other must stop with an error.
            other = 1 - a.fail_rank
            code, res = results[other]
            ok = results[a.fail_rank][0] == 17 and code != 0 and res is not None and "error" in res
            print(f"{what}, rank {a.fail_rank} died mid-step: rank {other} exit status {code}, "
                  f"{res.get('error') if res else 'no result'}")
            failed = not ok
        else:
            for r, (code, res) in enumerate(results):
                if code != 0 or res is None or "error" in res:
                    print(f"rank {r}: exit status {code}: {res.get('error') if res else 'no result'}")
                    failed = True
            if not failed and a.mode == "pipeline":
                stages = {s: copy.deepcopy(base[s]).to(dev) for s in range(STAGES)}
                fwd = {s: [stages[s]] * M for s in stages}
                want_out, want_w = run_schedule(0, stages, fwd, None, data, global_order(a.wgrad), Local(), dev)
                for r, (_, (got_out, got_w)) in enumerate(results):
                    keys = sorted(got_out)
                    if not same([got_out[k] for k in keys], [want_out[k] for k in keys]):
                        print(f"rank {r}: forward outputs differ from one eager process")
                        failed = True
                    for s, ps in got_w.items():
                        if not same(ps, want_w[s]):
                            print(f"rank {r}: final weights of stage {s} differ from one eager process")
                            failed = True
                n = sum(len(res[0]) for _, res in results)
                print(f"{what}: {n} forward outputs and the weights of {STAGES} stages "
                      f"{'differ' if failed else 'equal one eager process bit for bit'}")
            elif not failed and a.mode == "ddp":
                for r, (_, res) in enumerate(results):
                    if not same(res["graphed"], res["eager"]):
                        print(f"rank {r}: DDP over graphed layers differs from eager DDP")
                        failed = True
                print(f"{what}: parameters and grads on both ranks "
                      f"{'differ' if failed else 'equal eager DDP bit for bit'}")
            elif not failed:
                print(f"{what}: both ranks tore down in order {a.order}, memory held "
                      f"{[res['held'] for _, res in results]} bytes, as after the first cycle")
    print("FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
