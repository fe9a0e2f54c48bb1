"""Buckets from PyTorch: `graphed.torch.Buckets` samples, every size
captured in one memory plan, a call running the smallest bucket holding its
size. The reference is eager on the input padded with zero rows to the
bucket (and zero incoming grads on the padding): the same kernels on the
same shapes, so outputs on the actual rows and every grad equal it bit for
bit. Against eager on exactly the actual rows they agree to rounding only
(cuBLAS and the attention kernels choose by shape), which the tests measure
and bound. Models: an MLP with LayerNorm and GELU, and causal
transformer blocks in sequence-first layout (padding at the end of the
sequence is never attended by real tokens), trained with AdamW, gradient
accumulation and bf16 autocast; also the call above the largest bucket,
owned grads and strict leases across buckets, and every refusal (the pure-Python ones run
without a GPU)."""
import math
import warnings

import pytest

from _support import gpu_error, needs_torch, torch

if torch is not None:
    import torch.nn as nn
    import torch.nn.functional as F

    import graphed.torch as gt
    from _models import CausalBlock
    from graphed.torch import _buckets

pytestmark = needs_torch
needs_gpu = pytest.mark.skipif(gpu_error() is not None, reason=str(gpu_error()))

SIZES = (16, 32, 64)
WIDTH = 64


def mlp(seed=0, dtype=None):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, WIDTH)
    ).cuda().to(dtype or torch.float32)


def pad(x, rows):
    """A new tensor: `x` with zero rows appended up to `rows` (its first
    dimension)."""
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


def bucket_of(n, sizes=SIZES):
    return next(s for s in sizes if s >= n)


def grads_of(model):
    return [p.grad.clone() for p in model.parameters()]


def assert_equal(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what} {i}: max abs difference {(g.float() - w.float()).abs().max().item()}"


# ---- GPU -------------------------------------------------------------------------------------


@needs_gpu
def test_every_size_matches_eager_padded_to_its_bucket_bit_for_bit():
    model, ref, exact = mlp(), mlp(), mlp()
    samples = [(torch.randn(s, WIDTH, device="cuda", requires_grad=True),) for s in SIZES]
    graphed = gt.make_graphed_callables(model, gt.Buckets(*reversed(samples)))
    assert graphed.forward.bucket_sizes == list(SIZES), "sorted by size"
    worst = 0.0
    for n in (5, 16, 17, 40, 64, 1, 33, 12):
        x = torch.randn(n, WIDTH, device="cuda")
        gy = torch.randn(n, WIDTH, device="cuda")
        for m in (model, ref, exact):
            m.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = graphed(xg)
        assert y.shape == (n, WIDTH)
        y.backward(gy)
        b = bucket_of(n)
        xr = pad(x, b).requires_grad_()
        yr = ref(xr)
        yr.backward(pad(gy, b))
        assert torch.equal(y, yr[:n]), f"{n} rows: output"
        assert torch.equal(xg.grad, xr.grad[:n]), f"{n} rows: input grad"
        assert_equal(grads_of(model), grads_of(ref), f"{n} rows: param grad")
        # Eager of exactly n rows: to rounding.
        xe = x.clone().requires_grad_()
        exact(xe).backward(gy)
        for g, e in zip(grads_of(model) + [xg.grad], grads_of(exact) + [xe.grad]):
            worst = max(worst, ((g - e).abs().max() / e.abs().max().clamp_min(1e-12)).item())
    assert worst < 1e-4, f"against eager of exactly n rows: relative difference {worst}"
    graphed.reset()


