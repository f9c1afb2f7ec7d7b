"""Optimizer steps on the masters' local shards: the same kernels, without DTensor's dispatch.

The masters are ``Shard(0)`` DTensors, which torch's clipping and DCP need. An optimizer stepping
DTensors pays DTensor's Python dispatch on every op: fused AdamW over the small GPT's parameters
took 2.81 ms of host time per step, against 0.41 ms on plain tensors (2 × H200). That dominates an
eager or per-layer-graphed step. The swap itself is planned once: the step mapping of local
tensors is reused while the optimizer's state is unchanged (292 masters: 1.3–1.9 ms of host time
per step before, 0.7–0.9 ms after, on this project's CPU machine).

torch's element-wise optimizers compute every element from the same element of the parameter, its
gradient and its state. On a DTensor they therefore run exactly their local op on the local
tensors, and we can hand them the local tensors directly.

``install`` wraps the step of each of torch's element-wise optimizer classes, inside torch's own
hook wrapper (which torch adds at a class's first instance, as before). Step hooks, LR schedulers
and ``GradScaler`` therefore see the DTensors as before, and only the step body sees local tensors.
Around that body every master in ``param_groups`` and ``state`` is swapped for its local tensor,
which carries the local gradient and the local state tensors. Afterwards, in a ``finally``,
everything is swapped back, and any state the step created (the first step) is wrapped as DTensors
placed like the master, as FSDP2's optimizer state is.

The results are bitwise those of the DTensor path, because the same op runs on the same tensors
(fused SGD and Adagrad, which DTensor has no rule for, work here and raise there).
The swap applies only to this package's masters, and only when it is exact. Otherwise the step runs
on DTensors, as it would without this module:

* the optimizer is an instance of the class itself, not of a subclass, which may change the math;
* no closure is passed (its forward and backward would run inside the swap);
* ``differentiable`` is off, and the step is not being traced by ``torch.compile``;
* every master's ``.grad`` and state tensors are DTensors with the master's placements and mesh
  (0-d state such as a step count may be plain), and no other parameter is a DTensor.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from itertools import chain

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from .sharded_param import master_owner

ELEMENTWISE_NAMES = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD")
_MARK = "_fsdp_graph_local_shards"  # on a wrapped step body
# Each optimizer's _Swap, beside it rather than in it: pickling or deep-copying an optimizer
# must not meet the weak references a _Swap holds.
_SWAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install() -> None:
    """Wrap the element-wise optimizers' steps (idempotent). Optimizers built earlier whose step an
    LR scheduler already wrapped keep the DTensor path: exact, only slower."""
    for name in ELEMENTWISE_NAMES:
        cls = getattr(torch.optim, name, None)
        own = cls.__dict__.get("step") if cls is not None else None
        if cls is None or getattr(own, _MARK, False):
            continue
        body = cls.step  # its own or inherited (AdamW's is Adam's), with torch's and our wrappers
        hooked = getattr(body, "hooked", False)
        for wrapper in ("hooked", _MARK):
            if getattr(body, wrapper, False):
                body = body.__wrapped__
        step = _on_local_shards(body, cls)
        if hooked:  # as torch left it: hooks wrap a class's step once an instance exists, not before
            step = Optimizer.profile_hook_step(step)
            step.hooked = True
        cls.step = step


def _on_local_shards(body, cls):
    @functools.wraps(body)
    def step(self, *args, **kwargs):
        swap = None
        closure = args[0] if args else kwargs.get("closure")
        if type(self) is cls and closure is None and not torch.compiler.is_compiling():
            swap = _SWAPS.get(self)
            if swap is None:
                swap = _SWAPS[self] = _Swap()
            if not swap.prepare(self):
                swap = None
        if swap is None:
            return body(self, *args, **kwargs)
        try:
            swap.apply(self)
            return body(self, *args, **kwargs)
        finally:
            swap.undo(self)

    setattr(step, _MARK, True)
    return step


def _ids(state) -> list:
    """What a state mapping is, by identity (compared only while every object named is alive)."""
    return [(id(k), id(v), tuple(map(id, v.values()))) for k, v in state.items()]


def _flat_ids(state) -> list:
    """The identities of a state mapping, its keys and every value of its per-parameter dicts, in C
    loops: the per-step check that nothing in it changed (valid while those objects are alive)."""
    return [id(state), len(state), *map(id, state), *map(id, chain.from_iterable(map(dict.values, state.values())))]


class _Entry:
    """One master of the optimizer: where it sits in ``param_groups``, and its local tensor."""

    __slots__ = ("params", "index", "master", "local", "placements", "mesh", "grad_ref", "grad_local")

    def __init__(self, params: list, index: int, master: DTensor) -> None:
        self.params, self.index, self.master = params, index, master
        self.local, self.placements, self.mesh = master._local_tensor, master.placements, master.device_mesh
        self.grad_ref = None  # a weak reference to the gradient last checked
        self.grad_local = None  # during a step only

    def placed_like_master(self, value) -> bool:
        """A per-element value (gradient, state) the local-shard step may read: a DTensor placed
        like the master. A plain tensor beside a DTensor master is what the DTensor path refuses."""
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            return value.placements == self.placements and (mesh is self.mesh or mesh == self.mesh)
        return not isinstance(value, torch.Tensor) or value.dim() == 0


class _Swap:
    """One optimizer's masters, swapped for their local tensors for each step body.

    The step body sees ``optimizer.state`` replaced by a mapping built for the step: the same
    per-parameter dicts for other parameters, and for each master a dict of its state's local
    tensors. Between steps it holds the plan (the masters, which the optimizer holds anyway), weak
    references to the state tensors, and the step mapping of the state as it last was (the local
    tensors of the masters' state, the other parameters' per-parameter dicts): no gradient, no
    reference to the optimizer. What was checked is remembered, so an unchanged gradient or state
    is not checked again, and an unchanged state reuses its step mapping: the check compares
    identities in C loops, sound because a weak reference's callback drops the mapping the moment
    a state tensor it named is freed (its id could then be reused, and the mapping would keep the
    freed state's local tensor alive). A new plan (param groups changed) drops it too.

    A step that creates or replaces state (the first one) changes the step mapping: ``undo``
    carries the change over and the next step builds the mapping again."""

    def __init__(self) -> None:
        self.signature: tuple | None = None
        self.usable = False
        self.entries: list[_Entry] = []
        self.by_master: dict[int, _Entry] = {}
        self.checked: list = []  # weak references to the state tensors last checked
        self.state_ids: list | None = None  # ``_flat_ids`` of the state those were, None: check again
        # [the step mapping] while the state it was built from is unchanged; emptied by the callback
        # of a weak reference above when a checked state tensor is freed (the mapping would keep its
        # local tensor alive, and its id could be reused).
        self.cache: list = []
        self.state = self.step_state = None  # during a step only: the optimizer's mapping and the step's
        self.local_flat: list = []
        self._built_ids: list = []  # ``_ids`` of the step mapping as built, for ``undo``'s carry-over

    def prepare(self, optimizer) -> bool:
        """Check that the swap is exact for this step (see the module docstring); False: it is not."""
        groups = optimizer.param_groups
        signature = (*map(id, groups), *(id(p) for group in groups for p in (group["params"], *group["params"])))
        if signature != self.signature:  # a new plan: new entries, so a new step mapping too
            self.usable, self.signature = self._plan(groups), signature
            self.checked, self.cache, self.state_ids = [], [], None
        if not self.usable or optimizer.defaults.get("differentiable") or any(
                group.get("differentiable") for group in groups):
            return False
        grads = []
        for e in self.entries:
            master = e.master
            if master._local_tensor is not e.local:  # re-pointed (to_empty)
                e.local, self.state_ids = master._local_tensor, None
            grad = master.grad
            if grad is not None and (e.grad_ref is None or e.grad_ref() is not grad):
                if not e.placed_like_master(grad) or not isinstance(grad, DTensor):
                    return False
                e.grad_ref = weakref.ref(grad)
            grads.append(None if grad is None else grad._local_tensor)
        state = optimizer.state
        ids = _flat_ids(state)
        if not self.cache or ids != self.state_ids:
            for key, values in state.items():
                e = self.by_master.get(id(key))
                if e is not None and not all(map(e.placed_like_master, values.values())):
                    self.state_ids = None
                    return False
            cache = self.cache = [self._localize(state)]  # a fresh list: earlier callbacks empty the old one
            forget = lambda _ref: cache.clear()  # noqa: E731 (no reference back to this object)
            self.checked = [weakref.ref(v, forget) for values in state.values() for v in values.values()
                            if isinstance(v, torch.Tensor)]
            self.state_ids = ids
        for e, grad in zip(self.entries, grads):
            e.grad_local = grad
        self.state, self.step_state = state, self.cache[0]
        return True

    def _plan(self, groups) -> bool:
        entries = []
        for group in groups:
            params = group["params"]
            for i, param in enumerate(params):
                if isinstance(param, DTensor):
                    if master_owner(param) is None:
                        return False  # a DTensor that is not ours: its placements are not ours to reason about
                    entries.append(_Entry(params, i, param))
        self.entries = entries
        self.by_master = {id(e.master): e for e in entries}
        return bool(entries)

    def _localize(self, state) -> dict:
        """The step body's state mapping, built from the optimizer's for this step."""
        by_master, local_state = self.by_master, defaultdict(dict)
        for key, values in state.items():
            e = by_master.get(id(key))
            if e is None:
                local_state[key] = values
            else:
                local_state[e.local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in values.items()}
        self.local_flat, self._built_ids = _flat_ids(local_state), _ids(local_state)
        return local_state

    def apply(self, optimizer) -> None:
        for e in self.entries:
            e.params[e.index] = e.local
            e.local.grad = e.grad_local
        optimizer.state = self.step_state

    def undo(self, optimizer) -> None:
        state, local_state = self.state, self.step_state
        self.state = self.step_state = None
        optimizer.state = state
        for e in self.entries:
            e.params[e.index] = e.master
            e.local.grad = e.grad_local = None
        if _flat_ids(local_state) == self.local_flat:
            return  # updated in place: the DTensors over the local tensors are current
        # The step created or replaced state (its first step): carry it over as the DTensor path would,
        # and build the step mapping again at the next step.
        self.cache, self.state_ids = [], None
        known = {key: (dict_id, value_ids) for key, dict_id, value_ids in self._built_ids}
        local_ids = _ids(local_state)
        by_local = {id(e.local): e for e in self.entries}
        for (key_id, dict_id, value_ids), (key, values) in zip(local_ids, local_state.items()):
            if known.get(key_id) == (dict_id, value_ids):
                continue
            e = by_local.get(key_id)
            if e is None:
                state[key] = values
            else:  # into the master's own dict (a reference the user holds stays current)
                held = state[e.master]
                wrapped = {k: _as_dtensor_like(v, held.get(k), e.master, e.local) for k, v in values.items()}
                held.clear()
                held.update(wrapped)


def _as_dtensor_like(value, before, master: DTensor, local: torch.Tensor):
    """A state value after the step, as the DTensor path would hold it: the DTensor it was (the step
    updated its local tensor in place), or a new one for a per-element tensor the step created."""
    if isinstance(before, DTensor) and before._local_tensor is value:
        return before
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
        return DTensor.from_local(value, master.device_mesh, master.placements, run_check=False,
                                  shape=master.shape, stride=master.stride())
    return value  # a 0-d step count, a Python number
