"""Buckets on another dimension than the first, and grids of two, from
PyTorch (issue 40): `graphed.torch.Buckets` reads per tensor which
dimensions vary between the samples (the time dimension of [B, T, H], the
token dimension of a packed [T, H], or a grid of batch and length), a call
reads its actual sizes from its arguments, and outputs and input grads come
back of the actual sizes (strided views of the bucket's buffer). The
reference is eager on the input padded with zeros to the bucket on every
dimension that varies (and zero incoming grads there): the same kernels on
the same shapes, so the outputs on the real positions and every grad equal
it bit for bit; eager on the actual sizes agrees to rounding. Models: a
per-token MLP, nanoGPT's CausalSelfAttention and Block from
examples/torch_extension/nanogpt.py, unchanged (causal: padding at the end
of T is never attended by a real position), a mean over T without and with
a lengths input (the masking contract of docs/c-api.md), a grid of B and T,
and nanoGPT's blocks trained with AdamW, bf16 autocast, dropout and
gradient accumulation on lengths from 1 to 256 without a recapture. The
sample reading, the grid planning and every refusal run without a GPU."""
import copy
import os
import random
import sys
import warnings

import pytest

from _support import gpu_error, needs_torch, torch

if torch is not None:
    import torch.nn as nn
    import torch.nn.functional as F

    import graphed.torch as gt
    from graphed.torch import _buckets

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch_extension"))
    import nanogpt  # noqa: E402

# The models' base class (object without torch, whose tests are skipped).
_Module = nn.Module if torch is not None else object

pytestmark = needs_torch
needs_gpu = pytest.mark.skipif(gpu_error() is not None, reason=str(gpu_error()))

B, H = 3, 64
TS = (16, 32, 64)


def pad_to(x, sizes):
    """A new tensor: `x` with zeros appended on each dimension d of
    `sizes` ({dim: size}) up to that size."""
    for d, n in sorted(sizes.items()):
        shape = list(x.shape)
        shape[d] = n - x.shape[d]
        x = torch.cat([x, x.new_zeros(shape)], d)
    return x


def bucket_of(n, sizes):
    return next(s for s in sizes if s >= n)


def grads_of(model):
    return [p.grad.clone() for p in model.parameters()]


def assert_equal(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what} {i}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        assert torch.equal(g, w), f"{what} {i}: max abs difference {(g.float() - w.float()).abs().max().item()}"


def relative(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(H, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, H)).cuda()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- GPU -------------------------------------------------------------------------------------


@needs_gpu
def test_per_token_mlp_with_buckets_on_T_matches_eager_padded_bit_for_bit():
    """[B, T, H] with buckets on T: outputs and input grads of [B, t, H]
    (views of the bucket's [B, T, H] buffer, its pitch), equal to eager on
    the input padded to the bucket bit for bit, and to eager on t to
    rounding."""
    model, ref, exact = mlp(), mlp(), mlp()
    graphed = gt.make_graphed_callables(
        model, gt.Buckets(*[(torch.randn(B, t, H, device="cuda", requires_grad=True),) for t in TS])
    )
    assert graphed.forward.bucket_sizes == list(TS) and graphed.forward.bucket_sizes2 == []
    worst = 0.0
    for t in (5, 16, 17, 40, 64, 1, 33):
        x, gy = torch.randn(B, t, H, device="cuda"), torch.randn(B, t, H, device="cuda")
        for m in (model, ref, exact):
            m.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = graphed(xg)
        assert y.shape == (B, t, H)
        b = bucket_of(t, TS)
        if t < b:
            assert y.stride() == (b * H, H, 1), "a view of the bucket's buffer"
        y.backward(gy)
        xr = pad_to(x, {1: b}).requires_grad_()
        yr = ref(xr)
        yr.backward(pad_to(gy, {1: b}))
        assert torch.equal(y, yr[:, :t]), f"T={t}: output"
        assert xg.grad.shape == (B, t, H)
        assert torch.equal(xg.grad, xr.grad[:, :t]), f"T={t}: input grad"
        assert_equal(grads_of(model), grads_of(ref), f"T={t}: param grad")
        xe = x.clone().requires_grad_()
        exact(xe).backward(gy)
        for g, e in zip(grads_of(model) + [xg.grad], grads_of(exact) + [xe.grad]):
            worst = max(worst, relative(g, e))
    assert worst < 1e-4, f"against eager of the actual T: relative difference {worst}"
    graphed.reset()


