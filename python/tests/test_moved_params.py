"""Parameters that move (rebind_params=True, the default): every call looks
each parameter up in its module, so that a Parameter replaced there counts,
and compares it with what the graphs read; the graphs follow one at a new
address, and training stays bit-identical to eager training whatever moved
the parameters: load_state_dict(assign=True) every few steps, a
module.cpu() / module.cuda() round trip, an optimizer that replaces
tensors or Parameter objects, an FSDP-style regather into a new flat buffer
each step, moves between the iterations of a pipeline schedule. The old
memory is never read again (freed and filled with NaN, results still equal
eager), and a parameter moved between a forward and its backward is kept
until the backward. Refusals raise ParamMovedError naming the parameter:
rebind_params=False and a move (both addresses), another shape, dtype,
device or layout, a parameter gone, memory less aligned than at capture
(graphed's GRAPHED_STATUS_PARAM_MOVED message); nothing is replayed then
and the generators do not advance, so training goes on as eager. Side by
side, torch.cuda.make_graphed_callables after load_state_dict(assign=True)
keeps reading the old parameters and gives their grads to the old objects."""
import copy
import re

import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import torch.nn as nn
    import torch.nn.functional as F

    import graphed.torch as gt
    from _models import assert_all_equal

EMBD, HEADS, SEQ, BATCH = 64, 2, 32, 2
LR = 0.001
RUN_SEED = 1234


# ---- models: nanoGPT's transformer block, small --------------------------------------------


