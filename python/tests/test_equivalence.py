"""Graphed training is bit-identical to eager: Transformer Engine's
make_graphed_callables scenarios with plain torch modules (linear, layernorm
+ linear, MLP with and without activation checkpointing, multi-head
attention, a transformer encoder layer, scaled-dot-product attention), in
fp32, fp16 and bf16, the whole model graphed as one callable and layer by
layer, with grad buffers kept across steps and two accumulated microbatches."""
import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt
    from _models import BATCH, HEAD_DIM, HEADS, HIDDEN, SDPA, SEQ, assert_all_equal, data, make_layer, outputs_of

KINDS = ["linear", "layernorm_linear", "layernorm_mlp", "layernorm_mlp_checkpoint", "mha", "transformer", "attention"]
DTYPES = ["float32", "float16", "bfloat16"]  # names, so that collection needs no torch


def train(kind, dtype, mode, layers=3):
    torch.manual_seed(1234)
    modules = [make_layer(kind, dtype) for _ in range(layers)]
    for m in modules:
        for p in m.parameters():
            p.grad = torch.empty_like(p)
    if mode == "full":
        model = gt.make_graphed_callables(torch.nn.Sequential(*modules), (data(dtype, ones=True),), num_warmup_iters=10)
    elif mode == "individual":
        model = torch.nn.Sequential(
            *[gt.make_graphed_callables(m, (data(dtype, ones=True),), num_warmup_iters=10) for m in modules]
        )
    else:
        model = torch.nn.Sequential(*modules)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    torch.manual_seed(99)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        for _ in range(2):
            x, dy = data(dtype), data(dtype, requires_grad=False)
            y = model(x)
            y.backward(dy)
        opt.step()
    out = outputs_of(model, y)
    if mode == "full":
        model.reset()
    elif mode == "individual":
        for m in model:
            m.reset()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_graphed_training_matches_eager(kind, dtype):
    dtype = getattr(torch, dtype)
    eager = train(kind, dtype, "eager")
    assert_all_equal(train(kind, dtype, "full"), eager)
    assert_all_equal(train(kind, dtype, "individual"), eager)


def qkv(dtype, ones=False):
    make = torch.ones if ones else torch.randn
    return [make(BATCH, HEADS, SEQ, HEAD_DIM, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


def attention(dtype, graphed):
    torch.manual_seed(5)
    model = SDPA()
    if graphed:
        model = gt.make_graphed_callables(model, tuple(qkv(dtype, ones=True)), num_warmup_iters=10)
    for _ in range(3):
        inputs = qkv(dtype)
        y = model(*inputs)
        y.backward(torch.randn_like(y))
    out = [y.detach().clone()] + [i.grad.clone() for i in inputs]
    if graphed:
        model.reset()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_dot_product_attention_matches_eager(dtype):
    dtype = getattr(torch, dtype)
    assert_all_equal(attention(dtype, True), attention(dtype, False))


class Transposed(torch.nn.Module if torch is not None else object):
    """A linear layer whose output is a transposed (dense, not contiguous) view."""

    def __init__(self, dtype):
        super().__init__()
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=dtype)

    def forward(self, x):
        return self.fc(x).transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_keep_the_layout_eager_gives_them(dtype):
    # An output's strides are eager's, so *_like (here the grad drawn with
    # randn_like) and strided consumers see the same tensor.
    dtype = getattr(torch, dtype)

    def run(graphed):
        torch.manual_seed(11)
        model = Transposed(dtype)
        if graphed:
            model = gt.make_graphed_callables(model, (data(dtype, ones=True),), num_warmup_iters=3)
        for _ in range(2):
            x = data(dtype)
            y = model(x)
            y.backward(torch.randn_like(y))
        out = [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        strides = y.stride()
        if graphed:
            model.reset()
        return out, strides

    (got, got_strides), (want, want_strides) = run(True), run(False)
    assert got_strides == want_strides
    assert_all_equal(got, want)
