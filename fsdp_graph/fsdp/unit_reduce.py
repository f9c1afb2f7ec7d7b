"""One unit's reduce-scatter: where its input is staged, the copy-in, the collective.

The staging is the shared one (``buffers.CommScratch``) where the unit fits it; a wider unit goes
through it piece by piece (``reduce_pieces.py``), or, where one row of a parameter does not fit
(or no unit fits, so there is no shared staging), takes staging of its own for each reduce. The
reduce-scatter writes in place, into this rank's row of its input; HSDP then all-reduces that row
across replicas. ``UnitGradients`` decides where the gradients come from and where the result goes.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist

from .buffers import CommScratch, GradBuffer
from .collective_graphs import CollectiveGraphs
from .collectives import CommStreams, all_reduce, collective_failed, reduce_scatter_sum
from .flat_layout import FlatLayout
from .mesh import ShardMesh
from .reduce_pieces import ReducePiece, copy_piece_in, plan_pieces


class UnitReduce:
    def __init__(self, layout: FlatLayout, mesh: ShardMesh, device: torch.device) -> None:
        self.layout, self.device = layout, device
        self.name = "?"  # the unit's name (for error messages)
        self.group: dist.ProcessGroup | None = mesh.shard_group
        self.replicate_group: dist.ProcessGroup | None = mesh.replicate_group
        self._staging: tuple | None = None  # (scratch, reduce_in by rank, reduce_in, this rank's row) of this unit
        self._planned: tuple | None = None  # (staging size, the pieces or None) of a unit larger than it

    def pieces(self, scratch: CommScratch) -> list[ReducePiece] | None:
        """How this unit goes through the shared staging in pieces; None: it fits the staging
        whole, or stages on its own."""
        if scratch.fits(self.layout.gathered_numel) or scratch.reduce_in is None:
            return None
        if self._planned is None or self._planned[0] != scratch.gathered_numel:
            self._planned = (scratch.gathered_numel, plan_pieces(self.layout, scratch.gathered_numel))
        return self._planned[1]

    def whole(self, sources: list[torch.Tensor], target: GradBuffer, from_target: bool, scratch: CommScratch,
              streams: CommStreams, graphs: CollectiveGraphs | None,
              write: tuple | None = None) -> list[tuple[int, torch.Tensor]]:
        """One copy-in and one reduce-scatter of the whole unit, in the shared staging or in staging
        of its own; returns this rank's shard. ``from_target``: ``sources`` are views of ``target``,
        zeroed once copied in; ``graphs``: the unit's collective graphs, which replay the two (given
        only for sources at fixed addresses: the target, or a graph's static gradients and zeros).
        ``write``: (its key, ``write(shard)``), the shard's write into fixed sharded gradients
        (``ShardedGrads.fresh_write``): where graphs replay, it joins the reduce-scatter's graph and
        nothing is returned (written already); elsewhere the caller writes what is returned."""
        shared = scratch.fits(self.layout.gathered_numel)
        if shared and (self._staging is None or self._staging[0] is not scratch):
            self._staging = (scratch, *self._staging_views(scratch.reduce_in))
        graphs = graphs if shared else None  # (staging of its own moves)
        # Staging of its own (see ``buffers.CommScratch``) is allocated on this stream and freed
        # when the reduce is done: the allocator hands the block only to later work of this
        # stream, which is queued after these kernels.
        by_rank, grads, reduced = self._staging[1:] if shared else self._staging_views(
            torch.empty(self.layout.gathered_numel, dtype=scratch.dtypes.reduce, device=self.device))
        if from_target:
            def copy_in():
                self._copy_in(sources, by_rank, target)
        else:
            def copy_in():
                self.layout.copy_in(sources, by_rank)
        if graphs is None:
            copy_in()
        else:
            read = target.tensor.data_ptr() if from_target else tuple(s.data_ptr() for s in sources)
            key = (read, grads.data_ptr(), reduced.data_ptr())
            graphs.run("copy_in", key, copy_in)
        target.reduce_done = streams.record(streams.reduce)  # the target is free again
        one_process = self.group is None and self.replicate_group is None  # the staging holds the sum already

        def reduce_scatter():
            if not one_process:
                self._reduce_scatter(grads, reduced)

        if graphs is not None and write is not None:
            written_key, write_shard = write
            graphs.run("reduce_scatter_and_write", (*key, *written_key),
                       lambda: (reduce_scatter(), write_shard(reduced)))
            return []
        if graphs is None:
            reduce_scatter()
        elif not one_process:
            graphs.run("reduce_scatter", key, reduce_scatter)
        return [(0, reduced)]

    def in_pieces(self, pieces: list[ReducePiece], sources: list[torch.Tensor], reduce_in: torch.Tensor,
                  graphs: CollectiveGraphs | None, write: tuple | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Each piece copied into the shared staging, reduce-scattered in place, and handed on
        (``ShardedGrads.accumulate`` reads it before the next piece overwrites the staging).
        ``graphs``: the unit's collective graphs, which replay each piece's reduce-scatter (it reads
        and writes only the staging, so its key is the staging and the piece's size; the copy-in
        reads autograd's own tensors and stays eager). ``write``: as for ``whole``, the write into
        fixed sharded gradients (``ShardedGrads.fresh_write``), which then joins each piece's graph
        (keyed by the piece's start too), and nothing is handed on."""
        world, rank = self.layout.world_size, self.layout.rank
        collective = self.group is not None or self.replicate_group is not None
        for piece in pieces:
            by_rank = reduce_in[: world * piece.numel].view(world, piece.numel)
            copy_piece_in(self.layout, piece, sources, by_rank)
            reduce_scatter = partial(self._reduce_scatter, by_rank.view(-1), by_rank[rank]) if collective else None
            key = (reduce_in.data_ptr(), piece.numel)
            if graphs is not None and write is not None:
                written_key, write_shard = write
                graphs.run("reduce_scatter_and_write_piece", (*key, piece.start, *written_key),
                           partial(_reduce_and_write, reduce_scatter, write_shard, by_rank[rank], piece.start))
                continue
            if reduce_scatter is not None and graphs is None:
                reduce_scatter()
            elif reduce_scatter is not None:
                graphs.run("reduce_scatter_piece", key, reduce_scatter)
            yield piece.start, by_rank[rank]

    def _copy_in(self, sources: list[torch.Tensor], by_rank: torch.Tensor, target: GradBuffer) -> None:
        """The gradients into the staging in rank order (reduce dtype); the target zeroed for the
        next backward, off its path."""
        self.layout.copy_in(sources, by_rank)
        target.tensor[: self.layout.unsharded_numel].zero_()

    def _reduce_scatter(self, grads: torch.Tensor, reduced: torch.Tensor) -> None:
        try:
            reduce_scatter_sum(reduced, grads, self.group)
            all_reduce(reduced, self.replicate_group)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:  # gloo: a peer that never joined (timeout) or died
            raise collective_failed("gradient reduce-scatter", self.name, err) from err

    def _staging_views(self, reduce_in: torch.Tensor) -> tuple:
        """The copy-in's rows by rank, the reduce-scatter's input, and its output: this rank's row of
        the input (the in-place form, which saves a shard-sized buffer)."""
        by_rank = self.layout.by_rank(reduce_in)
        return by_rank, reduce_in[: self.layout.gathered_numel], by_rank[self.layout.rank]


def _reduce_and_write(reduce_scatter, write_shard, reduced: torch.Tensor, start: int) -> None:
    """A piece's reduce-scatter (None: one process, the staging holds the sum) and its write."""
    if reduce_scatter is not None:
        reduce_scatter()
    write_shard(reduced, start)
