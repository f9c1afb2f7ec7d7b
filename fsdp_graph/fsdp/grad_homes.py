"""Sharded gradients homed in a graph pool: a unit's ``.grad`` memory inside its graphs' activation memory.

With per-layer and segment graphs the graphs' memory pool holds every block's activations for the
whole step, so the sharded gradients, which the reduces make during the backward, add on top of it
where eager FSDP frees activations as gradients appear (large GPT on 2 × H200: +2.5 GiB, the peak
1.14 × FSDP2's; 1.06 × with homes, for segments).

Yet a unit's gradients live from its reduce to the optimizer step, and the pool
memory freed by the backwards captured before its reduce (the activations of the blocks after it,
every forward's temporaries) is not written again before the next forward. So after capturing the
backward of a unit's graph (per layer: of its first module; a segment: the unit's segment), the
capture takes the unit's gradient buffer from the pool
(``ShardedGrads.set_home``): the allocator hands out exactly that freed memory, and no graph
captured later gets it. A root that reduces in pieces between the graphs reduces at the end of its
backward, after that of its model's first graph (in call order), so it is homed after that graph's
capture (``graphs/gradient_homes.roots_homed_after``): not after the last capture, whose free memory
may be another model's activations, still to be read by that model's backward (a second loss).
A backward can still reach a root before all of its graphs' backwards have run (two losses over two
towers of one model): so each home is given ``busy``, whether a graph whose memory it may share has
replayed a forward and awaits its backward, and a reduce that finds one busy leaves the home alone
and takes memory of its own for that step.

The gradients stay the user's as in FSDP2: ``zero_grad()`` drops them, ``.grad`` objects can be
kept. Before a graph of the pool replays a forward, ``GradHomes.vacate`` moves values someone still
holds (a ``.grad`` not set to None, a ``.grad`` object kept) into memory of their own, the tensor
objects staying the same; a tensor made from a gradient (a slice, a view) cannot follow and is
refused, naming the fix. A home is at fixed addresses, so the optimizer graph reads the gradients
there and pins only gradients without a home (pinning gives a home up); its check holds no
``.grad`` object strongly, which would count as a holder. Only a pool of the graphs alone
(``pool=None``; not with activation offload) gets homes.

A home is one piece per parameter (its local rows), not one block for the whole unit: the blocks a
backward capture frees are single activations, rarely as large as a unit's gradients, and a home
that fits none of them takes new memory from the pool (per-layer graphs on medium: the pool grew by
all of the homes, 1.15 GiB, with one block per unit; by nothing with one piece per parameter).
"""

from __future__ import annotations

import weakref
from itertools import accumulate

import torch


class GradHomes:
    """The sharded gradients homed in one pool, and whether a reduce wrote a home since the last vacate."""

    def __init__(self) -> None:
        self.members: list = []  # ShardedGrads
        self.written = False
        self.warned_pinned = False  # that a member-to-be was pinned already (graphs/gradient_homes.py)
        self._busy: dict[int, object] = {}  # id(member) -> whether a graph sharing its home awaits its backward

    def add(self, grads, busy=None) -> None:
        """``busy()``: whether a graph whose memory ``grads``' home may share (one whose backward was
        captured before the home was taken) has replayed a forward and awaits its backward; None:
        none can. A reduce leaves a busy home alone (``ShardedGrads._homed``)."""
        self.members.append(grads)
        if busy is not None:
            self._busy[id(grads)] = busy

    def remove(self, grads) -> None:
        if grads in self.members:
            self.members.remove(grads)
        self._busy.pop(id(grads), None)

    def busy(self, grads) -> bool:
        busy = self._busy.get(id(grads))
        return busy is not None and busy()

    def vacate(self, what: str) -> None:
        """Before ``what`` (a graph of the pool) replays a forward, which may write any home."""
        if self.written:
            for grads in self.members:
                grads.leave_home_if_held(what)
            self.written = False

    def drop(self) -> None:
        """The graphs were not installed (a failed capture): every member keeps its memory elsewhere."""
        for grads in list(self.members):
            grads.give_up_home()
        self.members.clear()
        self._busy.clear()


