"""A unit's gradients: persistent unsharded targets, ``no_sync`` accumulation, the reduce-scatter.

Before the unit's backward, ``prepare`` points every trainable unsharded parameter's ``.grad`` at
a view of a persistent buffer (zero: the reduce that last read it zeroed it on the reduce stream,
off the compute stream's path), so AccumulateGrad adds into it in place and never adopts
a tensor of its own: gradient addresses are fixed. The buffer is the unit's gradient buffer (next
to its parameter buffer), or, while gradients accumulate without synchronisation (``no_sync``), a
per-unit accumulation buffer that keeps its sum until the next synchronised backward.

After the backward, ``reduce`` copies the target into the shared reduce staging in rank order,
casting to ``reduce_dtype`` (one ``_chunk_cat`` kernel), reduce-scatters it, all-reduces across
HSDP replicas, and averages the result into the masters' ``.grad`` (accumulated if already set,
as autograd does). Each ``.grad`` is the master's kind (a ``Shard(0)`` DTensor, or plain without
a mesh) over this rank's rows in ``sharded_flat``, created once.
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch
import torch.distributed as dist

from .buffers import CommScratch, FlatBuffers, GradBuffer
from .collectives import CommStreams, all_reduce, collective_failed, reduce_scatter_sum
from .flat_layout import FlatLayout
from .mesh import ShardMesh, local_tensor
from .sharded_param import ShardedParam


class UnitGradients:
    def __init__(self, params: list[ShardedParam], layout: FlatLayout, compute_dtype: torch.dtype,
                 master_flat: torch.Tensor, mesh: ShardMesh) -> None:
        self.params = params
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.name = "?"  # the unit's name, set by FSDPUnit.rename (for error messages)
        self.group: dist.ProcessGroup | None = mesh.shard_group
        self.replicate_group: dist.ProcessGroup | None = mesh.replicate_group
        self.world_size = layout.world_size * mesh.replicate_size  # the data-parallel ranks averaged over
        self.sharded_flat = torch.zeros_like(master_flat)
        self._local_views = layout.local_views(self.sharded_flat)
        self._sharded_views = [p.wrap(v) for p, v in zip(params, self._local_views)]  # the masters' .grad
        self.trainable: list[int] = []
        self._masters: list[torch.Tensor] = []  # of the trainable parameters, and their sharded views
        self._trainable_views: list[torch.Tensor] = []
        self.refresh_trainable()
        self.accumulation_pending = False  # a no_sync sum waits in the accumulation buffer
        self.divide_factor: float | None = None  # the reduced sum is divided by it (None: the world size)
        self._accum: GradBuffer | None = None
        self._accum_views: list[torch.Tensor] = []
        self._views_of: FlatBuffers | None = None  # the buffers ``_views`` are views of
        self._views: list[torch.Tensor] = []
        self._target: GradBuffer | None = None
        self._copy_in_sources: dict[int, tuple] = {}  # id(target) -> (target, its padded views)
        self._staging: tuple | None = None  # (scratch, reduce_in by rank, reduce_in, reduce_out) of this unit

    def refresh_trainable(self) -> None:
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self._masters = [self.params[i].master for i in self.trainable]
        self._trainable_views = [self._sharded_views[i] for i in self.trainable]

    # -- around the backward ----------------------------------------------------------------
    def prepare(self, buffers: FlatBuffers, sync: bool) -> None:
        """Point ``.grad`` of the trainable unsharded parameters at the persistent target."""
        if not self.trainable:
            return
        accumulate = not sync or self.accumulation_pending
        if accumulate:
            target, views = self._accumulation_buffer(), self._accum_views
        else:
            target, views = buffers.grads, self._views_into(buffers)
        if not (accumulate and self.accumulation_pending):
            target.take_for_backward()
        for i in self.trainable:
            self.params[i].unsharded.grad = views[i]
        self._target = target

    def finish(self, buffers: FlatBuffers, scratch: CommScratch, streams: CommStreams, sync: bool) -> None:
        """After the backward: reduce (``sync``) or keep the sum for the next synchronised backward."""
        target, self._target = self._target, None
        if target is None:
            return
        if sync:
            self._reduce(target, scratch, streams)
            self.accumulation_pending = False
        else:
            self.accumulation_pending = True

    def abandon(self) -> None:
        """A backward that will not finish (reset after an exception)."""
        self._target = None

    def _views_into(self, buffers: FlatBuffers) -> list[torch.Tensor]:
        if buffers is not self._views_of:
            self._views = self.layout.param_views(buffers.grads.tensor[: self.layout.unsharded_numel])
            self._views_of = buffers
        return self._views

    def _accumulation_buffer(self) -> GradBuffer:
        if self._accum is None:
            with torch.inference_mode(False):
                tensor = torch.zeros(
                    self.layout.unsharded_numel, dtype=self.compute_dtype, device=self.sharded_flat.device
                )
            self._accum = GradBuffer(tensor)
            self._accum_views = self.layout.param_views(tensor)
        return self._accum

    def _sources(self, target: GradBuffer) -> list[torch.Tensor]:
        entry = self._copy_in_sources.get(id(target))
        if entry is None or entry[0] is not target:
            entry = self._copy_in_sources[id(target)] = (target, self.layout.padded_views(target.tensor))
        return entry[1]

    def _reduce(self, target: GradBuffer, scratch: CommScratch, streams: CommStreams) -> None:
        layout = self.layout
        if self._staging is None or self._staging[0] is not scratch:
            self._staging = (scratch, layout.by_rank(scratch.reduce_in), scratch.reduce_in[: layout.gathered_numel],
                             scratch.reduce_out[: layout.shard_numel])
        _, by_rank, grads, reduced = self._staging
        with streams.enter(streams.reduce):
            layout.copy_in(self._sources(target), by_rank)
            target.tensor[: layout.unsharded_numel].zero_()  # ready for the next backward, off its path
            target.zeroed = True
            target.reduce_done = streams.record(streams.reduce)  # the target is free again
            try:
                reduce_scatter_sum(reduced, grads, self.group)
                all_reduce(reduced, self.replicate_group)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as err:  # gloo: a peer that never joined (timeout) or died
                raise collective_failed("gradient reduce-scatter", self.name, err) from err
            self._accumulate_sharded(reduced)
            self._run_post_accumulate_hooks()

    def _accumulate_sharded(self, reduced: torch.Tensor) -> None:
        """master.grad (+)= reduced / world_size, as autograd would accumulate into ``.grad``."""
        scale = 1.0 / (self.divide_factor or self.world_size)
        masters, views = self._masters, self._trainable_views
        current = [m.grad for m in masters]
        if all(map(operator.is_, current, repeat(None))):
            if reduced.dtype == self.sharded_flat.dtype:
                torch.mul(reduced, scale, out=self.sharded_flat)  # one pass instead of zero_ + add_
            else:  # add_ scales in the master dtype (a mul would scale in the reduce dtype)
                self.sharded_flat.zero_()
                self.sharded_flat.add_(reduced, alpha=scale)
            for master, view in zip(masters, views):
                master.grad = view
        elif all(map(operator.is_, current, views)):
            self.sharded_flat.add_(reduced, alpha=scale)
        else:
            for master, grad, view, i in zip(masters, current, views, self.trainable):
                span = self.layout.spans[i]
                piece = reduced.narrow(0, span.shard_offset, span.local_rows * span.row_numel).view(span.local_shape)
                if grad is None:
                    self._local_views[i].zero_()
                    master.grad = grad = view
                local_tensor(grad).add_(piece, alpha=scale)

    def _run_post_accumulate_hooks(self) -> None:
        """Hooks registered on the masters with ``register_post_accumulate_grad_hook`` (optimizer in
        backward): run once the master's ``.grad`` holds the reduced gradient, as FSDP2 runs them
        (autograd never accumulates into a master, so it would never call them). On GPU they run
        on the reduce stream, after the reduce. A whole-step graph cannot replay Python: refused."""
        for master in self._masters:
            hooks = master._post_accumulate_grad_hooks
            if hooks:
                if master.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        "a parameter of this model has a post-accumulate-grad hook (optimizer in backward), "
                        "which a whole-step CUDA graph cannot replay. Step the optimizer after backward, or "
                        "use GraphConfig(strategy='layer') / 'none'."
                    )
                for hook in list(hooks.values()):
                    hook(master)

    # -- between steps ----------------------------------------------------------------------
    def clear(self) -> None:
        """No gradient at all: masters' ``.grad`` None, no pending ``no_sync`` accumulation."""
        for param in self.params:
            param.master.grad = None
        self.accumulation_pending = False

    def expose_sharded(self) -> None:
        """Point every trainable master's ``.grad`` at its piece of the sharded gradient buffer,
        where a whole-step graph without optimizer writes each step's gradient."""
        for i in self.trainable:
            master, view = self.params[i].master, self._sharded_views[i]
            if master.grad is not view:
                master.grad = view

    def reattach(self) -> None:
        """After ``Module._apply`` swapped the masters' ``.grad`` tensors: values back into
        ``sharded_flat``, and each ``.grad`` a view of it again (see ``ShardedParam.reattach``)."""
        for param, view in zip(self.params, self._local_views):
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

    def _grad_buffers(self, buffers: FlatBuffers | None) -> list[GradBuffer]:
        return [b for b in (buffers.grads if buffers is not None else None, self._accum) if b is not None]

    def forget_events(self, buffers: FlatBuffers | None) -> None:
        for buffer in self._grad_buffers(buffers):
            buffer.reduce_done = None

    def forget_zeroed(self, buffers: FlatBuffers | None) -> None:
        """After a capture that failed midway: its steps flagged buffers as zeroed by kernels that
        were recorded, never run. The next backward zeroes them."""
        for buffer in self._grad_buffers(buffers):
            buffer.zeroed = False

    def snapshot(self) -> tuple:
        """What unit steps run at graph capture may change: the masters' ``.grad``, the sharded
        values, the ``no_sync`` flag (see ``RootContext.outside_training_step``)."""
        return [p.master.grad for p in self.params], self.sharded_flat.clone(), self.accumulation_pending

    def restore(self, snapshot: tuple) -> None:
        grads, values, pending = snapshot
        with torch.no_grad():
            self.sharded_flat.copy_(values)
        for param, grad in zip(self.params, grads):
            param.master.grad = grad
        self.accumulation_pending = pending
