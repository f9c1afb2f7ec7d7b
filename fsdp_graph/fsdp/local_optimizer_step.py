"""Optimizer steps on the masters' local shards: the same kernels, without DTensor's dispatch.

The masters are ``Shard(0)`` DTensors, which torch's clipping and DCP need. An optimizer stepping
DTensors pays DTensor's Python dispatch on every op: fused AdamW over the small GPT's parameters
took 2.81 ms of host time per step, against 0.41 ms on plain tensors (2 × H200). That dominates an
eager or per-layer-graphed step. torch's element-wise optimizers compute every element from the
same element of the parameter, its gradient and its state. On a DTensor they therefore run exactly
their local op on the local tensors, and we can hand them the local tensors directly.

``install`` wraps the step of each of torch's element-wise optimizer classes, inside torch's own
hook wrapper. Step hooks, LR schedulers and ``GradScaler`` therefore see the DTensors as before,
and only the step body sees local tensors. Around that body every master in ``param_groups`` and
``state`` is swapped for its local tensor, which carries the local gradient and the local state
tensors. Afterwards, in a ``finally``, everything is swapped back, and any state the step created
(the first step) is wrapped as DTensors placed like the master, as FSDP2's optimizer state is.

The results are bitwise those of the DTensor path, because the same op runs on the same tensors.
The swap applies only to this package's masters, and only when it is exact. Otherwise the step runs
on DTensors, as it would without this module:

* the optimizer is an instance of the class itself, not of a subclass, which may change the math;
* ``differentiable`` is off, and the step is not being traced by ``torch.compile``;
* every master's ``.grad`` and state tensors are DTensors with the master's placements, and no
  other parameter is a DTensor.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from .sharded_param import master_owner

ELEMENTWISE_NAMES = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD")
_MARK = "_fsdp_graph_local_shards"  # on a wrapped step body
_SWAP = "_fsdp_graph_swap"  # on an optimizer: its _Swap


def install() -> None:
    """Wrap the element-wise optimizers' steps (idempotent). Optimizers built earlier whose step an
    LR scheduler already wrapped keep the DTensor path: exact, only slower."""
    for name in ELEMENTWISE_NAMES:
        cls = getattr(torch.optim, name, None)
        own = cls.__dict__.get("step") if cls is not None else None
        if cls is None or getattr(own, _MARK, False):
            continue
        body = cls.step  # its own or inherited (AdamW's is Adam's), with torch's and our wrappers
        for wrapper in ("hooked", _MARK):
            if getattr(body, wrapper, False):
                body = body.__wrapped__
        cls.step = Optimizer.profile_hook_step(_on_local_shards(body, cls))
        cls.step.hooked = True  # torch's Optimizer.__init__ must not wrap it again
        setattr(cls.step, _MARK, True)


def _on_local_shards(body, cls):
    @functools.wraps(body)
    def step(self, *args, **kwargs):
        swap = None
        if type(self) is cls and not torch.compiler.is_compiling():
            swap = self.__dict__.get(_SWAP) or self.__dict__.setdefault(_SWAP, _Swap(self))
            if not swap.prepare():
                swap = None
        if swap is None:
            return body(self, *args, **kwargs)
        swap.apply()
        try:
            return body(self, *args, **kwargs)
        finally:
            swap.undo()

    setattr(step, _MARK, True)
    return step


def _ids(state) -> list:
    """What a state mapping is, by identity: its keys, their dicts and the values in them."""
    return [(id(k), id(v), tuple(map(id, v.values()))) for k, v in state.items()]


class _Entry:
    """One master of the optimizer: where it sits in ``param_groups``, its local tensor, and its
    gradient as last checked (an unchanged gradient costs no re-check)."""

    __slots__ = ("params", "index", "master", "local", "placements", "grad", "grad_local")

    def __init__(self, params: list, index: int, master: DTensor) -> None:
        self.params, self.index, self.master = params, index, master
        self.local, self.placements = master._local_tensor, master.placements
        self.grad = self.grad_local = None


class _Swap:
    """One optimizer's masters, swapped for their local tensors for each step body.

    The step body sees ``optimizer.state`` replaced by ``local_state``: the same per-parameter
    dicts for other parameters, and for each master a dict of its state's local tensors. Both
    mappings are kept from step to step and compared by identity, so an unchanged state costs no
    re-check and no tensor-keyed dict operation (each one a Python ``Tensor.__hash__`` call)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.signature: tuple = ()
        self.entries: list[_Entry] = []
        self.by_local: dict[int, _Entry] = {}
        self.state = None  # the optimizer's own state mapping, as ``state_ids`` describes it
        self.state_ids: list = []
        self.local_state: dict = {}
        self.local_ids: list = []

    def prepare(self) -> bool:
        """Check that the swap is exact for this step (see the module docstring); False: it is not."""
        optimizer = self.optimizer
        groups = optimizer.param_groups
        signature = (*map(id, groups), *(id(p) for group in groups for p in (group["params"], *group["params"])))
        if signature != self.signature:
            if not self._plan(groups):
                return False
            self.signature, self.state = signature, None
        for e in self.entries:
            master = e.master
            if master._local_tensor is not e.local:  # re-pointed (to_empty)
                e.local, self.state = master._local_tensor, None
            grad = master.grad
            if grad is not e.grad or (grad is not None and grad._local_tensor is not e.grad_local):
                if grad is not None and (not isinstance(grad, DTensor) or grad.placements != e.placements):
                    return False
                e.grad, e.grad_local = grad, None if grad is None else grad._local_tensor
        state = optimizer.state
        if state is not self.state or _ids(state) != self.state_ids:
            return self._localize(state)
        return True

    def _plan(self, groups) -> bool:
        entries = []
        for group in groups:
            if group.get("differentiable"):
                return False
            params = group["params"]
            for i, param in enumerate(params):
                if isinstance(param, DTensor):
                    if master_owner(param) is None:
                        return False  # a DTensor that is not ours: its placements are not ours to reason about
                    entries.append(_Entry(params, i, param))
        self.entries = entries
        return bool(entries)

    def _localize(self, state) -> bool:
        """Build the step body's state mapping from the optimizer's."""
        by_master = {id(e.master): e for e in self.entries}
        local_state = defaultdict(dict)
        for key, values in state.items():
            e = by_master.get(id(key))
            if e is None:
                local_state[key] = values
                continue
            if any(isinstance(v, DTensor) and v.placements != e.placements for v in values.values()):
                return False
            local_state[e.local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in values.items()}
        self.by_local = {id(e.local): e for e in self.entries}
        self.state, self.state_ids = state, _ids(state)
        self.local_state, self.local_ids = local_state, _ids(local_state)
        return True

    def apply(self) -> None:
        for e in self.entries:
            e.params[e.index] = e.local
            e.local.grad = e.grad_local
        self.optimizer.state = self.local_state

    def undo(self) -> None:
        optimizer, state = self.optimizer, self.state
        optimizer.state = state
        for e in self.entries:
            e.params[e.index] = e.master
            e.local.grad = None
        local_ids = _ids(self.local_state)
        if local_ids == self.local_ids:
            return  # updated in place: the DTensors over the local tensors are current
        # The step created or replaced state (its first step): carry it over as the DTensor path would.
        known = {key: (dict_id, value_ids) for key, dict_id, value_ids in self.local_ids}
        for (key_id, dict_id, value_ids), (key, values) in zip(local_ids, self.local_state.items()):
            if known.get(key_id) == (dict_id, value_ids):
                continue
            e = self.by_local.get(key_id)
            if e is None:
                state[key] = values
            else:
                before = state.get(e.master) or {}
                state[e.master] = {k: _as_dtensor_like(v, before.get(k), e.master, e.local) for k, v in values.items()}
        self.state_ids, self.local_ids = _ids(state), local_ids


def _as_dtensor_like(value, before, master: DTensor, local: torch.Tensor):
    """A state value after the step, as the DTensor path would hold it: the DTensor it was (the step
    updated its local tensor in place), or a new one for a per-element tensor the step created."""
    if isinstance(before, DTensor) and before._local_tensor is value:
        return before
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
        return DTensor.from_local(value, master.device_mesh, master.placements, run_check=False,
                                  shape=master.shape, stride=master.stride())
    return value  # a 0-d step count, a Python number
