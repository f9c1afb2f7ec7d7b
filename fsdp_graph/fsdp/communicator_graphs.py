"""CUDA graphs that captured NCCL collectives go before their communicators do.

A graph that captured an NCCL collective keeps resources of the communicator, and NCCL's
``ncclCommDestroy`` waits for them. So ``torch.distributed.destroy_process_group()`` never
returns while such a graph exists. Measured on 2 × H200, torch 2.11: with a whole-step graph
alive at the call, the call hung every time; with the graph released first, it returned
(pytorch/pytorch#115388 reports the same). A training script usually ends with that call while
its step is still alive, and so does the ``atexit`` hook of ``init_distributed``.

So every object that holds such a graph registers here (``hold``), and ``release_graphs()`` makes
each of them drop its graph, after a device synchronize, before any group is destroyed. Three
paths call it:

* ``fsdp_graph.shutdown()``, and with it the ``atexit`` hook;
* ``torch.distributed.destroy_process_group``, which the first ``hold`` wraps. A name imported
  with ``from torch.distributed import destroy_process_group`` before that is torch's own, so
  call ``fsdp_graph.shutdown()`` instead, or drop the step first.

A released holder refuses to replay and names the cause.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_holders: weakref.WeakSet = weakref.WeakSet()
_WRAPPED = "_fsdp_graph_releases_graphs"


def hold(holder) -> None:
    """Register ``holder`` (an object with ``release()``) until its graph is released or it is gone."""
    _holders.add(holder)
    _wrap_destroy_process_group()


def release_graphs() -> int:
    """Make every registered holder drop its graph; returns how many did."""
    holders = list(_holders)
    if holders and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # no replay still running when its graph goes
    for holder in holders:
        holder.release()
        _holders.discard(holder)
    return len(holders)


def _wrap_destroy_process_group() -> None:
    original = c10d.destroy_process_group
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        release_graphs()
        return original(*args, **kwargs)

    setattr(destroy_process_group, _WRAPPED, True)
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group
