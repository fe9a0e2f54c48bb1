"""A capture that names what broke (docs/pytorch.md, "When a capture
fails"): an operation that stream capture does not allow, issued by a
module's forward or backward under capture only (a host synchronisation by
`.item()` or `torch.cuda.synchronize()`, an allocation outside the graph's
pool, work on a stream the capture does not know), a Python exception, in a
bucket: `make_graphed_callables` raises a RuntimeError whose message names
the callable (name and index), the pass, the microbatch or bucket, the
operation (the torch operator, or the driver's error) and the Python line
that issued it, with the callback's traceback after; nothing of the capture
is left held, and the module captures again once fixed. Without a GPU: the
frame a message names (`failure_site`) and, with the extension, the torch
operator an exception unwound (`_failure_report`)."""
import gc
import os
import sys

import pytest

from _support import needs_extension, needs_gpu, torch

if torch is not None:
    import torch.nn as nn

    import graphed.torch as gt

from graphed.torch._errors import failure_site

HERE = os.path.basename(__file__)


def capturing():
    return torch.cuda.is_current_stream_capturing()


if torch is not None:

    class Faulty(nn.Module):
        """A Linear whose forward does `fault(x)` under capture only."""

        def __init__(self, fault=None):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.fault = fault

        def forward(self, x):
            if self.fault is not None and capturing():
                self.fault(x)
            return self.fc(x).relu()

    class ItemInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            if capturing():
                g.sum().item()  # item in backward
            return g * 2


def sample(rows=8):
    return (torch.randn(rows, 16, device="cuda", requires_grad=True),)


def capture_error(module, samples=None):
    """The message make_graphed_callables raises capturing `module`."""
    with pytest.raises(RuntimeError) as e:
        gt.make_graphed_callables(module, samples or sample())
    return str(e.value)


def assert_parts(msg, *parts):
    for part in parts:
        assert part in msg, f"{part!r} missing from: {msg}"


def held():
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), gt.memory_report()


def assert_released(before):
    """Nothing of the failed capture is held: torch's allocations, and
    graphed's accounting (memory_report) as before."""
    after = held()
    assert after[0] <= before[0], f"torch holds {after[0] - before[0]} bytes more after the failed capture"
    for key in ("total_bytes", "allocations", "live_sessions", "graphs", "torch_bytes"):
        assert after[1][key] == before[1][key], f"{key}: {before[1][key]} before, {after[1][key]} after"
    assert len(after[1]["sessions"]) == len(before[1]["sessions"]), after[1]


def where(module_forward_marker):
    """The line number in this file of the line holding the marker."""
    with open(__file__) as f:
        for n, line in enumerate(f, 1):
            if module_forward_marker in line and "where(" not in line:
                return f"{HERE}:{n}"
    raise AssertionError(module_forward_marker)


# ---- without a GPU ------------------------------------------------------------------------


def test_failure_site_is_the_last_frame_of_the_callers_code():
    def inner():
        raise ValueError("boom")  # the raising line

    try:
        inner()
    except ValueError:
        site = failure_site(sys.exc_info()[2])
    assert site.startswith(__file__ + ":"), site
    assert site.endswith("in inner: raise ValueError(\"boom\")  # the raising line"), site


def test_failure_site_skips_the_libraries_frames():
    import graphed.torch

    library = os.path.join(os.path.dirname(graphed.torch.__file__), "_fake_library.py")
    code = compile("def call(f):\n    f()\n", library, "exec")
    scope = {}
    exec(code, scope)

    def user():
        raise KeyError("k")

    try:
        scope["call"](user)
    except KeyError:
        site = failure_site(sys.exc_info()[2])
    assert "in user: raise KeyError" in site and "_fake_library" not in site, site


def test_failure_site_of_no_frame_is_empty():
    assert failure_site(None) == ""


_OPERATOR_ON_GPU = (
    "known defect, seen on the H100 machine (2026-12-07, torch 2.11, Python 3.12): the operator "
    "watch (RecordFunction callbacks) names no torch operator there, while it does on the CPU "
    "machines; the report still names the Python line"
)
_TORCH_ERROR_ON_GPU = (
    "known defect, seen on the H100 (2026-12-07): the error raised is torch's 'operation failed due "
    "to a previous error during capture' from a later call on the invalidated capture, not "
    "graphed's message naming the pass (since 2026-12-08 an error undoing the capture is told after "
    "the capture's own and the reset runs every stage; not yet run on a GPU: if this passes there, "
    "remove the mark)"
)


