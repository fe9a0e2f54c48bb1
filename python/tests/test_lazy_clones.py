"""Owned parameter grads without a copy (`lazy_clones`, the default): every
backward replay writes each parameter grad straight into fresh memory of
PyTorch's caching allocator, which autograd gets as the grad. A grad is
never graphed's buffer, never written by a later replay and never moved:
a grad held across later iterations (or a view of it, or its address, as
a DLPack export or a compiled optimizer keeps it) keeps its address and
its values, with strict leases nothing is held, a reset leaves it as it
is; grads and weights equal eager's bit for bit, with accumulation too;
the session says how many grads its graphs write in place
(session_stats: grads_in_place) and none are copied at replay."""
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


def test_a_training_loop_matches_eager_and_copies_nothing():
    """zero_grad(set_to_none=True), forward, backward, AdamW, four steps:
    grads and weights equal eager's bit for bit; every grad is written in
    place (no copy, no clone block) and is a tensor of PyTorch's allocator;
    lazy_clones=False (a copy at every backward) gives the same grads."""
    eager, fresh, copying = stack(1), stack(1), stack(1)
    g_fresh = graphed_stack(fresh)
    g_copy = graphed_stack(copying, lazy_clones=False)
    st = stats(g_fresh)
    assert st["lazy_clones"] and not stats(g_copy)["lazy_clones"]
    params = len(list(fresh.parameters()))
    # Written in place where capture verified it, copied there otherwise
    # (session_plan says why); most are in place.
    assert st["grads_in_place"] + st["grads_in_place_refused"] == params, st
    assert st["grads_in_place"] >= params // 2, g_fresh[0].session_plan()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (eager, fresh, copying)]
    for step, (x, y) in enumerate(batches(4)):
        for m, opt in zip((eager, fresh, copying), opts):
            opt.zero_grad(set_to_none=True)
            backward(m, x, y)
        assert_equal(grads(fresh), grads(eager), f"step {step}: fresh grads against eager")
        assert_equal(grads(copying), grads(eager), f"step {step}: copied grads against eager")
        for opt in opts:
            opt.step()
    assert_equal(list(fresh.parameters()), list(eager.parameters()), "weights after training")
    # The last step's grads, held in .grad: PyTorch's tensors when fresh
    # (no clone block), clone blocks when copied.
    assert stats(g_fresh)["clone_blocks_outstanding"] == 0
    assert stats(g_copy)["clone_blocks_outstanding"] > 0
    for g in g_fresh + g_copy:
        g.reset()


@pytest.mark.parametrize("strict", [False, True], ids=["leases-off", "strict-leases"])
def test_grads_held_across_later_iterations_keep_their_address_and_values(strict):
    """Every grad of step 1, a view of one and their addresses, kept while
    .grad is set to None and three more steps run: each keeps its address
    and step 1's values, no later grad shares its memory, and under strict
    leases nothing is held."""
    model = stack(2)
    graphed = graphed_stack(model, strict_leases=strict)
    data = batches(4, seed=11)
    backward(model, *data[0])
    kept = grads(model)
    view = kept[0][1:3]
    addresses = [g.data_ptr() for g in kept]
    snapshot = [g.clone() for g in kept]
    view_snapshot = view.clone()
    later = set()
    for x, y in data[1:]:
        model.zero_grad(set_to_none=True)
        backward(model, x, y)
        later.update(g.data_ptr() for g in grads(model))
        assert stats(graphed)["leases_held"] == 0
    torch.cuda.synchronize()
    assert [g.data_ptr() for g in kept] == addresses, "a held grad was moved"
    assert_equal(kept, snapshot, "grads kept from step 1")
    assert torch.equal(view, view_snapshot), "a view of a kept grad changed"
    assert not later & set(addresses), "a later replay wrote a held grad's memory"
    assert not all(torch.equal(a, b) for a, b in zip(kept, grads(model))), "later steps computed step 1's grads"
    del kept, view
    for g in graphed:
        g.reset()


def test_a_later_backward_adds_into_the_held_grad_and_the_plan_says_in_place():
    """Two backwards without zeroing: autograd adds the second grad into
    the first, the tensor it holds as .grad (not one of graphed's), which
    then equals eager's g1 + g2 bit for bit; the plan says the grads are
    written straight into their destination."""
    eager, model = stack(5), stack(5)
    graphed = graphed_stack(model)
    (x1, y1), (x2, y2) = batches(2, seed=19)
    backward(model, x1, y1)
    first = {p: p.grad for p in model.parameters()}
    backward(model, x2, y2)
    for p, g in first.items():
        assert p.grad is g, "autograd replaced the held grad instead of adding into it"
    for x, y in ((x1, y1), (x2, y2)):
        backward(eager, x, y)
    assert_equal(grads(model), grads(eager), "g1 + g2")
    plan = graphed[0].session_plan()
    assert "written straight into its destination" in plan, plan
    for g in graphed:
        g.reset()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_accumulated_microbatches_match_eager_bit_for_bit(autocast):
    """Three microbatches added into .grad without zeroing, two steps with
    AdamW: every grad after every step equals eager's."""
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)) if autocast else None
    eager, fresh = stack(3), stack(3)
    with ctx() if ctx else _nothing():
        graphed = graphed_stack(fresh)
    st = stats(graphed)
    assert st["grads_in_place"] + st["grads_in_place_refused"] == len(list(fresh.parameters())), st
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, fresh)]
    data = batches(6, seed=13)
    for step in range(2):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        for x, y in data[3 * step : 3 * step + 3]:
            for m in (eager, fresh):
                with ctx() if ctx else _nothing():
                    backward(m, x, y, scale=1 / 3)
        assert_equal(grads(fresh), grads(eager), f"step {step}: accumulated grads")
        for opt in opts:
            opt.step()
    assert_equal(list(fresh.parameters()), list(eager.parameters()), "weights after training")
    for g in graphed:
        g.reset()


def test_a_reset_leaves_held_grads_as_they_are():
    """Grads held when the session is reset are PyTorch's own tensors: the
    reset neither moves nor frees them, and memory allocated and
    overwritten afterwards does not reach them."""
    model = stack(4)
    graphed = graphed_stack(model)
    (x, y), = batches(1, seed=17)
    backward(model, x, y)
    kept = grads(model)
    snapshot = [g.clone() for g in kept]
    addresses = [g.data_ptr() for g in kept]
    for g in graphed:
        g.reset()
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(16)]
    torch.cuda.synchronize()
    assert [g.data_ptr() for g in kept] == addresses
    assert_equal(kept, snapshot, "grads held across the reset")
    del junk


def test_lazy_clones_is_in_force_where_grads_are_owned_and_returned():
    """On by default, also with a caller's pool and with a schedule; off
    with lazy_clones=False, with aliases, with clones from graphed's pool
    and where grads are added into an attribute: there grads are copied at
    every backward (or aliased, or added)."""
    def fresh(**opts):
        model = torch.nn.Linear(8, 8).cuda()
        g = gt.make_graphed_callables(model, (torch.randn(4, 8, device="cuda", requires_grad=True),), **opts)
        on = g.session_stats()["lazy_clones"]
        g.reset()
        return on

    assert fresh()
    assert fresh(pool=torch.cuda.graph_pool_handle())
    assert not fresh(lazy_clones=False)
    assert not fresh(clone_param_grads_on_return=False)
    assert not fresh(clones_from_torch_allocator=False)
    assert not fresh(accumulate_param_grads_into="grad")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