@needs_gpu
def test_owned_grads_of_one_bucket_survive_the_next():
    model = mlp()
    graphed = gt.make_graphed_callables(model, gt.Buckets(*[(torch.randn(s, WIDTH, device="cuda"),) for s in SIZES]))
    graphed(torch.randn(10, WIDTH, device="cuda")).sum().backward()
    kept = [p.grad for p in model.parameters()]
    copies = [g.clone() for g in kept]
    for p in model.parameters():
        p.grad = None
    for n in (60, 10, 30):
        graphed(torch.randn(n, WIDTH, device="cuda")).sum().backward()
        for p in model.parameters():
            p.grad = None
    torch.cuda.synchronize()
    assert_equal(kept, copies, "a grad kept from the first call")
    graphed.reset()


@needs_gpu
def test_strict_leases_hold_each_buckets_own_outputs():
    """A bucket's outputs are its own PyTorch tensors: an output held from
    one bucket refuses that bucket's next replay (strict_leases), not
    another bucket's."""
    graphed = gt.make_graphed_callables(
        mlp(), gt.Buckets(*[(torch.randn(s, WIDTH, device="cuda"),) for s in SIZES]), strict_leases=True
    )
    with torch.no_grad():
        y = graphed(torch.randn(10, WIDTH, device="cuda"))
        graphed(torch.randn(40, WIDTH, device="cuda"))
        with pytest.raises(gt.AliasHeldError):
            graphed(torch.randn(12, WIDTH, device="cuda"))
        del y
        assert graphed(torch.randn(12, WIDTH, device="cuda")).shape == (12, WIDTH)
    graphed.reset()


@needs_gpu
@pytest.mark.parametrize("mode", ["accumulate", "aliases", "eval"])
def test_grad_policies_and_inference_in_every_bucket(mode):
    """accumulate_param_grads_into="grad" (two calls of different buckets
    add into .grad in the graphs), aliased grads (clone_param_grads_on_return
    =False), and inference (eval mode, forward only): each equal to eager
    padded to the bucket, bit for bit."""
    model, ref = mlp(), mlp()
    if mode == "eval":
        model.eval()
        ref.eval()
    opts = {"accumulate": dict(accumulate_param_grads_into="grad"),
            "aliases": dict(clone_param_grads_on_return=False), "eval": {}}[mode]
    graphed = gt.make_graphed_callables(
        model, gt.Buckets(*[(torch.randn(s, WIDTH, device="cuda"),) for s in SIZES]), **opts
    )
    sizes = (7, 50)
    xs = [torch.randn(n, WIDTH, device="cuda") for n in sizes]
    gys = [torch.randn(n, WIDTH, device="cuda") for n in sizes]
    for x, gy in zip(xs, gys):
        if mode == "aliases":
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
        b = bucket_of(x.shape[0])
        if mode == "eval":
            with torch.no_grad():
                assert torch.equal(graphed(x), ref(pad(x, b))[: x.shape[0]])
            continue
        graphed(x).backward(gy)
        ref(pad(x, b)).backward(pad(gy, b))
        if mode == "aliases":
            assert_equal(grads_of(model), grads_of(ref), f"{x.shape[0]} rows: aliased param grad")
    if mode == "accumulate":
        assert_equal(grads_of(model), grads_of(ref), "grads of two buckets added into .grad")
    graphed.reset()


def block_stack(seed, n_blocks=2):
    torch.manual_seed(seed)
    return [CausalBlock(WIDTH, 4).cuda() for _ in range(n_blocks)]


