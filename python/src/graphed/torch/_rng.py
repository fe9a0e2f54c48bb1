"""Which CUDA generators draw graph-safely inside graphed callables, and the
saving and restoring of their states around capture (warmup draws random
numbers; Transformer Engine restores them afterwards, and so does graphed).

The device's default generator always does. register_generator adds others
for every later make_graphed_callables call (what Transformer Engine's RNG
tracker registers); Transformer Engine's own tracker states are added when
Transformer Engine is already imported."""
import sys

import torch

_registered = []


def register_generator(generator: torch.Generator) -> None:
    """Makes `generator` (a CUDA torch.Generator, for example one from
    `torch.cuda.default_generators[i].graphsafe_get_state()`) draw fresh
    numbers at every replay of the graphs captured from now on."""
    if not isinstance(generator, torch.Generator) or generator.device.type != "cuda":
        raise TypeError(f"register_generator takes a CUDA torch.Generator, not {generator!r}")
    if not any(g is generator for g in _registered):
        _registered.append(generator)


def registered_generators():
    return list(_registered)


def _transformer_engine_states():
    distributed = sys.modules.get("transformer_engine.pytorch.distributed")
    if distributed is None or not hasattr(distributed, "get_all_rng_states"):
        return []
    try:
        return [g for g in distributed.get_all_rng_states().values() if isinstance(g, torch.Generator)]
    except Exception:
        return []


def generators_for(device: torch.device, extra):
    """The generators, besides the default one, for a capture on `device`."""
    out = []
    for g in list(_registered) + _transformer_engine_states() + list(extra or ()):
        if g.device.type == "cuda" and (g.device.index or 0) == device.index and not any(g is h for h in out):
            out.append(g)
    return out


def save(device: torch.device, generators):
    gens = [torch.cuda.default_generators[device.index]] + list(generators)
    return [(g, g.get_state()) for g in gens]


def restore(saved):
    for g, state in saved:
        g.set_state(state)
