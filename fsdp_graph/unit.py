"""One FSDP unit: a module's parameters, flattened, sharded, and unsharded on demand.

Follow one parameter through it:

1. ``__init__``: the parameter gets a span in the unit's flat layout (``flat_layout.py``); this
   rank's piece is copied into ``master_flat`` (fp32 or wider) and a 1-D ``nn.Parameter`` view
   of that piece replaces the parameter in every module that referenced it. The optimizer sees
   this *master* under the original name.
2. ``pre_forward`` / ``pre_backward``: the master shard is cast into this rank's region of the
   unit's persistent parameter buffer (``buffers.py``) and all-gathered in place. Persistent
   full-shape ``nn.Parameter`` views of that buffer (the *unsharded* parameters, the same objects
   every iteration) are swapped into the modules for compute.
3. ``pre_backward`` also points every unsharded parameter's ``.grad`` at a view of the unit's
   persistent gradient buffer (zeroed), so AccumulateGrad adds into it in place and never adopts
   a tensor of its own: gradient addresses are fixed too.
4. ``post_backward``: the gradient buffer is reduce-scattered in ``reduce_dtype`` and averaged
   into the master's ``.grad`` (a view of ``sharded_grad_flat``; accumulated if ``.grad`` is
   already set, as autograd does). Under ``no_sync`` the gradients are instead kept in a per-unit
   accumulation buffer and reduced by the next synchronised backward.
5. ``post_forward`` / ``post_backward`` swap the masters back: "reshard" marks the buffer free.

On GPU the all-gathers run on one side stream, the reduce-scatters on another, joined to the
compute stream with events. Each step checks the unit's training state (``training_state.py``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
import torch
import torch.distributed as dist
import torch.nn as nn

from .buffers import FlatBuffers, GradBuffer, Placement, SlotPool
from .collectives import all_gather_inplace, reduce_scatter_sum
from .distributed import group_rank_and_size
from .flat_layout import FlatLayout
from .mixed_precision import MixedPrecision
from .root import CommStreams, RootContext
from .training_state import TrainingState, TransitionError, check_transition

MASTER_TAG = "_fsdp_graph_master_of"  # on every sharded master parameter: weakref to its unit
REPLACED_TAG = "_fsdp_graph_replaced_by"  # on an original parameter: weakref to the unit that sharded it


def _live_unit(param: nn.Parameter, tag: str) -> "FSDPUnit | None":
    ref = getattr(param, tag, None)
    unit = ref() if ref is not None else None
    return unit if unit is not None and unit.module.__dict__.get("_fsdp_unit") is unit else None


def master_owner(param: nn.Parameter) -> "FSDPUnit | None":
    """The unit whose sharded master ``param`` is (None for ordinary parameters)."""
    return _live_unit(param, MASTER_TAG)


def replaced_by(param: nn.Parameter) -> "FSDPUnit | None":
    """The unit that already sharded this original parameter: it is tied across units."""
    return _live_unit(param, REPLACED_TAG)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread right now."""
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class UnitConfig:
    mp_policy: MixedPrecision
    double_buffer: bool
    persist_buffer_on_alloc_fail: bool


class ManagedParam:
    """One original parameter: where it is referenced, its master shard, its original dtype."""

    __slots__ = ("name", "refs", "dtype", "requires_grad", "master", "master_ptr", "original")

    def __init__(self, name: str, refs: list[tuple[nn.Module, str]], original: nn.Parameter) -> None:
        self.name = name
        self.refs = refs
        self.dtype = original.dtype
        self.requires_grad = original.requires_grad
        self.original = weakref.ref(original)  # to recognise ties that cross unit boundaries
        self.master: nn.Parameter | None = None
        self.master_ptr = 0


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """Same memory, separate autograd version counter.

    The unsharded parameters are saved for backward, and the buffer under them is rewritten in
    place by later all-gathers (slot reuse) and by the re-gather before backward. That is by
    design (the data is restored before backward reads it), so those writes, made through the
    buffer tensor, must not bump the version counter autograd checks on the parameter views.
    """
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )


