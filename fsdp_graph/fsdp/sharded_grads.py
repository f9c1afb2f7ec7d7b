"""A unit's sharded gradients: the masters' ``.grad``, views of one flat buffer that lives as long as they do.

As in FSDP2, the sharded gradients are the user's: ``optimizer.zero_grad()`` (``set_to_none=True``,
torch's default) drops them, and their memory goes back before the next forward, which is where
activations peak. The next reduce-scatter makes a new buffer. ``zero_grad(set_to_none=False)``
keeps the buffer (the gradients become zeros and the reduce adds into them).

A whole-step graph writes the gradients at fixed addresses: ``pin()`` makes the buffer persistent
(allocated once, never dropped), and ``.grad`` is pointed back at it after each replay.

Each ``.grad`` is the master's kind: a ``Shard(0)`` DTensor (made with the master's spec: a plain
constructor call, not ``DTensor.from_local``'s checks, since a new buffer comes once per step) or
the plain local view without a mesh.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .flat_layout import FlatLayout
from .mesh import local_tensor
from .sharded_param import ShardedParam


class ShardedGrads:
    def __init__(self, params: list[ShardedParam], layout: FlatLayout, master_flat: torch.Tensor) -> None:
        self.params = params
        self.layout = layout
        self._like = master_flat  # dtype, device and size of the buffer
        self.pinned = False
        self.flat: torch.Tensor | None = None
        self.local_views: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []  # the masters' ``.grad`` while they are ours

    def ensure(self, zeros: bool) -> bool:
        """Make the buffer if there is none (``zeros``: zero-filled; else its values are undefined
        and the caller overwrites all of it). True if it was made now."""
        if self.flat is not None:
            return False
        with torch.inference_mode(False):
            flat = torch.zeros_like(self._like) if zeros else torch.empty_like(self._like)
        self._adopt(flat)
        return True

    def _adopt(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.local_views = self.layout.local_views(flat)
        self.views = [_like_master(p, v) for p, v in zip(self.params, self.local_views)]

    def release_if_dropped(self) -> None:
        """At the unit's next forward: give the buffer back if every ``.grad`` was set to None."""
        if self.flat is not None and not self.pinned and all(p.master.grad is None for p in self.params):
            self.flat, self.local_views, self.views = None, [], []

    def pin(self) -> None:
        """Keep one buffer for good (a whole-step graph writes into it at every replay)."""
        self.ensure(zeros=True)
        self.pinned = True

    def snapshot(self) -> tuple:
        return self.flat, self.local_views, self.views, None if self.flat is None else self.flat.clone()

    def restore(self, snapshot: tuple) -> None:
        self.flat, self.local_views, self.views, values = snapshot
        if values is not None:
            with torch.no_grad():
                self.flat.copy_(values)

    def reattach(self) -> None:
        """After ``Module._apply`` swapped the masters' ``.grad`` tensors: values back into the
        buffer, and each ``.grad`` a view of it again (see ``ShardedParam.reattach``)."""
        for param, view in zip(self.params, self.local_views):
            grad = param.master.grad
            found = None if grad is None else local_tensor(grad)
            if found is None or found.data_ptr() == view.data_ptr() or not view.numel():
                continue
            with torch.no_grad():
                view.copy_(found)
            if grad is not found:
                grad._local_tensor = view
            else:
                grad.data = view


def _like_master(param: ShardedParam, local: torch.Tensor) -> torch.Tensor:
    master = param.master
    if isinstance(master, DTensor):
        return DTensor(local, master._spec, requires_grad=False)
    return param.wrap(local)
