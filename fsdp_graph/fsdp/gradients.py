"""A unit's gradients: where its backward leaves them, ``no_sync`` accumulation, the reduce-scatter.

Before the unit's backward, ``prepare`` chooses where its gradients go:

* by default, nowhere of ours: ``.grad`` of the unsharded parameters is None, AccumulateGrad keeps
  the gradient autograd computed, and the reduce reads those tensors (held on the slot's
  ``GradBuffer`` until the compute stream has waited for the reduce). No buffer sits in memory
  between backwards, and nothing is zeroed and then accumulated into, as in FSDP2;
* for a unit whose parameters graphed modules cover (per-layer graphs), the gradients those
  graphs' backwards hand over (``graph_gradients.py``): their static buffers, at fixed addresses,
  which the reduce reads in place (and replays as a CUDA graph where it may, below);
* for another unit whose reduce replays as a CUDA graph (``collective_graphs``, and its staging is
  the shared one: ``CommScratch.fits``), which reads fixed addresses: views of the unit's persistent
  gradient buffer (zero: the reduce that last read it zeroed it on the reduce stream, off the
  compute stream's path), into which AccumulateGrad adds;
* while gradients accumulate without synchronisation (``no_sync``): views of a per-unit
  accumulation buffer that keeps its sum until the next synchronised backward.

After the backward, ``reduce`` copies the gradients into the shared reduce staging in rank order,
casting to ``reduce_dtype`` (one ``_chunk_cat`` kernel), reduce-scatters it, all-reduces across
HSDP replicas, and averages the result into the masters' ``.grad`` (accumulated if already set,
as autograd does). A unit larger than the staging does so piece by piece (``reduce_pieces.py``;
with collective graphs, each piece's reduce-scatter replays, keyed by the staging and its size, and
where the sharded gradients are at their home and fresh, with the piece's write in the same graph).
The masters' ``.grad`` live in ``sharded_grads.py``: views of one buffer per unit that follows
``zero_grad(set_to_none=...)`` as FSDP2's do (given back when every ``.grad`` was set to None, made
again by the next reduce), or stays for good once pinned by a whole-step graph or an optimizer graph
(which reads gradients homed in the layer graphs' pool there instead).
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch

from .buffers import CommScratch, FlatBuffers, GradBuffer
from .collective_graphs import CollectiveGraphs, can_replay
from .collectives import CommStreams
from .flat_layout import FlatLayout
from .graph_gradients import GraphGradients
from .mesh import ShardMesh
from .sharded_grads import ShardedGrads, run_post_accumulate_hooks
from .sharded_param import ShardedParam
from .stray_gradients import drop_unsharded_grads, refuse_stray_gradients
from .unit_reduce import UnitReduce
from .unused_params import GradientUse


class UnitGradients:
    def __init__(self, params: list[ShardedParam], layout: FlatLayout, compute_dtype: torch.dtype,
                 master_flat: torch.Tensor, mesh: ShardMesh) -> None:
        self.params = params
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.name = "?"  # the unit's name, set by FSDPUnit.rename (for error messages)
        self.group, self.replicate_group = mesh.shard_group, mesh.replicate_group  # (unused_params.py)
        self.world_size = layout.world_size * mesh.replicate_size  # the data-parallel ranks averaged over
        self.device = master_flat.device
        self.sharded = ShardedGrads(params, layout, master_flat)  # the masters' .grad
        self.trainable: list[int] = []
        self._masters: list[torch.Tensor] = []  # of the trainable parameters
        self.refresh_trainable()
        self.accumulation_pending = False  # a no_sync sum waits in the accumulation buffer
        self.divide_factor: float | None = None  # the reduced sum is divided by it (None: the world size)
        self._accum: GradBuffer | None = None
        self._accum_views: list[torch.Tensor] = []
        self._views_of: FlatBuffers | None = None  # the buffers ``_views`` are views of
        self._views: list[torch.Tensor] = []
        self._given: tuple = ([], {})  # the views ``prepare`` set as ``.grad``, and their versions then
        self._target: GradBuffer | None = None
        self._written = False  # this backward's gradients are autograd's own tensors (see the module docstring)
        self._copy_in_sources: dict[int, tuple] = {}  # id(target) -> (target, its padded views)
        self.reduce = UnitReduce(layout, mesh, self.device)  # staging, copy-in, reduce-scatter
        self.collective_graphs: CollectiveGraphs | None = None  # the reduce replayed as graphs (graph strategies)
        self.from_graphs = GraphGradients(params)  # gradients graphed modules hand over (graph_gradients.py)
        # Set while a segment graph captures this unit: the reduce leaves this rank's summed shard here
        # (unscaled, reduce dtype) and stops; ``accumulate_parked`` finishes it after each replay.
        self.parking: torch.Tensor | None = None
        self._zeros = _Zeros(layout, compute_dtype, self.device)  # for a frozen parameter, or one that got none
        self.use = GradientUse()  # which parameters got a gradient (``unused_params.py``)

    def release_zeros(self) -> None:
        """Give back the zeros read for parameters without a gradient (made again when next needed)."""
        self._zeros.release()

    def refresh_trainable(self) -> None:
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self._masters = [self.params[i].master for i in self.trainable]

    # -- around the backward ----------------------------------------------------------------
    def prepare(self, buffers: FlatBuffers, scratch: CommScratch, sync: bool) -> None:
        """Set ``.grad`` of the trainable unsharded parameters for this backward: None (autograd's
        own tensors), or views of a persistent target (see the module docstring)."""
        if not self.trainable:
            return
        accumulate = not sync or self.accumulation_pending
        fixed = self.collective_graphs is not None and scratch.fits(self.layout.gathered_numel)
        handed = self.from_graphs.open(self.trainable, accumulate)
        self._written = not accumulate and (handed or not fixed)
        refuse_stray_gradients(self.name, self.params, "found as its backward started")  # (finish leaves none)
        if self._written:
            target = buffers.grads
            target.release_held()
        else:
            if accumulate:
                target, views = self._accumulation_buffer(), self._accum_views
            else:
                target, views = buffers.grads, self._views_into(buffers)
            if not (accumulate and self.accumulation_pending):
                target.take_for_backward()
            for i in self.trainable:
                self.params[i].unsharded.grad = views[i]
            self._given = views, {i: views[i]._version for i in self.trainable}
        self._target = target

    def _got_gradient(self, i: int) -> bool:
        """Whether this backward gave parameter ``i`` a gradient: ``.grad`` set (autograd's own
        tensors), or the view ``prepare`` gave it accumulated into (each view has a version counter
        of its own, ``_counted``; a post-accumulate-grad hook cannot tell: it also runs where a
        backward function returned None for the parameter, as a graphed module does for one it
        does not use)."""
        grad = self.params[i].unsharded.grad
        if self._written or grad is None:
            return grad is not None or self.from_graphs.got(i)
        views, versions = self._given
        return grad is not views[i] or grad._version != versions[i]

    def finish(self, buffers: FlatBuffers, scratch: CommScratch, streams: CommStreams, sync: bool) -> None:
        """After the backward: reduce (``sync``) or keep the sum for the next synchronised backward."""
        target, self._target = self._target, None
        if target is None:
            return
        self.use.note(i for i in self.trainable if self._got_gradient(i))
        if sync:
            self._reduce(target, scratch, streams)
            self.accumulation_pending = False
        else:
            self._keep_sum(target)
        self.from_graphs.close()
        drop_unsharded_grads(self.params)  # (the next backward points .grad where it needs them again)

    def _keep_sum(self, target: GradBuffer) -> None:
        if target is not self._accum:  # no_sync set between this unit's pre- and post-backward: keep the sum
            accum = self._accumulation_buffer()
            accum.take_for_backward()
            for i in self.trainable:
                grad = self.from_graphs.gradient(i)
                if grad is not None:
                    self._accum_views[i].copy_(grad)
        self.accumulation_pending = True

    def abandon(self) -> None:
        """A backward that will not finish (reset after an exception)."""
        drop_unsharded_grads(self.params)
        self.from_graphs.close()
        self._target = None

    def _views_into(self, buffers: FlatBuffers) -> list[torch.Tensor]:
        if buffers is not self._views_of or self._views_of.grads.tensor is None:
            self._views = _counted(self.layout.param_views(buffers.grads.allocated()[: self.layout.unsharded_numel]))
            self._views_of = buffers
        return self._views

    def _accumulation_buffer(self) -> GradBuffer:
        if self._accum is None:
            self._accum = GradBuffer(self.layout.unsharded_numel, self.compute_dtype, self.device)
            self._accum_views = _counted(self.layout.param_views(self._accum.allocated()))
        return self._accum

    def _sources(self, target: GradBuffer) -> list[torch.Tensor]:
        entry = self._copy_in_sources.get(id(target))
        if entry is None or entry[0] is not target:
            entry = self._copy_in_sources[id(target)] = (target, self.layout.padded_views(target.tensor))
        return entry[1]

    def _take_sharded(self, writer_stream) -> list:
        """The trainable masters' ``.grad`` before the reduce changes them, and memory for the sharded
        buffer, taken on the compute stream, where its readers (optimizer, clipping) run."""
        current = [m.grad for m in self._masters]
        self.sharded.take(zeros=not all(map(operator.is_, current, repeat(None))), writer_stream=writer_stream)
        return current

    def _hand_on(self, reduced, current: list | None, scale: float) -> None:
        """This rank's reduced shard, as (start, values) pieces: into ``.grad``, or parked."""
        if self.parking is None:
            self.sharded.accumulate(reduced, current, self.trainable, scale)
            return
        for start, values in reduced:
            self.parking.narrow(0, start, values.numel()).copy_(values)

    def accumulate_parked(self, parked: torch.Tensor) -> None:
        """After a segment graph's backward replay, on the stream that replayed it: the shard its
        reduce parked (see ``parking``) into the masters' ``.grad``, as the eager reduce does."""
        if self.trainable:
            current = self._take_sharded(None)
            self.sharded.accumulate([(0, parked)], current, self.trainable, self._scale())
            run_post_accumulate_hooks(self._masters)

    def _scale(self) -> float:
        return 1.0 / (self.divide_factor or self.world_size)

    def _reduce(self, target: GradBuffer, scratch: CommScratch, streams: CommStreams) -> None:
        parked = self.parking is not None
        current = [m.grad for m in self._masters] if parked else self._take_sharded(streams.reduce)
        written, fixed = _take_written(self.params, self.layout, self._zeros, self.from_graphs) \
            if self._written else (None, True)
        if written is None and not target.side_streams_noted:
            streams.shared_with_side_streams(target.tensor)
            target.side_streams_noted = True
        pieces = self.reduce.pieces(scratch)
        with streams.enter(streams.reduce):
            if written is not None:
                sources = target.held = written  # until the compute stream has waited for this reduce
            else:
                sources = self._sources(target)
            scale = self._scale()
            # (The whole reduce's copy-in replays from fixed addresses only: the unit's buffers, a graph's
            # static gradients and the zeros, not autograd's own tensors. A piece's graph reads the staging.)
            graphs = self.collective_graphs if (fixed or pieces) and can_replay(self.collective_graphs) else None
            # (Not with a divide factor: one that changes each step would make a new graph each step.)
            write = None if parked or graphs is None or self.divide_factor is not None \
                else self.sharded.fresh_write(current, scale)
            if pieces is None:
                self._hand_on(self.reduce.whole(sources, target, written is None, scratch, streams, graphs, write),
                              current, scale)
            else:
                try:
                    self._hand_on(self.reduce.in_pieces(pieces, sources, scratch.reduce_in, graphs, write),
                                  current, scale)
                    if written is None:
                        target.tensor[: self.layout.unsharded_numel].zero_()  # for the next backward, off its path
                finally:  # (also after a failed collective: what was queued reading the target is covered)
                    target.reduce_done = streams.record(streams.reduce)
            if written is None:
                target.zeroed = True
            later = self.use.take_candidates(self.trainable, current)  # settled at the end of the backward
            if not parked:
                run_post_accumulate_hooks(
                    [m for i, m in zip(self.trainable, self._masters) if i not in later] if later else self._masters)

    # -- between steps ----------------------------------------------------------------------
    def clear(self) -> None:
        """No gradient at all: masters' ``.grad`` None, no pending ``no_sync`` accumulation."""
        for param in self.params:
            param.master.grad = None
        self.accumulation_pending = False
        self.use.used.clear()

    def pin_sharded(self) -> None:
        """One sharded gradient buffer for good: a whole-step graph writes into it at every replay."""
        self.sharded.pin()

    def expose_sharded(self, unused: frozenset[int] = frozenset()) -> None:
        """Point every trainable master's ``.grad`` at its piece of the pinned sharded gradient
        buffer, where a whole-step graph writes each step's gradient; not those of ``unused`` (no
        rank gave them a gradient in the captured step: None, as after an eager step)."""
        for i in self.trainable:
            if i in unused:
                continue
            master, view = self.params[i].master, self.sharded.views[i]
            if master.grad is not view:
                master.grad = view

    def _grad_buffers(self, buffers: FlatBuffers | None) -> list[GradBuffer]:
        return [b for b in (buffers.grads if buffers is not None else None, self._accum) if b is not None]

    def forget_events(self, buffers: FlatBuffers | None) -> None:
        """(After a device synchronise: every reduce is done.)"""
        for buffer in self._grad_buffers(buffers):
            buffer.reduce_done = None
            buffer.held = None

    def release_read(self, buffers: FlatBuffers | None) -> None:
        """Once the compute stream has waited for every reduce (the end of a backward): the
        gradients the reduces read go back to the allocator."""
        if buffers is not None:
            buffers.grads.held = None

    def forget_zeroed(self, buffers: FlatBuffers | None) -> None:
        """After a capture that failed midway: its steps flagged buffers as zeroed by kernels that
        were recorded, never run. The next backward zeroes them."""
        for buffer in self._grad_buffers(buffers):
            buffer.zeroed = False
            buffer.held = None

    def snapshot(self) -> tuple:
        """What unit steps run at graph capture may change: the masters' ``.grad``, the sharded
        values, the ``no_sync`` flag, the record of use (see ``RootContext.outside_training_step``)."""
        grads = [p.master.grad for p in self.params]
        return grads, self.sharded.snapshot(), self.accumulation_pending, self.use.snapshot()

    def restore(self, snapshot: tuple) -> None:
        grads, sharded, pending, use = snapshot
        self.use.restore(use)
        self.sharded.restore(sharded)
        for param, grad in zip(self.params, grads):
            param.master.grad = grad
        self.accumulation_pending = pending


