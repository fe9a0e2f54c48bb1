"""The optimizer in a step's graph (make_graphed_step's `optimizer`,
`clip_grad_norm` and `grad_scaler`): torch.optim's SGD, Adam and AdamW run
under the step's capture, after the last microbatch's backward (graphed's
update stage), so that one launch runs the whole iteration; replays never
call them.

What the graph cannot hold as it is, it follows or refuses at each call:
- the learning rate: a float (or CPU tensor) is read on the host at each
  call and copied into the step's scalar block, which the graph reads as a
  device tensor (any scheduler is followed, no recapture); a CUDA tensor
  is read where it is (a scheduler's fill_ is followed); SGD without
  fused=True takes its lr as a host number, so its graph holds the lr of
  its capture and a changed lr is refused;
- every other hyperparameter, the param groups, the optimizer's state
  tensors and the scaler's tensors are those of capture, or the call is
  refused with a message.

The check phase (with a grad scaler): unscale_, the skip flag from the
scaler's found_inf, grads zeroed on a skipped iteration (param_grads
"add"), the scaler's update (which runs whether or not the step is
skipped). The apply phase: clip_grad_norm_, optimizer.step(), grads
zeroed ("add")."""
import math
import struct
from collections import defaultdict

import torch

_MISSING = object()

_SUPPORTED = ("SGD", "Adam", "AdamW")


def _scalar_dtype(fused):
    try:
        from torch.optim.optimizer import _get_scalar_dtype

        return _get_scalar_dtype(is_fused=fused)
    except (ImportError, TypeError):  # pragma: no cover - older layouts
        return torch.float32 if fused else torch.get_default_dtype()


class _Mark:
    """Set when the optimizer's state is changed in a way the graph cannot
    follow (a state tensor replaced, added or removed)."""

    __slots__ = ("dirty", "what")

    def __init__(self):
        self.dirty = False
        self.what = ""

    def set(self, what):
        if not self.dirty:
            self.dirty, self.what = True, what


