"""Capture streams that no live graph set of this package shares.

cuBLAS keeps a workspace per (handle, stream), and a graph's matmuls write the one their capture
used. When a graph is destroyed, torch frees the workspaces of the stream it was captured on
(``CUDAGraph::reset`` calls ``clearCublasWorkspacesForStream``), whoever else still uses them.
``torch.cuda.Stream()`` hands out 32 pooled CUDA streams per device and priority, round-robin, so
the 33rd stream a process makes is its 1st again: a graph set captured on it would share a
workspace with one captured there before, and dropping either (an evaluation step built anew, a
rebuilt step) would free memory the other's kernels still write to. Silent corruption once the
allocator hands that memory out again.

So every capture of this package draws its stream here: the next pooled stream that no live
holder (a step, a group of graphed callables) of ours was given, nor torch's default capture
stream (``torch.cuda.graph``'s, where it exists already). A dropped set holds its stream until
its graphs are destroyed, which for graphed callables (a cycle with their group) is the garbage
collector's next run: when every stream is held, a collection runs and the pool is searched
again. Past that every stream is taken; the stream is then shared, with a warning that names the
fix. Collective graphs are not drawn here: they capture on FSDP's side streams (the high-priority
pool), with no cuBLAS call in them.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import torch

from .user_line import user_stacklevel

STREAMS_PER_POOL = 32  # torch's pooled streams per device and priority (c10's kStreamsPerPool)
_holders: dict[tuple[int, int], weakref.WeakSet] = {}  # (device, CUDA stream) -> live holders given it
_lock = threading.Lock()


def _key(stream: torch.cuda.Stream) -> tuple[int, int]:
    return stream.device.index, stream.cuda_stream


def _taken(stream: torch.cuda.Stream) -> bool:
    default = getattr(torch.cuda.graph, "default_capture_stream", None)
    return bool(_holders.get(_key(stream))) or (default is not None and _key(default) == _key(stream))


def _free_stream(device) -> torch.cuda.Stream | None:
    """The first of the pool's streams (one round of draws) that no live holder has, or None."""
    for _ in range(STREAMS_PER_POOL):
        stream = torch.cuda.Stream(device)
        if not _taken(stream):
            return stream
    return None


def capture_stream(device: torch.device | int | None, holder: object) -> torch.cuda.Stream:
    """A stream on ``device`` to warm up and capture on, kept from later captures while ``holder``
    (what owns the graphs captured on it) lives."""
    with _lock:
        stream = _free_stream(device)
        if stream is None:
            gc.collect()  # (dropped graph sets wait for the collector: their groups and callables form cycles)
            stream = _free_stream(device)
        if stream is None:
            stream = torch.cuda.Stream(device)
            warnings.warn(
                f"fsdp_graph: every capture stream torch has on {stream.device} ({STREAMS_PER_POOL}) is held by a live "
                "set of CUDA graphs, so this one shares a capture stream and its cuBLAS workspace with another; "
                "destroying either would free the workspace the other's matmuls still write. Drop the steps and "
                "graphed modules you no longer use (del step; gc.collect()) before building new ones, or graph "
                "more modules per call (one graph_modules call for all blocks).",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        _holders.setdefault(_key(stream), weakref.WeakSet()).add(holder)
    return stream

