"""The adapter's pass order and buffer-reuse releases (the compiled
extension; no GPU needed)."""
from _support import needs_extension, torch  # noqa: F401

pytestmark = needs_extension

TE = [(0, 0), (0, 1), (0, 0), (0, 1), (1, 1), (1, 0), (0, 0), (0, 1), (1, 1), (1, 0), (1, 1), (1, 0)]


def ext():
    from graphed import _torch_ext

    return _torch_ext


def roles():
    e = ext()
    return e.BUFFER_ROLE_OUTPUT, e.BUFFER_ROLE_GRAD_INPUT, e.BUFFER_ROLE_PARAM_GRADS


def test_pass_order_without_a_schedule():
    assert ext().pass_order(3, [], []) == [(0, 0, 0), (1, 0, 0), (2, 0, 0), (2, 0, 1), (1, 0, 1), (0, 0, 1)]


def test_pass_order_of_transformer_engines_scenario():
    order = ext().pass_order(2, TE, [])
    assert order[:6] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (1, 0, 1), (0, 0, 1)]
    assert order[6:] == [(0, 2, 0), (1, 2, 0), (1, 1, 1), (0, 1, 1), (1, 2, 1), (0, 2, 1)]


def test_pass_order_layers_and_weight_grad():
    # two layers in chunk 0: forward in order, backward in reverse
    assert ext().pass_order(2, [(0, 0), (1, 0)], [2]) == [(0, 0, 0), (1, 0, 0), (1, 0, 1), (0, 0, 1)]
    assert ext().pass_order(1, [(0, 0), (1, 0), (2, 0)], [1]) == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]


def test_reuse_releases_follow_transformer_engines_rules():
    OUTPUT, GRAD_INPUT, PARAM_GRADS = roles()
    rel = ext().reuse_releases(2, TE, [])
    assert all(r == [] for r in rel[:4])  # forwards release nothing
    # a backward lets go of its outputs and cloned parameter grads
    assert (1, 0, OUTPUT) in rel[4] and (1, 0, PARAM_GRADS) in rel[4]
    # chunk 1's first-layer input grad goes once chunk 0's backward of the same microbatch took it
    assert (1, 0, GRAD_INPUT) in rel[5]
    # chunk 0's first-layer input grad goes at the next backward step
    assert (0, 0, GRAD_INPUT) in rel[8]
    assert (1, 1, GRAD_INPUT) in rel[9] and (0, 1, GRAD_INPUT) in rel[10] and (1, 2, GRAD_INPUT) in rel[11]


def test_reuse_releases_with_weight_grad_wait_for_it():
    OUTPUT, _, PARAM_GRADS = roles()
    rel = ext().reuse_releases(1, [(0, 0), (1, 0), (2, 0)], [1])
    assert rel[1] == [(0, 0, OUTPUT)]
    assert rel[2] == [(0, 0, PARAM_GRADS)]


def test_a_first_layer_input_grad_goes_once_the_next_whole_backward_step_ran():
    _, GRAD_INPUT, _ = roles()
    # Two chunks of two layers, two microbatches:
    # F00 F10 F20 F30 F01 F11 F21 F31 B30 B20 B10 B00 B31 B21 B11 B01
    steps = [(0, 0), (0, 1), (0, 0), (0, 1), (1, 1), (1, 0), (1, 1), (1, 0)]
    rel = ext().reuse_releases(4, steps, [2, 2])
    when = {(c, m): k for k, rs in enumerate(rel) for c, m, role in rs if role == GRAD_INPUT}
    assert when[(3, 0)] == 9  # taken by the layer before it
    assert when[(2, 0)] == 11  # chunk 0 took it, and its step ended
    assert when[(0, 0)] == 13  # the next step's last pass, not its first (12)
    assert (0, 1) not in when  # the last step's is kept


def test_versions_agree():
    assert ext().library_version() == ext().header_version()
