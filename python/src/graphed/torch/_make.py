"""make_graphed_callables: Transformer Engine's signature (and torch's),
graphed underneath. Checks the arguments as Transformer Engine does,
flattens each callable's arguments, prepares hooks and generators, and hands
everything to the extension, which warms up and captures through graphed."""
import gc

import torch

from . import _buckets, _hooks, _options, _rng
from ._binding import Binding, Outputs
from ._callable import GraphedCallable, Session
from ._schedule import check_order, from_order


def extension():
    """The compiled extension, or an ImportError that says how to build it."""
    try:
        from graphed import _torch_ext
    except ImportError as e:
        raise ImportError(
            "graphed.torch needs its compiled extension (graphed._torch_ext), which failed to import: "
            f"{e}.{_built_for()} Install the package with `pip install --no-build-isolation <graphed>/python` "
            "(set GRAPHED_PREBUILT_LIBRARY on machines without Rust); see python/README.md"
        ) from e
    return _torch_ext


def _built_for():
    """Which torch the extension was built against, where that is not the
    one running (the usual reason it does not load), in a sentence."""
    import pathlib

    import graphed

    try:
        built = (pathlib.Path(graphed.__file__).parent / "built_with_torch.txt").read_text().strip()
    except OSError:
        return ""
    if built == torch.__version__:
        return ""
    return f" It was built against torch {built}; this is torch {torch.__version__}: rebuild it against this torch."


def memory_report():
    """What graphed holds now, as plain data: per live session ("sessions")
    its graphed static bytes, scratch, graph executables, the bytes of
    PyTorch's private pool it captured into (reserved and in use), and per
    callable its own and shared static bytes, graphs, outstanding and cached
    clone blocks and the PyTorch tensors kept for its graphs
    ("torch_bytes"), with whether it was released; and graphed's own
    process-wide accounting: the device bytes it allocated and still holds
    ("total_bytes"), its allocations, live sessions and graph executables.
    docs/memory.md explains each figure."""
    return extension().memory_report()


def export_dot(path=None):
    """Every live session's captured graphs as Graphviz DOT text, one
    digraph per session: a cluster per graph labelled by callable, pass,
    microbatch and bucket (or step), each node by its kind and, for a
    kernel, the kernel's name. Written to `path` when given; returned
    either way. A graphed callable's `export_dot()` gives its own session's."""
    text = extension().export_dot()
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


def graph_pool_handle():
    """A new graph memory pool id, to share between make_graphed_callables
    calls (and torch.cuda.graph captures) through `pool`."""
    return torch.cuda.graph_pool_handle()


def _pool_id(pool):
    if pool is None:
        return None
    pool = getattr(pool, "id", pool)  # torch.cuda.MemPool
    if not (isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(x, int) for x in pool)):
        raise TypeError(f"pool must come from graph_pool_handle() (a pair of ints), not {pool!r}")
    return pool


def _looks_like_pool(value):
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(x, int) for x in value)


def _module_checks(fn):
    if not isinstance(fn, torch.nn.Module):
        return
    if fn._backward_hooks or fn._backward_pre_hooks or fn._forward_hooks or fn._forward_pre_hooks:
        raise RuntimeError(
            "Modules must not have hooks registered at the time they are passed. However, registering hooks on "
            "modules after passing them through make_graphed_callables is allowed. If you have to use hooks during "
            "capture time, you can provide them in the capture_time_hooks argument, and they will be executed "
            "outside the CUDA graph capture context, meaning they will not be recorded into the graph and will not "
            "be replayed."
        )
    if any(b.requires_grad for b in fn.buffers()):
        raise RuntimeError(
            "In any :class:`~torch.nn.Module` passed to :func:`~make_graphed_callables`, only parameters may be "
            "trainable. All buffers must have ``requires_grad=False``."
        )