@needs_gpu
def test_tensors_of_one_callable_vary_on_different_dimensions():
    """[B, T, H] on T (dimension 1) and a packed [T, H] table on T
    (dimension 0) in one callable: both follow the bucket."""

    class AddPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = mlp()

        def forward(self, x, pos):
            return self.mlp(x + pos)

    model, ref = AddPositions(), AddPositions()
    ref.load_state_dict(model.state_dict())
    samples = [(torch.randn(B, t, H, device="cuda", requires_grad=True), torch.randn(t, H, device="cuda")) for t in TS]
    args, _, grid = _buckets.plan(gt.Buckets(*samples), {}, "sample_args[0]")
    assert grid.dims == [(1, None), (0, None)]
    graphed = gt.make_graphed_callables(model, gt.Buckets(*samples))
    for t in (7, 32, 50):
        x, pos, gy = (torch.randn(B, t, H, device="cuda"), torch.randn(t, H, device="cuda"),
                      torch.randn(B, t, H, device="cuda"))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = graphed(xg, pos)
        y.backward(gy)
        b = bucket_of(t, TS)
        xr = pad_to(x, {1: b}).requires_grad_()
        yr = ref(xr, pad_to(pos, {0: b}))
        yr.backward(pad_to(gy, {1: b}))
        assert torch.equal(y, yr[:, :t]) and torch.equal(xg.grad, xr.grad[:, :t]), f"T={t}"
        assert_equal(grads_of(model), grads_of(ref), f"T={t}: param grad")
    with pytest.raises(ValueError, match="argument 1 has 9 rows and argument 0 8"):
        graphed(torch.randn(B, 8, H, device="cuda"), torch.randn(9, H, device="cuda"))
    graphed.reset()


@needs_gpu
@pytest.mark.parametrize("layer", ["attention", "block"])
def test_causal_attention_on_T_equals_eager_padded(layer):
    """nanoGPT's CausalSelfAttention and Block (examples/torch_extension/
    nanogpt.py, unchanged; batch-first [B, T, C]) with buckets on T: causal,
    so padding at the end of T reaches no real position: outputs on the
    real positions, input grads and parameter grads equal eager padded to
    the bucket bit for bit (no mask)."""
    C, heads = 64, 4

    def build():
        torch.manual_seed(0)
        m = nanogpt.CausalSelfAttention(C, heads, 0.0) if layer == "attention" else nanogpt.Block(C, heads, 0.0)
        return m.cuda()

    model, ref = build(), build()
    graphed = gt.make_graphed_callables(
        model, gt.Buckets(*[(torch.randn(B, t, C, device="cuda", requires_grad=True),) for t in TS])
    )
    for t in (3, 16, 29, 64):
        x, gy = torch.randn(B, t, C, device="cuda"), torch.randn(B, t, C, device="cuda")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = graphed(xg)
        y.backward(gy)
        b = bucket_of(t, TS)
        xr = pad_to(x, {1: b}).requires_grad_()
        yr = ref(xr)
        yr.backward(pad_to(gy, {1: b}))
        assert torch.equal(y, yr[:, :t]), f"T={t}: output"
        assert torch.equal(xg.grad, xr.grad[:, :t]), f"T={t}: input grad"
        assert_equal(grads_of(model), grads_of(ref), f"T={t}: param grad")
    graphed.reset()


