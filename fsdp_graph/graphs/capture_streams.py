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
stream (``torch.cuda.graph``'s). Past 32 live holders on a device every stream is taken; the
stream is then shared, with a warning that names the fix.
"""

from __future__ import annotations

import warnings
import weakref

import torch

STREAMS_PER_POOL = 32  # torch's pooled streams per device and priority (c10's kStreamsPerPool)
_holders: dict[tuple[int, int], weakref.WeakSet] = {}  # (device, CUDA stream) -> live holders given it


def _key(stream: torch.cuda.Stream) -> tuple[int, int]:
    return stream.device.index, stream.cuda_stream


def _taken(stream: torch.cuda.Stream) -> bool:
    default = getattr(torch.cuda.graph, "default_capture_stream", None)
    return bool(_holders.get(_key(stream))) or (default is not None and _key(default) == _key(stream))


def capture_stream(device: torch.device | int | None, holder: object) -> torch.cuda.Stream:
    """A stream on ``device`` to warm up and capture on, kept from later captures while ``holder``
    (what owns the graphs captured on it) lives."""
    stream = torch.cuda.Stream(device)
    for _ in range(STREAMS_PER_POOL - 1):
        if not _taken(stream):
            break
        stream = torch.cuda.Stream(device)
    else:
        if _taken(stream):
            warnings.warn(
                f"fsdp_graph: more than {STREAMS_PER_POOL} sets of CUDA graphs are alive on {stream.device}, more than "
                "torch has streams to capture them on, so two sets share a capture stream and its cuBLAS workspace; "
                "destroying either would free the workspace the other's matmuls still write. Drop the steps and "
                "graphed modules you no longer use (del step) before building new ones, or graph more modules "
                "per call (one graph_modules call for all blocks).",
                RuntimeWarning,
                stacklevel=3,
            )
    _holders.setdefault(_key(stream), weakref.WeakSet()).add(holder)
    return stream


def holders_of(stream: torch.cuda.Stream) -> int:
    """How many live holders were given ``stream`` (for tests)."""
    return len(_holders.get(_key(stream), ()))