@needs_gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_causal_blocks_trained_on_variable_lengths_match_eager_padded(autocast):
    """nanoGPT-style training on variable-length batches: two causal blocks
    graphed separately over (seq, batch, hidden) with buckets of sequence
    lengths, tied input/output embeddings, AdamW, two accumulated
    microbatches per step. The reference pads each microbatch to its bucket
    (zero embeddings, loss on the actual tokens only): the same weights
    after every step, bit for bit."""
    vocab, batch, steps = 97, 4, 4
    lengths = [[9, 32], [64, 17], [40, 40], [1, 63]]

    def build(seed):
        blocks = block_stack(seed)
        torch.manual_seed(seed + 1)
        emb = nn.Embedding(vocab, WIDTH).cuda()
        params = [p for b in blocks for p in b.parameters()] + list(emb.parameters())
        return blocks, emb, torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)

    def loss_of(h, emb, tokens):
        logits = h @ emb.weight.t()  # tied embedding
        return F.cross_entropy(logits.float().reshape(-1, vocab), tokens.reshape(-1))

    g_blocks, g_emb, g_opt = build(0)
    r_blocks, r_emb, r_opt = build(0)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)) if autocast else None
    samples = [(torch.randn(t, batch, WIDTH, device="cuda", requires_grad=True),) for t in SIZES]
    with ctx() if ctx else _nothing():
        graphed = gt.make_graphed_callables(tuple(g_blocks), tuple(gt.Buckets(*samples) for _ in g_blocks))
    torch.manual_seed(5)
    data = [[torch.randint(0, vocab, (t + 1, batch), device="cuda") for t in ls] for ls in lengths]
    for step in range(steps):
        g_opt.zero_grad(set_to_none=True)
        r_opt.zero_grad(set_to_none=True)
        for seq in data[step]:
            t = seq.shape[0] - 1
            inp, tgt = seq[:-1], seq[1:]
            with ctx() if ctx else _nothing():
                h = g_emb(inp)
                for blk in graphed:
                    h = blk(h)
                loss_g = loss_of(h, g_emb, tgt) / 2
            loss_g.backward()
            b = bucket_of(t)
            with ctx() if ctx else _nothing():
                h = pad(r_emb(inp), b)  # the graph's padding rows are zero
                for blk in r_blocks:
                    h = blk(h)
                    # A graph zeroes its input's padding rows: so does the reference.
                    h = pad(h[:t], b)
                loss_r = loss_of(h[:t], r_emb, tgt) / 2
            loss_r.backward()
            assert torch.equal(loss_g, loss_r), f"step {step}, {t} tokens: loss {loss_g.item()} vs {loss_r.item()}"
        assert_equal([p.grad for b in g_blocks for p in b.parameters()],
                     [p.grad for b in r_blocks for p in b.parameters()], f"step {step}: block grad")
        assert torch.equal(g_emb.weight.grad, r_emb.weight.grad), f"step {step}: tied embedding grad"
        g_opt.step()
        r_opt.step()
    assert_equal([p for b in g_blocks for p in b.parameters()], [p for b in r_blocks for p in b.parameters()],
                 "weights after training")
    for blk in graphed:
        blk.reset()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@needs_gpu
def test_a_call_above_the_largest_bucket_runs_eagerly_or_raises():
    model = mlp()
    samples = gt.Buckets(*[(torch.randn(s, WIDTH, device="cuda"),) for s in SIZES])
    graphed = gt.make_graphed_callables(model, samples)
    x = torch.randn(100, WIDTH, device="cuda")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = graphed(x)
        graphed(x)
    above = [w for w in seen if "above its largest bucket" in str(w.message)]
    assert len(above) == 1, "warned once"
    model.forward.reset()  # back to eager to compare
    assert torch.equal(y, model(x))

    model = mlp()
    graphed = gt.make_graphed_callables(model, samples, bucket_overflow="raise")
    with pytest.raises(ValueError, match=r"a call of 65 rows, above its largest bucket \(64\)"):
        graphed(torch.randn(65, WIDTH, device="cuda"))
    with pytest.raises(ValueError, match="a call of 0 rows"):
        graphed(torch.randn(0, WIDTH, device="cuda"))
    with pytest.raises(ValueError, match=r"argument 0 is .*shape \[8, 32\]"):
        graphed(torch.randn(8, 32, device="cuda"))
    graphed.reset()


