"""Where unsharded parameters and gradients live: persistent slots, allocated once.

A CUDA graph replays fixed addresses, so a unit's unsharded parameters and gradients must sit at
the same address in every iteration. Three placements, decided once per root at lazy init:

* ``slot``: with ``double_buffer=True``, leaf units (units that contain no other unit) alternate
  between two slots, each unit always in the same slot (the alternation follows the first
  forward's execution order). The slot size is the most common leaf-unit size (the repeated
  layer), so one oversized layer does not double the memory of both slots.
* ``dedicated``: a unit that cannot share a slot gets its own persistent buffer
  (``persist_buffer_on_alloc_fail=True``): a unit larger than the slot, a unit that contains
  other units (the root stays unsharded while its children run, so it would pin a slot), or a
  unit sharded with ``reshard_after_forward=False`` (it stays gathered until its backward).
* ``dynamic``: a fresh allocation at every unshard, dropped at reshard, as in FSDP2. Used for
  ``double_buffer=False``, and for units that do not fit when
  ``persist_buffer_on_alloc_fail=False``. Addresses move between iterations, so such units cannot
  be captured in CUDA graphs.

"Reshard" only marks a buffer free; nothing persistent is ever freed. The plan is a pure function
of ``PlacementRequest``s (sizes, dtypes, flags), testable without a process group or a GPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


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
    param_owner: Any = field(default=None, repr=False)  # the parameter group whose data ``params`` holds

    @classmethod
    @torch.inference_mode(False)  # persistent buffers must outlive an inference-mode first call
    def allocate(cls, numel: int, shard_numel: int, dtypes: BufferDtypes, device: torch.device) -> FlatBuffers:
        params = torch.empty(numel, dtype=dtypes.compute, device=device)
        grads = torch.zeros(numel, dtype=dtypes.compute, device=device)
        reduce_in = None if dtypes.reduce == dtypes.compute else torch.empty(numel, dtype=dtypes.reduce, device=device)
        reduce_out = torch.empty(shard_numel, dtype=dtypes.reduce, device=device)
        return cls(params, GradBuffer(grads), reduce_in, reduce_out)

    def nbytes_held(self) -> int:
        """Bytes of device memory these buffers hold now (0 for a dynamic unit between unshards)."""
        tensors = (self.params, self.grads.tensor, self.reduce_in, self.reduce_out)
        return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


@dataclass(frozen=True)
class BufferDtypes:
    compute: torch.dtype
    reduce: torch.dtype


@dataclass
class SlotPool:
    """Two slots shared by the leaf units of one root with the same dtypes and group size."""

    numel: int
    shard_numel: int
    dtypes: BufferDtypes
    device: torch.device
    slots: list[FlatBuffers] = field(default_factory=list)
    _next: int = 0

    def assign(self) -> FlatBuffers:
        """The slot for the next unit in execution order (allocated on first use)."""
        if not self.slots:
            self.slots = [
                FlatBuffers.allocate(self.numel, self.shard_numel, self.dtypes, self.device) for _ in range(2)
            ]
        slot = self.slots[self._next]
        self._next ^= 1
        return slot


@dataclass(frozen=True)
class PlacementRequest:
    """What the plan needs to know of one unit."""

    numel: int  # padded flat size
    world_size: int
    dtypes: BufferDtypes
    device: torch.device
    group_id: int  # units may share slots only within one process group
    double_buffer: bool
    persist_buffer_on_alloc_fail: bool
    has_inner_units: bool
    reshard_after_forward: bool = True  # False: kept gathered until backward, so no slot to share

    @property
    def pool_key(self) -> tuple:
        return (self.dtypes, self.device, self.world_size, self.group_id)


def plan_placements(requests: list[PlacementRequest]) -> list[tuple[Placement, SlotPool | None]]:
    """Every unit's placement under one root, in the order of ``requests`` (see the module docstring)."""

    def slot_candidate(r: PlacementRequest) -> bool:
        return r.double_buffer and r.reshard_after_forward and not r.has_inner_units and r.numel > 0

    sizes: dict[tuple, Counter] = {}
    for r in requests:
        if slot_candidate(r):
            sizes.setdefault(r.pool_key, Counter())[r.numel] += 1
    pools: dict[tuple, SlotPool] = {}
    for key, counts in sizes.items():
        slot_numel = max(counts, key=lambda n: (counts[n], n))  # most common size; ties: the larger
        dtypes, device, world_size, _ = key
        pools[key] = SlotPool(slot_numel, slot_numel // world_size, dtypes, device)

    plan: list[tuple[Placement, SlotPool | None]] = []
    for r in requests:
        pool = pools.get(r.pool_key)
        if not r.double_buffer:
            plan.append((Placement.DYNAMIC, None))
        elif pool is not None and slot_candidate(r) and r.numel <= pool.numel:
            plan.append((Placement.SLOT, pool))
        elif r.persist_buffer_on_alloc_fail:
            plan.append((Placement.DEDICATED, None))
        else:
            plan.append((Placement.DYNAMIC, None))
    return plan
