"""Transformer Engine's interleaved pipeline schedule (`_order`,
`_num_layers_per_chunk`): Transformer Engine's checks of those arguments
against the callables and sample_args, with its messages (`check_order`,
pure Python: no torch), then the schedule as graphed reads it
(`from_order`: its steps, microbatches and the layers of each chunk, from
the library through the compiled extension, which checks graphed's own
rules with graphed's messages), and the mapping between Transformer
Engine's sample_args entries and graphed's (callable, microbatch)
instances.

In `_order`, chunks count from 1: `c` is a forward of chunk c, `-c` a
backward, `-c - 0.5` a delayed weight-gradient step. graphed numbers chunks
from 0 and writes each step as (pass, chunk).
"""
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union


class Schedule(NamedTuple):
    steps: List[Tuple[int, int]]  # (pass, chunk from 0), in order
    layers_per_chunk: List[int]
    microbatches: int
    prefix: List[int]  # first callable of each chunk

    @property
    def chunks(self) -> int:
        return len(self.layers_per_chunk)

    def sample_index(self, chunk: int, microbatch: int, layer: int) -> int:
        """Index in Transformer Engine's sample_args (and in the tuple it
        returns) of a layer's forward for one microbatch: chunk by chunk,
        microbatch by microbatch, layer by layer."""
        return self.prefix[chunk] * self.microbatches + microbatch * self.layers_per_chunk[chunk] + layer

    def entries(self) -> List[Tuple[int, int]]:
        """(callable, microbatch) of every sample_args entry, in order."""
        out = []
        for c, n in enumerate(self.layers_per_chunk):
            for m in range(self.microbatches):
                for l in range(n):
                    out.append((self.prefix[c] + l, m))
        return out


def _is_wgrad(value) -> bool:
    return math.ceil(value) != value


def check_order(
    order: Sequence[Union[int, float]],
    num_layers_per_chunk: Optional[Union[int, Sequence[int]]],
    num_callables: int,
    num_sample_args: int,
) -> Optional[List[int]]:
    """Transformer Engine's checks of `_order` and `_num_layers_per_chunk`
    against the callables and sample_args, with its messages. The rules of
    the schedule itself (steps, chunks, microbatches, how the callables
    split into chunks) are graphed's, checked by `from_order` with its
    messages; an order these checks cannot read (no forward or backward
    step, no positive chunk) is left to it. Returns
    `_num_layers_per_chunk` as one int per chunk, or None when it is not
    given (graphed then splits the callables evenly)."""
    order = list(order)
    without_wgrad = []
    wgrad = False
    for value in order:
        if value > 0:
            if not float(value).is_integer():
                raise TypeError(f"Forward order value must be an integer, but got {type(value).__name__}.")
            without_wgrad.append(int(value))
        elif _is_wgrad(value):
            if math.ceil(value) - value != 0.5:
                raise ValueError(f"The order diff of wgrad and dgrad must be 0.5, get {math.ceil(value) - value}.")
            wgrad = True
        else:
            without_wgrad.append(int(value))
    given = None
    if isinstance(num_layers_per_chunk, int):
        given = num_layers_per_chunk
    elif num_layers_per_chunk is not None:
        given = [int(n) for n in num_layers_per_chunk]
    if not without_wgrad or max(without_wgrad) < 1:
        return given if isinstance(given, list) else None
    chunks = max(without_wgrad)
    microbatches = len(without_wgrad) // chunks // 2
    if chunks * microbatches * 2 != len(without_wgrad):
        raise ValueError(
            f"Pipeline-parallel order dimension mismatch: num_model_chunks ({chunks}) * num_microbatches "
            f"({microbatches}) * 2 = {chunks * microbatches * 2}, but len(_order_without_wgrad) = "
            f"{len(without_wgrad)}"
        )
    if wgrad:
        if given is None:
            raise ValueError("'_num_layers_per_chunk' must be provided when delay_wgrad_compute is True.")
        for n in [given] * chunks if isinstance(given, int) else given:
            if n != 1:
                raise ValueError(
                    f"Each model chunk must have only one layer when delay_wgrad_compute is True, but got {n} layers."
                )
    if given is None:
        if not (num_sample_args * 2 >= len(without_wgrad) and num_sample_args * 2 % len(without_wgrad) == 0):
            raise ValueError(
                f"{num_sample_args} * 2 >= {len(without_wgrad)} and {num_sample_args} * 2 % {len(without_wgrad)} == 0"
            )
        layers = [num_sample_args // chunks // microbatches] * chunks
    elif isinstance(given, int):
        layers = given = [given] * chunks
    else:
        layers = given
        if len(layers) != chunks:
            raise ValueError(
                "If _num_layers_per_chunk is provided, it must be an integer or a list of "
                f"{chunks} integers, but got {num_layers_per_chunk}."
            )
    total = sum(layers)
    if num_callables != total:
        raise ValueError(
            f"Callables should have ({total}) entries when order input is provided but got {num_callables}."
        )
    if num_sample_args != total * microbatches:
        raise ValueError(f"Expected {total * microbatches} args tuple, but got {num_sample_args}.")
    for c in range(1, chunks + 1):
        dgrad = sum(1 for value in order if value == -c)
        wg = sum(1 for value in order if _is_wgrad(value) and math.ceil(value) == -c)
        if wg and wg != dgrad:
            raise RuntimeError(
                f"Number of wgrad graph({wg}) doesn't match number of dgrad graphs ({dgrad}) for chunk {-c}."
            )
    return given


def from_order(order, layers_per_chunk: Optional[List[int]], num_callables: int, library) -> Schedule:
    """The schedule graphed derives from `_order` (checked by check_order)
    for `num_callables` callables split per `layers_per_chunk` (None:
    evenly): `library` is the compiled extension, which asks graphed
    (graphed_schedule_from_te_order, graphed_schedule_shape); a schedule
    that breaks one of graphed's rules raises ValueError with its message."""
    s = library.schedule([float(value) for value in order], layers_per_chunk or [], num_callables)
    return Schedule(
        [tuple(step) for step in s["steps"]], list(s["layers_per_chunk"]), s["microbatches"], list(s["chunk_first"])
    )
