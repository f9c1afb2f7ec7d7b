"""Capture a whole step (or a whole model's forward) as one CUDA graph, FSDP collectives inside.

Unlike per-layer graphs, nothing is rerouted: FSDP's hooks run *during* the capture and their
CUDA work (the cast into the persistent buffer, the all-gather, the reduce-scatter, the gradient
accumulation) is recorded. That is legal because every tensor they touch is persistent. The
overlap survives: the all-gathers and reduce-scatters are issued on FSDP's side streams, which
fork from the capture stream (``wait_stream``) and join it again through events, so the graph
keeps them as parallel branches.

Events are the one thing to clean: a capture must not wait on an event recorded before it (the
reduce-done event of the last eager step, say), and eager work must not wait on one recorded
inside it, so the device is synchronised and every unit's events are dropped before and after.
The warm-up runs on the capture's stream, so the autograd engine's per-stream state is there.

The graph holds resources of the NCCL communicators its collectives ran on, and NCCL's destroy
waits for them: it is released before the default or an NCCL group is destroyed (``ReleasableGraph``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from ..fsdp.capture_interface import RootContext, release_before_destroy
from .capture import backward_on_this_thread, gc_paused

T = TypeVar("T")


@contextmanager
def on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Run the body on ``stream``, ordered after and before the current stream's work."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        current.wait_stream(stream)


class ReleasableGraph:
    """A captured graph that is dropped before the default or an NCCL group is destroyed (a graph holding NCCL
    collectives would make ``destroy_process_group`` wait forever); replaying it afterwards is refused."""

    def __init__(self, graph: torch.cuda.CUDAGraph, what: str) -> None:
        self._graph, self.what = graph, what
        release_before_destroy(self)

    def replay(self) -> None:
        graph = self._graph  # read once: a release may come from another thread
        if graph is None:
            raise RuntimeError(
                f"{self.what}: this CUDA graph was released when a process group was destroyed "
                "(destroy_process_group or fsdp_graph.shutdown: NCCL's destroy waits forever for a graph "
                "holding its collectives). Build a new step."
            )
        graph.replay()

    def release(self) -> None:
        self._graph = None


def capture_whole(what: str, run: Callable[[], T], contexts: list[RootContext], stream: torch.cuda.Stream,
                  pool=None):
    """Capture ``run()`` on ``stream`` (into ``pool``, a fresh one if None); returns (graph, what
    ``run`` returned: its static outputs)."""
    for ctx in contexts:
        ctx.forget_events()  # (synchronises the device)
    graph = torch.cuda.CUDAGraph()
    try:
        with gc_paused(), backward_on_this_thread(), torch.cuda.graph(graph, pool=pool, stream=stream):
            result = run()
    except BaseException as err:
        for ctx in contexts:
            ctx.capture_failed()
        if not isinstance(err, RuntimeError) or type(err).__module__.startswith("fsdp_graph."):
            raise  # (this package's own errors name their fix already)
        if "synchroniz" in str(err) or "captur" in str(err).lower():  # capture, capturing
            raise RuntimeError(
                f"{what}: CUDA graph capture failed: {err}\nCommon causes: a host sync in the step "
                "(.item(), printing a tensor, a data-dependent shape), work on the default stream, or "
                "autograd graphs of earlier eager steps still alive (drop the loss of earlier steps, "
                "`del loss`, before the first graphed step)."
            ) from err
        raise
    finally:
        for ctx in contexts:
            ctx.forget_events()
    return ReleasableGraph(graph, what), result
