"""A call whose tensors differ from the capture sample gets an error naming
the argument and both values; a module whose training flag differs from the
capture runs eagerly; calls under no_grad, on a side stream, with
Transformer Engine's per-call keywords, on a given capture stream, and after
reset."""
import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import graphed.torch as gt


def graphed_linear(**kw):
    model = torch.nn.Linear(8, 8, device="cuda")
    gt.make_graphed_callables(model, (torch.randn(4, 8, device="cuda", requires_grad=True),), **kw)
    return model


@pytest.mark.parametrize(
    "x, match",
    [
        (lambda: torch.randn(5, 8, device="cuda", requires_grad=True), "shape \\[5, 8\\]"),
        (lambda: torch.randn(4, 8, device="cuda", dtype=torch.float16, requires_grad=True), "Half"),
        (lambda: torch.randn(4, 8, requires_grad=True), "cpu"),
    ],
    ids=["shape", "dtype", "device"],
)
def test_mismatches_name_the_argument_and_both_values(x, match):
    model = graphed_linear()
    with pytest.raises(ValueError, match="argument 0 is .*" + match):
        model(x())
    model.reset()


def test_an_input_needing_a_grad_its_sample_did_not_is_refused():
    model = torch.nn.Linear(8, 8, device="cuda")
    gt.make_graphed_callables(model, (torch.randn(4, 8, device="cuda"),))
    with pytest.raises(ValueError, match="argument 0 is .*requires_grad=True; it was captured with shape \\[4, 8\\], "
                                         "Float, cuda:0, requires_grad=False"):
        model(torch.randn(4, 8, device="cuda", requires_grad=True))
    model.reset()


def test_an_input_needing_no_grad_where_its_sample_did_runs_and_drops_the_grad():
    # The common recipe: every sample requires grad, the first layer is then
    # fed data. torch and Transformer Engine run the call and drop the grad.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).cuda()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).cuda()
    model.load_state_dict(eager.state_dict())
    gt.make_graphed_callables(model, (torch.randn(4, 8, device="cuda", requires_grad=True),))
    for _ in range(3):
        x = torch.randn(4, 8, device="cuda")
        y, ye = model(x), eager(x)
        assert y.requires_grad  # the parameters need grads
        y.square().sum().backward()
        ye.square().sum().backward()
        assert x.grad is None
    torch.cuda.synchronize()
    assert torch.equal(y, ye)
    for p, pe in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, pe.grad)
    model.reset()


def test_wrong_types_and_counts():
    model = graphed_linear()
    with pytest.raises(TypeError, match="argument 0 must be a tensor, not int"):
        model(3)
    with pytest.raises(ValueError, match="takes 1 tensor inputs, got 2"):
        model(torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda"))
    model.reset()


def test_no_grad_calls_accept_any_requires_grad():
    model = graphed_linear()
    with torch.no_grad():
        y = model(torch.randn(4, 8, device="cuda"))
    assert not y.requires_grad
    model.reset()


class ModeAware(torch.nn.Module if torch is not None else object):
    def forward(self, x):
        return x * (2 if self.training else 3)


def test_training_flag_change_runs_eagerly():
    model = ModeAware().cuda()
    gt.make_graphed_callables(model, (torch.ones(2, 4, device="cuda", requires_grad=True),), allow_unused_input=True)
    x = torch.ones(2, 4, device="cuda", requires_grad=True)
    assert torch.equal(model(x), torch.full_like(x, 2))
    model.eval()
    assert torch.equal(model(x), torch.full_like(x, 3))
    model.train()
    assert torch.equal(model(x), torch.full_like(x, 2))
    model.reset()


def test_inference_capture():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8)).cuda().eval()
    ref = torch.nn.Sequential(*[m for m in model]).eval()
    x = torch.randn(4, 8, device="cuda")
    want = ref(x)
    gt.make_graphed_callables(model, (torch.randn(4, 8, device="cuda"),))
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert torch.equal(model(x).detach(), want.detach())
    model.reset()


def test_side_stream_event_and_per_call_keywords():
    torch.manual_seed(1)
    model = graphed_linear()
    ref = torch.nn.Linear(8, 8, device="cuda")
    ref.load_state_dict(model.state_dict())
    side = torch.cuda.Stream()
    for kw in ({}, {"cuda_graph_stream": side}, {"is_first_microbatch": True}):
        x = torch.randn(4, 8, device="cuda", requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        y = model(x, **kw)
        y.sum().backward()
        ref(xr).sum().backward()
        torch.cuda.synchronize()
        assert torch.equal(y, ref(xr)) and torch.equal(x.grad, xr.grad)
    event = torch.cuda.Event()
    event.record(side)
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    y = model(x, cuda_graph_stream=side, cuda_graph_event=event)
    torch.cuda.synchronize()
    assert torch.equal(y, ref(x))
    model.reset()


def test_capture_stream_and_reset_then_eager():
    stream = torch.cuda.Stream()
    model = graphed_linear(capture_stream=stream)
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    y = model(x)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.nn.functional.linear(x, model.weight, model.bias))
    model.reset()
    model.reset()  # idempotent
    assert "forward" not in model.__dict__  # the module's own forward is back
    assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))
    del y


def test_plain_callables_and_nested_outputs():
    w = torch.randn(8, 8, device="cuda", requires_grad=True)

    def f(x, pair):
        return {"y": x @ w, "z": [pair[0] * 2, pair[1] + 1]}

    sample = (torch.randn(4, 8, device="cuda", requires_grad=True),
              (torch.randn(3, device="cuda"), torch.randn(3, device="cuda")))
    g = gt.make_graphed_callables(f, sample)
    x, a, b = torch.randn(4, 8, device="cuda", requires_grad=True), torch.randn(3, device="cuda"), torch.randn(3, device="cuda")
    out = g(x, (a, b))
    assert set(out) == {"y", "z"} and torch.equal(out["z"][0], a * 2) and torch.equal(out["z"][1], b + 1)
    assert torch.equal(out["y"], x @ w)
    out["y"].sum().backward()
    assert torch.equal(x.grad, torch.ones(4, 8, device="cuda") @ w.detach().t())
    g.reset()
