"""A unit's FSDP steps (cast, all-gather, copy-out; copy-in, zeroing, reduce-scatter) replayed as
small CUDA graphs on their side streams.

Between per-layer graphs, the host issues each unit's unshard and reduce: four to six kernels and
NCCL calls, 300-600 µs of Python per unit and step (``docs/performance.md``). Every tensor those
steps touch is persistent for a unit in a slot or a dedicated buffer that fits the shared staging:
the master shard, the staging, the unsharded parameter and gradient buffers. So each body is
captured once, on the stream it runs on, and replayed afterwards: one launch in place of the
kernels and collectives. Nothing else changes: the same side streams, the same events around the
bodies, the same kernels (so the results are bitwise those of the eager bodies).

A body runs eagerly the first time it meets a set of addresses (NCCL initialises its communicator
lazily, and a capture must not), is captured the second time, and replayed from then on. The key
is the addresses the body reads and writes: a unit whose buffers move (a re-plan) captures again.
Nothing is captured while the stream is capturing already (a whole-step graph records the bodies
themselves). The bodies write only into persistent buffers; the one allocation inside them is the
small metadata tensor ``split_with_sizes_copy`` and ``_chunk_cat`` copy to the device, taken from
the graphs' shared pool. That is safe because the caching allocator reuses a block only on the
stream that freed it, and all unshard graphs replay in order on one stream, all reduce graphs on
the other. The capture uses ``capture_error_mode="thread_local"``, so NCCL's watchdog thread may
query its events meanwhile; NCCL orders captured and eager collectives of one communicator itself
(``NCCL_GRAPH_MIXING_SUPPORT``, on by default).

The graphs hold resources of their NCCL communicator, and NCCL's destroy waits for them: they are
released before any process group is destroyed (``communicator_graphs.py``; without that,
``destroy_process_group`` hung in every run on 2 × H200).

What NCCL's watchdog cannot see is a replayed collective: it times out eager collectives only.
That is why the replay is something the graph strategies switch on (``graph_modules``'s
``collective_graphs``), never the eager default.

A capture that fails raises once; that body runs eagerly from then on (same results). Known
defect: if CUDA invalidated the capture, torch's ``capture_end`` raises before it takes the pool
off the allocator's list of captures under way. The allocator then behaves as if a capture were
running for good (blocks freed after ``record_stream`` are not recycled, ``empty_cache`` asserts),
and every later capture into the shared pool fails too (each raising once, then eager). The fix
(end that routing, move the other units to a fresh pool) waits for a GPU run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from .communicator_graphs import hold


class CollectiveGraphs:
    """One unit's captured step bodies, by name and address key (see the module docstring)."""

    def __init__(self, pool) -> None:
        self.pool = pool  # shared by the graphs of one model; they allocate nothing
        self._graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}  # None: ran eagerly once
        self._eager_only: set[tuple] = set()  # bodies whose capture failed: eager from then on
        self.replays: dict[str, int] = {}  # by body name, for tests and the benchmark's report

    def run(self, name: str, key: tuple, body: Callable[[], None]) -> None:
        """Run ``body`` on the current (side) stream: replayed if captured, else eagerly or captured."""
        entry = (name, key)
        graph = self._graphs.get(entry, False)
        if graph is False or entry in self._eager_only:
            body()
            self._graphs[entry] = None
            return
        if graph is None:
            try:
                graph = self._capture(body)
            except BaseException:
                self._eager_only.add(entry)  # the error is raised once; the next call runs eagerly
                raise
            self._graphs[entry] = graph
            hold(self)
        graph.replay()
        self.replays[name] = self.replays.get(name, 0) + 1

    def _capture(self, body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # a collection during capture could free tensors other streams still use
        try:
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                body()
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass  # the capture was invalidated by the failure: the first error is the one to report
                raise
            graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        return graph

    def forget(self) -> None:
        """Drop every graph (the unit's buffers were planned again)."""
        self._graphs.clear()
        self._eager_only.clear()

    release = forget  # before a process group is destroyed (``communicator_graphs.release_graphs``)


def can_replay(graphs: CollectiveGraphs | None) -> bool:
    """Whether a body may run through ``graphs`` now: switched on, and the current stream is not
    being captured (a whole-step or layer capture records the body itself)."""
    return graphs is not None and not torch.cuda.is_current_stream_capturing()