def _counted(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same memory as ``views``, each with a version counter of its own (a view shares its
    base's): an accumulation into one parameter's gradient bumps only that one's."""
    with torch.inference_mode(False):
        return [torch.empty(0, dtype=v.dtype, device=v.device).set_(v.untyped_storage(), v.storage_offset(),
                                                                     v.size(), v.stride()) for v in views]


def _take_written(params: list[ShardedParam], layout: FlatLayout, zeros: _Zeros,
                  from_graphs: GraphGradients) -> tuple[list[torch.Tensor], bool]:
    """The gradients for the copy-in: autograd's, or those a graph handed over (zeros for a parameter
    that got none, or is frozen), taken off the unsharded parameters so the next backward starts again
    from None; and whether every one lies at a fixed address (handed over, or the zeros, where something
    was handed over: a capture's warm-up reduces only zeros, and would capture a graph no step replays)."""
    sources, fixed = [], bool(from_graphs.taken)
    for i in layout.moved_indices:
        grad = from_graphs.gradient(i)
        if grad is None:
            grad = zeros(layout.spans[i].shape)
        else:
            fixed = fixed and params[i].unsharded.grad is None  # (then handed over alone: the graph's buffer)
            params[i].unsharded.grad = None
            if grad.layout != torch.strided:  # (a sparse embedding's gradient)
                grad = grad.to_dense()
        sources.append(grad)
    return sources, fixed


class _Zeros:
    """Views of one persistent zero tensor (the unit's largest parameter): made once, only read.
    Inside a graph capture a fresh one (the pool's, zeroed at each replay): a tensor made there
    holds zeros only once the graph has run, so it cannot serve eager steps."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> None:
        self.layout, self.dtype, self.device = layout, dtype, device
        self._zero: torch.Tensor | None = None

    def __call__(self, shape: torch.Size) -> torch.Tensor:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self._zero is None:
            with torch.inference_mode(False):
                numel = max(span.numel for span in self.layout.spans)
                self._zero = torch.zeros(numel, dtype=self.dtype, device=self.device)
        return self._zero[: shape.numel()].view(shape)

    def release(self) -> None:
        """Made again when next needed (a reduce still reading it holds its views)."""
        self._zero = None
