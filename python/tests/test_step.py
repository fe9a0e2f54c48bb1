"""make_graphed_step: a small GPT (token and position embeddings, nanoGPT
blocks with causal attention, LayerNorm and dropout, an LM head with
cross-entropy) trained with AdamW over N microbatches per optimizer step,
each step one launch of graphed's step graph, equal to eager gradient
accumulation bit for bit: fp32 and bf16, dropout 0 and 0.1 (each
microbatch draws its own masks, the generator ends where eager's ends),
unrolled and looped (WHILE) steps (a looped step's iterations each draw
their own masks too), grads in `.grad` (set to None between
steps, or zeroed in place) or in `main_grad`. Weight tying (the head
reading the token embedding) matches to rounding only: eager sums the
tied weight's two grads before adding them into `.grad`, the step adds
each into it in turn. Refusals: data of the wrong shape or count, a
microbatch count the step does not run, a `.grad` replaced by another
tensor, a `.grad` set to None while its tensor is still held, a loss of
more than one element, a reset step."""
import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import torch.nn as nn
    import torch.nn.functional as F

    import graphed.torch as gt
    from _models import assert_all_equal
    from test_moved_params import SEQ, Block, EMBD

VOCAB, BATCH, STEPS = 96, 2, 3


class Embed(nn.Module if torch is not None else object):
    def __init__(self, dropout):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(SEQ, EMBD)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Head(nn.Module if torch is not None else object):
    """Final LayerNorm, LM head and cross-entropy: the step's loss."""

    def __init__(self, tied=None):
        super().__init__()
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        if tied is not None:
            self.lm_head.weight = tied

    def forward(self, x, targets):
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def gpt(dtype, dropout, layers=2, tied=False, seed=3):
    torch.manual_seed(seed)
    embed = Embed(dropout)
    blocks = [Block(dropout) for _ in range(layers)]
    head = Head(embed.wte.weight if tied else None)
    mods = [m.to(device="cuda", dtype=dtype) for m in [embed, *blocks, head]]
    if tied:
        mods[-1].lm_head.weight = mods[0].wte.weight
    return mods