@needs_gpu
def test_dynamic_and_fixed_inputs_and_outputs():
    """Two inputs (one dynamic, one fixed), two outputs (rows, and a fixed
    summary): each keeps its shape rule; a mismatch in the dynamic inputs'
    rows is refused."""

    class TwoIn(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x, bias):
            y = self.lin(x) + bias
            return y, self.lin.weight.sum(0) * 2

    torch.manual_seed(0)
    model = TwoIn().cuda()
    bias = torch.randn(WIDTH, device="cuda")
    graphed = gt.make_graphed_callables(
        model, gt.Buckets(*[(torch.randn(s, WIDTH, device="cuda"), bias) for s in SIZES])
    )
    y, s = graphed(torch.randn(20, WIDTH, device="cuda"), bias)
    assert y.shape == (20, WIDTH) and s.shape == (WIDTH,)
    with pytest.raises(ValueError, match="argument 1 is"):
        graphed(torch.randn(20, WIDTH, device="cuda"), torch.randn(3, device="cuda"))
    graphed.reset()

    class Pair(nn.Module):
        def forward(self, a, b):
            return a + b

    g = gt.make_graphed_callables(
        Pair(), gt.Buckets(*[(torch.randn(s, 4, device="cuda"), torch.randn(s, 4, device="cuda")) for s in SIZES])
    )
    with pytest.raises(ValueError, match="argument 1 has 6 rows and argument 0 5; its dynamic inputs give the call's size together"):
        g(torch.randn(5, 4, device="cuda"), torch.randn(6, 4, device="cuda"))
    a, b = torch.randn(5, 4, device="cuda"), torch.randn(5, 4, device="cuda")
    assert torch.equal(g(a, b), a + b)
    g.reset()


@needs_gpu
def test_an_output_whose_rows_do_not_follow_the_bucket_is_refused():
    class Doubles(nn.Module):
        def forward(self, x):
            return torch.cat([x, x])

    with pytest.raises(RuntimeError, match="one dimension of an output is the bucket size, or none changes"):
        gt.make_graphed_callables(Doubles(), gt.Buckets(*[(torch.randn(s, 4, device="cuda"),) for s in SIZES]))


@needs_gpu
def test_buckets_share_one_memory_plan():
    """graphed's static memory for 3 buckets: at most 1.10x the largest
    bucket's alone (each bucket's outputs and grads are PyTorch's, one set
    per bucket, counted by the driver)."""
    samples = [(torch.randn(s, WIDTH, device="cuda"),) for s in SIZES]
    one = gt.make_graphed_callables(mlp(), samples[-1])
    many = gt.make_graphed_callables(mlp(), gt.Buckets(*samples))
    a, b = one.session_stats(), many.session_stats()
    assert b["static_bytes"] <= math.ceil(1.10 * a["static_bytes"]), (a["static_bytes"], b["static_bytes"])
    one.reset()
    many.reset()


@needs_gpu
def test_buckets_take_the_memory_of_one_shape():
    """8 buckets (32 to 256 rows) of a 4-layer MLP of width 1024 keep at
    most 1.10x the PyTorch tensors (outputs, input grads, parameter grads)
    of the largest bucket alone: every bucket's graphs write one buffer
    each, of the largest bucket's shape. The private pool holds at most
    1.10x the largest bucket's and one more set of parameter grads (a
    later bucket's capture computes its grads into tensors of its own while
    the shared ones live), rounded up to one of the pool's 20 MiB segments.
    Also the device memory the make took, both ways (cuMemGetInfo; written
    to $OUT when set, not asserted: the graph executables are the
    driver's)."""
    import os

    sizes = [32 * k for k in range(1, 9)]

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())]).cuda()

    def made(samples, rows):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        graphed = gt.make_graphed_callables(model(), samples)
        x = torch.randn(rows, 1024, device="cuda", requires_grad=True)
        graphed(x).sum().backward()
        torch.cuda.synchronize()
        taken = free - torch.cuda.mem_get_info()[0]
        mine = [s for s in gt.memory_report()["sessions"] if not s["reset"]][-1]
        figures = (mine["callables"][0]["torch_bytes"], mine["torch_pool_reserved"], taken)
        graphed.reset()
        return figures

    # One shape takes exactly its rows; the buckets take a padded call.
    one = made((torch.randn(sizes[-1], 1024, device="cuda", requires_grad=True),), sizes[-1])
    many = made(gt.Buckets(*[(torch.randn(n, 1024, device="cuda", requires_grad=True),) for n in sizes]), sizes[-1] - 5)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "buckets_memory.txt"), "a") as f:
            f.write(f"torch_bytes, pool reserved, device: one shape {one}, 8 buckets {many}, "
                    f"ratios {[round(b / a, 3) for a, b in zip(one, many)]}\n")
    assert many[0] <= 1.10 * one[0], (one, many)
    grads = sum(p.numel() * p.element_size() for p in model().parameters())
    assert many[1] <= 1.10 * one[1] + grads + (20 << 20), (one, many, grads)


