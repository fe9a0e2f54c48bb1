"""Keyword arguments: tensors in sample_kwargs are graphed like positional
ones, other values are fixed at capture and checked at each call
(Transformer Engine's keyword-argument scenario, with allow_unused_input)."""
import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt
    from _models import BATCH, SEQ, Attention, assert_all_equal, data, outputs_of


def mask():
    return torch.randint(2, (BATCH, 1, SEQ, SEQ), dtype=torch.bool, device="cuda")


def train(graphed):
    torch.manual_seed(11)
    model = Attention(torch.float32, unused=True)
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    if graphed:
        model = gt.make_graphed_callables(
            model,
            (data(torch.float32, ones=True),),
            sample_kwargs=dict(attention_mask=torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool, device="cuda"), scale=0.5),
            allow_unused_input=True,
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    torch.manual_seed(12)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        for _ in range(2):
            x, dy = data(torch.float32), data(torch.float32, requires_grad=False)
            y = model(x, attention_mask=mask(), scale=0.5)
            y.backward(dy)
        opt.step()
    out = outputs_of(model, y)
    if graphed:
        model.reset()
    return out, model


def test_keyword_arguments_match_eager():
    want, _ = train(False)
    got, _ = train(True)
    assert_all_equal(got, want)


def test_fixed_and_missing_keyword_arguments():
    model = Attention(torch.float32)
    m = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool, device="cuda")
    gt.make_graphed_callables(model, (data(torch.float32, ones=True),), sample_kwargs=dict(attention_mask=m, scale=0.5))
    x, m2 = data(torch.float32), mask()
    by_name = model(x, attention_mask=m2, scale=0.5).clone()
    # A keyword argument given by position, the fixed one left out: the
    # same binding, the same output.
    assert torch.equal(model(x, m2), by_name)
    with pytest.raises(ValueError, match="'scale' is 0.7; it was captured with 0.5"):
        model(x, attention_mask=mask(), scale=0.7)
    with pytest.raises(TypeError, match="missing keyword argument 'attention_mask'"):
        model(x)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['causal'\\]"):
        model(x, attention_mask=mask(), causal=True)
    with pytest.raises(ValueError, match="keyword argument 'attention_mask' is shape \\[2, 1, 32, 16\\]"):
        model(x, attention_mask=mask()[..., :16])
    model.reset()


def test_unused_parameters_get_no_grad_and_unused_inputs_need_allow_unused_input():
    model = Attention(torch.float32, unused=True)

    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, ignored):
            return self.inner(x)

    with pytest.raises(RuntimeError, match="allow_unused_input=True"):
        gt.make_graphed_callables(TwoInputs(), (data(torch.float32), data(torch.float32)))
    two = TwoInputs()
    gt.make_graphed_callables(two, (data(torch.float32), data(torch.float32)), allow_unused_input=True)
    x, ignored = data(torch.float32), data(torch.float32)
    two(x, ignored).sum().backward()
    assert x.grad is not None and ignored.grad is None
    assert model.unused.weight.grad is None and model.qkv.weight.grad is not None
    two.reset()
