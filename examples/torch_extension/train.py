"""A small training loop with graphed layers, next to the same layers run
eagerly: a 4-layer MLP with dropout, each layer graphed with
graphed.torch.make_graphed_callables (owned grads, fresh dropout masks at
every replay). Prints whether graphed training matched eager bit for bit.
Needs a GPU and the graphed package (python/README.md).

    python3 examples/torch_extension/train.py
"""
import copy

import torch
import torch.nn as nn

import graphed.torch


def mlp(width=256, depth=4):
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)) for _ in range(depth - 1)]
    return [m.cuda() for m in layers + [nn.Linear(width, width)]]


def train(layers, steps=10, width=256, batch=64):
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.05)
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x, target = torch.randn(batch, width, device="cuda"), torch.randn(batch, width, device="cuda")
        y = x
        for m in layers:
            y = m(y)
        nn.functional.mse_loss(y, target).backward()
        opt.step()
    return [p.detach().clone() for m in layers for p in m.parameters()]


def main():
    torch.manual_seed(0)
    eager = mlp()
    layers = copy.deepcopy(eager)
    # One sample per layer; the first layer's input needs no grad, the others' do.
    samples = tuple((torch.randn(64, 256, device="cuda", requires_grad=i > 0),) for i in range(len(layers)))
    layers = list(graphed.torch.make_graphed_callables(tuple(layers), samples))
    same = all(torch.equal(a, b) for a, b in zip(train(layers), train(eager)))
    print("graphed training matches eager bit for bit:", same)
    for layer in layers:  # the graphs and their buffers are freed with the last
        layer.reset()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
