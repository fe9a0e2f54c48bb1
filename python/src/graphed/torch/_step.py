"""make_graphed_step: a training step (a chain of layers and its loss, over
N microbatches) captured as one graph and replayed with one launch, each
parameter's grad added into `param.grad` (or another attribute, such as
Megatron's `main_grad`) as eager gradient accumulation adds it.

    step = graphed.torch.make_graphed_step(blocks, loss_fn, (x,), (y,), microbatches=4)
    losses = step(xs, ys)           # xs: [4, *x.shape]; losses: [4]
    optimizer.step(); optimizer.zero_grad()

A tuple gives several inputs or targets: step(xs, ys) is step((xs,), (ys,)).

The modules keep their own forward (eager); `step.callables` are their
graphs, callable on their own, in the step's memory."""
import gc
import sys

import torch

from . import _ddp, _optim, _rng
from ._binding import Binding
from ._buckets import Buckets
from ._errors import AliasHeldError
from ._make import _device_of, _module_checks, _param_slot, _pool_id, callable_spec, extension


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _chain_samples(layers, sample_input, sample_target, loss_fn):
    """Each layer's sample inputs (the previous layer's outputs on the
    samples, run eagerly) and the loss's (the last outputs, then the
    targets). Outputs take a grad where they require one."""
    samples, args = [], _as_tuple(sample_input)
    for layer in layers:
        samples.append(args)
        with torch.enable_grad():
            outs = _as_tuple(layer(*args))
        args = tuple(o.detach().clone().requires_grad_(o.requires_grad) for o in outs)
    samples.append(args + _as_tuple(sample_target))
    return samples