class CausalSelfAttention(nn.Module if torch is not None else object):
    def __init__(self, dropout):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module if torch is not None else object):
    def __init__(self, dropout):
        super().__init__()
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.c_proj = nn.Linear(4 * EMBD, EMBD)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module if torch is not None else object):
    def __init__(self, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention(dropout)
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = MLP(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTBlocks(nn.Module if torch is not None else object):
    """Blocks graphed as one callable: parameters named
    "blocks.0.attn.c_attn.weight" and so on."""

    def __init__(self, layers, dropout):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def gpt(dtype, dropout=0.1, layers=2, seed=3):
    torch.manual_seed(seed)
    return GPTBlocks(layers, dropout).to(device="cuda", dtype=dtype)


def batch(dtype, steps, seed=7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(BATCH, SEQ, EMBD, device="cuda", dtype=dtype, generator=g) for _ in range(steps)]
    dys = [torch.randn(BATCH, SEQ, EMBD, device="cuda", dtype=dtype, generator=g) for _ in range(steps)]
    return xs, dys


def graphed(model, dtype, **kw):
    """`model`, graphed in place (its forward replaced); every parameter
    must be movable unless rebind_params=False."""
    sample = torch.randn(BATCH, SEQ, EMBD, device="cuda", dtype=dtype)
    gt.make_graphed_callables(model, (sample,), **kw)
    if kw.get("rebind_params", True):
        assert all(model.params_movable()), param_lines(model)
    return model


def param_lines(model):
    return "\n".join(line for line in model.session_plan().splitlines() if line.startswith("param "))


# ---- training, eager and graphed alike ----------------------------------------------------


def sgd(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-LR)


def owner_of(model, qualified):
    prefix, _, key = qualified.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), key


def train(model, xs, dys, between=None, update=sgd):
    """One SGD step per (x, dy), from the same generator state; `between(model,
    k)` runs before step k > 0. Every current parameter must get its grad.
    Returns every step's output and the final parameters."""
    torch.manual_seed(RUN_SEED)
    outs = []
    for k, (x, dy) in enumerate(zip(xs, dys)):
        if between is not None and k > 0:
            between(model, k)
        model.zero_grad(set_to_none=True)
        y = model(x)
        y.backward(dy)
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"step {k}: no grad for {missing}"
        outs.append(y.detach().clone())
        update(model)
    return outs, [p.detach().clone() for p in model.parameters()]


def against_eager(base, dtype, steps, between=None, update=sgd, prepare=None, **kw):
    """Trains a copy of `base` eagerly and a copy graphed, with the same
    moves; asserts every output and the final parameters equal; returns the
    graphed model's stats (before reset)."""
    xs, dys = batch(dtype, steps)
    eager = copy.deepcopy(base)
    model = copy.deepcopy(base)
    if prepare is not None:
        prepare(eager)
        prepare(model)
    want = train(eager, xs, dys, between, update)
    graphed(model, dtype, **kw)
    got = train(model, xs, dys, between, update)
    stats = model.session_stats()
    model.reset()
    assert_all_equal(got[0], want[0])
    assert_all_equal(got[1], want[1])
    return stats


DTYPES = ["float32", "bfloat16"]


# ---- (a) load_state_dict(assign=True) every K steps, with torch's graphs side by side -------


def state_dicts(base, n, seed=11):
    """`n` state dicts near `base`'s (perturbed weights), made once."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        {k: v + 0.05 * torch.randn(v.shape, device="cuda", dtype=v.dtype, generator=g)
         for k, v in base.state_dict().items()}
        for _ in range(n)
    ]


def swapper(sds, every):
    def between(model, k):
        if k % every == 0:
            sd = sds[(k // every - 1) % len(sds)]
            # Fresh tensors (new addresses) become the parameters.
            model.load_state_dict({name: t.clone() for name, t in sd.items()}, assign=True)

    return between


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_swapped_with_load_state_dict_assign_train_as_eager(dtype, dropout):
    dtype = getattr(torch, dtype)
    base = gpt(dtype, dropout)
    every, steps = 2, 7
    sds = state_dicts(base, 3)
    nparams = len(list(base.parameters()))
    st = against_eager(base, dtype, steps, swapper(sds, every))
    assert st["params_movable"] == nparams and st["params_move_refused"] == 0
    # Each swap moves every parameter (the clones are made while the old ones live).
    assert st["param_moves"] == (steps - 1) // every * nparams

    if dropout != 0.0:
        return
    # Side by side: torch.cuda.make_graphed_callables on an identical model
    # keeps the Parameter objects it was given (they are its autograd
    # Function's inputs) and its graphs read their memory: after the swap it
    # computes with the old weights, and the old objects get the grads.
    xs, dys = batch(dtype, every + 1)
    eager = copy.deepcopy(base)
    want, _ = train(eager, xs, dys, swapper(sds, every))
    tmodel = copy.deepcopy(base)
    tmodel = torch.cuda.make_graphed_callables(tmodel, (torch.randn(BATCH, SEQ, EMBD, device="cuda", dtype=dtype),))
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.manual_seed(RUN_SEED)
    for k in range(every + 1):
        if k == every:
            old = list(tmodel.parameters())
            for q in old:
                q.grad = None
            swapper(sds, every)(tmodel, k)
        tmodel.zero_grad(set_to_none=True)
        y = tmodel(xs[k])
        y.backward(dys[k])
        if k < every:
            assert torch.allclose(y.float(), want[k].float(), **tol), f"torch's graphs differ from eager at step {k}"
            sgd(tmodel)
    assert not torch.allclose(y.float(), want[every].float(), **tol), (
        "torch's graphs followed the swapped parameters: the documented difference is gone"
    )
    assert all(p.grad is None for p in tmodel.parameters()), "torch gave grads to the new Parameter objects"
    assert all(p.grad is not None for p in old), "torch's grads went neither to the old nor the new parameters"


# ---- (b) module.cpu() then module.cuda() between steps --------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_cuda_round_trip_between_steps_trains_as_eager(dtype):
    dtype = getattr(torch, dtype)

    def between(model, k):
        # Odd steps keep the old memory alive through the round trip, so
        # that every parameter comes back at a new address; even steps let
        # the allocator hand back whatever it likes (often the same).
        keep = [p.data for p in model.parameters()] if k % 2 else None
        model.cpu()
        model.cuda()
        del keep

    st = against_eager(gpt(dtype), dtype, 6, between)
    assert st["param_moves"] >= 3 * st["params_movable"]
    assert st["params_move_refused"] == 0


# ---- (c) an optimizer that replaces tensors and Parameter objects ---------------------------


def replacing_update(model):
    """SGD out of place: every other parameter gets a new tensor (p.data =),
    the others a new Parameter object in their module's _parameters."""
    with torch.no_grad():
        for i, (name, p) in enumerate(list(model.named_parameters())):
            new = p.detach() - LR * p.grad
            if i % 2:
                p.data = new
            else:
                owner, key = owner_of(model, name)
                owner._parameters[key] = nn.Parameter(new)


@pytest.mark.parametrize("dtype", DTYPES)
def test_optimizer_replacing_tensors_and_parameter_objects_trains_as_eager(dtype):
    dtype = getattr(torch, dtype)
    base = gpt(dtype)
    nparams = len(list(base.parameters()))
    steps = 5
    st = against_eager(base, dtype, steps, update=replacing_update)
    assert st["param_moves"] == (steps - 1) * nparams


# ---- (d) FSDP-style regather into a new flat buffer each step -------------------------------


def flat_layout(model, lead=4):
    """Offsets (in elements) of every parameter in one flat buffer, the
    first `lead` elements in: 16 bytes past the buffer's start, so that
    every parameter is less than 256-byte aligned, as views into a flat
    buffer often are."""
    offsets, n = [], lead
    for p in model.parameters():
        offsets.append(n)
        n += p.numel()
    return offsets, n


def regather(model, k=None):
    """A NEW flat buffer, filled with the parameters' values; every
    parameter's .data becomes a view at the same offset (the old buffer is
    let go)."""
    offsets, n = flat_layout(model)
    params = list(model.parameters())
    flat = torch.empty(n, device="cuda", dtype=params[0].dtype)
    with torch.no_grad():
        for p, o in zip(params, offsets):
            flat[o:o + p.numel()].copy_(p.reshape(-1))
    for p, o in zip(params, offsets):
        p.data = flat[o:o + p.numel()].view_as(p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fsdp_style_flat_buffer_regathered_each_step_trains_as_eager(dtype):
    dtype = getattr(torch, dtype)
    base = gpt(dtype)
    nparams = len(list(base.parameters()))
    steps = 5
    # Captured as views of a flat buffer, as FSDP's parameters are.
    st = against_eager(base, dtype, steps, between=regather, prepare=regather)
    assert st["param_moves"] == (steps - 1) * nparams


# ---- the old memory is not read ------------------------------------------------------------


def fill_freed_memory_with_nan(like):
    """After the old tensors were freed: the cache emptied, then new memory
    (likely where they were) filled with NaN."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return [torch.full_like(p, float("nan")) for p in like for _ in range(4)]


def test_old_memory_is_not_read_after_a_move():
    dtype = torch.float32
    junk = []

    def between(model, k):
        params = list(model.parameters())
        for p in params:
            p.data = p.data.clone()  # the old tensor is freed here
        junk.append(fill_freed_memory_with_nan(params))

    st = against_eager(gpt(dtype), dtype, 4, between)
    assert st["param_moves"] == 3 * st["params_movable"]


def test_memory_moved_between_forward_and_backward_is_kept_until_the_backward():
    dtype = torch.float32
    base = gpt(dtype)
    xs, dys = batch(dtype, 3)

    def run(model):
        torch.manual_seed(RUN_SEED)
        outs, junk = [], []
        for x, dy in zip(xs, dys):
            model.zero_grad(set_to_none=True)
            y = model(x)
            params = list(model.parameters())
            for p in params:
                p.data = p.data.clone()  # same values; the backward reads what the forward read
            junk.append(fill_freed_memory_with_nan(params))
            y.backward(dy)
            outs.append(y.detach().clone())
            outs.extend(p.grad.clone() for p in model.parameters())
            sgd(model)
        return outs + [p.detach().clone() for p in model.parameters()]

    want = run(copy.deepcopy(base))
    model = graphed(copy.deepcopy(base), dtype)
    got = run(model)
    model.reset()
    assert_all_equal(got, want)


# ---- moves between the iterations of a pipeline schedule -----------------------------------


def test_moves_between_iterations_of_a_pipeline_schedule_follow_every_microbatch():
    from test_pipeline import TE_ORDER, dataset, params_of, run, samples

    torch.manual_seed(5)
    base = [nn.Linear(64, 64, device="cuda") for _ in range(2)]
    data = dataset(torch.float32)

    def iterations(fwd, mods):
        outs = []
        for i, it in enumerate(data):
            if i > 0:
                for p in params_of(mods):
                    p.data = p.data.clone()
            o, _ = run(TE_ORDER, fwd, params_of(mods), [it])
            outs.extend(o)
        return outs + [p.detach().clone() for p in params_of(mods)]

    eager = copy.deepcopy(base)
    want = iterations([[eager[0]] * 3, [eager[1]] * 3], eager)
    mods = copy.deepcopy(base)
    g = gt.make_graphed_callables(tuple(mods), samples(2, 3, torch.float32), _order=TE_ORDER, allow_unused_input=True)
    got = iterations([list(g[0:3]), list(g[3:6])], mods)
    st = g[0].session_stats()
    for c in g:
        c.reset()
    assert_all_equal(got, want)
    # 2 chunks x 3 microbatches x 2 parameters, moved before each of 2 iterations.
    assert st["param_moves"] == 2 * 2 * 3 * 2


# ---- refusals ------------------------------------------------------------------------------


def hexa(ptr):
    return f"{ptr:#x}"


def moved_message(name, old, new):
    return re.escape(f"parameter '{name}' moved from {hexa(old)} to {hexa(new)}")


def test_rebind_params_off_refuses_a_move_naming_the_parameter_and_both_addresses():
    dtype = torch.float32
    base = gpt(dtype)
    xs, dys = batch(dtype, 4)
    eager = copy.deepcopy(base)
    want = train(eager, xs, dys)
    model = graphed(copy.deepcopy(base), dtype, rebind_params=False)
    assert not any(model.params_movable())
    st = model.session_stats()
    assert (st["params_movable"], st["params_move_refused"]) == (0, 0)

    def between(model, k):
        if k != 2:
            return
        p = model.blocks[0].attn.c_attn.weight
        orig = p.data
        p.data = orig.clone()
        with pytest.raises(gt.ParamMovedError, match=moved_message("blocks.0.attn.c_attn.weight", orig.data_ptr(),
                                                                    p.data_ptr())) as e:
            model(xs[k])
        assert isinstance(e.value, RuntimeError)
        assert "GRAPHED_STATUS_PARAM_MOVED" in str(e.value) and "rebind_params=False" in str(e.value)
        # Nothing was replayed and the generators did not advance: back where
        # it was, training goes on as eager.
        p.data = orig

    got = train(model, xs, dys, between)
    model.reset()
    assert_all_equal(got[0], want[0])
    assert_all_equal(got[1], want[1])


def test_memory_less_aligned_than_at_capture_is_refused_with_graphed_message():
    dtype = torch.float32
    base = gpt(dtype)
    xs, dys = batch(dtype, 4)
    want = train(copy.deepcopy(base), xs, dys)
    model = graphed(copy.deepcopy(base), dtype)
    kept = []

    def between(model, k):
        if k != 2:
            return
        p = model.blocks[1].mlp.c_fc.weight
        old = p.data_ptr()
        # Held, so that the caching allocator cannot give the clone below
        # the captured address back (that would be no move at all).
        kept.append(p.data)
        buf = torch.empty(p.numel() + 1, device="cuda", dtype=p.dtype)
        view = buf[1:].view_as(p)  # 4 bytes past an allocation
        view.copy_(p.detach())
        p.data = view
        with pytest.raises(gt.ParamMovedError) as e:
            model(xs[k])
        msg = str(e.value)
        assert re.search(moved_message("blocks.1.mlp.c_fc.weight", old, view.data_ptr()), msg), msg
        assert "GRAPHED_STATUS_PARAM_MOVED" in msg and "aligned to 4 bytes" in msg, msg
        # A tensor of its own is aligned: followed.
        p.data = view.clone()

    got = train(model, xs, dys, between)
    st = model.session_stats()
    model.reset()
    assert_all_equal(got[0], want[0])
    assert_all_equal(got[1], want[1])
    assert st["param_moves"] == 1


def linear_graphed(**kw):
    torch.manual_seed(21)
    model = nn.Linear(64, 64, device="cuda")
    eager = copy.deepcopy(model)
    gt.make_graphed_callables(model, (torch.randn(8, 64, device="cuda", requires_grad=True),), **kw)
    return model, eager


CHANGES = {
    "shape": (lambda m: setattr(m.weight, "data", torch.zeros(65, 64, device="cuda")),
              r"parameter 'weight' is now shape \[65, 64\], Float, cuda:0, contiguous; its graphs read shape \[64, 64\]"),
    "dtype": (lambda m: setattr(m.weight, "data", m.weight.data.double()), r"parameter 'weight' is now .*Double"),
    "device": (lambda m: m.cpu(), r"parameter 'weight' is now shape \[64, 64\], Float, cpu"),
    "layout": (lambda m: setattr(m.weight, "data", m.weight.data.t()), r"parameter 'weight' is now .*not contiguous"),
    "gone": (lambda m: m._parameters.__setitem__("bias", None), r"parameter 'bias' is now NoneType, not a tensor"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_parameter_the_graphs_cannot_read_as_it_is_raises_naming_it(change):
    model, eager = linear_graphed()
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    saved = {k: v for k, v in model._parameters.items()}
    data = {k: v.data for k, v in saved.items()}
    apply, match = CHANGES[change]
    apply(model)
    with pytest.raises(gt.ParamMovedError, match=match):
        model(x)
    # Put back (the device change by a round trip: new addresses, followed).
    if change == "device":
        model.cuda()
    else:
        model._parameters.update(saved)
        for k, v in saved.items():
            v.data = data[k]
    y = model(x)
    ye = eager(x.detach().clone().requires_grad_())
    assert torch.equal(y, ye)
    model.reset()


def test_a_move_under_no_grad_is_followed():
    model, eager = linear_graphed()
    x = torch.randn(8, 64, device="cuda")
    for _ in range(3):
        for p in model.parameters():
            p.data = p.data.clone()
        with torch.no_grad():
            y = model(x)
        assert torch.equal(y, eager(x))
    assert model.session_stats()["param_moves"] == 3 * 2
    model.reset()


def test_rebind_params_is_the_default_and_reported():
    model, _ = linear_graphed()
    assert model.params_movable() == [True, True]
    st = model.session_stats()
    assert (st["params_movable"], st["params_move_refused"], st["param_moves"]) == (2, 0, 0)
    assert "param 0 of Linear_0 (microbatch 0): movable" in model.session_plan()
    model.reset()
