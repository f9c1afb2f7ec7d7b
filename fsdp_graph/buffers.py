"""Where unsharded parameters and gradients live: persistent slots, allocated once.

A CUDA graph replays fixed addresses, so a unit's unsharded parameters and gradients must sit at
the same address in every iteration. Three placements, decided once per root at lazy init:

* ``slot``: with ``double_buffer=True``, leaf units (units that contain no other unit) alternate
  between two slots, each unit always in the same slot (the alternation follows the first
  forward's execution order). The slot size is the most common leaf-unit size (the repeated
  layer), so one oversized layer does not double the memory of both slots.
* ``dedicated``: a unit that cannot share a slot gets its own persistent buffer
  (``persist_buffer_on_alloc_fail=True``): a unit larger than the slot, or a unit that contains
  other units (the root stays unsharded while its children run, so it would pin a slot).
* ``dynamic``: a fresh allocation at every unshard, dropped at reshard, as in FSDP2. Used for
  ``double_buffer=False``, and for units that do not fit when
  ``persist_buffer_on_alloc_fail=False``. Addresses move between iterations, so such units cannot
  be captured in CUDA graphs.

"Reshard" only marks a buffer free; nothing persistent is ever freed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .unit import FSDPUnit


class Placement(Enum):
    SLOT = "slot"
    DEDICATED = "dedicated"
    DYNAMIC = "dynamic"


@dataclass
class GradBuffer:
    """Unsharded gradients (compute dtype) and the event of the last reduce that read them.

    The next writer waits on that event instead of on the whole reduce stream, so the
    reduce-scatter of one unit overlaps the backward of the next.
    """

    tensor: torch.Tensor
    reduce_done: Any = None  # torch.cuda.Event on GPU

    def wait_until_reduced(self) -> None:
        if self.reduce_done is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.reduce_done)


@dataclass
class FlatBuffers:
    """One unit-sized set of buffers: unsharded parameters, their gradients, reduce staging."""

    params: torch.Tensor  # compute dtype, [numel]
    grads: GradBuffer  # compute dtype, [numel]
    reduce_in: torch.Tensor | None  # reduce dtype, [numel]; None when it equals the compute dtype
    reduce_out: torch.Tensor  # reduce dtype, [numel // world_size]
    param_owner: FSDPUnit | None = field(default=None, repr=False)

    @classmethod
    @torch.inference_mode(False)  # persistent buffers must outlive an inference-mode first call
    def allocate(
        cls,
        numel: int,
        shard_numel: int,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
    ) -> "FlatBuffers":
        params = torch.empty(numel, dtype=compute_dtype, device=device)
        grads = torch.zeros(numel, dtype=compute_dtype, device=device)
        reduce_in = None if reduce_dtype == compute_dtype else torch.empty(numel, dtype=reduce_dtype, device=device)
        reduce_out = torch.empty(shard_numel, dtype=reduce_dtype, device=device)
        return cls(params, GradBuffer(grads), reduce_in, reduce_out)


@dataclass
class SlotPool:
    """Two slots shared by the leaf units of one root with the same dtypes and group size."""

    numel: int
    shard_numel: int
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    device: torch.device
    slots: list[FlatBuffers] = field(default_factory=list)
    _next: int = 0

    def assign(self) -> FlatBuffers:
        """The slot for the next unit in execution order (allocated on first use)."""
        if not self.slots:
            self.slots = [
                FlatBuffers.allocate(self.numel, self.shard_numel, self.compute_dtype, self.reduce_dtype, self.device)
                for _ in range(2)
            ]
        slot = self.slots[self._next]
        self._next ^= 1
        return slot


def plan_placements(units: list[FSDPUnit]) -> dict[FSDPUnit, tuple[Placement, SlotPool | None]]:
    """Decide every unit's placement under one root (see the module docstring for the rule)."""
    units_with_children = {u.parent for u in units if u.parent is not None}
    candidates: dict[tuple, list[FSDPUnit]] = {}
    for unit in units:
        if unit.config.double_buffer and unit not in units_with_children and unit.layout.padded_numel > 0:
            candidates.setdefault(unit.buffer_key, []).append(unit)

    pools: dict[tuple, SlotPool] = {}
    for key, group in candidates.items():
        sizes = Counter(u.layout.padded_numel for u in group)
        slot_numel = max(sizes, key=lambda n: (sizes[n], n))  # most common size; ties: the larger
        world_size = group[0].world_size
        compute_dtype, reduce_dtype, device = group[0].compute_dtype, group[0].reduce_dtype, group[0].device
        pools[key] = SlotPool(slot_numel, slot_numel // world_size, compute_dtype, reduce_dtype, device)

    plan: dict[FSDPUnit, tuple[Placement, SlotPool | None]] = {}
    for unit in units:
        pool = pools.get(unit.buffer_key)
        if not unit.config.double_buffer:
            plan[unit] = (Placement.DYNAMIC, None)
        elif pool is not None and unit not in units_with_children and 0 < unit.layout.padded_numel <= pool.numel:
            plan[unit] = (Placement.SLOT, pool)
        elif unit.config.persist_buffer_on_alloc_fail:
            plan[unit] = (Placement.DEDICATED, None)
        else:
            plan[unit] = (Placement.DYNAMIC, None)
    return plan
