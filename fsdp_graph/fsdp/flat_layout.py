"""How one unit's parameters are laid out: FSDP2's row chunks per rank, one flat shard per rank.

Every parameter is split along dim 0 by ``torch.chunk``'s rule, as FSDP2 (and DTensor's
``Shard(0)``) does: rank r holds rows ``[r·c, (r+1)·c)`` with ``c = ceil(rows / world)``, so a
rank's piece is a whole-row slice with the parameter's trailing shape, possibly short or empty on
the last ranks. That is what lets the sharded parameters be ``Shard(0)`` DTensors every consumer
(clipping, DCP, ``full_tensor``) reads correctly.

Three flat layouts of the same parameters:

* the **shard** (``shard_numel`` per rank): the chunks of every parameter, each padded to ``c``
  rows, back to back. The masters and the sharded gradients are views of it.
* the **gathered** buffer (``world · shard_numel``): every rank's shard in rank order, what one
  all-gather produces and what one reduce-scatter consumes.
* the **unsharded** buffer (``unsharded_numel``): every parameter whole (padded to ``world · c``
  rows), each starting at a multiple of ``ALIGN_NUMEL`` elements, so the unsharded parameters and
  gradients are contiguous full-shape views. The all-gather's copy-out and the reduce-scatter's
  copy-in (``torch._chunk_cat``) move data between the gathered and the unsharded layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN_NUMEL = 64


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class ParamSpan:
    """One parameter in the three layouts, for this rank."""

    shape: torch.Size
    row_numel: int  # elements per row (dim 0)
    chunk_rows: int  # rows per rank, c = ceil(rows / world)
    row_start: int  # this rank's first row (min(rows, rank · c))
    local_rows: int  # rows this rank holds (c, fewer, or 0 on the last ranks)
    shard_offset: int  # start of its chunk inside a shard
    offset: int  # start inside the unsharded buffer

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.local_rows, *self.shape[1:]))



class FlatLayout:
    def __init__(self, shapes: list[torch.Size], world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.spans: list[ParamSpan] = []
        shard_cursor, cursor = 0, 0
        for shape in shapes:
            if len(shape) == 0:
                raise ValueError("a 0-d (scalar) parameter cannot be sharded by rows")  # callers name it
            rows = shape[0]
            row_numel = shape.numel() // rows if rows else 0
            chunk_rows = -(-rows // world_size)
            local_rows = max(0, min(chunk_rows, rows - rank * chunk_rows))
            cursor = _round_up(cursor, ALIGN_NUMEL)
            span = ParamSpan(shape, row_numel, chunk_rows, min(rows, rank * chunk_rows), local_rows,
                             shard_cursor, cursor)
            self.spans.append(span)
            shard_cursor += span.chunk_numel
            cursor += world_size * span.chunk_numel
        self.numel = sum(s.numel for s in self.spans)
        self.shard_numel = shard_cursor
        self.gathered_numel = world_size * shard_cursor
        self.unsharded_numel = _round_up(cursor, ALIGN_NUMEL)
        self.moved_spans = [s for s in self.spans if s.chunk_numel]  # what copy_in / copy_out move (no empties)
        self.moved_indices = [i for i, s in enumerate(self.spans) if s.chunk_numel]
        self._chunk_sizes = [s.chunk_numel for s in self.moved_spans]

    # -- views of a shard-sized buffer (masters, sharded gradients) ---------------------
    def local_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of every parameter, in their local shape."""
        return [shard.narrow(0, s.shard_offset, s.local_rows * s.row_numel).view(s.local_shape) for s in self.spans]

    # -- views of an unsharded buffer ------------------------------------------------------
    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Full-shape views of every parameter inside an unsharded buffer."""
        return [flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.spans]

    def padded_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every non-empty parameter with its padding rows (``world · c`` rows): what ``_chunk_cat``
        splits into per-rank chunks."""
        return [flat.narrow(0, s.offset, self.world_size * s.chunk_numel).view(self.world_size * s.chunk_rows,
                                                                               *s.shape[1:])
                for s in self.moved_spans]

    def rank_major_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every non-empty parameter with its padding as ``[world, c · row_numel]``: the copy-out targets."""
        return [flat.narrow(0, s.offset, self.world_size * s.chunk_numel).view(self.world_size, s.chunk_numel)
                for s in self.moved_spans]

    # -- between the gathered and the unsharded layouts ------------------------------------
    def by_rank(self, gathered: torch.Tensor) -> torch.Tensor:
        """A gathered buffer as ``[world, shard_numel]``."""
        return gathered[: self.gathered_numel].view(self.world_size, self.shard_numel)

    def copy_out(self, by_rank: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Unsharded buffer <- gathered buffer (``by_rank``), after an all-gather, in one kernel.
        ``targets``: ``rank_major_views`` of the unsharded buffer (made once per buffer)."""
        if targets:
            torch.split_with_sizes_copy(by_rank, self._chunk_sizes, dim=1, out=targets)

    def copy_in(self, sources: list[torch.Tensor], by_rank: torch.Tensor) -> None:
        """Gathered buffer (``by_rank``) <- unsharded gradients, casting to its dtype, before a
        reduce-scatter, in one kernel. ``sources``: one tensor per parameter of ``moved_indices``,
        the ``padded_views`` of an unsharded buffer or full-shape tensors (``_chunk_cat`` pads
        their rows to ``world · c`` with zeros, as the padded views hold)."""
        if sources:
            torch._chunk_cat(sources, dim=0, num_chunks=self.world_size, out=by_rank)

    def full_from_gathered(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's full value (a copy) from a gathered buffer."""
        by_rank = gathered.view(self.world_size, self.shard_numel)
        return [by_rank[:, s.shard_offset : s.shard_offset + s.chunk_numel]
                .reshape(self.world_size * s.chunk_rows, *s.shape[1:])[: s.rows].clone()
                for s in self.spans]
