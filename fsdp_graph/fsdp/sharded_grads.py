"""A unit's sharded gradients: the masters' ``.grad``, views of one flat buffer whose memory follows ``zero_grad``.

As in FSDP2, the sharded gradients are the user's: ``optimizer.zero_grad()`` (``set_to_none=True``,
torch's default) drops them, and their memory goes back before the next forward, which is where
activations peak. The next reduce-scatter takes memory again. ``zero_grad(set_to_none=False)``
keeps it (the gradients become zeros and the reduce adds into them).

The buffer and its views are made once: giving the memory back resizes the buffer's storage to
zero and taking it again resizes it back (as FSDP2 does with unsharded parameters), so a step
makes no new tensors or DTensors and the ``.grad`` objects stay the same (the optimizer's checks
remember them). If anything besides these views still holds the storage (a ``.grad`` kept by the
user, an alias of it), the memory is left to that holder instead: the views are dropped and new
ones made at the next reduce, so no tensor a user holds ever changes under them.

A whole-step graph writes the gradients at fixed addresses: ``pin()`` keeps the memory for good,
and ``.grad`` is pointed back at it after each replay.

Under per-layer and segment graphs the buffer may have a home in the graphs' pool
(``grad_homes.py``): memory the pool's activations use only between the next forward and this
unit's backward, one piece per parameter (a root that reduces in pieces between the graphs: until
the end of its backward). While every ``.grad`` is None the reduce writes there (the flat buffer
is then an empty stand-in and the views are the pieces'), except while a graph that may share the
home's memory awaits its backward (``GradHomes.add``'s ``busy``); values still held when a graph
replays a forward move out first into a flat buffer of their own (``leave_home_if_held``).

Each ``.grad`` is the master's kind: a ``Shard(0)`` DTensor made with the master's spec, or the
plain local view without a mesh.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable
from itertools import repeat

import torch
from torch.distributed.tensor import DTensor

from .flat_layout import FlatLayout
from .grad_homes import HomeRows
from .mesh import local_tensor
from .sharded_param import ShardedParam


class ShardedGrads:
    def __init__(self, params: list[ShardedParam], layout: FlatLayout, master_flat: torch.Tensor) -> None:
        self.params = params
        self.layout = layout
        self._like = master_flat  # dtype, device and size of the buffer
        self.pinned = False
        self.flat: torch.Tensor | None = None
        self.local_views: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []  # the masters' ``.grad`` while they are ours
        self._own_holders: tuple | None = None  # who holds the buffer and its views when only we do
        self.home: list[torch.Tensor] | None = None  # per parameter, memory in a graph pool (grad_homes.py)
        self.homes = None  # the GradHomes of that pool
        self._home_storages: list[int] = []  # the pieces' storages (read while at home only)
        self._home_rows = HomeRows(layout)
        self._at_home = False  # the views are the home's pieces (and ``flat`` an empty stand-in)

    @property
    def live(self) -> bool:
        """The buffer has its memory: at a home, or read from its storage."""
        return self.flat is not None and (self._at_home or self.flat.untyped_storage().nbytes() > 0)

    @property
    def owns_memory(self) -> bool:
        """The buffer holds memory of its own: live and not at a home in a graph pool."""
        return self.live and not self._at_home

    def take(self, zeros: bool, writer_stream=None) -> None:
        """Before a reduce writes the gradients: memory for the buffer (``zeros``: zero-filled, else
        undefined: the caller overwrites all of it). If every ``.grad`` is None and something besides
        our views still holds the buffer (a ``.grad`` kept across ``zero_grad``, called after the
        forward), that holder keeps it and a new buffer is made. ``writer_stream``: a side stream that
        writes the buffer; its memory is not reused before that stream's queued work is done."""
        if self.home is not None and self._homed():  # (zeros asks for zeros only where .grad is set: its values
            self.homes.written = True                # are there already, the next forward not having run)
            return
        if self.live:
            if self.pinned or any(p.master.grad is not None for p in self.params) or self._only_ours():
                return
            self._detach()  # (given back at a forward, the memory was checked then: only a live one needs it)
        with torch.inference_mode(False):
            if self.flat is None:
                self._adopt(torch.zeros_like(self._like) if zeros else torch.empty_like(self._like))
            else:
                self._regrow()
                if zeros:
                    self.flat.zero_()
        if writer_stream is not None:
            self.flat.record_stream(writer_stream)  # (a buffer given back after a failed backward, say)

    def _homed(self) -> bool:
        """Whether the reduce writes the home: always while no ``.grad`` is set (the buffer moves there,
        a holder of the old one keeping it); with ``.grad`` set, only if the values are there. Never
        while a graph that may share its memory awaits its backward (``GradHomes.add``)."""
        if self.homes.busy(self):
            self.leave_home_if_held("a reduce while a graph's backward is pending")
            if self._at_home:
                self._detach()
            return False
        if any(p.master.grad is not None for p in self.params):
            return self._at_home
        if self._at_home:
            if self._only_ours():
                return True
            self.leave_home_if_held("a reduce")  # (held since the last forward: it stays the holder's)
        self._detach()
        self._at_home = True
        with torch.inference_mode(False):
            self._adopt(self._like.new_empty(0), [piece.view(piece.shape) for piece in self.home])
        return True

    def set_home(self, homes, busy=None) -> bool:
        """Take the home, with the allocator routed into a graph pool (``graphs/gradient_homes.py``).
        Not for a pinned buffer, nor where torch cannot count who holds a storage. ``busy``: as for
        ``GradHomes.add``."""
        if self.home is not None or self.pinned or not self._like.numel() or _storage_uses(self._like) is None:
            return False
        with torch.inference_mode(False):
            self.home = [torch.empty_like(local) for local in self.layout.local_views(self._like)]
        self._home_storages = [piece.untyped_storage()._cdata for piece in self.home]  # (the pieces hold them)
        self.homes = homes
        homes.add(self, busy)
        return True

    def leave_home_if_held(self, what: str) -> None:
        """Before ``what`` may write the home: values someone holds (a ``.grad`` set, a ``.grad`` object
        kept) move to memory of their own, under the same tensor objects. A tensor made from them
        (a slice, a view) would keep reading the home: refused."""
        if not self._at_home or (all(p.master.grad is None for p in self.params) and self._only_ours()):
            return
        holders = self._holders()
        if holders is None or holders[0] != self._own_holders[0]:
            name = self.params[0].name if self.params else "?"
            raise RuntimeError(
                f"{what}: a tensor made from a sharded gradient of the FSDP unit that owns {name} (a slice or "
                "view of .grad, or its to_local()) is still alive. Under per-layer and segment graphs the sharded "
                "gradients live in the graphs' memory pool, which the next forward writes, so that "
                "tensor would change under you. Clone it (.clone()) to keep it past the optimizer step, or "
                "drop it before the next forward."
            )
        self._move_out()
        self._at_home = False
        # Our count now: one storage (no tensor of anyone else's shares it, as checked), counted once the
        # move's temporaries are gone; the view objects are the same.
        self._own_holders = (_storage_uses(self.flat), *self._own_holders[1:])

    def _move_out(self) -> None:
        with torch.inference_mode(False), torch.no_grad():
            moved = torch.empty_like(self._like)
            for view, local in zip(self.local_views, self.layout.local_views(moved)):
                local.copy_(view)
                view.data = local
            self.flat.data = moved  # (the stand-in: the same object, so a snapshot holding it follows)

    def give_up_home(self) -> None:
        """No home from now on (the gradients get pinned, or the graphs were not installed)."""
        if self.home is None:
            return
        self.leave_home_if_held("pinning the sharded gradients")
        if self._at_home:
            self._detach()
        self.homes.remove(self)
        self.home = self.homes = None
        self._home_storages = []
        self._home_rows = HomeRows(self.layout)  # (its plan holds views of the old pieces: a new home needs its own)

    def _regrow(self) -> None:
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())

    def _adopt(self, flat: torch.Tensor, local_views: list[torch.Tensor] | None = None) -> None:
        self.flat = flat
        self.local_views = self.layout.local_views(flat) if local_views is None else local_views
        self.views = [_like_master(p, v) for p, v in zip(self.params, self.local_views)]
        self._own_holders = self._holders()

    def _detach(self) -> None:
        self.flat, self.local_views, self.views, self._own_holders = None, [], [], None
        self._at_home = False

    def _holders(self) -> tuple | None:
        """References to the storage (tensors sharing it) and to each view object (a ``.grad`` the
        user kept); None where torch cannot count storage users. Equal to the count taken when the
        views were made, or moved out of a home (no ``.grad`` set then, none now), only if nothing
        else holds them."""
        if self._at_home:  # (the pieces' storages, whose handles set_home keeps; less the writer's views)
            uses = sum(map(_STORAGE_USE_COUNT, self._home_storages)) - self._home_rows.views_held()
        else:
            uses = _storage_uses(self.flat)
        if uses is None:
            return None
        return (uses, [sys.getrefcount(v) for v in self.views], [sys.getrefcount(v) for v in self.local_views])

    def _only_ours(self) -> bool:
        holders = self._holders()
        return holders is not None and holders == self._own_holders

    def accumulate(self, reduced: Iterable[tuple[int, torch.Tensor]], current: list, trainable: list[int],
                   scale: float) -> None:
        """master.grad (+)= reduced · scale, as autograd would accumulate into ``.grad``. ``reduced``:
        this rank's shard as (start, values) pieces in shard order, whole rows each (one piece, or a
        wide unit's ``reduce_pieces``, each made as it is read); ``current``: the trainable masters'
        ``.grad`` before the reduce."""
        masters = [self.params[i].master for i in trainable]
        views = [self.views[i] for i in trainable]
        fresh = all(map(operator.is_, current, repeat(None)))
        ours = not fresh and all(map(operator.is_, current, views))
        targets = []  # (some .grad set elsewhere) each parameter's own, None ones started from zeros
        if not (fresh or ours):
            for master, grad, view, i in zip(masters, current, views, trainable):
                if grad is None:
                    self.local_views[i].zero_()
                    master.grad = grad = view
                targets.append((local_tensor(grad), i))
        for start, values in reduced:
            if not (fresh or ours):
                for grad, i in targets:
                    _add_rows(self.layout, grad, i, start, values, scale)
            elif self._at_home:
                self._home_rows.write(self.home, start, values, scale, fresh)
            else:
                whole = start == 0 and values.numel() == self.flat.numel()  # (the common case: no view to make)
                flat = self.flat if whole else self.flat.narrow(0, start, values.numel())
                if fresh and values.dtype == flat.dtype:
                    torch.mul(values, scale, out=flat)  # one pass instead of zero_ + add_
                else:  # add_ scales in the master dtype (a mul would scale in the reduce dtype)
                    if fresh:
                        flat.zero_()
                    flat.add_(values, alpha=scale)
        if fresh:
            for master, view in zip(masters, views):
                master.grad = view

    def fresh_write(self, current: list, scale: float) -> tuple | None:
        """After ``take``: where every ``.grad`` was None (``current``) and the buffer is at its home,
        ``accumulate``'s write as a (key, ``body(values, start=0)``) a graph may replay, of the whole
        shard or of each piece of a reduce in pieces (``HomeRows.fresh_write``); ``accumulate`` of no
        pieces then only sets ``.grad``. Else None."""
        fresh = self._at_home and all(map(operator.is_, current, repeat(None)))
        return self._home_rows.fresh_write(self.home, scale) if fresh else None

    def release_if_dropped(self) -> None:
        """At the unit's next forward: give the memory back if every ``.grad`` was set to None."""
        if not self.live or self.pinned or self._at_home or any(p.master.grad is not None for p in self.params):
            return  # (a home is the pool's memory: GradHomes.vacate moves what is held out of it)
        if self._only_ours():
            self.flat.untyped_storage().resize_(0)
        else:  # a tensor of the user's still reads this memory: leave it theirs
            self._detach()

    def pin(self) -> None:
        """Keep the memory for good (a whole-step graph writes into it at every replay)."""
        self.give_up_home()
        self.take(zeros=True)
        self.pinned = True

    def snapshot(self) -> tuple:
        values = None
        if self.live:
            values = [v.clone() for v in self.local_views] if self._at_home else self.flat.clone()
        return self.flat, self.local_views, self.views, self._own_holders, values

    def restore(self, snapshot: tuple) -> None:
        """Back to the snapshot's buffer and values. Memory it holds stays where it is (a pinned
        buffer is captured in a graph); memory taken since the snapshot is given back at the next
        forward, as any other."""
        self.flat, self.local_views, self.views, self._own_holders, values = snapshot
        # At home while the stand-in is still empty (a vacate since the snapshot moved it out, under it).
        self._at_home = self.home is not None and self.flat is not None and not self.flat.numel()
        if isinstance(values, list) and not self._at_home:
            self._own_holders = (_storage_uses(self.flat), *self._own_holders[1:])  # (moved out since)
        if values is not None:
            if not self.live:
                self._regrow()  # the snapshot's own buffer again, whoever else holds it
            with torch.no_grad():
                if isinstance(values, list):  # (taken at home: per parameter, wherever they are now)
                    torch._foreach_copy_(self.local_views, values)
                else:
                    self.flat.copy_(values)