@needs_extension
@pytest.mark.xfail(torch is not None and torch.cuda.is_available(), reason=_OPERATOR_ON_GPU, strict=True)
def test_failure_report_names_the_torch_operator_and_the_line():
    from graphed import _torch_ext

    def fault():
        torch.ones(2).view(3)  # view of 2 elements as 3

    report = _torch_ext._failure_report(fault)
    assert_parts(report, "torch operator aten::view", f"{where('# view of 2 elements as 3')} in fault",
                 "torch.ones(2).view(3)")
    assert _torch_ext._failure_report(lambda: None) == ""


@needs_extension
def test_failure_report_of_a_python_exception_names_its_line():
    from graphed import _torch_ext

    def fault():
        raise ValueError("not under capture")  # python fault

    report = _torch_ext._failure_report(fault)
    assert "torch operator" not in report, report
    assert_parts(report, where("# python fault"), "ValueError: not under capture")


# ---- on a GPU --------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.xfail(reason=_TORCH_ERROR_ON_GPU, strict=True)
def test_item_in_forward_names_the_operator_and_the_line():
    before = held()
    msg = capture_error(Faulty(lambda x: x.sum().item()).cuda())  # item under capture
    assert_parts(msg, "forward", "callable 'Faulty_0' (index 0) in session", "microbatch 0, no buckets",
                 "torch operator aten::", where("# item under capture"),
                 "callable 'Faulty_0': ")  # the callback's traceback after graphed's message
    assert_released(before)


@needs_gpu
def test_synchronize_in_forward_names_the_line():
    msg = capture_error(Faulty(lambda x: torch.cuda.synchronize()).cuda())  # device sync
    assert_parts(msg, "forward pass of callable 'Faulty_0' (index 0)", "microbatch 0, no buckets",
                 where("# device sync"), "torch.cuda.synchronize()")


@needs_gpu
@pytest.mark.xfail(reason=_TORCH_ERROR_ON_GPU, strict=True)
def test_item_in_backward_names_the_backward_pass():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return ItemInBackward.apply(self.fc(x))

    msg = capture_error(M().cuda())
    assert_parts(msg, "backward", "callable 'M_0' (index 0)", "microbatch 0, no buckets", "torch operator aten::",
                 where("# item in backward"))


@needs_gpu
def test_pinned_allocation_outside_the_pool_is_named():
    msg = capture_error(Faulty(lambda x: torch.empty(1 << 20, pin_memory=True)).cuda())  # pinned alloc
    assert_parts(msg, "forward", "callable 'Faulty_0' (index 0)", "microbatch 0, no buckets",
                 where("# pinned alloc"))


@needs_gpu
@pytest.mark.xfail(reason=_TORCH_ERROR_ON_GPU, strict=True)
def test_work_on_a_stream_the_capture_does_not_know_is_named():
    side = torch.cuda.Stream()

    def fork(x):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.mul(2)  # never joined back

    msg = capture_error(Faulty(fork).cuda())
    assert_parts(msg, "capture of the forward pass of callable 'Faulty_0' (index 0)", "microbatch 0, no buckets",
                 "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "was not joined back")


@needs_gpu
def test_a_python_exception_keeps_its_traceback_and_names_its_line():
    def fault(x):
        raise ValueError("a shape this layer refuses")  # python raise

    msg = capture_error(Faulty(fault).cuda())
    assert_parts(msg, "the forward callback of callable 'Faulty_0' (index 0)", "microbatch 0, no buckets",
                 "returned 1 during capture", where("# python raise"),
                 "ValueError: a shape this layer refuses", "callable 'Faulty_0': ")


@needs_gpu
def test_the_bucket_is_named():
    def fault(x):
        if x.shape[0] == 16:
            torch.cuda.synchronize()  # bucket sync

    samples = gt.Buckets(sample(16), sample(8))
    msg = capture_error(Faulty(fault).cuda(), samples)
    assert_parts(msg, "callable 'Faulty_0' (index 0)", "microbatch 0, bucket 1 (16 rows)", where("# bucket sync"))


@needs_gpu
@pytest.mark.xfail(
    reason="known defect, seen on the H100 (2026-12-07): torch holds 1,536 bytes more after the failed "
    "capture than before it",
    strict=True,
)
def test_the_module_captures_again_once_fixed():
    before = held()
    module = Faulty(lambda x: x.sum().item()).cuda()
    capture_error(module)
    assert_released(before)
    module.fault = None
    graphed = gt.make_graphed_callables(module, sample())
    x = torch.randn(8, 16, device="cuda", requires_grad=True)
    graphed(x).sum().backward()
    assert x.grad is not None