# ---- without a GPU: the samples and options -----------------------------------------------------


def test_plan_reads_sizes_and_dynamic_inputs_in_order():
    x = [torch.zeros(s, 3) for s in (8, 2, 4)]
    bias = torch.zeros(3)
    args, kwargs, grid = _buckets.plan(gt.Buckets(*[(t, bias) for t in x]), {}, "sample_args[0]")
    assert grid.sizes == [2, 4, 8] and grid.sizes2 == [] and grid.dynamic == [True, False]
    assert grid.dims == [(0, None), (None, None)]
    assert args[0] is x[0] and kwargs == {}
    # Keyword samples per bucket too.
    args, kwargs, grid = _buckets.plan(
        gt.Buckets(*[(t,) for t in x]), gt.Buckets(*[{"m": torch.zeros(t.shape[0])} for t in x]), "s"
    )
    assert grid.sizes == [2, 4, 8] and grid.dynamic == [True, True]
    assert _buckets.plan((x[0],), {}, "s") == ((x[0],), {}, None)


@pytest.mark.parametrize(
    "samples, says",
    [
        (lambda: [(torch.zeros(4, 3),), (torch.zeros(8, 5),)], "change together but differ"),
        (lambda: [(torch.zeros(4, 3),), (torch.zeros(8, 3, dtype=torch.float16),)], "only sizes change"),
        (lambda: [(torch.zeros(4, 3), torch.zeros(4)), (torch.zeros(8, 3), torch.zeros(9))],
         "argument 1 has .4, 9. on dimension 0 .* argument 0 .4, 8. on dimension 0: they change together"),
        (lambda: [(torch.zeros(4, 3),), (torch.zeros(4, 3),)], "all the same shape"),
        (lambda: [(torch.zeros(4, 3),)], "one bucket sample makes no buckets"),
        (lambda: [(torch.zeros(4, 3),), ((torch.zeros(8, 3),),)], "another structure"),
        (lambda: [(torch.zeros(4, 3),), (torch.zeros(8, 3),), (torch.zeros(4, 3),)], "the same size"),
    ],
)
def test_plan_refuses_samples_that_make_no_buckets(samples, says):
    with pytest.raises(ValueError, match=says):
        _buckets.plan(gt.Buckets(*samples()), {}, "sample_args[0]")


def test_options_that_do_not_go_with_buckets_are_refused():
    b = gt.Buckets((torch.zeros(4, 3),), (torch.zeros(8, 3),))
    lin = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="bucket_overflow must be one of"):
        gt.make_graphed_callables(lin, b, bucket_overflow="pad")
    with pytest.raises(ValueError, match="pass bucket_overflow='raise'"):
        gt.make_graphed_callables(lin, b, accumulate_param_grads_into="main_grad")
    with pytest.raises(ValueError, match="cannot be given with _order"):
        gt.make_graphed_callables((lin,), (b, b), _order=[1, 1, -1, -1])
    with pytest.raises(ValueError, match="a step graph holds one shape"):
        gt.make_graphed_step([lin], nn.MSELoss(), b, torch.zeros(8, 3))
