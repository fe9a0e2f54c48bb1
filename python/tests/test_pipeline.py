"""Transformer Engine's interleaved pipeline scenario (2 chunks of one
layer, 3 microbatches, order 1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1),
driven as Megatron drives it: every forward output and the final weights
equal eager, with and without buffer reuse and clones; reuse takes less
memory; weight-grad steps (-c - 0.5) run delayed weight-gradient graphs."""
import copy

import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt
    from _models import assert_all_equal

TE_ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
H, B = 64, 16


def run(order, fwd, params, data, dw=None):
    """Iterations following `order`: chunk c+1's input is chunk c's output,
    detached (it arrives from another stage); a backward of chunk c takes the
    grad of that input; -c - 0.5 runs chunk c's delayed weight gradient.
    fwd[c][m] runs chunk c for microbatch m. Returns every forward output and
    the final parameters."""
    chunks = max(int(o) for o in order)
    outputs = []
    opt = torch.optim.SGD(params, lr=0.1)
    for xs, dys in data:
        opt.zero_grad(set_to_none=True)
        nf, nb, nw, link, out = [0] * chunks, [0] * chunks, [0] * chunks, {}, {}
        for o in order:
            if o > 0:
                c = o - 1
                m = nf[c]
                nf[c] += 1
                y = fwd[c][m](xs[m] if c == 0 else link[(c, m)])
                out[(c, m)] = y
                outputs.append(y.detach().clone())
                if c + 1 < chunks:
                    link[(c + 1, m)] = y.detach().requires_grad_()
            elif o != int(o):
                c = int(-o - 0.5) - 1
                dw[c][nw[c]]()
                nw[c] += 1
            else:
                c = -o - 1
                m = nb[c]
                nb[c] += 1
                out[(c, m)].backward(dys[m] if c == chunks - 1 else link[(c + 1, m)].grad)
        opt.step()
    return outputs, [p.detach().clone() for p in params]


def params_of(mods):
    return [p for m in mods for p in m.parameters()]


def dataset(dtype, iters=3, microbatches=3):
    return [
        ([torch.randn(B, H, device="cuda", dtype=dtype) for _ in range(microbatches)],
         [torch.randn(B, H, device="cuda", dtype=dtype) for _ in range(microbatches)])
        for _ in range(iters)
    ]


def samples(chunks, microbatches, dtype):
    return tuple((torch.randn(B, H, device="cuda", dtype=dtype, requires_grad=c > 0),)
                 for c in range(chunks) for _ in range(microbatches))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("clones", [True, False], ids=["clones", "aliases"])
@pytest.mark.parametrize("reuse", [False, True], ids=["no-reuse", "reuse"])
def test_interleaved_schedule_matches_eager(dtype, clones, reuse):
    dtype = getattr(torch, dtype)
    torch.manual_seed(5)
    base = [torch.nn.Linear(H, H, device="cuda", dtype=dtype) for _ in range(2)]
    data = dataset(dtype)
    eager = copy.deepcopy(base)
    want_out, want_w = run(TE_ORDER, [[eager[0]] * 3, [eager[1]] * 3], params_of(eager), data)
    mods = copy.deepcopy(base)
    g = gt.make_graphed_callables(tuple(mods), samples(2, 3, dtype), _order=TE_ORDER, allow_unused_input=True,
                                  _reuse_graph_input_output_buffers=reuse, clone_param_grads_on_return=clones)
    assert len(g) == 6
    got_out, got_w = run(TE_ORDER, [list(g[0:3]), list(g[3:6])], params_of(mods), data)
    assert len(got_out) == len(want_out)
    assert_all_equal(got_out, want_out)
    assert_all_equal(got_w, want_w)
    for c in g:
        c.reset()


def test_reuse_takes_less_memory():
    def footprint(reuse):
        torch.manual_seed(5)
        mods = [torch.nn.Linear(H, H, device="cuda") for _ in range(2)]
        s = samples(2, 3, torch.float32)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        g = gt.make_graphed_callables(tuple(mods), s, _order=TE_ORDER, _reuse_graph_input_output_buffers=reuse)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        stats = g[0].session_stats()
        for c in g:
            c.reset()
        return held, stats

    held, stats = footprint(False)
    held_reuse, stats_reuse = footprint(True)
    assert stats_reuse["static_bytes"] < stats["static_bytes"]
    assert held_reuse < held, f"PyTorch memory held by the graphs: {held_reuse} with reuse, {held} without"


WGRAD_ORDER = [1, 2, 1, 2, -2, -2.5, -1, -1.5, -2, -2.5, -1, -1.5]


@pytest.mark.parametrize("clones", [True, False], ids=["clones", "aliases"])
def test_weight_grad_steps_match_eager(clones):
    torch.manual_seed(6)
    base = [torch.nn.Linear(H, H, device="cuda") for _ in range(2)]
    data = dataset(torch.float32, microbatches=2)
    eager = copy.deepcopy(base)
    noop = [[lambda: None] * 2] * 2
    want_out, want_w = run(WGRAD_ORDER, [[eager[0]] * 2, [eager[1]] * 2], params_of(eager), data, noop)
    mods = copy.deepcopy(base)
    g = gt.make_graphed_callables(tuple(mods), samples(2, 2, torch.float32), _order=WGRAD_ORDER,
                                  _num_layers_per_chunk=[1, 1], clone_param_grads_on_return=clones)
    fwd = [list(g[0:2]), list(g[2:4])]
    dw = [[f.backward_dw for f in fwd[0]], [f.backward_dw for f in fwd[1]]]
    # backward gives input grads only; the parameter grads come from backward_dw
    got_out, got_w = run(WGRAD_ORDER, fwd, params_of(mods), data, dw)
    assert_all_equal(got_out, want_out)
    assert_all_equal(got_w, want_w)
    for c in g:
        c.reset()


@pytest.mark.parametrize("shared", [True, False], ids=["shared_pool", "own_pools"])
def test_pool_between_calls(shared):
    # Graphs sharing a pool are replayed in the order they were captured;
    # the same two calls with a pool each, for comparison.
    pool = gt.graph_pool_handle() if shared else None
    torch.manual_seed(3)
    base = [torch.nn.Linear(H, H, device="cuda") for _ in range(2)]
    eager = copy.deepcopy(base)
    mods = copy.deepcopy(base)
    a = gt.make_graphed_callables(mods[0], (torch.randn(B, H, device="cuda"),), pool=pool)
    b = gt.make_graphed_callables(mods[1], (torch.randn(B, H, device="cuda"),), pool=pool)
    for _ in range(3):
        for graphed, ref in ((a, eager[0]), (b, eager[1])):
            x = torch.randn(B, H, device="cuda")
            # A dense incoming grad: the expanded one of .sum() is read in
            # place by eager's weight-grad GEMM but copied into the graph's
            # static grad buffer (as in torch), which rounds differently.
            dy = torch.randn(B, H, device="cuda")
            graphed(x).backward(dy)
            ref(x).backward(dy)
    assert_all_equal([p.grad for p in params_of(mods)], [q.grad for q in params_of(eager)])
    a.reset()
    b.reset()
