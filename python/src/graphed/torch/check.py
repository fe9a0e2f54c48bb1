"""Prints what graphed.torch runs on (versions, the library in use, the
driver and the device) and runs a one-layer self-test: an nn.Linear graphed
next to the same layer run eagerly, outputs and grads bit-identical, and a
grad kept across replays unchanged.

    python -m graphed.torch.check

Exit status 0 when everything that can run here passed (without a GPU the
self-test is skipped, and says so), 1 otherwise.
"""
import copy
import platform
import sys


def main() -> int:
    import graphed

    print(f"graphed package   {graphed.__version__} ({graphed.__file__})")
    print(f"python            {platform.python_version()}")
    try:
        import torch
    except ImportError as e:
        print(f"torch             not importable: {e}")
        return 1
    from graphed.torch import _versions

    in_range = "supported" if _versions.supported(torch.__version__) else "NOT in the supported range"
    print(f"torch             {torch.__version__} (CUDA {torch.version.cuda}); {in_range}")
    print(f"supported torch   {_versions.text()}")
    from graphed.torch._make import extension

    try:
        ext = extension()
    except ImportError as e:
        print(f"extension         {e}")
        return 1
    print(f"extension         built against torch {ext.built_with_torch()}")
    print(f"libgraphed        {ext.library_version()} (header {ext.header_version()})")
    print(f"library path      {ext.library_path()}")
    drv = ext.driver()
    version = drv["driver_cuda_version"]
    driver = f"CUDA {version // 1000}.{version % 1000 // 10}" if version else "none"
    print(f"driver            {driver}, {drv['device_count']} device(s) {drv['message']}".rstrip())
    if not torch.cuda.is_available() or drv["device_count"] == 0:
        print("self-test         skipped: no CUDA device here")
        return 0
    print(f"device            {torch.cuda.get_device_name()} (capability {'.'.join(map(str, torch.cuda.get_device_capability()))})")
    return self_test(torch)


def self_test(torch) -> int:
    import graphed.torch as gt

    torch.manual_seed(0)
    eager = torch.nn.Linear(256, 256).cuda()
    layer = copy.deepcopy(eager)
    gt.make_graphed_callables(layer, (torch.randn(32, 256, device="cuda", requires_grad=True),))
    checks = []
    kept = None
    for step in range(3):
        x = torch.randn(32, 256, device="cuda", requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        y, ye = layer(x), eager(xe)
        y.sum().backward()
        ye.sum().backward()
        checks.append(("output", torch.equal(y, ye)))
        checks.append(("input grad", torch.equal(x.grad, xe.grad)))
        checks.append(("weight grad (accumulated)", torch.equal(layer.weight.grad, eager.weight.grad)))
        if step == 0:
            kept, kept_value = layer.weight.grad, layer.weight.grad.clone()
            layer.weight.grad = None
            eager.weight.grad = None
    torch.cuda.synchronize()
    checks.append(("grad kept across replays unchanged", torch.equal(kept, kept_value)))
    layer.reset()
    ok = all(good for _, good in checks)
    for what, good in checks:
        print(f"self-test         {what}: {'ok' if good else 'FAILED'}")
    print(f"self-test         {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
