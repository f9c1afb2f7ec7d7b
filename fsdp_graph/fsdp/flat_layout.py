"""How one unit's parameters are laid out in a flat buffer and split into per-rank shards.

Parameters are concatenated in order, each starting at a multiple of ``ALIGN_NUMEL`` elements
(aligned views keep vectorised kernels fast), and the total is padded so that every rank owns
one contiguous shard of equal size. A parameter's piece on a rank is the intersection of its
range with the rank's shard range: possibly empty, and always 1-D.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN_NUMEL = 64


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter sits in the flat buffer, and which part of it this rank's shard holds."""

    shape: torch.Size
    offset: int  # start in the flat buffer
    numel: int
    shard_start: int  # start of this rank's piece inside the shard
    piece_start: int  # start of this rank's piece inside the flattened parameter
    piece_numel: int


class FlatLayout:
    def __init__(self, shapes: list[torch.Size], world_size: int, rank: int) -> None:
        offsets, cursor = [], 0
        for shape in shapes:
            cursor = _round_up(cursor, ALIGN_NUMEL)
            offsets.append(cursor)
            cursor += shape.numel()
        self.numel = cursor
        self.padded_numel = _round_up(cursor, ALIGN_NUMEL * world_size) if cursor else 0
        self.shard_numel = self.padded_numel // world_size
        self.world_size, self.rank = world_size, rank
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.spans: list[ParamSpan] = []
        for shape, offset in zip(shapes, offsets):
            start, end = max(offset, lo), min(offset + shape.numel(), hi)
            piece = max(0, end - start)
            self.spans.append(
                ParamSpan(
                    shape=shape,
                    offset=offset,
                    numel=shape.numel(),
                    shard_start=(start - lo) if piece else 0,
                    piece_start=(start - offset) if piece else 0,
                    piece_numel=piece,
                )
            )

    def shard_slice(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        rank = self.rank if rank is None else rank
        return flat.narrow(0, rank * self.shard_numel, self.shard_numel)

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Full-shape views of every parameter inside an unsharded flat buffer."""
        return [flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.spans]

    def piece_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's 1-D piece of every parameter inside a shard-sized buffer."""
        return [shard.narrow(0, s.shard_start, s.piece_numel) for s in self.spans]
