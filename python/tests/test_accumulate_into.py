"""accumulate_param_grads_into: the backward graph adds each parameter's
grad into a tensor the parameter holds (`.grad`, Megatron's `main_grad`),
graphed's GRAPHED_GRAD_POLICY_ACCUMULATE_INTO, and autograd gets none.
Gradient accumulation over microbatches with AdamW through nanoGPT blocks
(dropout, fp32 and bf16) equals eager accumulation bit for bit, with the
same `.grad` tensors kept from step to step; `main_grad` the same; DDP with
gradient_as_bucket_view=True gets the grads in its bucket views; delayed
weight-grad passes of a pipeline schedule accumulate too. Refused with a
message: an attribute that is None or not a tensor of the parameter's
shape and dtype (an fp32 main_grad for bf16 parameters), a bad option."""
import copy
import os

import pytest

from _support import needs_gpu, needs_torch, torch

if torch is not None:
    import graphed.torch as gt
    from _models import assert_all_equal
    from test_moved_params import BATCH, EMBD, SEQ, batch, gpt

MICROBATCHES, STEPS = 3, 3


def assert_created_by_the_forward(params):
    """Where `.grad` was None before a forward, the forward made it zeros:
    graphed looked it up as the destination (autograd would leave it None
    until the backward), so equality with eager afterwards means the graph
    added the grads there, and autograd did not add them again."""
    for p in params:
        assert p.grad is not None, "the forward did not create .grad: nothing accumulates into it"
        assert torch.count_nonzero(p.grad) == 0


def train(model, dtype, accumulate=None, zero_to_none=True, graphed=False):
    """STEPS AdamW steps, each over MICROBATCHES microbatches; returns the
    outputs, the final parameters and grads (`.grad`, or `accumulate`'s
    attribute), and the grads' addresses per step. `graphed` with `.grad`:
    the first forward of each step where they are None must create the
    grads (a model graphed with accumulate_param_grads_into="grad")."""
    xs, dys = batch(dtype, STEPS * MICROBATCHES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    torch.manual_seed(99)
    outs, addresses = [], []
    attr = accumulate or "grad"
    for step in range(STEPS):
        if attr == "grad":
            opt.zero_grad(set_to_none=zero_to_none)
        else:
            for p in model.parameters():
                getattr(p, attr).zero_()
        for m in range(MICROBATCHES):
            k = step * MICROBATCHES + m
            y = model(xs[k])
            if graphed and attr == "grad" and m == 0 and (zero_to_none or step == 0):
                assert_created_by_the_forward(model.parameters())
            y.backward(dys[k])
            outs.append(y.detach().clone())
        grads = [getattr(p, attr) for p in model.parameters()]
        addresses.append([g.data_ptr() for g in grads])
        if attr != "grad":
            for p in model.parameters():
                assert p.grad is None, "autograd got a grad graphed accumulated"
                p.grad = p.main_grad.clone()
        opt.step()
        if attr != "grad":
            for p in model.parameters():
                p.grad = None
    return outs, [p.detach().clone() for p in model.parameters()], [g.clone() for g in grads], addresses


def assert_same_training(got, want):
    """Outputs, final parameters and grads of two train() runs, bit for bit."""
    for g, w in zip(got[:3], want[:3]):
        assert_all_equal(g, w)


def graphed(model, dtype, **kw):
    gt.make_graphed_callables(model, (torch.randn(BATCH, SEQ, EMBD, device="cuda", dtype=dtype),), **kw)
    return model


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_accumulation_into_grad_equals_eager_with_adamw(dtype, dropout):
    dtype = getattr(torch, dtype)
    base = gpt(dtype, dropout)
    want = train(copy.deepcopy(base), dtype)
    model = graphed(copy.deepcopy(base), dtype, accumulate_param_grads_into="grad")
    got = train(model, dtype, graphed=True)
    model.reset()
    assert_same_training(got, want)


@needs_gpu
def test_the_same_grad_tensors_serve_every_step():
    model = graphed(gpt(torch.float32), torch.float32, accumulate_param_grads_into="grad")
    *_, addresses = train(model, torch.float32, zero_to_none=False, graphed=True)
    model.reset()
    assert addresses[0] == addresses[1] == addresses[2], "the grads were replaced between steps"


@needs_gpu
def test_main_grad_takes_the_grads_and_autograd_none():
    base = gpt(torch.float32)
    want = train(copy.deepcopy(base), torch.float32)
    model = copy.deepcopy(base)
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)
    graphed(model, torch.float32, accumulate_param_grads_into="main_grad")
    got = train(model, torch.float32, accumulate="main_grad")
    model.reset()
    assert_same_training(got, want)