def _param_slot(module, qualified, param):
    """(the `_parameters` dict of the module owning parameter `qualified`
    of `module`, its key there), or None where `param` is not found there
    (a module whose named_parameters() names something else): that
    parameter is then the tensor registered, whose data may still move."""
    prefix, _, key = qualified.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return None
    params = getattr(owner, "_parameters", None)
    if not isinstance(params, dict) or params.get(key) is not param:
        return None
    return params, key


def _device_of(bindings, callables):
    for b in bindings:
        for t in b.samples:
            if t.is_cuda:
                return t.device
    for fn in callables:
        if isinstance(fn, torch.nn.Module):
            for p in fn.parameters():
                if p.is_cuda:
                    return p.device
    return torch.device("cuda", torch.cuda.current_device())


def callable_spec(ext, k, fn, binding, hooks):
    """What the extension needs of callable `k` (a module or a function)
    with its flattened sample `binding` and capture-time `hooks`: its name,
    its output flattener and its spec."""
    base = type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", "callable")
    name = f"{base}_{k}"
    out = Outputs(f"graphed callable '{name}'")

    # A module's own forward, taken now: its forward attribute is replaced later.
    call = fn.forward if isinstance(fn, torch.nn.Module) else fn

    def forward(flat, call=call, binding=binding, out=out):
        args, kwargs = binding.unflatten(flat)
        return out.flatten(call(*args, **kwargs))

    named = list(fn.named_parameters()) if isinstance(fn, torch.nn.Module) else []
    # Where each parameter lives: its owning module's _parameters dict
    # and key, which every call reads (a Parameter replaced there, as
    # load_state_dict(assign=True) does, is then the one the graphs
    # read and the one that gets the grad).
    slots = [_param_slot(fn, qualified, p) for qualified, p in named]
    hook = None
    if hooks is not None and not _hooks.is_empty(hooks):
        hook = _hooks.Dispatcher(fn, hooks, binding.unflatten, out.unflatten, ext.PASS_FORWARD, ext.PASS_BACKWARD)
    spec = dict(
        name=name,
        forward=forward,
        samples=binding.samples,
        input_names=binding.names,
        params=[p for _, p in named],
        param_names=[n for n, _ in named],
        param_slots=slots if named else None,
        # Frozen here: a later change does not move a grad between clone and alias.
        param_flags=[
            ext.PARAM_FLAGS_DELAYED_WGRAD if getattr(p, "skip_backward_post_hook", False) else 0 for _, p in named
        ],
        hook=hook,
    )
    return name, out, spec


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters=3,
    allow_unused_input=False,
    sample_kwargs=None,
    fp8_enabled=None,
    fp8_calibrating=None,
    fp8_recipe=None,
    fp8_group=None,
    fp8_weight_caching=None,
    enabled=None,
    calibrating=None,
    recipe=None,
    amax_reduction_group=None,
    cache_quantized_params=None,
    _order=None,
    _num_layers_per_chunk=None,
    pool=None,
    retain_graph_in_backward=False,
    _reuse_graph_input_output_buffers=False,
    clone_param_grads_on_return=True,
    pre_warmup_hook=None,
    post_warmup_hook=None,
    capture_time_hooks=None,
    capture_stream=None,
    *,
    _clone_param_grads_on_return=None,
    strict_leases=False,
    debug=False,
    rebind_inputs=True,
    rebind_params=True,
    clones_from_torch_allocator=True,
    lazy_clones=True,
    generators=None,
    accumulate_param_grads_into=None,
    bucket_overflow="eager",
):
    """Graphs `modules` (a module or callable, or a tuple of them), each
    with its sample positional args and keyword args; returns what it was
    given, graphed (Transformer Engine's and torch's make_graphed_callables;
    docs/migration.md lists every argument).

    Differences that matter: parameter grads are owned by default
    (`clone_param_grads_on_return=False` returns aliases of the graph's
    buffers, as torch does); random numbers are drawn afresh at every replay
    (the default CUDA generator, those given in `generators` and those
    registered with register_generator); a call whose tensors differ from
    the sample in shape, dtype, device or requires_grad raises ValueError
    naming the argument. graphed's own options: `strict_leases` (a replay
    that would overwrite an alias still held raises AliasHeldError),
    `debug` (every replay runs pass by pass and checks for a device error
    after each, naming the callable and pass that surfaced it; slower; also
    on with GRAPHED_DEBUG=1 in the environment),
    `clones_from_torch_allocator` (clones from PyTorch's caching allocator,
    the default, or graphed's pool), `lazy_clones` (True, the default:
    every backward writes the parameter grads straight into fresh memory of
    PyTorch's allocator, which autograd gets, where capture verified it (a
    copy into that memory where not): owned grads without a copy, never
    written by a later replay and never moved; in force in training where
    grads go to autograd, with `clone_param_grads_on_return` and
    `clones_from_torch_allocator` on and without buffer reuse; False: every
    grad is copied into a clone at every backward),
    `rebind_inputs` (on by default: inputs and incoming grads are read
    where they are instead of copied, where capture verifies it; a rebound
    input must not be modified in place before its backward; False copies
    them, as torch does),
    `rebind_params` (on by default: every call compares each parameter of a
    module, looked up in its module so that a replaced Parameter counts,
    with what the graphs read, and points the graphs at one that moved,
    where capture verified they can follow it; a move they cannot follow,
    or a parameter of another shape, dtype, device or layout, raises
    ParamMovedError naming it; False: any move raises), `generators`,
    `accumulate_param_grads_into` (None: grads go to autograd; "grad", or
    another attribute of each parameter such as Megatron's "main_grad": the
    backward graph adds each parameter's grad into the tensor that attribute
    holds at the forward, a contiguous tensor of the parameter's shape and
    dtype, `grad` created as zeros where it is None; autograd then gets no
    grad for it, so nothing copies or adds it again, and DDP finds it in
    `param.grad`, its bucket view with gradient_as_bucket_view=True).

    Buckets: a callable's sample_args entry (and sample_kwargs entry) may be
    `graphed.torch.Buckets(sample, sample, ...)`, samples that differ in the
    first dimension of some tensors: every size is captured, sharing one
    memory plan, and a call runs the smallest bucket holding its size
    (docs/pytorch.md). `bucket_overflow`: what a call above the largest
    bucket does, "eager" (runs the callable eagerly, warning once) or
    "raise" (ValueError).
    """
    # torch's positional order has `pool` fifth, where Transformer Engine
    # has sample_kwargs: a pool handle there is taken as the pool.
    if _looks_like_pool(sample_kwargs) and pool is None:
        pool, sample_kwargs = sample_kwargs, None
    if _clone_param_grads_on_return is not None:
        clone_param_grads_on_return = _clone_param_grads_on_return
    single = not isinstance(modules, (tuple, list))
    callables = (modules,) if single else tuple(modules)
    if single:
        sample_args = (sample_args,)
        sample_kwargs = ({} if sample_kwargs is None else sample_kwargs,)
    else:
        sample_args = tuple(sample_args)
        sample_kwargs = tuple({} for _ in sample_args) if sample_kwargs is None else tuple(sample_kwargs)
    _options.check_fp8(
        len(callables),
        fp8_enabled=fp8_enabled, fp8_calibrating=fp8_calibrating, fp8_recipe=fp8_recipe, fp8_group=fp8_group,
        fp8_weight_caching=fp8_weight_caching, enabled=enabled, calibrating=calibrating, recipe=recipe,
        amax_reduction_group=amax_reduction_group, cache_quantized_params=cache_quantized_params,
    )
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_callables does not support the autocast caching. Please set `cache_enabled=False`."
        )
    if accumulate_param_grads_into is not None and (
        not isinstance(accumulate_param_grads_into, str) or not accumulate_param_grads_into.isidentifier()
    ):
        raise ValueError(
            "accumulate_param_grads_into must be None or the name of a parameter attribute ('grad', 'main_grad'), "
            f"not {accumulate_param_grads_into!r}"
        )
    if bucket_overflow not in _buckets.OVERFLOW:
        raise ValueError(f"bucket_overflow must be one of {_buckets.OVERFLOW}, not {bucket_overflow!r}")
    if int(num_warmup_iters) < 0:
        raise ValueError(f"num_warmup_iters must be >= 0, got {num_warmup_iters}")

    modes = [fn.training for fn in callables if isinstance(fn, torch.nn.Module)]
    training = all(modes)
    if not training and any(modes):
        raise RuntimeError(
            "make_graphed_callables only supports when modules are all in training or all in inference mode."
        )
    if _order is None:
        if len(sample_args) != len(callables):
            raise ValueError(
                f"Expected sample_args to have the same length as callables, but got {len(sample_args)} "
                f"sample_args for {len(callables)} callables"
            )
        if len(sample_kwargs) != len(callables):
            raise ValueError(
                f"Expected sample_kwargs to have the same length as callables, but got {len(sample_kwargs)} "
                f"sample_kwargs for {len(callables)} callables"
            )
    else:
        layers_per_chunk = check_order(_order, _num_layers_per_chunk, len(callables), len(sample_args))
        if len(sample_kwargs) != len(sample_args):
            raise ValueError(
                "Pipeline-parallel schedule requires sample_kwargs and sample_args to have the same length, but got "
                f"{len(sample_kwargs)} sample_kwargs for {len(sample_args)} sample_args"
            )
    if _reuse_graph_input_output_buffers:
        if _order is None:
            raise ValueError("`_order` must be provided when `_reuse_graph_input_output_buffers` is True.")
        if not training:
            raise RuntimeError("`_reuse_graph_input_output_buffers` is only available in training mode.")
    for fn in callables:
        _module_checks(fn)
    if _order is None:
        seen = set()
        for k, fn in enumerate(callables):
            if isinstance(fn, torch.nn.Module):
                if id(fn) in seen:
                    raise ValueError(
                        f"callable {k} is a module given before: without _order each module is graphed once "
                        "(its forward is replaced by its graphs); give it once, or use _order for several microbatches"
                    )
                seen.add(id(fn))
    # Buckets: each callable's largest sample and its Grid (sizes, and the
    # dimensions of each input that follow them).
    buckets = [None] * len(sample_args)
    if any(isinstance(x, _buckets.Buckets) for x in sample_args + sample_kwargs):
        if _order is not None:
            raise ValueError("Buckets need the default order: they cannot be given with _order (a pipeline schedule)")
        if bucket_overflow == "eager" and accumulate_param_grads_into not in (None, "grad"):
            raise ValueError(
                f"bucket_overflow='eager' runs a call above the largest bucket eagerly, whose grads autograd puts in "
                f".grad, not in .{accumulate_param_grads_into}: pass bucket_overflow='raise'"
            )
        sample_args, sample_kwargs = list(sample_args), list(sample_kwargs)
        for k in range(len(sample_args)):
            sample_args[k], sample_kwargs[k], buckets[k] = _buckets.plan(
                sample_args[k], sample_kwargs[k], f"sample_args[{k}]"
            )
        sample_args, sample_kwargs = tuple(sample_args), tuple(sample_kwargs)
    hooks = _hooks.canonicalize(len(callables), capture_time_hooks)
    if _order is None:
        schedule = None
        entries = [(k, 0) for k in range(len(callables))]
    else:
        # The schedule graphed derives (and checks by its own rules).
        schedule = from_order(_order, layers_per_chunk, len(callables), extension())
        entries = schedule.entries()

    # graphed captures one signature per callable: its first microbatch's.
    first = {}
    for idx, (k, m) in enumerate(entries):
        if m == 0:
            first[k] = idx
    bindings = [Binding(sample_args[first[k]], sample_kwargs[first[k]]) for k in range(len(callables))]
    for idx, (k, m) in enumerate(entries):
        if m > 0:
            bindings[k].check_same(sample_args[idx], sample_kwargs[idx], f"sample_args[{idx}]")
    if not torch.cuda.is_available():
        raise RuntimeError("graphed.torch needs a CUDA device; torch.cuda.is_available() is False")
    device = _device_of(bindings, callables)

    ext = extension()
    names, outputs, specs = [], [], []
    rows = [None] * len(callables)
    for k, fn in enumerate(callables):
        name, out, spec = callable_spec(ext, k, fn, bindings[k], hooks[k])
        grid = buckets[k]
        if grid is not None:
            spec.update(
                bucket_sizes=grid.sizes,
                bucket_sizes2=grid.sizes2,
                dynamic_inputs=grid.dynamic,
                dynamic_dims=[-1 if d is None else d for d, _ in grid.dims],
                dynamic_dims2=[-1 if d is None else d for _, d in grid.dims],
            )
            rows[k] = _buckets.Rows(grid, bucket_overflow, name)
        names.append(name)
        outputs.append(out)
        specs.append(spec)
    if capture_stream is not None:
        capture_stream = (capture_stream.cuda_stream, capture_stream.device_index)
    gens = _rng.generators_for(device, generators)
    options = dict(
        num_warmup_iters=int(num_warmup_iters),
        training=training,
        allow_unused_input=bool(allow_unused_input),
        retain_graph_in_backward=bool(retain_graph_in_backward),
        clone_param_grads_on_return=bool(clone_param_grads_on_return),
        clones_from_torch_allocator=bool(clones_from_torch_allocator),
        lazy_clones=bool(lazy_clones),
        strict_leases=bool(strict_leases),
        debug=bool(debug),
        rebind_inputs=bool(rebind_inputs),
        rebind_params=bool(rebind_params),
        steps=schedule.steps if schedule else [],
        layers_per_chunk=schedule.layers_per_chunk if schedule else [],
        reuse_buffers=bool(_reuse_graph_input_output_buffers),
        accumulate_into=accumulate_param_grads_into,
        pool=_pool_id(pool),
        capture_stream=capture_stream,
        generators=gens,
        pre_warmup_hook=pre_warmup_hook,
        post_warmup_hook=post_warmup_hook,
    )
    # Warmup draws random numbers; the states go back afterwards, so that
    # graphing does not change what follows. The garbage collector stays off
    # during capture, where it could free objects that own CUDA work.
    saved = _rng.save(device, gens)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.device(device):
            graphs = ext.make(specs, options)
    finally:
        if collecting:
            gc.enable()
        _rng.restore(saved)

    impls = [g for per_callable in graphs for g in per_callable]
    restore = [(fn, fn.__dict__.get("forward")) for fn in callables if isinstance(fn, torch.nn.Module) and _order is None]
    session = Session(impls, restore)

    def wrap(k, m):
        fn = callables[k]
        module = fn if isinstance(fn, torch.nn.Module) else None
        eager = fn.forward if module is not None else fn
        return GraphedCallable(graphs[k][m], bindings[k], outputs[k], module, training, eager, session, k, rows[k])

    if schedule is not None:
        return tuple(wrap(k, m) for k, m in entries)
    results = []
    for k, fn in enumerate(callables):
        g = wrap(k, 0)
        if isinstance(fn, torch.nn.Module):
            fn.forward = g
            fn.reset = g.reset
            fn.backward_dw = g.backward_dw
            fn.session_stats = g.session_stats
            fn.session_plan = g.session_plan
            fn.export_dot = g.export_dot
            fn.params_movable = g.params_movable
            results.append(fn)
        else:
            results.append(g)
    return results[0] if single else tuple(results)