def reattach_grads(grads: ShardedGrads) -> None:
    """After ``Module._apply`` swapped the masters' ``.grad`` tensors: values back into the
    buffer, and each ``.grad`` a view of it again (see ``ShardedParam.reattach``)."""
    if not grads.live:
        return
    for param, view in zip(grads.params, grads.local_views):
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


def _add_rows(layout: FlatLayout, grad: torch.Tensor, i: int, start: int, values: torch.Tensor, scale: float) -> None:
    """Parameter ``i``'s rows inside the piece of the shard at ``start`` (``values``) into ``grad``."""
    span = layout.spans[i]
    lo = max(start, span.shard_offset)
    hi = min(start + values.numel(), span.shard_offset + span.local_rows * span.row_numel)
    if hi > lo:
        rows = slice((lo - span.shard_offset) // span.row_numel, (hi - span.shard_offset) // span.row_numel)
        grad[rows].add_(values[lo - start : hi - start].view(rows.stop - rows.start, *span.shape[1:]),
                        alpha=scale)


def run_post_accumulate_hooks(masters: list[torch.Tensor]) -> None:
    """Hooks registered on the masters with ``register_post_accumulate_grad_hook`` (optimizer in
    backward): run once the master's ``.grad`` holds the reduced gradient, as FSDP2 runs them
    (autograd never accumulates into a master, so it would never call them). On GPU they run
    on the reduce stream, after the reduce (those of a parameter this rank gave no gradient: at the end
    of the backward, on the compute stream, ``unused_params.py``; after a segment graph's replay: on the
    stream it replayed on, ``UnitGradients.accumulate_parked``). A whole-step graph cannot replay
    Python: refused."""
    for master in masters:
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


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_uses(tensor: torch.Tensor) -> int | None:
    """How many tensors (and storage handles) share ``tensor``'s storage; None where torch cannot tell."""
    return None if _STORAGE_USE_COUNT is None else _STORAGE_USE_COUNT(tensor.untyped_storage()._cdata)


def _like_master(param: ShardedParam, local: torch.Tensor) -> torch.Tensor:
    master = param.master
    if isinstance(master, DTensor):
        return DTensor(local, master._spec, requires_grad=False)
    return param.wrap(local)