class GraphedStep:
    """A training step in one launch (make_graphed_step). Call it with the
    data of `n` microbatches: `inputs` (what the first layer takes) and
    `targets` (what the loss takes after the last layer's outputs), each
    tensor with a leading dimension of `n` (the step's microbatch count;
    with loop=True any count from 1 to it; a step of one microbatch also
    takes the sample's shape). It runs the forward and backward of each
    microbatch in turn, adds each parameter's grad into its `attr`
    (`param.grad` by default) and returns the losses, shape [n].

    The grads are added into the tensors the parameters held at capture.
    Set to None between steps (optimizer.zero_grad()), such a tensor is
    zeroed and given back to its parameter, unless something still holds it
    (AliasHeldError: the step would write into it); replaced by another
    tensor, the call raises ValueError."""

    def __init__(self, impl, callables, params, slots, attr, overwrite, update=None, ddp=None):
        self._impl = impl
        self._update = update
        self._ddp = ddp
        self._callables = callables
        self._attr = attr
        self._overwrite = overwrite
        # (name, parameter at capture, its slot, its destination, what
        # holds it at capture: Python references and storage users),
        # grads only.
        self._dsts = []
        for (name, p), slot, d in zip(params, slots, impl.destinations):
            # A tied parameter (in two callables) has one destination.
            if d is not None and not any(e[3] is d for e in self._dsts):
                self._dsts.append((name, p, slot, d, 0))
            del d
        # What holds each destination when its attribute is None and
        # nothing else does (measured so, as the check counts: this list's
        # entry, the check's variable, getrefcount's argument, and whatever
        # the extension keeps), so that a call can tell a tensor still held.
        self._refs = [self._baseline(k) for k in range(len(self._dsts))]
        self.microbatches = impl.microbatches

    def _baseline(self, k):
        name, p, slot, d, _ = self._dsts[k]
        attached = getattr(p, self._attr, None) is d
        setattr(p, self._attr, None)
        refs = sys.getrefcount(d)
        self._dsts[k] = (name, p, slot, d, extension().storage_use_count(d))
        if attached:
            setattr(p, self._attr, d)
        return refs

    def __call__(self, inputs, targets=(), n=None):
        if self.is_reset:
            if self._ddp is not None and self._ddp.released_by_group:
                raise RuntimeError(
                    "graphed step: it was reset when its process group was destroyed (destroy_process_group): its "
                    "graph held that group's all-reduce; make the step again with the new group"
                )
            raise RuntimeError("graphed step: it was reset")
        if self._ddp is not None and not self._ddp.alive():
            raise RuntimeError(
                "graphed step: its ddp process group is gone (destroyed, or torch.distributed torn down); the step's "
                "graph holds that group's all-reduce: make the step again with the new group"
            )
        data = [*_as_tuple(inputs), *_as_tuple(targets)]
        if n is None:
            first = data[0] if data and isinstance(data[0], torch.Tensor) else None
            n = first.shape[0] if first is not None and self.microbatches > 1 else 0
        update = self._update
        scalars = lrs = None
        if update is not None:
            scalars, lrs = update.before_call()
        attached = self._destinations_ready()
        try:
            losses = self._impl.replay(data, int(n), scalars)
            if update is not None:
                update.last = lrs  # what the scalar block holds now
            return losses
        except BaseException:
            # A refused call changes nothing the caller sees: the attributes
            # set to None are None again (the destinations, held by nothing
            # else, may have been zeroed).
            for p in attached:
                setattr(p, self._attr, None)
            raise

    def _destinations_ready(self):
        """Each parameter's attribute holds its destination again (zeroed
        where it was set to None), or the call raises before anything runs.
        Returns the parameters whose attribute it set."""
        attr, ext = self._attr, None
        # First every check (a refusal's traceback then holds no destination).
        none = []
        for k, ((name, p, slot, d, uses), refs) in enumerate(zip(self._dsts, self._refs)):
            if slot is not None:
                p = slot[0].get(slot[1], p)
            g = getattr(p, attr, None)
            if g is d:
                continue
            if g is not None:
                shape, address = tuple(d.shape), d.data_ptr()
                del d  # not kept alive by this frame in the traceback
                raise ValueError(
                    f"graphed step: parameter '{name}'.{attr} is another tensor than the one the step adds its grad "
                    f"into (captured: {shape} at {address:#x}); set it back, or to None (zero_grad()), or make the "
                    "step again"
                )
            ext = ext or extension()
            if sys.getrefcount(d) > refs or ext.storage_use_count(d) > uses:
                del d  # not kept alive by this frame in the traceback
                raise AliasHeldError(
                    f"graphed step: parameter '{name}'.{attr} was set to None, but its tensor from the last step is "
                    "still referenced; the step would zero it and add this step's grad into it. Drop that reference "
                    "(or clone it), or zero the grads in place (zero_grad(set_to_none=False))"
                )
            none.append((k, p))
        if none:
            # Added into: zeroed first; set: the step overwrites it.
            if not self._overwrite:
                torch._foreach_zero_([self._dsts[k][3] for k, _ in none])
            for k, p in none:
                setattr(p, attr, self._dsts[k][3])
        return [p for _, p in none]

    def skipped(self):
        """With a grad_scaler: whether the last call skipped its optimizer
        step (its grads were not finite), as eager GradScaler.step skips it.
        Waits for that call's graph to finish."""
        return bool(self._skipped()[0])

    @property
    def skipped_total(self):
        """With a grad_scaler: how many calls since capture skipped their
        optimizer step (counted on the device; waits for the last call)."""
        return int(self._skipped()[1])

    def _skipped(self):
        if self._update is None or self._update.scaler is None:
            raise RuntimeError("graphed step: it has no grad_scaler, so it never skips its optimizer step")
        if self.is_reset:
            raise RuntimeError("graphed step: it was reset")
        return self._impl.skipped()

    @property
    def optimizer(self):
        """The optimizer the step's graph runs (None: the caller steps it)."""
        return None if self._update is None else self._update.opt

    @property
    def process_group(self):
        """The process group whose all-reduce the step's graph holds (None:
        made without ddp)."""
        return None if self._ddp is None else self._ddp.group

    @property
    def collectives(self):
        """The collectives the step's graph holds, in the order it runs
        them (made with ddp; [] without): per bucket a
        Collective(op, reduce, dtype, numel, nbytes, bucket, params,
        scale), as the ranks compared them before the first call."""
        return [] if self._ddp is None else list(self._ddp.recorded)

    @property
    def callables(self):
        """The layers and the loss, graphed (each replayable on its own)."""
        return self._callables

    def session_stats(self):
        """graphed's memory and graph figures of the step's session."""
        return self._callables[0].session_stats()

    def reset(self):
        """Frees the step's graphs and memory; calls then raise."""
        self._callables[0].reset()

    @property
    def is_reset(self):
        """Whether its graphs are gone: reset, or one of its callables
        released (the step's graphs go with it)."""
        return any(c.is_released for c in self._callables)


