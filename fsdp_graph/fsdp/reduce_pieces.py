"""A wide unit's reduce in pieces, through the shared staging.

The shared reduce staging (``buffers.CommScratch``) is sized for the repeated layer. A wider unit
(the root with the embeddings) would stage its whole reduce-scatter input on its own: every
rank's shard in the reduce dtype, fp32 under mixed precision, twice the unit's bf16 gradients.
That staging is taken at the end of the backward, which is where the per-layer graphs' pool and
the sharded gradients are both at their fullest (``docs/performance.md``). Reduced in pieces
instead, it needs no memory of its own:

* a piece is a contiguous range of the shard: a run of whole parameters, or rows of one parameter
  too large for the staging (a split falls on a row, so every piece is whole rows);
* each piece is copied into the shared staging in rank order (cast to the reduce dtype),
  reduce-scattered in place, and accumulated into the sharded gradients, one after another on the
  reduce stream, so the staging is reused only after the piece before it has been read.

Every element is summed over the same ranks as in one reduce-scatter of the whole unit (where a
collective's summation order depends on its size, as gloo's all-reduce over more than two HSDP
replicas does, a piece may round differently from the whole, as any bucketing would). If one row
of some parameter is larger than the staging (or there is no shared staging), the unit stages on
its own as before. A collective that fails part-way leaves the pieces before it accumulated; its
``CollectiveError`` ends the step, as any failed collective does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .flat_layout import FlatLayout


@dataclass(frozen=True)
class ReducePiece:
    start: int  # in the shard
    numel: int  # per rank
    params: tuple[int, int]  # [first, stop) in the layout's moved (non-empty) parameters
    rows: tuple[int, int] | None = None  # rows [a, b) of each rank's chunk of one parameter; None: whole ones


def plan_pieces(layout: FlatLayout, staging_numel: int) -> list[ReducePiece] | None:
    """The pieces of ``layout``'s shard that fit ``staging_numel`` elements of staging each (rank
    order: ``world`` rows of ``numel``); None if one row of a parameter does not fit."""
    per_rank = staging_numel // layout.world_size
    spans = layout.moved_spans
    if not spans or any(span.row_numel > per_rank for span in spans):
        return None
    pieces: list[ReducePiece] = []
    first, numel = 0, 0  # the run of whole parameters being gathered into one piece
    for j, span in enumerate(spans):
        if numel and numel + span.chunk_numel > per_rank:
            pieces.append(ReducePiece(spans[first].shard_offset, numel, (first, j)))
            first, numel = j, 0
        if span.chunk_numel <= per_rank:
            numel += span.chunk_numel
            continue
        step = per_rank // span.row_numel
        for a in range(0, span.chunk_rows, step):
            b = min(a + step, span.chunk_rows)
            pieces.append(ReducePiece(span.shard_offset + a * span.row_numel, (b - a) * span.row_numel,
                                      (j, j + 1), (a, b)))
        first = j + 1
    if numel:
        pieces.append(ReducePiece(spans[first].shard_offset, numel, (first, len(spans))))
    return pieces


def copy_piece_in(layout: FlatLayout, piece: ReducePiece, sources: list[torch.Tensor], by_rank: torch.Tensor) -> None:
    """The staging's rows (``by_rank``: ``[world, piece.numel]``) <- this piece of ``sources`` (one
    per moved parameter, as ``FlatLayout.copy_in`` takes them: padded to ``world · c`` rows, or
    full-shape, whose missing rows are zeros), cast to the staging's dtype."""
    first, stop = piece.params
    if piece.rows is None:
        torch._chunk_cat(sources[first:stop], dim=0, num_chunks=layout.world_size, out=by_rank)
        return
    a, b = piece.rows
    span, source = layout.moved_spans[first], sources[first]
    out = by_rank.view(layout.world_size, b - a, *span.shape[1:])
    whole = min(source.shape[0] // span.chunk_rows, layout.world_size)  # ranks whose chunk the source holds whole
    if whole:
        out[:whole].copy_(source[: whole * span.chunk_rows].unflatten(0, (whole, span.chunk_rows))[:, a:b])
    if whole < layout.world_size:  # the rows past the parameter's end are padding: zeros
        out[whole:].zero_()
        present = max(0, min(source.shape[0] - whole * span.chunk_rows - a, b - a))
        if present:
            start = whole * span.chunk_rows + a
            out[whole, :present].copy_(source[start : start + present])