class HomeRows:
    """Writes a reduced shard into a home's pieces: per parameter the rows a (start, values) piece of
    the shard covers, as one multi-tensor copy (and scale). The plan (the pieces' views, the split of
    the source) is made once per (start, length); a source's parts are kept only while that source
    tensor lives."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self._plan: tuple | None = None  # ((start, numel), split sizes, positions of the kept parts, views)
        # The last source's parts, while that tensor object lives (the shared staging's row, the parking
        # buffer: made once; a unit's own staging dies after its reduce, and the parts with it).
        self._source: tuple | None = None  # (weak reference to the source, plan key, its parts)
        self._addresses: tuple | None = None  # (the home's pieces, their addresses): ``fresh_write``'s key

    def views_held(self) -> int:
        """How many views of the pieces the plan keeps (they share the pieces' storage)."""
        return 0 if self._plan is None else len(self._plan[3])

    def write(self, pieces: list[torch.Tensor], start: int, values: torch.Tensor, scale: float, fresh: bool) -> None:
        """``pieces (+)= values · scale`` where they overlap, in the kernels the whole buffer would run
        (bitwise the same per element): fresh, a copy and a multiply (``torch.mul`` rounds as they do);
        else an ``add_`` per parameter (a zeroed one when fresh in another dtype)."""
        sizes, kept, dests = self._planned(pieces, start, values.numel())
        if not dests:  # (none of this rank's rows in that part of the shard)
            return
        sources = self._parts(values, sizes, kept)
        if fresh and values.dtype == pieces[0].dtype:
            torch._foreach_copy_(dests, sources)
            if scale != 1.0:
                torch._foreach_mul_(dests, scale)
            return
        for dest, source in zip(dests, sources):
            if fresh:
                dest.zero_()
            dest.add_(source, alpha=scale)

    def fresh_write(self, pieces: list[torch.Tensor], scale: float) -> tuple:
        """``write``, fresh, as (key, ``body(values, start=0)``) for a collective graph: of the whole
        shard (``UnitReduce.whole``) or of each piece of a reduce in pieces (``UnitReduce.in_pieces``).
        The key is the pieces' addresses and the scale (the source's and the start the caller adds),
        which is all the recorded kernels depend on."""
        if self._addresses is None or self._addresses[0] is not pieces:  # (a home's pieces never move)
            self._addresses = (pieces, tuple(piece.data_ptr() for piece in pieces))
        return (*self._addresses[1], scale), lambda values, start=0: self.write(pieces, start, values, scale, True)

    def _parts(self, values: torch.Tensor, sizes: list[int], kept: list[int]) -> list[torch.Tensor]:
        cached = self._source
        if cached is not None and cached[0]() is values and cached[1] is self._plan:
            return cached[2]
        if values.dim() != 1 or not values.is_contiguous():
            parts = values.split_with_sizes(sizes)
            return [parts[k] for k in kept]
        # Made on the storage, not as views of ``values``: a view would keep that tensor object alive
        # (its base), and the weak reference that drops the parts with it would never fire.
        storage, offsets = values.untyped_storage(), list(accumulate([values.storage_offset(), *sizes]))
        with torch.no_grad():
            sources = [values.new_empty(0).set_(storage, offsets[k], (sizes[k],)) for k in kept]
        self._source = (weakref.ref(values, self._forget_source), self._plan, sources)
        return sources

    def _forget_source(self, ref) -> None:
        if self._source is not None and self._source[0] is ref:
            self._source = None

    def _planned(self, pieces: list[torch.Tensor], start: int, numel: int) -> tuple[list, list, list]:
        if self._plan is not None and self._plan[0] == (start, numel):
            return self._plan[1:]
        sizes, kept, dests, at = [], [], [], start  # (the source split into gaps and the rows we hold)
        for piece, span in zip(pieces, self.layout.spans):
            lo = max(start, span.shard_offset)
            hi = min(start + numel, span.shard_offset + span.local_rows * span.row_numel)
            if hi > lo:
                sizes += [lo - at, hi - lo]
                kept.append(len(sizes) - 1)
                dests.append(piece.view(-1)[lo - span.shard_offset : hi - span.shard_offset])
                at = hi
        sizes.append(start + numel - at)
        self._plan = ((start, numel), sizes, kept, dests)
        return sizes, kept, dests
