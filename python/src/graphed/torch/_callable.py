"""What make_graphed_callables returns: graphed callables (for plain
callables, and one per sample_args entry with `_order`), and modules whose
forward is one. A call checks the module's training flag (a different one
runs the module eagerly, as in torch and Transformer Engine), takes
Transformer Engine's per-call keywords, matches the arguments against the
capture sample (with buckets, its size against the largest bucket) and
replays; the extension checks each tensor."""


class Session:
    """The graphs of one make_graphed_callables call (one graphed session),
    shared by the graphed callables it returned. reset() on one of them
    releases that one only, as in Transformer Engine: it runs eagerly from
    then on (a module gets its own forward back) while the others keep
    replaying, and once every graphed callable of its callable is released
    (one, or one per microbatch with `_order`), that callable's graphs and
    the memory only it uses are freed. The last release frees the rest.
    Dropped without reset(), the graphs and their memory are freed with
    the last reference to them."""

    def __init__(self, impls, restore_modules):
        self._impls = impls  # any one frees them all
        # id(module) -> (module, previous instance forward or None)
        self._restore = {id(module): (module, previous) for module, previous in restore_modules}
        self._live = 0
        self._per_callable = {}  # callable index -> graphed callables not yet released
        self.is_reset = False

    def adopt(self, callable_index):
        """Counts one more graphed callable sharing the graphs."""
        self._live += 1
        self._per_callable[callable_index] = self._per_callable.get(callable_index, 0) + 1

    def release(self, module, callable_index, impl):
        """One graphed callable let go (its module, if make_graphed_callables
        replaced that module's forward, gets it back); the last of its
        callable frees that callable's graphs and memory, the last of all
        frees the rest. A release the extension refuses (a strict lease
        still held, a replay in progress on another thread) raises and
        changes nothing."""
        last = self._live <= 1
        if not last and self._per_callable[callable_index] == 1 and not self.is_reset:
            impl.release()
        entry = self._restore.pop(id(module), None) if module is not None else None
        if entry is not None:
            _restore(*entry)
        self._live -= 1
        self._per_callable[callable_index] -= 1
        if last:
            self.reset()

    def reset(self):
        """Frees the graphs and their buffers (every callable of this call).
        Callables and modules then run eagerly. Outputs, input grads and
        aliased parameter grads returned before must no longer be used; owned
        (cloned) grads stay valid."""
        if self.is_reset:
            return
        self._impls[0].reset()
        self.is_reset = True
        for module, previous in self._restore.values():
            _restore(module, previous)
        # Nothing of the session is needed any more.
        self._impls = ()
        self._restore = {}


def _restore(module, previous):
    """The module's own forward back, graphed's attributes gone."""
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous
    for name in ("backward_dw", "session_stats", "session_plan", "export_dot", "params_movable"):
        module.__dict__.pop(name, None)
    # A second reset is a no-op that holds nothing: the module must not
    # keep this session (whose extension objects hold the module's
    # forward, a cycle the garbage collector cannot see through).
    module.__dict__["reset"] = _already_reset


def _already_reset():
    """The module's graphs were released by an earlier reset(): nothing to do."""


class GraphedCallable:
    __slots__ = (
        "_impl", "_binding", "_outputs", "_module", "_training", "_eager", "_session", "_released", "_rows",
        "_index", "__weakref__",
    )

    def __init__(self, impl, binding, outputs, module, training, eager, session, index, rows=None):
        self._impl = impl
        self._binding = binding
        self._outputs = outputs
        self._module = module
        self._training = training
        self._eager = eager
        self._session = session
        self._released = False
        self._rows = rows  # with buckets: _buckets.Rows
        self._index = index  # its callable's, in the make_graphed_callables call
        session.adopt(index)

    def __call__(self, *args, **kwargs):
        stream = event = None
        if kwargs:
            stream = kwargs.pop("cuda_graph_stream", None)
            event = kwargs.pop("cuda_graph_event", None)
            kwargs.pop("is_first_microbatch", None)  # FP8 weight caching only
        module = self._module
        if self._released or self._session.is_reset or (module is not None and module.training != self._training):
            return self._eager(*args, **kwargs)
        rows = self._rows
        if rows is None:
            flat = args if self._binding.simple and not kwargs else self._binding.match(args, kwargs)
        else:
            # match() consumes the keywords; a call above the buckets needs them.
            flat = args if self._binding.simple and not kwargs else self._binding.match(args, dict(kwargs))
            if rows.above(flat):
                return self._eager(*args, **kwargs)
        if stream is not None:
            stream = (stream.cuda_stream, stream.device_index)
            event = None if event is None else event.cuda_event
        return self._outputs.unflatten(self._impl.replay(flat, stream, event))

    def backward_dw(self):
        """Replays the delayed weight-gradient graph of this callable (and
        microbatch) and accumulates its parameter grads into `param.grad`; a
        no-op for callables without weight-grad steps in `_order`, and once
        it is reset (its eager backward computed every grad)."""
        if self._released or self._session.is_reset:
            return
        self._impl.backward_dw()

    def reset(self):
        """Releases this graphed callable, as Transformer Engine's reset()
        does: it runs eagerly from now on (a module gets its own forward
        back), while the other callables of the same make_graphed_callables
        call keep replaying their graphs. Its graphs, the static buffers
        only it uses and the PyTorch tensors kept for them are freed at once
        (with `_order`, once every microbatch's graphed callable of it is
        released): outputs, input grads and aliased parameter grads it
        returned must then no longer be used; owned grads stay valid. The
        last release frees the rest. A second call does nothing."""
        if self._released:
            return
        self._session.release(self._module, self._index, self._impl)
        self._released = True

    @property
    def is_reset(self):
        """Whether this callable was released (or its graphs freed)."""
        return self._released or self._session.is_reset

    def session_stats(self):
        """graphed's memory and graph figures for the session."""
        return self._impl.session_stats()

    def session_plan(self):
        """graphed's plan of the session's static buffers, and for each input
        asked to be rebound whether it is (or why it is copied), as text."""
        return self._impl.session_plan()

    def export_dot(self, path=None):
        """The session's captured graphs as Graphviz DOT text (a cluster per
        graph, labelled by callable, pass, microbatch and bucket; each node
        by its kind and kernel name), written to `path` when given; "" once
        reset."""
        text = self._impl.export_dot()
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def params_movable(self):
        """Per parameter of the module, in named_parameters() order: whether
        a call may find it at another address (the graphs follow it) or
        raises ParamMovedError (rebind_params=False, or capture could not
        verify it: session_plan() says why). Empty for plain callables."""
        return list(self._impl.params_movable())

    @property
    def bucket_sizes(self):
        """The sizes it was captured at (empty: one shape)."""
        return list(self._impl.bucket_sizes)

    @property
    def bucket_sizes2(self):
        """A grid's second sizes (empty: none)."""
        return list(self._impl.bucket_sizes2)

    @property
    def training(self):
        return self._training

    def __repr__(self):
        return f"<graphed callable {self._outputs.name}{' (reset)' if self.is_reset else ''}>"