class FSDPUnit:
    def __init__(
        self,
        module: nn.Module,
        params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        config: UnitConfig,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.module = module
        self.class_name = type(module).__name__
        self.name = self.class_name  # fully_shard renames it to "<path> (<class>)" once the tree is known
        self.config = config
        self.group = group
        self.device = device
        self.rank, self.world_size = group_rank_and_size(group)
        self.params = [ManagedParam(name, refs, p) for name, p, refs in params]
        self.compute_dtype, self.reduce_dtype, master_dtype = self._dtypes([p for _, p, _ in params])
        self.layout = FlatLayout([p.shape for _, p, _ in params], self.world_size, self.rank)

        self.master_flat = torch.zeros(self.layout.shard_numel, dtype=master_dtype, device=device)
        self.sharded_grad_flat = torch.zeros_like(self.master_flat)
        self._sharded_grad_views = self.layout.piece_views(self.sharded_grad_flat)
        with torch.no_grad():
            for mp, (_, original, _), span, piece in zip(
                self.params, params, self.layout.spans, self.layout.piece_views(self.master_flat)
            ):
                piece.copy_(original.detach().reshape(-1)[span.piece_start : span.piece_start + span.piece_numel])
                mp.master = nn.Parameter(piece, requires_grad=mp.requires_grad)
                setattr(mp.master, MASTER_TAG, weakref.ref(self))
                setattr(original, REPLACED_TAG, weakref.ref(self))
                mp.master_ptr = mp.master.data_ptr()
        self._trainable = [i for i, mp in enumerate(self.params) if mp.requires_grad]
        self._use_masters()

        self.state = TrainingState.IDLE
        self.requires_gradient_sync = True
        self.graphed = False  # set by graph_modules: graphs hold this unit's buffer addresses
        self.parent: FSDPUnit | None = None
        self.root_unit: FSDPUnit = self
        self.subtree_units: list[FSDPUnit] = [self]
        self.root_ctx: RootContext | None = None
        self.placement: Placement | None = None
        self._pool: SlotPool | None = None
        self._unsharded: list[nn.Parameter] = []  # created at the first bind, then the same objects forever
        self._grad_hooked: set[int] = set()
        self._post_backward_from_params = False  # inputs need no grad: finish when all grads accumulated
        self._grads_accumulated = 0
        self._unbind()
        self._accum: GradBuffer | None = None
        self._accum_views: list[torch.Tensor] = []
        self._accum_pending = False

    # -- construction helpers -------------------------------------------------------------
    def _dtypes(self, originals: list[nn.Parameter]) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        for mp, p in zip(self.params, originals):
            if not p.dtype.is_floating_point:
                raise TypeError(
                    f"FSDP unit {self.name}: parameter '{mp.name}' has dtype {p.dtype}; fully_shard shards "
                    "floating-point parameters only. Register it as a buffer instead."
                )
        dtypes = sorted({p.dtype for p in originals}, key=str)
        mp_policy = self.config.mp_policy
        if mp_policy.param_dtype is None and len(dtypes) > 1:
            examples = ", ".join(
                f"'{next(mp.name for mp in self.params if mp.dtype == d)}' is {d}" for d in dtypes
            )
            raise TypeError(
                f"FSDP unit {self.name} has parameters of mixed dtypes ({examples}). One flat buffer "
                "needs one compute dtype: pass mp_policy=MixedPrecision(param_dtype=...), cast the "
                "module with .to(dtype) before fully_shard, or fully_shard the differing submodule "
                "as its own unit."
            )
        compute = mp_policy.param_dtype or (dtypes[0] if dtypes else torch.float32)
        reduce = mp_policy.reduce_dtype or compute
        master = torch.float32
        for d in dtypes:
            master = torch.promote_types(master, d)
        return compute, reduce, master

    @property
    def buffer_key(self) -> tuple:
        """Units that may share slots: same dtypes, device and shard count."""
        return (self.compute_dtype, self.reduce_dtype, self.device, self.world_size, id(self.group))

    # -- buffer binding -------------------------------------------------------------------
    def bind_root(self, ctx: RootContext, placement: Placement, pool: SlotPool | None) -> None:
        self.root_ctx, self.placement, self._pool = ctx, placement, pool
        self._unbind()
        if placement is not Placement.SLOT:
            self._bind(self._allocate())
        if placement is Placement.DYNAMIC:
            self._free_dynamic()

    def bind_slot(self) -> None:
        """Take this unit's slot now (normally taken at its first unshard, in execution order)."""
        if self.placement is Placement.SLOT and self._buffers is None:
            self._bind(self._pool.assign())

    def _allocate(self) -> FlatBuffers:
        n = self.layout.padded_numel
        return FlatBuffers.allocate(n, n // self.world_size, self.compute_dtype, self.reduce_dtype, self.device)

    @torch.inference_mode(False)  # a first call under inference_mode must not make inference tensors
    def _bind(self, buffers: FlatBuffers) -> None:
        """Point the unit at ``buffers`` (once per placement). The unsharded parameters are
        created once; a re-plan at a later lazy init only re-points them (``.data``)."""
        n = self.layout.padded_numel
        self._buffers = buffers
        self._param_flat = buffers.params[:n]
        views = self.layout.param_views(_alias(self._param_flat))
        if not self._unsharded:
            self._unsharded = [nn.Parameter(v, requires_grad=mp.requires_grad) for v, mp in zip(views, self.params)]
            self._hook_grad_accumulation()
        else:
            for param, view in zip(self._unsharded, views):
                param.data = view
        self._grad_views = self.layout.param_views(buffers.grads.tensor[:n])

    def _dynamic_storages(self):
        b, streams = self._buffers, self.root_ctx.streams
        pairs = ((b.params, streams.all_gather), (b.grads.tensor, streams.reduce),
                 (b.reduce_in, streams.reduce), (b.reduce_out, streams.reduce))
        return [(t, stream) for t, stream in pairs if t is not None]

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

    def _unbind(self) -> None:
        self._buffers: FlatBuffers | None = None
        self._param_flat: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        self._gathered = False  # the buffer holds this unit's current parameters (maybe in flight)
        self._prefetched = False  # gathered ahead of use in this pass, not yet consumed
        self._unshard_event = None
        self._grad_target: GradBuffer | None = None

    def _acquire(self, prefetch: bool) -> bool:
        """Own a buffer for the unsharded parameters; False when a prefetch finds it busy."""
        if self.placement is Placement.DYNAMIC:
            self._regrow_dynamic()
            return True
        if self._buffers is None:
            self._bind(self._pool.assign())
        owner = self._buffers.param_owner
        if owner is not None and owner is not self:
            if owner.state is not TrainingState.IDLE:
                if prefetch:
                    return False
                raise RuntimeError(
                    f"FSDP units {owner.name} and {self.name} share a double-buffer slot but both need "
                    "their parameters unsharded at once (units run in a different order than in the "
                    "first forward, or one unit runs inside another that is not its parent unit). "
                    f"Pass double_buffer=False to fully_shard for one of them."
                )
            owner._gathered = owner._prefetched = False  # evict: its data will be overwritten
        self._buffers.param_owner = self
        return True

    # -- unshard / reshard ----------------------------------------------------------------
    def _issue_unshard(self, prefetch: bool = False) -> bool:
        if not self._acquire(prefetch):
            return False
        streams = self.root_ctx.streams
        if self.layout.padded_numel:
            with streams.enter(streams.all_gather):
                self.layout.shard_slice(self._param_flat).copy_(self.master_flat)
                all_gather_inplace(self._param_flat, self.layout.shard_numel, self.group)
                self._unshard_event = streams.record(streams.all_gather)
        self._gathered = True
        return True

    def _prefetch(self) -> None:
        if self._issue_unshard(prefetch=True):
            self._prefetched = True

    def _use_unsharded(self) -> None:
        CommStreams.wait(self._unshard_event)
        self._unshard_event = None
        for mp, unsharded in zip(self.params, self._unsharded):
            self._check_not_replaced(mp, unsharded)
            for module, attr in mp.refs:
                module._parameters[attr] = unsharded

    def _use_masters(self) -> None:
        for mp in self.params:
            for module, attr in mp.refs:
                module._parameters[attr] = mp.master

    def _check_not_replaced(self, mp: ManagedParam, unsharded: nn.Parameter) -> None:
        for module, attr in mp.refs:
            current = module._parameters.get(attr)
            if current is not mp.master and current is not unsharded:
                break
        else:
            if mp.master.numel() == 0 or mp.master.data_ptr() == mp.master_ptr:
                return
        raise RuntimeError(
            f"FSDP unit {self.name}: parameter '{mp.name}' was replaced after fully_shard (the module "
            "no longer holds the sharded parameter fully_shard installed, or its .data was reassigned). "
            "Update values in place instead: fsdp_graph.load_full_state_dict(model, state_dict), or "
            "`with torch.no_grad(): param.copy_(...)` on the sharded parameter."
        )

    def _release(self) -> None:
        """Reshard: the masters go back into the modules; the buffer is free for the next unit."""
        self._use_masters()
        if self.placement is Placement.DYNAMIC:
            self._free_dynamic()
            self._gathered = self._prefetched = False

    def _sync_requires_grad(self) -> None:
        """Follow ``requires_grad`` changes made on the sharded parameters after fully_shard."""
        changed = False
        for mp, unsharded in zip(self.params, self._unsharded):
            if mp.master.requires_grad != mp.requires_grad:
                mp.requires_grad = mp.master.requires_grad
                unsharded.requires_grad_(mp.requires_grad)
                changed = True
        if changed:
            self._trainable = [i for i, mp in enumerate(self.params) if mp.requires_grad]
            self._hook_grad_accumulation()

    def _hook_grad_accumulation(self) -> None:
        for i in self._trainable:
            if i not in self._grad_hooked:
                self._unsharded[i].register_post_accumulate_grad_hook(self._on_grad_accumulated)
                self._grad_hooked.add(i)

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        """For a unit whose inputs need no gradient (nothing to hang a post-backward on): run
        post-backward once every trainable parameter's gradient has been accumulated."""
        if not self._post_backward_from_params or self.state is not TrainingState.BACKWARD:
            return
        self._grads_accumulated += 1
        if self._grads_accumulated == len(self._trainable):
            self.post_backward()

    def post_backward_from_param_grads(self) -> None:
        """Called at forward time when no input requires grad (see ``_on_grad_accumulated``)."""
        self._post_backward_from_params = True

    # -- the four hook steps --------------------------------------------------------------
    def pre_forward(self) -> None:
        ctx = self.ensure_root_ctx()
        if self is ctx.root and not _in_backward():
            ctx.begin_forward()  # a new iteration (also recovers units an exception left mid-step)
        if self.state is TrainingState.BACKWARD:
            return  # activation-checkpoint recompute: pre_backward already unsharded us
        check_transition(self.name, "pre_forward", self.state, (TrainingState.IDLE,))
        ctx.record_forward(self)
        if not self._prefetched:
            self._issue_unshard()
        self._prefetched = False
        self._sync_requires_grad()
        self._use_unsharded()
        self.state = TrainingState.FORWARD
        following = ctx.next_forward(self)
        if following is not None and following.state is TrainingState.IDLE and not following._prefetched:
            following._prefetch()

    def post_forward(self) -> None:
        if self.state is TrainingState.BACKWARD:
            return
        check_transition(self.name, "post_forward", self.state, (TrainingState.FORWARD,))
        self._release()
        self.state = TrainingState.IDLE
        if self is self.root_ctx.root:
            self.root_ctx.end_forward()

    def pre_backward(self) -> None:
        if self.state is TrainingState.BACKWARD:
            return  # several outputs each fire the hook; the first one does the work
        check_transition(self.name, "pre_backward", self.state, (TrainingState.IDLE,))
        ctx = self.ensure_root_ctx()
        ctx.record_backward(self)
        if not self._gathered:
            self._issue_unshard()
        self._prefetched = False
        self._use_unsharded()
        self.state = TrainingState.BACKWARD
        self._prepare_grads()
        previous = ctx.next_backward(self)
        if previous is not None and previous.state is TrainingState.IDLE and not previous._gathered:
            previous._prefetch()

    def post_backward(self) -> None:
        check_transition(self.name, "post_backward", self.state, (TrainingState.BACKWARD,))
        target = self._grad_target
        if target is not None:
            if self.requires_gradient_sync:
                self._reduce(target)
                self._accum_pending = False
            else:
                self._accum_pending = True
        self._grad_target = None
        self._post_backward_from_params = False
        self._release()
        self._gathered = False
        self.state = TrainingState.IDLE

    # -- gradients ------------------------------------------------------------------------
    def _prepare_grads(self) -> None:
        if not self._trainable:
            return
        accumulate = not self.requires_gradient_sync or self._accum_pending
        if accumulate:
            if self._accum is None:
                with torch.inference_mode(False):
                    tensor = torch.zeros(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
                self._accum = GradBuffer(tensor)
                self._accum_views = self.layout.param_views(tensor)
            target, views = self._accum, self._accum_views
        else:
            target, views = self._buffers.grads, self._grad_views
        if not (accumulate and self._accum_pending):
            target.wait_until_reduced()
            target.tensor[: self.layout.padded_numel].zero_()
        for i in self._trainable:
            self._unsharded[i].grad = views[i]
        self._grad_target = target
        self._grads_accumulated = 0

    def _reduce(self, target: GradBuffer) -> None:
        n, buffers, streams = self.layout.padded_numel, self._buffers, self.root_ctx.streams
        with streams.enter(streams.reduce):
            grads = target.tensor[:n]
            if buffers.reduce_in is not None:
                grads = buffers.reduce_in[:n].copy_(grads)
            reduced = buffers.reduce_out[: self.layout.shard_numel]
            reduce_scatter_sum(reduced, grads, self.group)
            self._accumulate_sharded_grads(reduced)
            target.reduce_done = streams.record(streams.reduce)

    def _accumulate_sharded_grads(self, reduced: torch.Tensor) -> None:
        """master.grad (+)= reduced / world_size, as autograd would accumulate into ``.grad``."""
        scale = 1.0 / self.world_size
        masters = [self.params[i].master for i in self._trainable]
        views = [self._sharded_grad_views[i] for i in self._trainable]
        current = [m.grad for m in masters]
        if all(g is None for g in current):
            self.sharded_grad_flat.zero_()
            self.sharded_grad_flat.add_(reduced, alpha=scale)
            for master, view in zip(masters, views):
                master.grad = view
        elif all(g is v for g, v in zip(current, views)):
            self.sharded_grad_flat.add_(reduced, alpha=scale)
        else:
            for master, grad, view, i in zip(masters, current, views, self._trainable):
                span = self.layout.spans[i]
                piece = reduced.narrow(0, span.shard_start, span.piece_numel)
                if grad is None:
                    master.grad = view.zero_()
                    grad = view
                grad.add_(piece, alpha=scale)

    def clear_grads(self) -> None:
        """No gradient at all: masters' ``.grad`` None, no pending ``no_sync`` accumulation."""
        for mp in self.params:
            mp.master.grad = None
        self._accum_pending = False

    def expose_sharded_grads(self) -> None:
        """Point every trainable master's ``.grad`` at its piece of the sharded gradient buffer,
        where a whole-step graph without optimizer writes each step's gradient."""
        for i in self._trainable:
            master, view = self.params[i].master, self._sharded_grad_views[i]
            if master.grad is not view:
                master.grad = view

    # -- root and iteration boundaries ----------------------------------------------------
    def ensure_root_ctx(self) -> RootContext:
        if self.root_ctx is None:
            root = self.root_unit
            RootContext(root, root.subtree_units)  # binds itself to every unit
        return self.root_ctx

    def reset_if_stuck(self) -> None:
        """Bring a unit left mid-step by an exception back to IDLE (called at a root forward)."""
        if self.state is not TrainingState.IDLE:
            self._use_masters()
            self._grad_target = None
            self._gathered = self._prefetched = self._post_backward_from_params = False
            self.state = TrainingState.IDLE

    def clear_prefetch(self) -> None:
        self._prefetched = False

    def forget_events(self) -> None:
        """Drop recorded CUDA events (call after a device synchronize). A capture must not wait on
        an event recorded outside it, and eager work must not wait on one recorded inside it."""
        self._unshard_event = None
        for buffer in (self._buffers.grads if self._buffers is not None else None, self._accum):
            if buffer is not None:
                buffer.reduce_done = None

    # -- graph capture ------------------------------------------------------------------
    def grad_state(self) -> tuple:
        """What unit steps run at graph capture may change: the masters' ``.grad``, the sharded
        gradient values, the ``no_sync`` accumulation flag (see ``RootContext.outside_training_step``)."""
        return [mp.master.grad for mp in self.params], self.sharded_grad_flat.clone(), self._accum_pending

    def restore_grad_state(self, state: tuple) -> None:
        grads, values, accum_pending = state
        with torch.no_grad():
            self.sharded_grad_flat.copy_(values)
        for mp, grad in zip(self.params, grads):
            mp.master.grad = grad
        self._accum_pending = accum_pending

    # -- full parameters (state dicts, re-planning) ---------------------------------------
    def _require_idle(self, what: str) -> None:
        if self.state is not TrainingState.IDLE:
            raise TransitionError(
                f"FSDP unit {self.name}: {what} needs the unit idle, but it is in {self.state.value}; "
                "call it outside forward/backward."
            )

    def full_params(self) -> list[torch.Tensor]:
        """Every parameter's full value, in its original shape and dtype (a collective)."""
        self._require_idle("gathering full parameters")
        full = torch.zeros(self.layout.padded_numel, dtype=self.master_flat.dtype, device=self.device)
        with torch.no_grad():
            self.layout.shard_slice(full).copy_(self.master_flat)
            all_gather_inplace(full, self.layout.shard_numel, self.group)
        return [view.to(mp.dtype, copy=True) for view, mp in zip(self.layout.param_views(full), self.params)]

    def load_full_param(self, index: int, value: torch.Tensor, key: str) -> None:
        self._require_idle("loading a state dict")
        span = self.layout.spans[index]
        if tuple(value.shape) != tuple(span.shape):
            raise ValueError(
                f"load_full_state_dict: '{key}' has shape {tuple(value.shape)} but the model's parameter "
                f"has shape {tuple(span.shape)}"
            )
        piece = value.detach().reshape(-1)[span.piece_start : span.piece_start + span.piece_numel]
        with torch.no_grad():
            self.params[index].master.copy_(piece)

    def __repr__(self) -> str:
        return f"FSDPUnit({self.name}, params={len(self.params)}, numel={self.layout.numel}, state={self.state.value})"