class _WatchedDict(dict):
    """A parameter's optimizer state: a plain dict that notes a replaced
    tensor (setting a key to the object it holds is no change). Pickles and
    copies as a plain dict."""

    __slots__ = ("_mark", "_name")

    def _note(self, key):
        self._mark.set(f"the optimizer's state '{key}' of parameter '{self._name}' was replaced")

    def __setitem__(self, key, value):
        if dict.get(self, key, _MISSING) is not value:
            self._note(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        self._note(key)
        dict.__delitem__(self, key)

    def pop(self, key, *default):
        if key in self:
            self._note(key)
        return dict.pop(self, key, *default)

    def popitem(self):
        self._mark.set(f"the optimizer's state of parameter '{self._name}' was changed")
        return dict.popitem(self)

    def clear(self):
        self._mark.set(f"the optimizer's state of parameter '{self._name}' was cleared")
        dict.clear(self)

    def update(self, *args, **kw):
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def __reduce__(self):
        return (dict, (dict(self),))


class _WatchedState(defaultdict):
    """optimizer.state: notes a parameter's state dict replaced or removed."""

    def __init__(self, mark, *args):
        super().__init__(dict, *args)
        self._mark = mark

    def __setitem__(self, key, value):
        if dict.get(self, key, _MISSING) is not value:
            self._mark.set("a parameter's optimizer state was replaced")
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._mark.set("a parameter's optimizer state was removed")
        super().__delitem__(key)

    def __reduce__(self):
        return (defaultdict, (dict, dict(self)))


def _plain_state(optimizer, state_dict):
    state_dict["state"] = {k: dict(v) if isinstance(v, _WatchedDict) else v for k, v in state_dict["state"].items()}
    return state_dict


def _kind(optimizer):
    name = type(optimizer).__name__
    if type(optimizer) is not getattr(torch.optim, name, None) or name not in _SUPPORTED:
        raise TypeError(
            f"make_graphed_step: optimizer is {type(optimizer).__module__}.{type(optimizer).__qualname__}; the step's "
            "graph runs torch.optim.SGD, Adam and AdamW (their own classes, not subclasses): step the optimizer "
            "eagerly after the step, or use one of those"
        )
    return "sgd" if name == "SGD" else "adam"


def _frozen_keys(optimizer):
    return tuple(k for k in optimizer.defaults if k not in ("lr", "capturable"))


def check_arguments(optimizer, clip_grad_norm, grad_scaler, attr, module_params):
    """The checks that need no GPU: types, values, the optimizer's parameters
    among the layers'. Raises TypeError or ValueError naming the argument."""
    if optimizer is None:
        if clip_grad_norm is not None or grad_scaler is not None:
            raise ValueError("make_graphed_step: clip_grad_norm and grad_scaler need an optimizer (optimizer=...)")
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"make_graphed_step: optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    kind = _kind(optimizer)
    if attr != "grad":
        raise ValueError(
            f"make_graphed_step: with an optimizer the grads go to .grad (the optimizer reads them there), not "
            f".{attr}"
        )
    if clip_grad_norm is not None:
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)):
            raise TypeError(f"make_graphed_step: clip_grad_norm must be a number, not {type(clip_grad_norm).__name__}")
        if not math.isfinite(clip_grad_norm) or clip_grad_norm <= 0:
            raise ValueError(f"make_graphed_step: clip_grad_norm must be a positive finite number, not {clip_grad_norm}")
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"make_graphed_step: grad_scaler must be a torch.amp.GradScaler, not {type(grad_scaler).__name__}")
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        raise ValueError(
            "make_graphed_step: the optimizer has step hooks; the graph would run them once, at capture, and never "
            "again: remove them (or step the optimizer eagerly)"
        )
    from torch.optim import optimizer as _o

    if getattr(_o, "_global_optimizer_pre_hooks", None) or getattr(_o, "_global_optimizer_post_hooks", None):
        raise ValueError(
            "make_graphed_step: global optimizer step hooks are registered; the graph would run them once, at capture"
        )
    known = {id(p) for p in module_params}
    seen = set()
    for gi, g in enumerate(optimizer.param_groups):
        for k in _frozen_keys(optimizer):
            v = g.get(k)
            if isinstance(v, torch.Tensor) or (isinstance(v, tuple) and any(isinstance(x, torch.Tensor) for x in v)):
                raise ValueError(
                    f"make_graphed_step: param group {gi}'s {k} is a tensor; the step's graph holds it as a number "
                    "(only lr may be a tensor)"
                )
        if g.get("differentiable"):
            raise ValueError(f"make_graphed_step: param group {gi} is differentiable; the step's graph updates in place")
        lr = g["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"make_graphed_step: param group {gi}'s lr is a tensor of {lr.numel()} elements, not one")
        if kind == "sgd" and not g.get("fused") and isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            raise ValueError(
                f"make_graphed_step: param group {gi}: SGD without fused=True reads a tensor lr on the host (a "
                "synchronisation the graph cannot hold); pass fused=True, or a float lr"
            )
        if kind == "sgd" and g["momentum"] != 0 and g["dampening"] != 0:
            state = optimizer.state
            if any("momentum_buffer" not in state.get(p, {}) for p in g["params"]):
                raise ValueError(
                    f"make_graphed_step: param group {gi}: SGD with dampening {g['dampening']} starts its momentum "
                    "buffers with the first grad undamped, which a graph of one update cannot repeat; step it "
                    "eagerly once first, or use dampening=0"
                )
        for pi, p in enumerate(g["params"]):
            if id(p) not in known:
                raise ValueError(
                    f"make_graphed_step: the optimizer's parameter {pi} of param group {gi} (shape "
                    f"{tuple(p.shape)}) is not a parameter of the step's layers; the step computes no grad for it"
                )
            if id(p) in seen:
                raise ValueError(f"make_graphed_step: parameter {pi} of param group {gi} is in two param groups")
            seen.add(id(p))


class StepUpdate:
    """The update stage of one step: prepared before capture (state made,
    kernels loaded), captured by `check` and `apply`, and kept honest at
    each call by `before_call`."""

    def __init__(self, optimizer, clip_grad_norm, grad_scaler, zero_grads, params, device):
        self.opt = optimizer
        self.kind = _kind(optimizer)
        self.clip = None if clip_grad_norm is None else float(clip_grad_norm)
        self.scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self.zero = zero_grads
        self.device = device
        # The step's parameters, in order, and where each optimizer parameter is.
        index = {}
        for k, (name, p) in enumerate(params):
            index.setdefault(id(p), (k, name))
        self.names = {id(p): name for name, p in params}
        self.opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        self.places = [index[id(p)][0] for p in self.opt_params]
        self.keys = _frozen_keys(optimizer)
        self._prepare_groups()
        self._prepare_state()
        self._prepare_scaler()
        self.last = None  # the lrs the scalar block holds

    # ---- before capture ----------------------------------------------------------------------

    def _prepare_groups(self):
        """Each group made capturable, and where its lr comes from: a slot
        of the scalar block (float or CPU tensor), itself (a CUDA tensor),
        or baked in (SGD without fused)."""
        opt = self.opt
        self.groups = []
        slots = 0
        for gi, g in enumerate(opt.param_groups):
            if self.kind == "adam":
                # torch's capturable Adam(W): the step count on the device, a
                # tensor lr; fused Adam computes alike either way.
                g["capturable"] = True
            lr = g["lr"]
            if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
                if lr.device != self.device:
                    raise ValueError(f"make_graphed_step: param group {gi}'s lr is on {lr.device}, not {self.device}")
                source, slot = lr, None
            elif self.kind == "sgd" and not g.get("fused"):
                source, slot = float(lr), None
            else:
                source, slot = None, slots
                slots += 1
            frozen = tuple(g.get(k) for k in self.keys)
            self.groups.append((g, g["params"], len(g["params"]), frozen, source, slot))
        self.slots = slots
        self.scalar_bytes = 0 if slots == 0 else ((slots * 4 + 255) // 256) * 256
        self.fmt = f"<{slots}f{self.scalar_bytes - 4 * slots}x"
        self.group_list = opt.param_groups
        self.ngroups = len(opt.param_groups)

    def _prepare_state(self):
        """The state each parameter's first step would make (zeros, a device
        step count), made now, outside the graph's memory; then the state
        watched for replacement."""
        opt = self.opt
        self.mark = _Mark()
        watched = _WatchedState(self.mark)
        for g in opt.param_groups:
            for p in g["params"]:
                st = dict(opt.state.get(p, {}))
                if self.kind == "adam":
                    fused = bool(g.get("fused"))
                    if not st:
                        st["step"] = torch.zeros((), dtype=_scalar_dtype(fused), device=p.device)
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        if g["amsgrad"]:
                            st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    elif not torch.is_tensor(st["step"]) or st["step"].device != p.device:
                        # As torch moves it for capturable Adam (its __setstate__).
                        st["step"] = torch.tensor(float(st["step"]), dtype=_scalar_dtype(fused), device=p.device)
                elif g["momentum"] != 0 and st.get("momentum_buffer") is None:
                    # momentum * 0 + grad is the grad: eager's first step.
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                w = _WatchedDict(st)
                w._mark, w._name = self.mark, self.names.get(id(p), "?")
                dict.__setitem__(watched, p, w)
        for p, st in opt.state.items():  # state of parameters in no group
            if p not in watched:
                dict.__setitem__(watched, p, st)
        opt.state = watched
        self.state = watched
        if not getattr(opt, "_graphed_plain_state", False):
            # state_dict() holds plain dicts, so that a checkpoint loads
            # with weights_only=True.
            opt.register_state_dict_post_hook(_plain_state)
            opt._graphed_plain_state = True

    def _prepare_scaler(self):
        s = self.scaler
        if s is None:
            self.seed = None
            return
        if s._scale is None:
            s._lazy_init_scale_growth_tracker(self.device)
        self.scale, self.tracker = s._scale, s._growth_tracker
        self.scaler_frozen = self._scaler_values()
        self.seed = s._scale

    def _scaler_values(self):
        s = self.scaler
        return (s._growth_factor, s._backoff_factor, s._growth_interval, s._enabled)

    def warm_up(self):
        """Runs what the capture will run once, eagerly, on scratch copies
        (the parameters, grads and state untouched), so that no kernel's
        module loads for the first time under capture."""
        opt = self.opt
        groups = []
        twins = {}
        for g, params, _, _, source, slot in self.groups:
            copies = []
            for p in params:
                c = p.detach().clone()
                c.grad = torch.zeros_like(c)
                twins[p] = c
                copies.append(c)
            hp = {k: v for k, v in g.items() if k != "params"}
            if slot is not None:
                hp["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device)
            groups.append(dict(hp, params=copies))
        scratch = type(opt)(groups)
        for p, c in twins.items():
            scratch.state[c] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
        grads = [c.grad for c in twins.values()]
        if self.scaler is not None:
            found = torch.zeros((), dtype=torch.float32, device=self.device)
            scale = self.scale.clone()
            tracker = self.tracker.clone()
            inv = scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            flag = torch.zeros(1, dtype=torch.int32, device=self.device)
            flag.copy_(found.reshape(1))
            if self.zero:
                mask = found > 0
                for g in grads:
                    g.masked_fill_(mask, 0)
            s = self.scaler
            torch._amp_update_scale_(scale, tracker, found, s._growth_factor, s._backoff_factor, s._growth_interval)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(list(twins.values()), self.clip, foreach=True)
        scratch.step()
        if self.zero:
            torch._foreach_zero_(grads)
        torch.cuda.current_stream(self.device).synchronize()

    # ---- under capture -----------------------------------------------------------------------

    def _grads_where_the_step_put_them(self, grads):
        for p, k in zip(self.opt_params, self.places):
            g = grads[k]
            if g is None or p.grad is None or p.grad.data_ptr() != g.data_ptr():
                raise RuntimeError(
                    f"make_graphed_step: parameter '{self.names[id(p)]}'.grad is not where the step puts its grad "
                    "under capture"
                )

    def check(self, slot, grads, scalars, flag):
        """unscale_, the skip flag, the scaler's update (run either way)."""
        self._grads_where_the_step_put_them(grads)
        s, opt = self.scaler, self.opt
        s.unscale_(opt)
        found = list(s._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        total = found[0]
        for f in found[1:]:
            total = total + f.to(total.device)
        flag.copy_(total.reshape(1))
        if self.zero:
            # A skipped iteration's grads start the next from zero too.
            mask = total > 0
            for p in self.opt_params:
                p.grad.masked_fill_(mask, 0)
        s.update()

    def apply(self, slot, grads, scalars, flag):
        """clip_grad_norm_, optimizer.step() with each lr where the graph
        reads it, the grads zeroed."""
        if self.scaler is None:
            self._grads_where_the_step_put_them(grads)
        lrs = None if scalars is None else scalars.view(torch.float32)
        saved = []
        try:
            for g, _, _, _, source, slot_k in self.groups:
                saved.append(g["lr"])
                if slot_k is not None:
                    g["lr"] = lrs[slot_k]
                elif isinstance(source, torch.Tensor):
                    g["lr"] = source
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.opt_params, self.clip, foreach=True)
            self.opt.step()
            if self.zero:
                torch._foreach_zero_([p.grad for p in self.opt_params])
        finally:
            for (g, *_), lr in zip(self.groups, saved):
                g["lr"] = lr
        # The optimizer's own step wrote the state it holds back: no change.
        self.mark.dirty = False

    # ---- at each call ------------------------------------------------------------------------

    def before_call(self):
        """Every check of what the graph holds; returns (the scalar block's
        bytes or None, the lrs they hold)."""
        opt = self.opt
        if opt.param_groups is not self.group_list or len(opt.param_groups) != self.ngroups:
            raise RuntimeError(
                "graphed step: the optimizer's param groups changed since capture (a group added or replaced); the "
                "step's graph updates the groups it captured: make the step again"
            )
        if opt.state is not self.state or self.mark.dirty:
            what = self.mark.what if self.mark.dirty else "the optimizer's state was replaced (load_state_dict?)"
            raise RuntimeError(
                f"graphed step: {what}; the step's graph updates the state tensors it captured: copy new values into "
                "them in place (tensor.copy_), or make the step again"
            )
        lrs = []
        for gi, (g, params, n, frozen, source, slot) in enumerate(self.groups):
            if opt.param_groups[gi] is not g or g["params"] is not params or len(params) != n:
                raise RuntimeError(
                    f"graphed step: the optimizer's param group {gi} changed since capture (replaced, or its params); "
                    "make the step again"
                )
            if tuple(g.get(k) for k in self.keys) != frozen:
                changed = [k for k, v in zip(self.keys, frozen) if g.get(k) != v]
                raise RuntimeError(
                    f"graphed step: param group {gi}'s {', '.join(changed)} changed since capture (captured: "
                    f"{', '.join(f'{k}={v!r}' for k, v in zip(self.keys, frozen) if k in changed)}); the step's "
                    "graph holds them: set them back, or make the step again"
                )
            lr = g["lr"]
            if slot is not None:
                lrs.append(float(lr))
            elif isinstance(source, torch.Tensor):
                if lr is not source:
                    raise RuntimeError(
                        f"graphed step: param group {gi}'s lr is another object than the CUDA tensor the graph reads; "
                        "change its value in place (fill_, as schedulers do), or make the step again"
                    )
            elif lr != source:
                raise RuntimeError(
                    f"graphed step: param group {gi}'s lr changed ({source!r} at capture, {lr!r} now), and SGD "
                    "without fused=True takes lr as a host number the graph holds; make the optimizer with "
                    "fused=True to change lr between calls"
                )
        if self.scaler is not None:
            s = self.scaler
            if s._scale is not self.scale or s._growth_tracker is not self.tracker or self._scaler_values() != self.scaler_frozen:
                raise RuntimeError(
                    "graphed step: the grad scaler's scale, growth tracker or factors changed since capture; the "
                    "step's graph holds them (load_state_dict copies into them only before capture): make the step again"
                )
        if not lrs or lrs == self.last:
            return None, lrs
        return struct.pack(self.fmt, *lrs), lrs
