"""A small, stable view into the engine for tests, benchmarks and debugging.

Read-only facts (``unit_buffers``, ``unsharded_param_addresses``, ``unsharded_grad_addresses``)
and a way to run code around every unit step (``watch_steps``), so that callers need not reach
into private state that changes with the implementation. ``watch_steps`` wraps the step methods
only while its block runs: the default hot path carries no check for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .buffers import Placement
from .root import RootContext
from .unit import FSDPUnit


@dataclass(frozen=True)
class UnitBuffers:
    """Where a unit's unsharded parameters and gradients live now."""

    placement: Placement | None  # None before the root's lazy init
    params: tuple[int, int]  # [start, end) addresses of its parameter buffer (a slot is shared)
    grads: tuple[int, int]  # [start, end) of its gradient buffer
    nbytes_held: int  # device memory its buffers hold now (0: dynamic, between unshards)
    own_staging_bytes: int = 0  # the most its collectives stage on their own (0: it uses the shared staging)


def _range(tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()


def unit_buffers(unit: FSDPUnit) -> UnitBuffers:
    group = unit.param_group
    buffers, layout, own = group.buffers, group.layout, 0
    if group.scratch is not None and layout.shard_numel and not group.scratch.fits(layout.gathered_numel):
        dtypes = group.scratch.dtypes
        gather = layout.gathered_numel * dtypes.compute.itemsize
        # (the reduce-scatter writes in place; a unit that reduces in pieces stages in the shared staging)
        in_pieces = unit.grads.reduce.pieces(group.scratch) is not None
        reduce = 0 if in_pieces else layout.gathered_numel * dtypes.reduce.itemsize
        own = max(gather, reduce)
    if buffers is None:  # a slot unit before its first unshard
        return UnitBuffers(unit.placement, (0, 0), (0, 0), 0, own)
    grads = (0, 0) if buffers.grads.tensor is None else _range(buffers.grads.tensor)  # (allocated at first use)
    return UnitBuffers(unit.placement, _range(buffers.params), grads, buffers.nbytes_held(), own)


def sharded_grad_bytes_held(unit: FSDPUnit) -> int:
    """Bytes of device memory of its own the unit's sharded gradient buffer holds now (0 after
    ``zero_grad()`` gave it back, before the first backward, or at a home in a graph pool)."""
    sharded = unit.grads.sharded
    return sharded.flat.untyped_storage().nbytes() if sharded.owns_memory else 0


def sharded_grad_bytes(unit: FSDPUnit) -> int:
    """Bytes of the unit's sharded gradient buffer (the masters' ``.grad``), whether it exists now or not."""
    master_flat = unit.param_group.master_flat
    return master_flat.numel() * master_flat.element_size()


def unsharded_param_addresses(unit: FSDPUnit) -> list[int | None]:
    """Per parameter, the address of its persistent unsharded form (None before it exists)."""
    return [p.unsharded.data_ptr() if p.unsharded is not None else None for p in unit.params]


def unsharded_grad_addresses(unit: FSDPUnit) -> list[int | None]:
    """Per parameter, the address of its unsharded ``.grad`` (None when it has none)."""
    return [p.unsharded.grad.data_ptr() if p.unsharded is not None and p.unsharded.grad is not None else None
            for p in unit.params]


Watcher = Callable[[str, object], None]


@contextmanager
def watch_methods(targets: list[tuple[type, str, str, Callable]], before: Watcher | None = None,
                  after: Watcher | None = None) -> Iterator[None]:
    """Call ``before(label, subject)`` / ``after(label, subject)`` around each target method while
    the block runs. ``targets``: (class, method name, label, subject(args) -> object)."""
    originals = []
    for owner, attr, label, subject in targets:
        original = owner.__dict__[attr]
        is_static = isinstance(original, staticmethod)
        function = original.__func__ if is_static else original

        def watched(*args, _function=function, _label=label, _subject=subject, **kwargs):
            if before is not None:
                before(_label, _subject(args))
            try:
                return _function(*args, **kwargs)
            finally:
                if after is not None:
                    after(_label, _subject(args))

        setattr(owner, attr, staticmethod(watched) if is_static else watched)
        originals.append((owner, attr, original))
    try:
        yield
    finally:
        for owner, attr, original in reversed(originals):
            setattr(owner, attr, original)


# Every way into a unit step: the hooks enter through the root; post-backward runs from autograd
# (or the root's end of backward) on the unit itself.
STEPS = (
    (RootContext, "pre_forward", "pre_forward", lambda args: args[1]),
    (RootContext, "post_forward", "post_forward", lambda args: args[1]),
    (RootContext, "pre_backward", "pre_backward", lambda args: args[1]),
    (FSDPUnit, "post_backward", "post_backward", lambda args: args[0]),
    (RootContext, "end_backward", "end_backward", lambda args: args[0].root),
)


def watch_steps(before: Watcher | None = None, after: Watcher | None = None):
    """Around every unit step: ``before(step, unit)`` / ``after(step, unit)``, with ``step`` one of
    ``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``, ``end_backward`` (the
    root's end-of-backward callback, which may run ``post_backward`` of units inside it; so may a
    ``pre_backward`` that needs the slot of a unit whose post-backward waits for the end)."""
    return watch_methods(list(STEPS), before, after)