def data(n, seed=7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.randint(0, VOCAB, (STEPS, n, BATCH, SEQ), device="cuda", generator=g)
    tgt = torch.randint(0, VOCAB, (STEPS, n, BATCH, SEQ), device="cuda", generator=g)
    return idx, tgt


def params_of(mods):
    seen, out = set(), []
    for m in mods:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def train(mods, n, step=None, attr="grad", set_to_none=True, counts=None):
    """STEPS AdamW steps over `n` microbatches each (`counts[s]` with a
    looped step): eagerly, or through `step`. Returns the losses, the final
    parameters and grads, and the generator's state after."""
    idx, tgt = data(n)
    params = params_of(mods)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    torch.manual_seed(1234)
    losses = []
    for s in range(STEPS):
        k = counts[s] if counts else n
        if attr == "grad":
            opt.zero_grad(set_to_none=set_to_none)
        else:
            for p in params:
                p.main_grad.zero_()
                p.grad = None
        if step is None:
            for m in range(k):
                x = idx[s, m]
                for mod in mods[:-1]:
                    x = mod(x)
                loss = mods[-1](x, tgt[s, m])
                loss.backward()
                losses.append(loss.detach().reshape(1))
            if attr != "grad":
                for p in params:
                    p.main_grad += p.grad
                    p.grad = None
        else:
            losses.append(step(idx[s, :k], tgt[s, :k]))
        if attr != "grad":
            for p in params:
                p.grad = p.main_grad.clone()
        opt.step()
    grads = [p.grad.clone() for p in params]
    return torch.cat(losses), [p.detach().clone() for p in params], grads, torch.cuda.get_rng_state()


def sample():
    idx, tgt = data(1, seed=5)
    return idx[0, 0], tgt[0, 0]


def make_step(mods, n, **kw):
    x, t = sample()
    return gt.make_graphed_step(mods[:-1], mods[-1], (x,), (t,), microbatches=n, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("n", [1, 4])
def test_step_trains_as_eager_accumulation(dtype, dropout, n):
    dt = getattr(torch, dtype)
    want = train(gpt(dt, dropout), n)
    mods = gpt(dt, dropout)
    step = make_step(mods, n)
    assert step.session_stats()["step_graphs"] == 1
    got = train(mods, n, step=step)
    assert_all_equal(got[0], want[0])
    assert_all_equal(got[1], want[1])
    assert_all_equal(got[2], want[2])
    assert torch.equal(got[3], want[3]), "the generator did not end where eager's ends"


def test_grads_zeroed_in_place_and_main_grad():
    want = train(gpt(torch.float32, 0.1), 2, set_to_none=False)
    mods = gpt(torch.float32, 0.1)
    got = train(mods, 2, step=make_step(mods, 2), set_to_none=False)
    assert_all_equal(got[1], want[1])

    base = gpt(torch.float32, 0.1)
    for p in params_of(base):
        p.main_grad = torch.zeros_like(p)
    want = train(base, 2, attr="main_grad")
    mods = gpt(torch.float32, 0.1)
    for p in params_of(mods):
        p.main_grad = torch.zeros_like(p)
    step = make_step(mods, 2, accumulate_param_grads_into="main_grad")
    got = train(mods, 2, step=step, attr="main_grad")
    assert_all_equal(got[1], want[1])
    assert_all_equal(got[2], want[2])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_looped_step_runs_any_count_as_eager(dropout):
    """One captured microbatch in a WHILE loop, 4, 1 and 3 microbatches per
    call; with dropout every iteration draws its own masks (the generator's
    offset moved on by one microbatch's draws at the start of each), so the
    losses, weights, grads and the generator's final state are eager's."""
    counts = [4, 1, 3]
    want = train(gpt(torch.float32, dropout), 4, counts=counts)
    mods = gpt(torch.float32, dropout)
    step = make_step(mods, 4, loop=True)
    got = train(mods, 4, step=step, counts=counts)
    assert_all_equal(got[0], want[0])
    assert_all_equal(got[1], want[1])
    assert_all_equal(got[2], want[2])
    assert torch.equal(got[3], want[3]), "the generator did not end where eager's ends"


def test_looped_step_draws_other_masks_in_each_microbatch():
    """The same data in every microbatch: eager's losses differ per
    microbatch (each draws other masks), and so do the looped step's."""
    mods = gpt(torch.float32, 0.3)
    step = make_step(mods, 3, loop=True)
    x, t = sample()
    losses = step(x.expand(3, *x.shape).contiguous(), t.expand(3, *t.shape).contiguous())
    assert len(set(losses.tolist())) == 3, losses


def grads_of_one_step(mods, n, step=None):
    idx, tgt = data(n)
    params = params_of(mods)
    for p in params:
        p.grad = None
    if step is None:
        for m in range(n):
            x = idx[0, m]
            for mod in mods[:-1]:
                x = mod(x)
            mods[-1](x, tgt[0, m]).backward()
    else:
        step(idx[0], tgt[0])
    return [p.grad.clone() for p in params]


def test_weight_tying_matches_to_rounding():
    """The tied weight's grad to rounding (eager adds its two grads
    together first), every other grad bit for bit; one step, as an
    optimizer would amplify the rounding into every later difference."""
    base = gpt(torch.float32, 0.0, tied=True)
    want = grads_of_one_step(base, 3)
    mods = gpt(torch.float32, 0.0, tied=True)
    got = grads_of_one_step(mods, 3, make_step(mods, 3))
    tied = [i for i, p in enumerate(params_of(mods)) if p is mods[0].wte.weight]
    assert len(got) == len(want) and tied == [0]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert_all_equal(got[1:], want[1:])


def test_set_grads_replace_the_previous_steps():
    """param_grads="set": after each call `.grad` holds that call's grads
    (no zero_grad between steps), equal to eager's of the same data."""
    mods = gpt(torch.float32, 0.1)
    step = make_step(mods, 2, param_grads="set")
    idx, tgt = data(2, seed=9)
    for s in range(2):
        torch.manual_seed(50 + s)
        step(idx[s], tgt[s])
    got = [p.grad.clone() for p in params_of(mods)]
    base = gpt(torch.float32, 0.1)
    torch.manual_seed(51)
    for p in params_of(base):
        p.grad = None
    for m in range(2):
        x = idx[1, m]
        for mod in base[:-1]:
            x = mod(x)
        base[-1](x, tgt[1, m]).backward()
    assert_all_equal(got, [p.grad for p in params_of(base)])


def test_set_grads_come_back_after_zero_grad_set_to_none():
    """param_grads="set" with the optimizer's default zero_grad (set to
    None) between steps: each call gives `.grad` back, holding that
    call's grads (an optimizer would otherwise skip every parameter)."""
    mods = gpt(torch.float32, 0.0)
    step = make_step(mods, 2, param_grads="set")
    idx, tgt = data(2, seed=9)
    params = params_of(mods)
    for s in range(2):
        for p in params:
            p.grad = None
        step(idx[s], tgt[s])
        assert all(p.grad is not None for p in params)
    base = gpt(torch.float32, 0.0)
    for m in range(2):
        x = idx[1, m]
        for mod in base[:-1]:
            x = mod(x)
        base[-1](x, tgt[1, m]).backward()
    assert_all_equal([p.grad for p in params], [p.grad for p in params_of(base)])


def test_refusals():
    mods = gpt(torch.float32, 0.1)
    step = make_step(mods, 2)
    idx, tgt = data(2)
    with pytest.raises(ValueError, match=r"microbatches asked; the step runs exactly 2"):
        step(idx[0, :1], tgt[0, :1])
    with pytest.raises(ValueError, match=r"argument 0 is .*the step takes"):
        step(idx[0, :, :1], tgt[0])
    with pytest.raises(ValueError, match=r"takes 2 data inputs, got 1"):
        step(idx[0], ())
    step(idx[0], tgt[0])
    p = mods[1].ln_1.weight
    held = p.grad
    p.grad = None
    with pytest.raises(gt.AliasHeldError, match=r"ln_1.weight'.grad was set to None"):
        step(idx[0], tgt[0])
    del held
    step(idx[0], tgt[0])
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=r"ln_1.weight'.grad is another tensor"):
        step(idx[0], tgt[0])
    step.reset()
    with pytest.raises(RuntimeError, match=r"reset"):
        step(idx[0], tgt[0])


@pytest.mark.parametrize("param_grads", ["add", "set"])
def test_refused_call_leaves_grads_and_generators(param_grads):
    """A call refused after the grads set to None were re-attached (here:
    the microbatch count, checked by the extension) leaves them None and
    the generators where they were; the next call runs as it would have."""
    mods = gpt(torch.float32, 0.1)
    step = make_step(mods, 2, param_grads=param_grads)
    idx, tgt = data(2)
    step(idx[0], tgt[0])
    params = [p for p in params_of(mods) if p.requires_grad]
    for p in params:
        p.grad = None
    rng = torch.cuda.get_rng_state()
    with pytest.raises(ValueError, match=r"microbatches asked"):
        step(idx[1, :1], tgt[1, :1])
    assert all(p.grad is None for p in params)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    step(idx[1], tgt[1])
    assert all(p.grad is not None for p in params)


def test_capture_refusals():
    mods = gpt(torch.float32, 0.0)
    x, _ = sample()
    with pytest.raises(RuntimeError, match=r"one tensor of one element"):
        gt.make_graphed_step(mods[:-1], lambda y: y * 2, (x,), ())
    with pytest.raises(ValueError, match=r"accumulate_param_grads_into"):
        gt.make_graphed_step(mods[:-1], mods[-1], (x,), (x,), accumulate_param_grads_into=None)
