"""A unit's parameters as one flat group: the master shard, the persistent buffer, unshard and reshard.

FSDP2's ``FSDPParamGroup``, for a flat layout (``flat_layout.py``). Where the unsharded data is,
is one explicit state:

    SHARDED --unshard--> GATHERED --use--> UNSHARDED --reshard--> GATHERED (persistent placement)
    SHARDED --prefetch--> PREFETCHED --use--> UNSHARDED           SHARDED  (dynamic: memory freed)
    PREFETCHED --clear_prefetch--> GATHERED
    GATHERED / PREFETCHED --evict (another unit took the slot)--> SHARDED
    any --drop (the masters are about to change, or a reset)--> SHARDED

GATHERED and PREFETCHED mean the buffer holds this unit's current parameters (the all-gather
may still be in flight: ``use`` makes the compute stream wait for it); UNSHARDED means the
modules compute with them. A slot is shared by two units: a unit takes it with ``_acquire``,
which evicts the other one (refused while the other one is UNSHARDED, unless the other one's
post-backward waits for the end of the backward and this unshard is for a backward: it runs first).

Unshard casts the master shard into this rank's part of the shared gather buffer, all-gathers in
place, and copies the result out into the unit's persistent buffer (one kernel:
``FlatLayout.copy_out``), all on the all-gather stream, with no allocation; a unit larger than
the shared gather buffer (``buffers.CommScratch``) takes one of its own for each all-gather.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.distributed as dist
import torch.nn as nn

from .buffers import BufferDtypes, CommScratch, FlatBuffers, Placement, SlotPool
from .collective_graphs import CollectiveGraphs, can_replay
from .collectives import CommStreams, all_gather_inplace, collective_failed
from .flat_layout import FlatLayout
from .mesh import ShardMesh
from .sharded_param import ShardedParam, alias

_master_writes = [0]  # optimizer steps and state-dict loads seen (once someone keeps gathered data)
_watching_optimizers = False


def note_master_writes() -> None:
    """The masters may have changed (an optimizer step, a state-dict load): kept gathered copies are stale."""
    _master_writes[0] += 1


def watch_master_writes() -> None:
    """Count every optimizer step from now on (a global optimizer hook, registered once, by the
    first unit that keeps gathered parameters after backward)."""
    global _watching_optimizers
    if not _watching_optimizers:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda *_: note_master_writes())
        _watching_optimizers = True


class ShardState(Enum):
    SHARDED = "sharded"
    PREFETCHED = "prefetched"
    GATHERED = "gathered"
    UNSHARDED = "unsharded"


HOLDS_DATA = (ShardState.PREFETCHED, ShardState.GATHERED)


class ParamGroup:
    def __init__(self, name: str, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
                 dtypes: BufferDtypes, master_dtype: torch.dtype, mesh: ShardMesh, device: torch.device) -> None:
        self.name = name  # the unit's, for messages (renamed once the tree is known)
        self.dtypes = dtypes
        self.group: dist.ProcessGroup | None = mesh.shard_group
        self.device = device
        rank, world_size = mesh.shard_rank_and_size
        self.layout = FlatLayout([p.shape for _, p, _ in params], world_size, rank)
        self.master_flat = torch.zeros(self.layout.shard_numel, dtype=master_dtype, device=device)
        locals_ = self.layout.local_views(self.master_flat)
        self.params = [ShardedParam(name, refs, p, local, span, mesh)
                       for (name, p, refs), local, span in zip(params, locals_, self.layout.spans)]
        self.use_masters()
        self.state = ShardState.SHARDED
        self.placement: Placement | None = None
        self.buffers: FlatBuffers | None = None  # a slot is taken at the first unshard
        self.scratch: CommScratch | None = None
        self._pool: SlotPool | None = None
        self._streams: CommStreams | None = None
        self._param_flat: torch.Tensor | None = None
        self._unshard_event = None
        self._gathered_at = (-1, -1)  # (master writes noted, master_flat's version) when last gathered
        self.collective_graphs: CollectiveGraphs | None = None  # the unshard replayed as a graph (graph strategies)
        self.yield_slot = lambda: False  # the unit's: finish a backward to give the slot up (FSDPUnit._finish_for_slot)

    # -- placement ------------------------------------------------------------------------
    def bind(self, placement: Placement, pool: SlotPool | None, scratch: CommScratch, streams: CommStreams) -> None:
        """Take the placement the root planned (at its lazy init; again after a re-plan)."""
        self.placement, self._pool, self.scratch, self._streams = placement, pool, scratch, streams
        if self.buffers is not None:
            self.buffers.grads.release_held()  # (read by a reduce of a failed backward, perhaps in flight)
        self.buffers, self.state, self._unshard_event = None, ShardState.SHARDED, None
        self._shared_staging = None
        if self.collective_graphs is not None:
            self.collective_graphs.forget()
        if self.layout.shard_numel and scratch.fits(self.layout.gathered_numel):
            scratch.allocate_staging()
            streams.shared_with_side_streams(scratch.gather, scratch.reduce_in)
            self._shared_staging = self._staging_views(scratch.gather)
        if placement is not Placement.SLOT:
            self._bind_buffers(FlatBuffers.allocate(self.layout.unsharded_numel, self.dtypes, self.device))
        if placement is Placement.DYNAMIC:
            self._free_dynamic()

    def take_slot(self) -> None:
        """Take this unit's slot now (normally taken at its first unshard, in execution order)."""
        if self.placement is Placement.SLOT and self.buffers is None:
            self._bind_buffers(self._pool.assign())

    @torch.inference_mode(False)  # a first call under inference_mode must not make inference tensors
    def _bind_buffers(self, buffers: FlatBuffers) -> None:
        """Point the unsharded parameters at ``buffers`` (created at the first bind, then re-pointed)."""
        self.buffers = buffers
        if self.placement is not Placement.DYNAMIC:
            self._streams.shared_with_side_streams(buffers.params)  # (gradients: at their first reduce)
        self._param_flat = buffers.params[: self.layout.unsharded_numel]
        for param, view in zip(self.params, self.layout.param_views(alias(self._param_flat))):
            param.bind(view)
        self._copy_out_targets = self.layout.rank_major_views(self._param_flat)

    def _dynamic_storages(self):
        b, streams = self.buffers, self._streams
        return [(t, stream) for t, stream in ((b.params, streams.all_gather), (b.grads.tensor, streams.reduce))
                if t is not None]

    def _free_dynamic(self) -> None:
        """Dynamic placement, at reshard: give the memory back. The storage objects stay, so every
        view of them (the unsharded parameters, views autograd saved) sees the memory again when
        ``_regrow_dynamic`` reallocates it (possibly at another address), as FSDP2 does."""
        for tensor, stream in self._dynamic_storages():
            if stream is not None:
                tensor.record_stream(stream)
            tensor.untyped_storage().resize_(0)

    def _regrow_dynamic(self) -> None:
        for tensor, _ in self._dynamic_storages():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(tensor.numel() * tensor.element_size())
                self.buffers.grads.zeroed = False  # new memory: whatever was there

    def _acquire(self, prefetch: bool, for_backward: bool = False) -> bool:
        """Own a buffer for the unsharded parameters; False when a prefetch finds it busy.
        ``for_backward``: the backward reached this unit, so a unit holding the slot while its
        post-backward waits for the end of the backward may finish now (``yield_slot``); not for a
        forward, which in a backward is an activation-checkpoint recompute, before the holder's
        backward has run."""
        if self.placement is Placement.DYNAMIC:
            self._regrow_dynamic()
            return True
        if self.buffers is None:
            self._bind_buffers(self._pool.assign())
        owner = self.buffers.param_owner
        if owner is not None and owner is not self:
            if owner.state is ShardState.UNSHARDED:
                if prefetch:
                    return False
                if for_backward and owner.yield_slot():  # (its post-backward waited: it ran now)
                    return self._acquire(prefetch)
                raise RuntimeError(
                    f"FSDP units {owner.name} and {self.name} share a double-buffer slot but both need "
                    "their parameters unsharded at once (units run in a different order than in the "
                    "first forward, one unit runs inside another that is not its parent unit, or "
                    f"module.unshard() left {owner.name} unsharded: call its reshard() first). Otherwise "
                    "pass double_buffer=False to fully_shard for one of them."
                )
            owner.evict()
        self.buffers.param_owner = self
        return True

    # -- unshard / reshard ----------------------------------------------------------------
    def _issue_unshard(self, prefetch: bool, for_backward: bool = False) -> bool:
        if not self._acquire(prefetch, for_backward):
            return False
        streams, layout = self._streams, self.layout
        self._gathered_at = (_master_writes[0], self.master_flat._version)
        if layout.shard_numel:
            with streams.enter(streams.all_gather):
                shared = self._shared_staging
                fixed = shared is not None and self.placement is not Placement.DYNAMIC
                if fixed and can_replay(self.collective_graphs):
                    key = (self.master_flat.data_ptr(), shared[0].data_ptr(), self._param_flat.data_ptr())
                    self.collective_graphs.run("unshard", key, lambda: self._gather(*shared))
                else:
                    # Staging of its own (a unit larger than the shared one) is allocated on this stream and
                    # freed when this function returns: the allocator hands the block only to later work
                    # of this stream, which is queued after these reads.
                    self._gather(*(shared or self._staging_views(
                        torch.empty(layout.gathered_numel, dtype=self.dtypes.compute, device=self.device))))
                self._unshard_event = streams.record(streams.all_gather)
        return True

    def _gather(self, gathered: torch.Tensor, own_shard: torch.Tensor, by_rank: list[torch.Tensor]) -> None:
        """Cast the master shard into place, all-gather, copy out into the unsharded parameters."""
        own_shard.copy_(self.master_flat)
        try:
            all_gather_inplace(gathered, self.layout.shard_numel, self.group)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:  # gloo: a peer that never joined (timeout) or died
            raise collective_failed("all-gather", self.name, err) from err
        self.layout.copy_out(by_rank, self._copy_out_targets)

    def _staging_views(self, gather: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The all-gather's output in ``gather``, this rank's part of it, and its rows by rank."""
        layout = self.layout
        gathered = gather[: layout.gathered_numel]
        own = gathered.narrow(0, layout.rank * layout.shard_numel, layout.shard_numel)
        return gathered, own, layout.by_rank(gather)

    def unshard(self, for_backward: bool = False) -> None:
        """Gather now (for use in this step); the data lands asynchronously on GPU. ``for_backward``:
        see ``_acquire``."""
        self._issue_unshard(prefetch=False, for_backward=for_backward)
        self.state = ShardState.GATHERED

    def prefetch(self, strict: bool = False) -> None:
        """Gather ahead of use, unless the buffer is busy with another unit's parameters (then
        nothing happens; ``strict``: the slot-conflict error instead)."""
        if self._issue_unshard(prefetch=not strict):
            self.state = ShardState.PREFETCHED

    def use(self) -> None:
        """Swap the gathered parameters into the modules (the compute stream waits for them)."""
        self._streams.wait(self._unshard_event)
        self._unshard_event = None
        for param in self.params:
            param.use_unsharded(self.name)
        self.state = ShardState.UNSHARDED

    def use_masters(self) -> None:
        for param in self.params:
            master = param.master
            for module, attr in param.refs:
                module._parameters[attr] = master

    def reshard(self, free: bool = True) -> None:
        """The masters go back into the modules; the buffer is free for the next unit (a dynamic
        one's memory is freed, unless ``free=False``: kept gathered until after backward)."""
        self.use_masters()
        if self.placement is Placement.DYNAMIC and free:
            self._free_dynamic()
            self.state = ShardState.SHARDED
        else:
            self.state = ShardState.GATHERED

    def holds_current_masters(self) -> bool:
        """Whether the buffer holds the masters as they are now: gathered, with no optimizer step,
        state-dict load (``note_master_writes``) or in-place write through ``master_flat`` since.
        Never under graph capture, whose replays must all-gather."""
        return (self.state in HOLDS_DATA and self._gathered_at == (_master_writes[0], self.master_flat._version)
                and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()))

    def clear_prefetch(self) -> None:
        if self.state is ShardState.PREFETCHED:
            self.state = ShardState.GATHERED

    def evict(self) -> None:
        """Another unit takes the slot: its data will overwrite ours."""
        self.state = ShardState.SHARDED

    def drop(self) -> None:
        """The gathered copy is stale (the optimizer will change the masters), or a reset."""
        if self.state is ShardState.UNSHARDED:
            self.use_masters()
        self.state = ShardState.SHARDED

    def forget_event(self) -> None:
        self._unshard_event = None

    def sync_requires_grad(self) -> bool:
        """Follow ``requires_grad`` changes made on the masters after fully_shard; True if any."""
        changed = False
        for param in self.params:
            if param.master.requires_grad != param.requires_grad:
                param.follow_requires_grad()
                changed = True
        return changed

    # -- full parameters (state dicts, re-planning) ---------------------------------------
    def full_params(self) -> list[torch.Tensor]:
        """Every parameter's full value, in its original shape and dtype (a collective)."""
        layout = self.layout
        gathered = torch.zeros(layout.gathered_numel, dtype=self.master_flat.dtype, device=self.device)
        with torch.no_grad():
            gathered.narrow(0, layout.rank * layout.shard_numel, layout.shard_numel).copy_(self.master_flat)
            all_gather_inplace(gathered, layout.shard_numel, self.group)
        return [full.to(p.dtype) for full, p in zip(layout.full_from_gathered(gathered), self.params)]

    def load_full_param(self, index: int, value: torch.Tensor, key: str) -> None:
        span = self.layout.spans[index]
        if tuple(value.shape) != tuple(span.shape):
            raise ValueError(
                f"load_full_state_dict: '{key}' has shape {tuple(value.shape)} but the model's parameter "
                f"has shape {tuple(span.shape)}"
            )
        with torch.no_grad():
            self.params[index].local.copy_(value.detach().narrow(0, span.row_start, span.local_rows))

    def reattach_masters(self) -> None:
        """After ``Module._apply`` swapped the masters' tensors (``to_empty`` of a meta-device model,
        ``.to(device)``): their values go back into ``master_flat`` (``ShardedParam.reattach``)."""
        if any(p.moved() for p in self.params):
            self.drop()  # the gathered copy, if any, is stale
            for param in self.params:
                param.reattach()
        for param in self.params:
            param.retag()  # torch's swap_tensors moved the tags to the discarded tensors
