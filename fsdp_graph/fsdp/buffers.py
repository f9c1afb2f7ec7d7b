"""Where unsharded parameters live: persistent slots, allocated once.

A CUDA graph replays fixed addresses, so a unit's unsharded parameters must sit at the same
address in every iteration, and so must its gradients where a graph reads them (a reduce replayed
as a graph: the placement's ``GradBuffer``, allocated at first use; otherwise the reduce reads
autograd's own gradient tensors, see ``gradients.py``). Three placements, decided once per root at
lazy init:

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

"Reshard" only marks a buffer free; no slot or dedicated buffer is ever freed. The plan is a pure function
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
    """A unit-sized unsharded gradient (compute dtype), the event of the last reduce that read
    the unit's gradients, and what that reduce read.

    Two ways a backward hands its gradients to the reduce (``gradients.py``):

    * *into this buffer* (``tensor``, allocated at first use): AccumulateGrad adds into views of
      it, so the gradients sit at fixed addresses, which the units whose reduce replays as a graph
      need (unless their graphs hand their gradients over: ``graph_gradients.py``). The reduce
      reads it and zeroes it for the next backward;
    * *tensors of their own* (every other unit): autograd's, or a graph's static gradient buffers
      handed over; the reduce reads them, and they are ``held`` here until the compute stream has
      waited for that reduce; then autograd's go back to the allocator. No buffer, no zeroing, no
      accumulation pass.

    The next user of the buffer waits on ``reduce_done`` instead of on the whole reduce stream, so
    the reduce-scatter of one unit overlaps the backward of the next.
    """

    numel: int
    dtype: torch.dtype
    device: torch.device
    tensor: torch.Tensor | None = None  # the fixed-address buffer, once a backward has used it
    reduce_done: Any = None  # torch.cuda.Event on GPU
    zeroed: bool = True  # all zeros once ``reduce_done`` has passed (the reduce zeroes what it read)
    side_streams_noted: bool = False  # ``CommStreams.shared_with_side_streams`` was told of it
    held: list | None = None  # autograd's gradients the last reduce read, alive until it is done

    @torch.inference_mode(False)  # persistent buffers must outlive an inference-mode first call
    def allocated(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            self.zeroed, self.side_streams_noted = True, False
        return self.tensor

    def take_for_backward(self) -> None:
        """Hand the buffer to a backward that accumulates into it: zero unless the last reduce
        already did (on its stream, off the compute stream's path), or the buffer is new."""
        self.wait_until_reduced()
        self.held = None
        tensor = self.allocated()
        if not self.zeroed:
            tensor.zero_()  # the whole buffer: an abandoned backward may have written anywhere
        self.zeroed = False

    def release_held(self) -> None:
        """What the last reduce read goes back to the allocator, once the compute stream (where it was
        allocated, and where the allocator hands it out next) has waited for that reduce."""
        if self.held is not None:
            self.wait_until_reduced()
            self.held = None

    def wait_until_reduced(self) -> None:
        if self.reduce_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.reduce_done)


@dataclass
class FlatBuffers:
    """One unit-sized pair of buffers: unsharded parameters and their gradients (compute dtype)."""

    params: torch.Tensor  # [numel]
    grads: GradBuffer  # [numel]
    param_owner: Any = field(default=None, repr=False)  # the parameter group whose data ``params`` holds

    @classmethod
    @torch.inference_mode(False)  # persistent buffers must outlive an inference-mode first call
    def allocate(cls, numel: int, dtypes: BufferDtypes, device: torch.device) -> FlatBuffers:
        params = torch.empty(numel, dtype=dtypes.compute, device=device)
        return cls(params, GradBuffer(numel, dtypes.compute, device))  # gradients: at first use

    def nbytes_held(self) -> int:
        """Bytes of device memory these buffers hold now (0 for a dynamic unit between unshards)."""
        return sum(t.untyped_storage().nbytes() for t in (self.params, self.grads.tensor) if t is not None)


@dataclass
class CommScratch:
    """Staging for the collectives of the units of one root with the same dtypes and group: the
    all-gather's output (compute dtype) and the reduce-scatter's input (reduce dtype), in the
    gathered (rank-major) layout; the reduce-scatter writes its output in place, into this rank's
    row of its input (NCCL's in-place form), so no output buffer is kept. All-gathers run one
    after another on one stream, and so do reduce-scatters, so one set serves every unit that
    fits; it is sized for the largest slot unit (the repeated layer). A larger unit (the root
    with the embeddings, say) reduces through it in pieces (``reduce_pieces.py``), and takes
    all-gather staging of its own from the caching allocator, on the all-gather stream, giving it
    back right after, as FSDP2 does: kept persistent, it would sit in memory at the activation
    peak for a gather that runs when activations are few (the root's, at the start of the
    forward). Inside a whole-step capture that staging comes from the graph's pool."""

    gathered_numel: int
    dtypes: BufferDtypes
    device: torch.device
    gather: torch.Tensor | None = None
    reduce_in: torch.Tensor | None = None

    def fits(self, gathered_numel: int) -> bool:
        return gathered_numel <= self.gathered_numel

    @torch.inference_mode(False)
    def allocate_staging(self) -> None:
        if self.gather is None and self.gathered_numel:
            self.gather = torch.empty(self.gathered_numel, dtype=self.dtypes.compute, device=self.device)
            self.reduce_in = torch.empty(self.gathered_numel, dtype=self.dtypes.reduce, device=self.device)


@dataclass(frozen=True)
class BufferDtypes:
    compute: torch.dtype
    reduce: torch.dtype


@dataclass
class SlotPool:
    """Two slots shared by the leaf units of one root with the same dtypes and group size."""

    numel: int
    dtypes: BufferDtypes
    device: torch.device
    slots: list[FlatBuffers] = field(default_factory=list)
    _next: int = 0

    def assign(self) -> FlatBuffers:
        """The slot for the next unit in execution order (allocated on first use)."""
        if not self.slots:
            self.slots = [
                FlatBuffers.allocate(self.numel, self.dtypes, self.device) for _ in range(2)
            ]
        slot = self.slots[self._next]
        self._next ^= 1
        return slot


@dataclass(frozen=True)
class PlacementRequest:
    """What the plan needs to know of one unit."""

    numel: int  # unsharded buffer size
    world_size: int
    dtypes: BufferDtypes
    device: torch.device
    group_id: int  # units may share slots only within one process group
    double_buffer: bool
    persist_buffer_on_alloc_fail: bool
    has_inner_units: bool
    reshard_after_forward: bool = True  # False: kept gathered until backward, so no slot to share
    gathered_numel: int = 0  # its all-gather output / reduce-scatter input (``flat_layout.py``)

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
        dtypes, device, _, _ = key
        pools[key] = SlotPool(slot_numel, dtypes, device)

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


def plan_scratch(requests: list[PlacementRequest],
                 plan: list[tuple[Placement, SlotPool | None]]) -> list[CommScratch]:
    """Every unit's shared collective staging, in the order of ``requests``: one per pool key, sized
    for its largest slot unit (empty without slot units: every unit then stages on its own)."""
    scratch: dict[tuple, CommScratch] = {}
    for r, (placement, _) in zip(requests, plan):
        s = scratch.setdefault(r.pool_key, CommScratch(0, r.dtypes, r.device))
        if placement is Placement.SLOT:
            s.gathered_numel = max(s.gathered_numel, r.gathered_numel)
    return [scratch[r.pool_key] for r in requests]