class MeanOverT(_Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return self.lin(x).mean(1)


class MeanOverLengths(_Module):
    """The mean over the real positions: the lengths ([B], each sequence's)
    are an ordinary input, and the sum runs over a mask built from them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x, lengths):
        y = self.lin(x)
        mask = (torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]).to(y.dtype)
        return (y * mask[:, :, None]).sum(1) / lengths[:, None].to(y.dtype)


@needs_gpu
def test_a_mean_over_T_sees_the_padding_unless_given_the_lengths():
    """The masking contract (docs/c-api.md, "Masking"): a mean over the
    padded dimension divides by the bucket's T, so it differs from the
    unpadded run; with the lengths passed as an input it equals the
    unpadded run (to rounding: another T, another reduction) and eager
    padded bit for bit."""
    torch.manual_seed(0)
    plain, masked = MeanOverT().cuda(), MeanOverLengths().cuda()
    masked.lin.load_state_dict(plain.lin.state_dict())
    g_plain = gt.make_graphed_callables(
        copy.deepcopy(plain), gt.Buckets(*[(torch.randn(B, t, H, device="cuda"),) for t in TS])
    )
    lengths_sample = torch.full((B,), 1, device="cuda", dtype=torch.long)
    g_masked = gt.make_graphed_callables(
        copy.deepcopy(masked), gt.Buckets(*[(torch.randn(B, t, H, device="cuda"), lengths_sample) for t in TS])
    )
    t = 20
    b = bucket_of(t, TS)
    x = torch.randn(B, t, H, device="cuda")
    lengths = torch.full((B,), t, device="cuda", dtype=torch.long)
    with torch.no_grad():
        want = plain(x)
        got_plain = g_plain(x)
        got_masked = g_masked(x, lengths)
        assert not torch.allclose(got_plain, want, atol=1e-3), "the plain mean divides by the bucket's T"
        assert torch.allclose(got_masked, want, atol=1e-5, rtol=1e-5), "the lengths mask the padding"
        assert torch.equal(got_masked, masked(pad_to(x, {1: b}), lengths)), "eager padded, bit for bit"
    g_plain.reset()
    g_masked.reset()


@needs_gpu
def test_a_grid_of_B_and_T_matches_eager_padded_bit_for_bit():
    """A grid of batch (2, 4) and length (16, 32) buckets over [B, T, H],
    with a per-sequence scale [B] that follows B only: every pair is
    captured, a call runs the smallest B and the smallest T holding its
    sizes, and outputs, input grads and parameter grads equal eager padded
    on both dimensions bit for bit."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = mlp()

        def forward(self, x, scale):
            return self.mlp(x) * scale[:, None, None]

    bs, ts = (2, 4), (16, 32)
    model, ref = Scaled(), Scaled()
    ref.load_state_dict(model.state_dict())
    samples = [(torch.randn(b, t, H, device="cuda", requires_grad=True), torch.randn(b, device="cuda"))
               for b in bs for t in ts]
    graphed = gt.make_graphed_callables(model, gt.Buckets(*samples))
    assert graphed.forward.bucket_sizes == list(bs) and graphed.forward.bucket_sizes2 == list(ts)
    before = graphed.forward.session_stats()["graph_count"]
    for nb, nt in ((1, 5), (3, 20), (4, 32), (2, 16), (4, 1)):
        x, scale, gy = (torch.randn(nb, nt, H, device="cuda"), torch.randn(nb, device="cuda"),
                        torch.randn(nb, nt, H, device="cuda"))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = graphed(xg, scale)
        assert y.shape == (nb, nt, H)
        y.backward(gy)
        bb, bt = bucket_of(nb, bs), bucket_of(nt, ts)
        xr = pad_to(x, {0: bb, 1: bt}).requires_grad_()
        yr = ref(xr, pad_to(scale, {0: bb}))
        yr.backward(pad_to(gy, {0: bb, 1: bt}))
        assert torch.equal(y, yr[:nb, :nt]), f"{nb} x {nt}: output"
        assert torch.equal(xg.grad, xr.grad[:nb, :nt]), f"{nb} x {nt}: input grad"
        assert_equal(grads_of(model), grads_of(ref), f"{nb} x {nt}: param grad")
    assert graphed.forward.session_stats()["graph_count"] == before, "no recapture"
    graphed.reset()
    strict = gt.make_graphed_callables(Scaled(), gt.Buckets(*samples), bucket_overflow="raise")
    with pytest.raises(ValueError, match=r"a call of sizes \[5, 8\], above its largest bucket \(\[4, 32\]\)"):
        strict(torch.randn(5, 8, H, device="cuda"), torch.randn(5, device="cuda"))
    with pytest.raises(ValueError, match="argument 1 has 3 rows and argument 0 2"):
        strict(torch.randn(2, 8, H, device="cuda"), torch.randn(3, device="cuda"))
    strict.forward.reset()


def gpt(dropout, seed=0):
    torch.manual_seed(seed)
    return nanogpt.GPT(vocab=128, block_size=256, n_layer=2, n_head=4, n_embd=64, dropout=dropout).cuda()


@needs_gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["dropout0", "dropout0.1"])
def test_nanogpt_blocks_trained_on_lengths_1_to_256_match_eager_padded(dropout):
    """nanoGPT's batch-first blocks (examples/torch_extension/nanogpt.py,
    unchanged), each graphed with buckets on T (32 to 256), trained with
    AdamW, bf16 autocast and two accumulated microbatches per step on
    lengths drawn from 1 to 256. The reference runs the same GPT eagerly
    on each microbatch padded to its bucket (zero positions after the
    embeddings and after each block, as the graphs' padding is; loss on
    the real positions), with the same seeds for dropout: loss, grads and
    weights equal bit for bit after every step; with dropout 0, equal to
    eager on the actual length to rounding. Nothing is captured after the
    first call."""
    sizes, batch, steps, micro = (32, 64, 128, 256), 4, 3, 2
    model, ref = gpt(dropout), gpt(dropout)
    unpadded = gpt(dropout)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)  # noqa: E731
    with autocast():
        gt.make_graphed_callables(
            tuple(model.blocks),
            tuple(gt.Buckets(*[(torch.randn(batch, t, 64, device="cuda", requires_grad=True),) for t in sizes])
                  for _ in model.blocks),
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    r_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    rng = random.Random(40)
    torch.manual_seed(1)
    data = [[torch.randint(0, 128, (batch, rng.randint(1, 256) + 1), device="cuda") for _ in range(micro)]
            for _ in range(steps)]
    data[0][0] = torch.randint(0, 128, (batch, 257), device="cuda")  # the largest bucket, full
    data[1][1] = torch.randint(0, 128, (batch, 2), device="cuda")  # one token
    stats = None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        r_opt.zero_grad(set_to_none=True)
        for m, seq in enumerate(data[step]):
            idx, tgt = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
            t = idx.shape[1]
            b = bucket_of(t, sizes)
            torch.manual_seed(1000 + 10 * step + m)
            with autocast():
                loss = model(idx, tgt) / micro
            loss.backward()
            if stats is None:
                stats = model.blocks[0].session_stats()
            torch.manual_seed(1000 + 10 * step + m)
            with autocast():
                x = pad_to(nanogpt.embed(ref, idx), {1: b})
                for blk in ref.blocks:
                    # The next graph zeroes its input's padding: so does the reference.
                    x = pad_to(blk(x)[:, :t], {1: b})
                r_loss = nanogpt.head(ref, x[:, :t], tgt) / micro
            r_loss.backward()
            assert torch.equal(loss, r_loss), f"step {step}, T={t}: loss {loss.item()} vs {r_loss.item()}"
            if step == 0 and m == 0 and dropout == 0.0:
                unpadded.load_state_dict(ref.state_dict())
                with autocast():
                    u_loss = unpadded(idx, tgt) / micro
                u_loss.backward()
                assert abs(u_loss.item() - loss.item()) <= 1e-2 * abs(u_loss.item()), (loss.item(), u_loss.item())
                for (name, p), q in zip(model.named_parameters(), unpadded.parameters()):
                    assert relative(p.grad, q.grad) < 5e-2, f"{name}: against eager on the actual length"
        assert_equal([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()], f"step {step}: grad")
        opt.step()
        r_opt.step()
        assert_equal(list(model.parameters()), list(ref.parameters()), f"step {step}: weights")
    after = model.blocks[0].session_stats()
    for key in ("graph_count", "capture_ns"):
        assert after[key] == stats[key], f"{key}: {stats[key]} after the first call, {after[key]} at the end"
    for blk in model.blocks:
        blk.reset()


# ---- without a GPU: the samples, the grid and the refusals -----------------------------------------


def test_plan_reads_the_dimension_that_varies_per_tensor():
    # [B, T, H] on T, a [T] mask on T (dimension 0), a fixed [H] bias.
    x = [torch.zeros(2, t, 4) for t in (8, 2, 4)]
    bias = torch.zeros(4)
    args, kwargs, grid = _buckets.plan(gt.Buckets(*[(t, torch.zeros(t.shape[1]), bias) for t in x]), {}, "s")
    assert grid.sizes == [2, 4, 8] and grid.sizes2 == []
    assert grid.dims == [(1, None), (0, None), (None, None)] and grid.dynamic == [True, True, False]
    assert args[0] is x[0], "the largest sample is the one warmup runs on"
    # A packed [T, H] batch: the first dimension, as before.
    _, _, grid = _buckets.plan(gt.Buckets(*[(torch.zeros(t, 4),) for t in (3, 5)]), {}, "s")
    assert grid.dims == [(0, None)] and grid.sizes == [3, 5]


def test_plan_reads_a_grid_that_the_samples_cover():
    samples = [(torch.zeros(b, t, 4), torch.zeros(b), torch.zeros(t)) for t in (16, 32, 64) for b in (4, 2)]
    args, _, grid = _buckets.plan(gt.Buckets(*samples), {}, "s")
    assert grid.sizes == [2, 4] and grid.sizes2 == [16, 32, 64]
    assert grid.dims == [(0, 1), (0, None), (None, 0)]
    assert tuple(args[0].shape) == (4, 64, 4), "the largest pair"
    # The first size is the one the first tensor shows first.
    _, _, grid = _buckets.plan(gt.Buckets(*[(torch.zeros(t, b),) for b in (1, 3) for t in (5, 7)]), {}, "s")
    assert grid.sizes == [5, 7] and grid.sizes2 == [1, 3] and grid.dims == [(0, 1)]


def test_rows_reads_a_calls_sizes_and_what_is_above():
    grid = _buckets.Grid([2, 4], [16, 32], [(0, 1), (0, None)])
    rows = _buckets.Rows(grid, "raise", "m")
    assert rows.sizes([torch.zeros(3, 20, 4), torch.zeros(3)]) == (3, 20)
    assert not rows.above([torch.zeros(4, 32, 4), torch.zeros(4)])
    with pytest.raises(ValueError, match=r"a call of sizes \[3, 33\], above its largest bucket \(\[4, 32\]\)"):
        rows.above([torch.zeros(3, 33, 4), torch.zeros(3)])
    on_t = _buckets.Rows(_buckets.Grid([8, 16], [], [(1, None)]), "eager", "m")
    assert on_t.sizes([torch.zeros(2, 9, 4)]) == (9,)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert on_t.above([torch.zeros(2, 17, 4)]) and on_t.above([torch.zeros(2, 17, 4)])
    assert len([w for w in seen if "a call of 17 rows is above its largest bucket (16)" in str(w.message)]) == 1
    assert on_t.sizes([torch.zeros(9)]) is None, "the extension refuses it, naming it"


@pytest.mark.parametrize(
    "samples, says",
    [
        # A grid missing pairs.
        (lambda: [(torch.zeros(b, t, 4),) for b, t in ((2, 8), (2, 16), (4, 8))],
         r"grid of argument 0 dimension 0 \[2, 4\] by argument 0 dimension 1 \[8, 16\], but miss the pairs \[\[4, 16\]\]"),
        # Two tensors whose sizes change together but differ.
        (lambda: [(torch.zeros(2, t, 4), torch.zeros(t + 1)) for t in (8, 16)],
         r"argument 1 has \[9, 17\] on dimension 0 in the bucket samples and argument 0 \[8, 16\] on dimension 1"),
        # A tensor on two dimensions of the same size.
        (lambda: [(torch.zeros(t, t),) for t in (8, 16)], "varies on dimensions 0 and 1 with the same sizes"),
        # A third size.
        (lambda: [(torch.zeros(b, t, c),) for b in (1, 2) for t in (3, 4) for c in (5, 6)], "a third size"),
        # Two dimensions after one of more than one element.
        (lambda: [(torch.zeros(2, b, t),) for b in (1, 2) for t in (3, 4)], "not be rows of one pitch"),
        # The same pair twice.
        (lambda: [(torch.zeros(b, t),) for b, t in ((1, 3), (1, 4), (2, 3), (2, 4), (2, 4))], r"the same sizes \[2, 4\]"),
        # Another number of dimensions.
        (lambda: [(torch.zeros(2, 8),), (torch.zeros(2, 8, 1),)], "keeps its number of dimensions"),
    ],
)
def test_plan_refuses_samples_that_make_no_grid(samples, says):
    with pytest.raises(ValueError, match=says):
        _buckets.plan(gt.Buckets(*samples()), {}, "sample_args[0]")
