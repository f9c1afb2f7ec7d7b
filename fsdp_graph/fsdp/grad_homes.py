"""Sharded gradients homed in a graph pool: a unit's ``.grad`` memory inside its graphs' activation memory.

With segment graphs the graphs' memory pool holds every block's activations for the whole step, so
the sharded gradients, which the reduces make during the backward, add on top of it where eager
FSDP frees activations as gradients appear (large GPT on 2 × H200: +2.5 GiB, the peak 1.14 ×
FSDP2's; 1.06 × with homes). Per-layer graphs do not use homes: there a home carved after each
block's backward capture fragmented the memory the next blocks' backward captures reuse, and the
pool grew by as much as the homes (measured: ``docs/performance.md``).

Yet a unit's gradients live from its reduce to the optimizer step, and the pool
memory freed by the backwards captured before its reduce (the activations of the blocks after it,
every forward's temporaries) is not written again before the next forward. So after capturing the
backward of a unit's segment, the capture takes the unit's gradient buffer from the pool
(``ShardedGrads.set_home``): the allocator hands out exactly that freed memory, and no graph
captured later gets it.

The gradients stay the user's as in FSDP2: ``zero_grad()`` drops them, ``.grad`` objects can be
kept. Before a graph of the pool replays a forward, ``GradHomes.vacate`` moves values someone still
holds (a ``.grad`` not set to None, a ``.grad`` object kept) into memory of their own, the tensor
objects staying the same; a tensor made from a gradient (a slice, a view) cannot follow and is
refused, naming the fix. The optimizer graph pins the gradients at fixed addresses: ``pin`` gives
the home up. Only a pool of the segments alone (``graph_segments(pool=None)``) gets homes.
"""

from __future__ import annotations


class GradHomes:
    """The sharded gradients homed in one pool, and whether a reduce wrote a home since the last vacate."""

    def __init__(self) -> None:
        self.members: list = []  # ShardedGrads
        self.written = False

    def vacate(self, what: str) -> None:
        """Before ``what`` (a graph of the pool) replays a forward, which may write any home."""
        if self.written:
            for grads in self.members:
                grads.leave_home_if_held(what)
            self.written = False

    def drop(self) -> None:
        """The graphs were not installed (a failed capture): every member keeps its memory elsewhere."""
        for grads in list(self.members):
            grads.give_up_home()
        self.members.clear()
