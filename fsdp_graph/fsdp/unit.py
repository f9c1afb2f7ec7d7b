"""One FSDP unit: its checked steps (pre/post forward, pre/post backward) over its parameter group.

A unit is a module passed to ``fully_shard``. It owns a ``ParamGroup`` (master shard,
persistent buffer, unshard/reshard: ``param_group.py``) and a ``UnitGradients`` (gradient
targets, ``no_sync``, reduce-scatter: ``gradients.py``). What it adds is the order of things and
the checks: each step verifies the unit's training state (``training_state.py``) and raises a
``TransitionError`` naming the unit when called out of order, which is what lets a graph wrapper
drive the steps by hand. The forward and backward steps also prefetch the neighbour that the
root's recorded execution order names (``order.py``).

Buffers, streams and the execution order are given to the unit by its root at lazy init
(``bind``); the unit never reaches up to the root. The entry points are therefore the module's
hooks and the sentinel handlers (``hooks.py``), which go through the root (lazy init, iteration
boundaries); a step called on the unit before its root's lazy init says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .buffers import BufferDtypes, CommScratch, Placement, PlacementRequest, SlotPool
from .collective_graphs import CollectiveGraphs
from .collectives import CommStreams
from .gradients import UnitGradients
from .mesh import ShardMesh
from .mixed_precision import MixedPrecisionPolicy
from .order import ExecutionOrder
from .param_group import HOLDS_DATA, ParamGroup, ShardState
from .sharded_param import ShardedParam
from .training_state import TrainingState, TransitionError, check_transition


@dataclass(frozen=True)
class UnitConfig:
    mp_policy: MixedPrecisionPolicy
    double_buffer: bool
    persist_buffer_on_alloc_fail: bool
    reshard_after_forward: bool = True  # False: gathered from forward to backward, one all-gather

    @property
    def fixed_addresses(self) -> bool:
        """Unsharded parameters (and gradient buffers, where a graph reads them) never move: what a
        CUDA graph needs."""
        return self.double_buffer and self.persist_buffer_on_alloc_fail


def _dtypes(name: str, params: list[tuple[str, nn.Parameter, list]], policy: MixedPrecisionPolicy):
    """(compute, reduce, master) dtypes, or an error naming the parameter and the fix."""
    for pname, p, _ in params:
        if isinstance(p, DTensor):
            raise ValueError(
                f"FSDP unit {name}: parameter '{pname}' is already a DTensor (tensor parallel?). fsdp_graph "
                "shards plain parameters only; combining it with tensor parallelism is not supported. Shard "
                "the model without parallelize_module, or use torch.distributed.fsdp for FSDP + TP."
            )
        if p.ndim == 0:
            raise ValueError(
                f"FSDP unit {name}: parameter '{pname}' is a 0-d (scalar) tensor; fully_shard shards parameters "
                "by rows, as FSDP2 does (which refuses scalars too). Make it a 1-D tensor of one element, e.g. "
                "nn.Parameter(value.reshape(1))."
            )
        if not p.dtype.is_floating_point:
            raise TypeError(
                f"FSDP unit {name}: parameter '{pname}' has dtype {p.dtype}; fully_shard shards "
                "floating-point parameters only. Register it as a buffer instead."
            )
    dtypes = sorted({p.dtype for _, p, _ in params}, key=str)
    if policy.param_dtype is None and len(dtypes) > 1:
        examples = ", ".join(f"'{next(n for n, p, _ in params if p.dtype == d)}' is {d}" for d in dtypes)
        raise TypeError(
            f"FSDP unit {name} has parameters of mixed dtypes ({examples}). One flat buffer "
            "needs one compute dtype: pass mp_policy=MixedPrecisionPolicy(param_dtype=...), cast the "
            "module with .to(dtype) before fully_shard, or fully_shard the differing submodule "
            "as its own unit."
        )
    compute = policy.param_dtype or (dtypes[0] if dtypes else torch.float32)
    reduce = policy.reduce_dtype or compute
    master = torch.float32
    for d in dtypes:
        master = torch.promote_types(master, d)
    return compute, reduce, master


class FSDPUnit:
    def __init__(self, module: nn.Module, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
                 config: UnitConfig, mesh: ShardMesh, device: torch.device, class_name: str | None = None) -> None:
        self.module = module
        self.class_name = class_name or type(module).__name__
        self.config = config
        self.mesh = mesh
        self.group: dist.ProcessGroup | None = mesh.shard_group
        self.device = device
        self.world_size = mesh.shard_rank_and_size[1]
        compute, reduce, master = _dtypes(self.class_name, params, config.mp_policy)
        self.compute_dtype = compute
        self.param_group = ParamGroup(self.class_name, params, BufferDtypes(compute, reduce), master, mesh, device)
        self.grads = UnitGradients(self.params, self.param_group.layout, compute, self.param_group.master_flat, mesh)
        for param in self.params:
            param.tag(self)
        self.rename(self.class_name)  # fully_shard renames it to "<path> (<class>)" once the tree is known
        self.active = True  # False once fully_shard dissolved it to rebuild it
        self.state = TrainingState.IDLE
        self.in_forward_method = False  # a registered forward method runs (it may call the module again)
        self.nested_forwards = 0  # forwards of this module inside that method (its self(...) calls)
        self.requires_gradient_sync = True
        self.reshard_after_backward = True  # False: keep the gathered parameters for the next forward
        self.forward_prefetch: list[FSDPUnit] | None = None  # set_modules_to_forward_prefetch (None: implicit)
        self.backward_prefetch: list[FSDPUnit] | None = None
        self.collective_graphs_chosen: bool | None = None  # graph_modules(collective_graphs=) given for it
        self.parent: FSDPUnit | None = None
        self.segmented = False  # its steps replay inside a segment graph: nothing outside it prefetches it
        self._streams: CommStreams | None = None
        self._order: ExecutionOrder | None = None
        self._awaits_end_of_backward = False  # inputs need no grad: post-backward at the root's end of backward
        self.param_group.yield_slot = self._finish_for_slot

    def rename(self, name: str) -> None:
        self.name = self.param_group.name = self.grads.name = self.grads.reduce.name = name

    @property
    def params(self) -> list[ShardedParam]:
        return self.param_group.params

    @property
    def placement(self) -> Placement | None:
        return self.param_group.placement

    @property
    def shard_state(self) -> ShardState:
        return self.param_group.state

    # -- lazy init, by the root -----------------------------------------------------------
    def placement_request(self, has_inner_units: bool) -> PlacementRequest:
        layout, config = self.param_group.layout, self.config
        return PlacementRequest(layout.unsharded_numel, self.world_size, self.param_group.dtypes, self.device,
                                id(self.group), config.double_buffer, config.persist_buffer_on_alloc_fail,
                                has_inner_units, config.reshard_after_forward, layout.gathered_numel)

    def bind(self, placement: Placement, pool: SlotPool | None, scratch: CommScratch, streams: CommStreams,
             order: ExecutionOrder) -> None:
        self._streams, self._order = streams, order
        self.param_group.bind(placement, pool, scratch, streams)

    def take_slot(self) -> None:
        self.param_group.take_slot()

    def replay_collectives(self, graphs: CollectiveGraphs | None) -> None:
        """Replay this unit's unshard and reduce bodies as CUDA graphs (``collective_graphs.py``), or
        run them eagerly again (None)."""
        self.param_group.collective_graphs = self.grads.collective_graphs = graphs
        if graphs is not None:
            # The capture's passes left every parameter without a gradient (they differentiate stand-ins),
            # so its reduces read zeros; a reduce that replays reads the gradients a graph handed over,
            # or the unit's gradient buffer.
            self.grads.release_zeros()

    def _refuse_unbound(self, step: str) -> None:
        raise RuntimeError(
            f"FSDP unit {self.name}: {step} called on the unit directly before its root's lazy init. A unit's "
            "steps run through its root: call the module (module(...)), or the hook functions and handlers "
            "(fsdp_graph.fsdp.hooks.pre_forward_unshard(module, args, kwargs), "
            "fsdp_graph.pre_backward_handler(module), ...), as a graph wrapper does."
        )

    # -- the four steps ---------------------------------------------------------------------
    def pre_forward(self) -> bool:
        """Unshard (unless prefetched) and prefetch the next unit; False for an activation-
        checkpoint recompute inside backward, where pre_backward already unsharded."""
        if self.state is TrainingState.BACKWARD:
            return False
        check_transition(self.name, "pre_forward", self.state, (TrainingState.IDLE,))
        if self._order is None:
            self._refuse_unbound("pre_forward")
        if torch.is_grad_enabled():  # (a no-grad forward before a pending backward leaves it as it is)
            self._awaits_end_of_backward = False  # set again by this forward's hooks if it applies
        self._order.record_forward(self)
        group = self.param_group
        state = group.state
        kept = not self.reshard_after_backward and self._kept_from_backward()
        if not kept and state is not ShardState.PREFETCHED and state is not ShardState.UNSHARDED:
            group.unshard()  # (UNSHARDED here: the user called module.unshard() before this forward)
        if group.sync_requires_grad():
            self.grads.refresh_trainable()
        group.use()
        self.state = TrainingState.FORWARD
        self._prefetch_next(self.forward_prefetch, self._order.after_in_forward, for_backward=False)
        return True

    def post_forward(self) -> bool:
        if self.state is TrainingState.BACKWARD:
            return False
        check_transition(self.name, "post_forward", self.state, (TrainingState.FORWARD,))
        self.param_group.reshard(free=self.config.reshard_after_forward)
        self.state = TrainingState.IDLE
        return True

    def pre_backward(self) -> bool:
        """Unshard again (unless the buffer still holds the parameters), choose where the gradients
        go (``UnitGradients.prepare``), prefetch the previous unit. False when already done for this backward."""
        if self.state is TrainingState.BACKWARD:
            return False  # several outputs each fire the hook; the first one does the work
        check_transition(self.name, "pre_backward", self.state, (TrainingState.IDLE,))
        if self._order is None:
            self._refuse_unbound("pre_backward")
        self._order.record_backward(self)
        group = self.param_group
        if group.state not in HOLDS_DATA:
            group.unshard(for_backward=True)
        group.use()
        self.state = TrainingState.BACKWARD
        self.grads.prepare(group.buffers, group.scratch, self.requires_gradient_sync)
        self._prefetch_next(self.backward_prefetch, self._order.after_in_backward, for_backward=True)
        return True

    def _prefetch_next(self, explicit: list[FSDPUnit] | None, neighbour, for_backward: bool) -> None:
        """The units set by set_modules_to_*_prefetch, else the neighbour in the recorded order."""
        if explicit is None:
            following = neighbour(self)
            explicit = () if following is None else (following,)
        for unit in explicit:
            unit.prefetch(for_backward=for_backward)

    def post_backward(self) -> None:
        check_transition(self.name, "post_backward", self.state, (TrainingState.BACKWARD,))
        group = self.param_group
        self.grads.finish(group.buffers, group.scratch, self._streams, self.requires_gradient_sync)
        self._awaits_end_of_backward = False
        keep = self.keeps_gathered_after_backward()
        self.param_group.reshard(free=not keep)
        if not keep:
            self.param_group.drop()  # the optimizer changes the masters next
        self.state = TrainingState.IDLE

    def prefetch(self, for_backward: bool) -> None:
        """Gather ahead of this unit's step (asked by the unit before it). Not while it computes;
        not twice in a forward; not in a backward when the buffer still holds its parameters."""
        if self.state is not TrainingState.IDLE or self.segmented:
            return
        state = self.param_group.state
        if state is ShardState.PREFETCHED or state is ShardState.UNSHARDED or (for_backward and state in HOLDS_DATA):
            return  # (UNSHARDED while idle: module.unshard() put them in place already)
        if self.reshard_after_backward or not self._kept_from_backward():
            self.param_group.prefetch()

    def keeps_gathered_after_backward(self) -> bool:
        """set_reshard_after_backward(False) keeps the gathered parameters after a backward that did
        not synchronise gradients (accumulation: no optimizer step can follow it), outside capture."""
        return (not self.reshard_after_backward and not self.requires_gradient_sync
                and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()))

    def _kept_from_backward(self) -> bool:
        """Gathered parameters kept after the last backward (set_reshard_after_backward(False)) that
        are still the masters' current values: the forward uses them as they are."""
        return self.param_group.state is ShardState.GATHERED and self.param_group.holds_current_masters()

    # -- post-backward for units whose inputs need no gradient -----------------------------
    def post_backward_at_end(self) -> None:
        """Called at forward time when no input requires grad (token ids, say): nothing to hang the
        post-backward trigger on, so the root's end-of-backward step runs it, as FSDP2's does, in
        the same order on every rank (where a unit's inputs need a gradient on every rank or on
        none, as FSDP2 needs too). Not when every parameter has accumulated: which ones get a
        gradient may differ between ranks, and a parameter used inside a reentrant checkpoint
        accumulates more than once; the ranks' reduce-scatters would pair with other units'."""
        self._awaits_end_of_backward = True

    def _finish_for_slot(self) -> bool:
        """Another unit's unshard for its backward needs the slot this unit holds while its
        post-backward waits for the end of the backward: finish it now (the backward has moved on
        to that unit). False if it is not waiting so."""
        if self.state is not TrainingState.BACKWARD or not self._awaits_end_of_backward:
            return False
        self.post_backward()
        return True

    # -- iteration boundaries and capture, by the root ------------------------------------
    def reset_if_stuck(self) -> None:
        """Bring a unit left mid-step by an exception back to IDLE (called at a root forward)."""
        self.nested_forwards, self.in_forward_method = 0, False
        if self.state is not TrainingState.IDLE:
            self.param_group.drop()
            self.grads.abandon()
            self._awaits_end_of_backward = False
            self.state = TrainingState.IDLE

    def forget_events(self) -> None:
        """Drop recorded CUDA events (call after a device synchronize). A capture must not wait on
        an event recorded outside it, and eager work must not wait on one recorded inside it."""
        self.param_group.forget_event()
        self.grads.forget_events(self.param_group.buffers)

    def capture_failed(self) -> None:
        """A capture that ran this unit's steps failed: what they flagged was never executed."""
        self.grads.forget_zeroed(self.param_group.buffers)

    def require_idle(self, what: str, *, unsharded_ok: bool = False) -> None:
        """Refuse work on the masters while the modules hold the unsharded parameters (mid-step,
        or after module.unshard(), unless ``unsharded_ok``)."""
        if self.state is not TrainingState.IDLE:
            raise TransitionError(
                f"FSDP unit {self.name}: {what} needs the unit idle, but it is in {self.state.value}; "
                "call it outside forward/backward."
            )
        if self.param_group.state is ShardState.UNSHARDED and not unsharded_ok:
            raise TransitionError(
                f"FSDP unit {self.name}: {what} needs the sharded parameters in the modules, but module.unshard() "
                "left the unsharded ones there; call module.reshard() first."
            )

    def __repr__(self) -> str:
        numel = self.param_group.layout.numel
        return f"FSDPUnit({self.name}, params={len(self.params)}, numel={numel}, state={self.state.value})"