def make_graphed_step(
    layers,
    loss_fn,
    sample_input,
    sample_target=(),
    *,
    microbatches=1,
    loop=False,
    accumulate_param_grads_into="grad",
    param_grads="add",
    num_warmup_iters=3,
    generators=None,
    pool=None,
    capture_stream=None,
    rebind_params=True,
    optimizer=None,
    clip_grad_norm=None,
    grad_scaler=None,
    ddp=None,
    bucket_cap_mb=None,
):
    """Captures a training step: `layers` (modules or functions, in order:
    layer k+1 takes layer k's outputs) and `loss_fn` (takes the last
    layer's outputs, then the targets; returns a one-element tensor), for
    `microbatches` microbatches per launch (unrolled, each drawing its own
    random numbers; loop=True: one captured microbatch in a conditional
    WHILE node, a call running 1 to `microbatches`, each iteration drawing
    its own random numbers too). `sample_input` and `sample_target` are one
    microbatch's data (a tensor or a tuple). Each parameter's grad is added
    into its `accumulate_param_grads_into` attribute ("grad", created as
    zeros where None; "main_grad"; ...), a contiguous tensor of its shape and
    dtype; with param_grads="set" each call sets it to the call's grads
    instead (the sum over its microbatches, no zeroing needed between
    steps: torch's whole-step capture recipe). Returns a GraphedStep.

    `optimizer` (torch.optim SGD, Adam or AdamW) puts the update in the
    step's graph: after the last microbatch, clip_grad_norm_(params,
    `clip_grad_norm`, foreach=True) where given, optimizer.step(), and the
    grads zeroed (param_grads="add"; "set" leaves each call's grads in
    .grad). `grad_scaler` (torch.amp.GradScaler, fp16): the loss's backward
    is seeded with its scale, and unscale_, the inf check, the skipped
    step and the scale's update run in the graph too. The learning rate is
    read at each call (schedulers are followed); the rest of the optimizer
    is held as captured, a change refused.

    `ddp` (True: the default process group; or a ProcessGroup; NCCL only)
    puts the data-parallel all-reduce in the step's graph, after the last
    microbatch's backward and before clipping, unscaling and the optimizer
    (in the main graph, never in the conditional node that may skip a
    scaled update): the grads bucketed as DistributedDataParallel buckets
    them (`bucket_cap_mb`, default DDP's: 1 MiB for the first bucket, then
    25), each bucket multiplied by 1 / world size, summed over the group
    and copied back, so that .grad (or the accumulate attribute) holds what
    eager DDP leaves there, with no_sync() for all but the last
    microbatch. Without an optimizer the step ends with the reduced grads.
    A gloo group or an uninitialised torch.distributed is refused (keep the
    all-reduce outside the graph: DDP over make_graphed_callables layers).
    Every rank must make the same step: the ranks' captured collectives are
    compared before the first call (CollectiveMismatchError naming the
    first difference). destroy_process_group() resets the steps whose
    graphs hold the group's collectives first. See docs/pytorch.md."""
    layers = tuple(layers) if isinstance(layers, (tuple, list)) else (layers,)
    if not layers:
        raise ValueError("make_graphed_step: no layers")
    if param_grads not in ("add", "set"):
        raise ValueError(f"param_grads must be 'add' or 'set', not {param_grads!r}")
    if not isinstance(accumulate_param_grads_into, str) or not accumulate_param_grads_into.isidentifier():
        raise ValueError(
            "accumulate_param_grads_into must name a parameter attribute ('grad', 'main_grad'), "
            f"not {accumulate_param_grads_into!r}"
        )
    if isinstance(sample_input, Buckets) or isinstance(sample_target, Buckets):
        raise ValueError(
            "make_graphed_step: a step graph holds one shape; Buckets go to make_graphed_callables (each layer "
            "graphed with its buckets, called as usual)"
        )
    callables = layers + (loss_fn,)
    for fn in callables:
        _module_checks(fn)
        if isinstance(fn, torch.nn.Module) and not fn.training:
            raise RuntimeError("make_graphed_step: a step trains; every module must be in training mode")
    if len({id(fn) for fn in callables}) != len(callables):
        raise ValueError("make_graphed_step: a module is given twice; each layer is graphed once")
    _optim.check_arguments(
        optimizer,
        clip_grad_norm,
        grad_scaler,
        accumulate_param_grads_into,
        [p for fn in callables if isinstance(fn, torch.nn.Module) for p in fn.parameters()],
    )
    _ddp.check_bucket_cap(bucket_cap_mb, ddp)
    group = _ddp.resolve_group(ddp)
    if not torch.cuda.is_available():
        raise RuntimeError("graphed.torch needs a CUDA device; torch.cuda.is_available() is False")
    ext = extension()
    attr = accumulate_param_grads_into

    def destination(p):
        d = getattr(p, attr, None)
        if d is None:
            d = torch.zeros_like(p, memory_format=torch.contiguous_format)
            setattr(p, attr, d)
        return d

    gens = None
    saved = None
    update = None
    allreduce = None
    collecting = gc.isenabled()
    try:
        probe = Binding(_as_tuple(sample_input), {})
        device = _device_of([probe], callables)
        gens = _rng.generators_for(device, generators)
        saved = _rng.save(device, gens)
        samples = _chain_samples(layers, sample_input, sample_target, loss_fn)
        _rng.restore(saved)
        specs, params, slots, names = [], [], [], []
        for k, fn in enumerate(callables):
            name, _, spec = callable_spec(ext, k, fn, Binding(samples[k], {}), None)
            names.append(name)
            specs.append(spec)
            params += [(f"{name}.{n}", p) for n, p in zip(spec["param_names"], spec["params"])]
            slots += spec["param_slots"] or [None] * len(spec["params"])
        options = dict(
            num_warmup_iters=int(num_warmup_iters),
            training=True,
            rebind_params=bool(rebind_params),
            accumulate_into=attr,
            copy_into=param_grads == "set",
            pool=_pool_id(pool),
            capture_stream=None if capture_stream is None else (capture_stream.cuda_stream, capture_stream.device_index),
            generators=gens,
        )
        step = dict(microbatches=int(microbatches), loop=bool(loop), destination=destination)
        if optimizer is not None:
            update = _optim.StepUpdate(optimizer, clip_grad_norm, grad_scaler, param_grads == "add", params, device)
            with torch.cuda.device(device):
                update.warm_up()
            step.update(
                update_apply=update.apply,
                update_check=update.check if update.scaler is not None else None,
                scalar_bytes=update.scalar_bytes,
                loss_seed=update.seed,
            )
        if group is not None:
            # Planned, and the plans compared between the ranks, before any
            # collective of the step runs (every rank takes part, one whose
            # plan failed too).
            with torch.cuda.device(device):
                allreduce = _ddp.StepAllReduce.agreed(group, params, bucket_cap_mb, device)
            _ddp.first_in_main_graph(step, allreduce.record)
        gc.disable()
        with torch.cuda.device(device):
            if allreduce is None:
                impls, impl = ext.make_step(specs, options, step)
            else:
                try:
                    allreduce.warm_up()
                    impls, impl = ext.make_step(specs, options, step)
                except BaseException as e:
                    # The other ranks learn of it in the comparison after
                    # capture (rather than waiting in it), then this error.
                    allreduce.verify(failure=f"{type(e).__name__}: {str(e)[:2000]}")
                    raise
                try:
                    allreduce.verify()
                except BaseException:
                    impls[0].reset()
                    raise
    finally:
        if collecting:
            gc.enable()
        if saved is not None:
            _rng.restore(saved)
    out = GraphedStep(impl, impls, params, slots, attr, param_grads == "set", update, allreduce)
    if allreduce is not None:
        _ddp.register(out)
    return out