@needs_gpu
def test_a_missing_or_mismatched_accumulator_is_refused_before_the_replay():
    model = graphed(gpt(torch.bfloat16), torch.bfloat16, accumulate_param_grads_into="main_grad")
    x = torch.randn(BATCH, SEQ, EMBD, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"parameter 'blocks\.0\.ln_1\.weight'\.main_grad is None"):
        model(x)
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    with pytest.raises(ValueError, match="an accumulator of another dtype is not supported"):
        model(x)
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)
    model(x).sum().backward()  # right ones: it runs
    assert all(p.grad is None for p in model.parameters())
    assert any(p.main_grad.abs().sum() > 0 for p in model.parameters())
    model.reset()


@needs_torch
@pytest.mark.parametrize("bad", [1, "", "main grad", True])
def test_a_bad_option_is_a_value_error(bad):
    with pytest.raises(ValueError, match="accumulate_param_grads_into must be None or the name"):
        gt.make_graphed_callables(torch.nn.Linear(4, 4), (torch.randn(2, 4),), accumulate_param_grads_into=bad)


def ddp_train(accumulate):
    import torch.distributed as dist  # noqa: F401

    torch.manual_seed(7)
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256, device="cuda"), torch.nn.ReLU()) for _ in range(3)]
    if accumulate:
        layers = [gt.make_graphed_callables(m, (torch.randn(32, 256, device="cuda", requires_grad=i > 0),),
                                            accumulate_param_grads_into="grad") for i, m in enumerate(layers)]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.25,
                                                      gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(8)
    views = []
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        x, dy = torch.randn(32, 256, device="cuda"), torch.randn(32, 256, device="cuda")
        with model.no_sync():
            y = model(x)
            if accumulate and not views:
                assert_created_by_the_forward(model.parameters())
            y.backward(dy)
        x, dy = torch.randn(32, 256, device="cuda"), torch.randn(32, 256, device="cuda")
        model(x).backward(dy)
        views.append([p.grad.data_ptr() for p in model.parameters()])
        opt.step()
    out = [p.detach().clone() for p in model.parameters()] + [p.grad.clone() for p in model.parameters()]
    if accumulate:
        for m in layers:
            m.reset()
    return out, views


@needs_gpu
def test_ddp_bucket_views_take_the_grads():
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        want, _ = ddp_train(False)
        got, views = ddp_train(True)
    finally:
        dist.destroy_process_group()
    assert_all_equal(got, want)
    assert views[1] == views[2], "the grads are not the reducer's bucket views from step to step"


@needs_gpu
def test_delayed_weight_grads_accumulate_too():
    from test_pipeline import WGRAD_ORDER, dataset, params_of, run, samples

    torch.manual_seed(6)
    base = [torch.nn.Linear(64, 64, device="cuda") for _ in range(2)]
    data = dataset(torch.float32, microbatches=2)
    eager = copy.deepcopy(base)
    noop = [[lambda: None] * 2] * 2
    want = run(WGRAD_ORDER, [[eager[0]] * 2, [eager[1]] * 2], params_of(eager), data, noop)
    mods = copy.deepcopy(base)
    g = gt.make_graphed_callables(tuple(mods), samples(2, 2, torch.float32), _order=WGRAD_ORDER,
                                  _num_layers_per_chunk=[1, 1], accumulate_param_grads_into="grad")
    fwd = [list(g[0:2]), list(g[2:4])]
    dw = [[f.backward_dw for f in fwd[0]], [f.backward_dw for f in fwd[1]]]
    # The first chunk's first microbatch, once outside the schedule's
    # iterations (no optimizer step): its forward creates the grads.
    y = fwd[0][0](data[0][0][0])
    assert_created_by_the_forward(mods[0].parameters())
    y.backward(torch.zeros_like(y))
    dw[0][0]()
    got = run(WGRAD_ORDER, fwd, params_of(mods), data, dw)
    for c in g:
        c.reset()
    assert_all_equal(got[0], want[0])
    assert_all_equal(got[1], want[1])
