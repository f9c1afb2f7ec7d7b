"""Each unit's sharded gradients homed in its graphs' pool, right after its backward capture.

Per-layer and segment captures record backwards in reverse order. Once the backward of a unit's
graph is captured (per layer: its first module's, ``capture._homing``; a segment: the unit's
segment's), the pool's free memory is what the graphs captured so far use only between
the next forward and that backward (the later blocks' activations, every forward's temporaries),
so the unit's gradient buffer, live from its reduce to the optimizer step, is taken from there
(``fsdp/grad_homes.py`` says why and what keeps it safe). A root that reduces in pieces between the
graphs (``replayable_roots``) reduces at the end of its backward, after the backward of the first
graph in call order that holds one of its units (``roots_homed_after``): it is homed after that
graph's capture, and each piece's write then replays with its reduce-scatter. Unlike a unit's, a
root's reduce can come before some of those graphs' backwards (a first loss of two over two towers
reaches it): every home is therefore left alone by a reduce while a graph whose memory it may share
awaits its backward (``home_gradients``). Routing an allocation into a graph pool
outside a capture uses torch's private binding, as ``torch.cuda.use_mem_pool`` and inductor's
CUDA graph trees do; where it is missing the gradients stay where they were.
"""

from __future__ import annotations

import warnings
import weakref
from functools import partial

import torch

from ..fsdp.capture_interface import FSDPUnit, replayable_roots, root_contexts
from .user_line import user_stacklevel


def home_gradients(units: list[FSDPUnit], group, index: int, pool, stream: torch.cuda.Stream) -> None:
    """Take each unit's gradient buffer from ``pool`` (on the capture ``stream``, whose freed blocks
    the allocator hands out), for units with trainable parameters, after the backward capture of
    ``group``'s member ``index`` (a per-layer graph or a segment, in call order). The home may share
    the memory of the members from ``index`` on (their backwards were captured before it): while one
    of them has replayed a forward and awaits its backward, a reduce leaves the home alone. For a
    unit whose graphs form one chain that never happens (its reduce follows its first graph's
    backward, which replays after every later member's); it does where a backward reaches a unit
    before all of its graphs' backwards have run: a root, or a unit with modules in two towers of
    one model, under two losses, the second still to come."""
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    units = [u for u in units if u.grads.trainable]
    if not units or begin is None or end is None or release is None:
        return
    pinned = [u for u in units if u.grads.sharded.pinned]
    if pinned and not group.homes.warned_pinned:
        group.homes.warned_pinned = True
        warnings.warn(
            f"the sharded gradients of FSDP unit {pinned[0].name} are pinned for good (by a graph_optimizer_step "
            "built before these graphs, or a whole-step graph), so they keep memory of their own through the "
            "forward instead of a home in the graphs' memory pool, which an optimizer graph reads as well. "
            "Build graph_optimizer_step after graph_modules / graph_segments (make_train_step does).",
            stacklevel=user_stacklevel(),
        )
    device = stream.device.index
    with torch.cuda.stream(stream):
        begin(device, pool)
        try:
            for unit in units:
                unit.grads.sharded.set_home(group.homes, partial(_backward_pending, weakref.ref(group), index))
        finally:
            end(device, pool)
            release(device, pool)


def roots_homed_after(units_per_graph: list[list[FSDPUnit]]) -> dict[int, list[FSDPUnit]]:
    """The roots that reduce in pieces between the graphs (``replayable_roots``), by the index of the
    first graph, in call order, that holds one of their units. A root reduces at the end of its
    backward, after that graph's backward (the last of its graphs captured and replayed): homed after
    that capture, its memory is what the graphs captured so far use only until then, and no later
    capture (another model's backward, which replays after that root's reduce) gets it. Taken after
    the last capture instead, a root's home could hold the activations of another model's graphs
    whose backward is still to come: a second loss's backward. Roots a graph holds are homed as units."""
    first: dict[int, tuple] = {}
    for i, units in enumerate(units_per_graph):
        for unit in units:
            for ctx in root_contexts(unit.module):
                first.setdefault(id(ctx), (i, ctx))
    graphed = {id(unit) for units in units_per_graph for unit in units}
    homed: dict[int, list[FSDPUnit]] = {}
    for i, ctx in first.values():
        if id(ctx.root) not in graphed and replayable_roots([ctx]):
            homed.setdefault(i, []).append(ctx.root)
    return homed


def _backward_pending(group_ref, index: int) -> bool:
    group = group_ref()  # (weak: a home does not keep its graphs alive)
    return group is not None and group.pending_from(index) is not None
