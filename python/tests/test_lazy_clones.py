"""Owned parameter grads without a copy (`lazy_clones`, the default): each
grad is handed out where its backward graph wrote it and copied out only
when it is still held at a replay that may overwrite it. A training loop
that drops its grads (zero_grad(set_to_none=True)) copies none; a grad
held across the next iteration, or a view of it, keeps its values;
accumulated microbatches equal eager's bit for bit; strict leases find
nothing held; a reset leaves held grads intact; the session counts what
it copied (session_stats)."""
import copy

import pytest

from _support import needs_gpu, torch

pytestmark = needs_gpu

if torch is not None:
    import torch.nn.functional as F

    import graphed.torch as gt
    from _models import CausalBlock

SEQ, BATCH, WIDTH, BLOCKS = 16, 4, 64, 3


def stack(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[CausalBlock(WIDTH, 4) for _ in range(BLOCKS)]).cuda()


def graphed_stack(model, **opts):
    """Each block graphed on its own, as layers are graphed in practice."""
    samples = tuple((torch.randn(SEQ, BATCH, WIDTH, device="cuda", requires_grad=True),) for _ in model)
    return gt.make_graphed_callables(tuple(model), samples, **opts)


def batches(n, seed=7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def one():
        return torch.randn(SEQ, BATCH, WIDTH, device="cuda", generator=g)

    return [(one(), one()) for _ in range(n)]


def backward(model, x, y, scale=1.0):
    (F.mse_loss(model(x), y) * scale).backward()


def grads(model):
    return [p.grad for p in model.parameters()]


def stats(graphed):
    return graphed[0].session_stats()


def assert_equal(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what}: tensor {i} differs (max abs {(g.float() - w.float()).abs().max().item()})"


def test_a_loop_that_drops_its_grads_copies_none_and_matches_eager():
    """zero_grad(set_to_none=True), forward, backward, AdamW, four steps:
    grads and weights equal eager's bit for bit, and nothing was copied;
    lazy_clones=False (a copy at every backward) gives the same grads."""
    eager, lazy, copying = stack(1), stack(1), stack(1)
    g_lazy = graphed_stack(lazy)
    g_copy = graphed_stack(copying, lazy_clones=False)
    assert stats(g_lazy)["lazy_clones"] and not stats(g_copy)["lazy_clones"]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (eager, lazy, copying)]
    for step, (x, y) in enumerate(batches(4)):
        for m, opt in zip((eager, lazy, copying), opts):
            opt.zero_grad(set_to_none=True)
            backward(m, x, y)
        assert_equal(grads(lazy), grads(eager), f"step {step}: lazy grads against eager")
        assert_equal(grads(copying), grads(eager), f"step {step}: copied grads against eager")
        for opt in opts:
            opt.step()
    assert_equal(list(lazy.parameters()), list(eager.parameters()), "weights after training")
    assert stats(g_lazy)["lazy_grads_copied"] == 0
    assert stats(g_lazy)["lazy_bytes_copied"] == 0
    # The last step's grads, held in .grad: graphed's buffers when lent,
    # clone blocks when copied (so nothing above passed by copying).
    assert stats(g_lazy)["clone_blocks_outstanding"] == 0
    assert stats(g_copy)["clone_blocks_outstanding"] > 0
    for g in g_lazy + g_copy:
        g.reset()


@pytest.mark.parametrize("strict", [False, True], ids=["leases-off", "strict-leases"])
def test_grads_held_across_the_next_iteration_keep_their_values(strict):
    """Every grad of step 1, and a view of one, kept while .grad is set to
    None and step 2 runs: each keeps step 1's values and no longer shares
    memory with step 2's grads; each was copied once (at step 2's first
    forward), and under strict leases nothing is reported held."""
    model = stack(2)
    graphed = graphed_stack(model, strict_leases=strict)
    (x1, y1), (x2, y2) = batches(2, seed=11)
    backward(model, x1, y1)
    kept = grads(model)
    view = kept[0][1:3]
    snapshot = [g.clone() for g in kept]
    view_snapshot = view.clone()
    model.zero_grad(set_to_none=True)
    backward(model, x2, y2)
    assert_equal(kept, snapshot, "grads kept from step 1")
    assert torch.equal(view, view_snapshot), "a view of a kept grad changed"
    for old, new in zip(kept, grads(model)):
        assert old.data_ptr() != new.data_ptr()
    assert not all(torch.equal(a, b) for a, b in zip(kept, grads(model))), "step 2 computed step 1's grads"
    st = stats(graphed)
    assert st["lazy_grads_copied"] == len(kept)
    assert st["lazy_bytes_copied"] == sum(g.numel() * g.element_size() for g in kept)
    assert st["leases_held"] == (len(kept) if strict else 0)  # step 2's, under strict leases
    del kept, view
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_accumulated_microbatches_match_eager_bit_for_bit(autocast):
    """Three microbatches added into .grad without zeroing, two steps with
    AdamW: every grad after every step equals eager's. Each parameter's
    .grad is copied once per step, at the second microbatch's forward (the
    first microbatch's grad, held as .grad; the later ones are added into
    that copy and dropped)."""
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)) if autocast else None
    eager, lazy = stack(3), stack(3)
    with ctx() if ctx else _nothing():
        graphed = graphed_stack(lazy)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, lazy)]
    data = batches(6, seed=13)
    for step in range(2):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        for x, y in data[3 * step : 3 * step + 3]:
            for m in (eager, lazy):
                with ctx() if ctx else _nothing():
                    backward(m, x, y, scale=1 / 3)
        assert_equal(grads(lazy), grads(eager), f"step {step}: accumulated grads")
        for opt in opts:
            opt.step()
    assert_equal(list(lazy.parameters()), list(eager.parameters()), "weights after training")
    params = len(list(lazy.parameters()))
    assert stats(graphed)["lazy_grads_copied"] == 2 * params
    for g in graphed:
        g.reset()


def test_a_reset_leaves_held_grads_intact():
    """Grads held when the session is reset are copied out before its pool
    goes: PyTorch memory allocated and overwritten afterwards does not
    reach them."""
    model = stack(4)
    graphed = graphed_stack(model)
    (x, y), = batches(1, seed=17)
    backward(model, x, y)
    kept = grads(model)
    snapshot = [g.clone() for g in kept]
    lent_at = [g.data_ptr() for g in kept]
    for g in graphed:
        g.reset()
    # Copied out by the reset (each now over memory of its own), not left
    # over the freed pool.
    assert all(g.data_ptr() != p for g, p in zip(kept, lent_at)), "a held grad was not copied out at the reset"
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(16)]
    torch.cuda.synchronize()
    assert_equal(kept, snapshot, "grads held across the reset")
    del junk


def test_lazy_clones_is_in_force_only_where_every_writer_is_known():
    """On by default; off with lazy_clones=False; off with aliases, with a
    caller's pool (its other graphs may write the buffers) and with clones
    from graphed's pool: there grads are copied at every backward (or
    aliased)."""
    def lazy(**opts):
        model = torch.nn.Linear(8, 8).cuda()
        g = gt.make_graphed_callables(model, (torch.randn(4, 8, device="cuda", requires_grad=True),), **opts)
        on = g.session_stats()["lazy_clones"]
        g.reset()
        return on

    assert lazy()
    assert not lazy(lazy_clones=False)
    assert not lazy(clone_param_grads_on_return=False)
    assert not lazy(pool=torch.cuda.graph_pool_handle())
    assert not lazy(clones_from_torch_allocator=False)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
