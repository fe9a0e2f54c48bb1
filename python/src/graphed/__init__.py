"""graphed: capture training layers' forward and backward passes into CUDA
graphs, replay them, and return parameter gradients with safe lifetimes.

The PyTorch integration is graphed.torch (make_graphed_callables, a drop-in
for torch's and Transformer Engine's). This top-level module imports nothing
heavy.
"""

__version__ = "0.1.0"
