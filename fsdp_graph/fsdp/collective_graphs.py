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
small metadata tensor ``split_with_sizes_copy`` and ``_chunk_cat`` copy to the device (from a
pinned host buffer), taken from the graphs' shared pool. That is safe because the caching
allocator reuses a device block only on the stream that freed it, and all unshard graphs replay in
order on one stream, all reduce graphs on the other; torch keeps pinned host blocks used in a
capture out of reuse (the whole-step graph relies on the same). The capture uses
``capture_error_mode="thread_local"``, so NCCL's watchdog thread may query its events meanwhile;
NCCL orders captured and eager collectives of one communicator itself
(``NCCL_GRAPH_MIXING_SUPPORT``, on by default). Bitwise equality with the eager bodies is tested
on 2 ranks (``tests/test_graph_parity_gpu.py``), where a sum does not depend on its order; with
more ranks NCCL could choose another reduce-scatter algorithm under capture than eagerly.

The graphs hold resources of their NCCL communicator, and NCCL's destroy waits for them: they are
released before any process group is destroyed (``communicator_graphs.py``; without that,
``destroy_process_group`` hung in every run on 2 × H200).

What NCCL's watchdog cannot see is a replayed collective: it times out eager collectives only.
That is why the replay is something the graph strategies switch on (``graph_modules``'s
``collective_graphs``), never the eager default.

A capture that fails raises once, naming the unit, the body and the setting that keeps every
body eager; that body runs eagerly from then on, until the unit's buffers are planned again (same
results). If CUDA invalidated the capture, torch's ``capture_end`` raises before it takes the pool
off the allocator's list of captures under way: that is undone here (``_stop_allocating_to``), and
the units that share the pool move on to a fresh one (``GraphPool.renew``). The old pool is never
released (the failed graph does not release it): it keeps the few metadata blocks it holds for the
process's life. An error the collective itself raises during the capture is reported the same way:
under capture NCCL only enqueues, so it is about the capture, not a peer.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from .communicator_graphs import hold


class CollectiveGraphCaptureError(RuntimeError):
    """Capturing a unit's unshard or reduce body as a CUDA graph failed (the body stays eager)."""


class GraphPool:
    """The memory pool the collective graphs of one ``graph_modules`` call share (they allocate
    only the copies' metadata); made at the first capture, renewed after a failed one."""

    def __init__(self) -> None:
        self._handle = None

    @property
    def handle(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def renew(self) -> None:
        self._handle = None


class CollectiveGraphs:
    """One unit's captured step bodies, by name and address key (see the module docstring)."""

    def __init__(self, pool: GraphPool, unit: str = "") -> None:
        self.pool = pool
        self.unit = unit
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
            except BaseException as err:
                self._eager_only.add(entry)  # the error is raised once; the next call runs eagerly
                self.pool.renew()  # the failed capture's partial blocks stay with the old pool
                if not isinstance(err, Exception):
                    raise
                # A CollectiveError too: under capture NCCL only enqueues (a peer's timeout surfaces
                # later, from the watchdog), so an error the collective raises now is about the capture.
                raise CollectiveGraphCaptureError(
                    f"FSDP unit {self.unit}: capturing its {name} as a CUDA graph failed: {err}. This body runs "
                    "eagerly from now on. GraphConfig(collective_graphs=False) (graph_modules(collective_graphs="
                    "False), graph_segments(collective_graphs=False)) keeps every unit's unshard and reduce eager."
                ) from err
            self._graphs[entry] = graph
            hold(self)
        graph.replay()
        self.replays[name] = self.replays.get(name, 0) + 1

    def _capture(self, body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        pool, device = self.pool.handle, torch.cuda.current_device()
        collecting = gc.isenabled()
        gc.disable()  # a collection during capture could free tensors other streams still use
        try:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                body()
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:
                    _stop_allocating_to(device, pool)  # the first error is the one to report
                raise
            try:
                graph.capture_end()
            except RuntimeError:
                _stop_allocating_to(device, pool)
                raise
        finally:
            if collecting:
                gc.enable()
        return graph

    def spawn(self, name: str) -> CollectiveGraphs:
        """Graphs of another body's, in the same pool (the root's use exchange, ``RootContext``)."""
        return CollectiveGraphs(self.pool, name)

    def forget(self) -> None:
        """Drop every graph (the unit's buffers were planned again)."""
        self._graphs.clear()
        self._eager_only.clear()

    release = forget  # before a process group is destroyed (``communicator_graphs.release_graphs``)


def _stop_allocating_to(device: int, pool) -> None:
    """End the allocator's routing into ``pool`` after a capture CUDA invalidated: torch's
    ``capture_end`` raised before doing so, and left as it is, the allocator believes a capture is
    under way for good (it stops recycling blocks freed with ``record_stream``, and
    ``empty_cache`` asserts). Torch's binding for this is private (``torch.cuda.use_mem_pool`` uses
    it); where it is missing or refuses (the pool was ended already), nothing is done."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(device, pool)
    except RuntimeError:
        pass


def can_replay(graphs: CollectiveGraphs | None) -> bool:
    """Whether a body may run through ``graphs`` now: switched on, and the current stream is not
    being captured (a whole-step or layer capture records the body itself)."""
    return graphs is not None and not torch.cuda.is_current_stream_capturing()
