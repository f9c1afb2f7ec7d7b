"""CUDA graphs that captured NCCL collectives go before their communicators do.

A graph that captured an NCCL collective keeps resources of the communicator, and NCCL's
``ncclCommDestroy`` waits for them. So ``torch.distributed.destroy_process_group()`` never
returns while such a graph exists. Measured on 2 × H200, torch 2.11: with a whole-step graph
alive at the call, the call hung every time; with the graph released first, it returned
(pytorch/pytorch#115388 reports the same). A training script usually ends with that call while
its step is still alive, and so does the ``atexit`` hook of ``init_distributed``.

So every object that holds such a graph registers here (``hold``), and ``release_graphs()`` makes
each of them drop its graph, after a device synchronize, before a group is destroyed. Two paths
call it:

* ``fsdp_graph.shutdown()``, and with it the ``atexit`` hook;
* ``torch.distributed.destroy_process_group``, which the first ``hold`` wraps: for the default
  group (everything goes) and for any NCCL group (a graph may hold its collectives, and which
  ones it holds is not known here), not for a gloo group, whose destroy waits for no graph (a
  metrics group destroyed mid-training leaves the steps alone). A name imported with
  ``from torch.distributed import destroy_process_group`` before that is torch's own, so call
  ``fsdp_graph.shutdown()`` instead, or drop the step first.

A released whole-step or whole-forward graph refuses to replay and names the cause; released
collective graphs (``collective_graphs.py``) run their bodies eagerly and capture again.
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
        try:
            torch.cuda.synchronize()  # no replay still running when its graph goes
        except RuntimeError:
            pass  # a sticky CUDA error: nothing runs any more, and the graphs must go all the same
    for holder in holders:
        holder.release()
        _holders.discard(holder)
    return len(holders)


def _holds_graphs_of(group) -> bool:
    """Whether destroying ``group`` may wait for a graph: the default group (all of them go), or an
    NCCL group (the only backend whose destroy waits for captured collectives)."""
    if group is None or group is c10d.GroupMember.WORLD:
        return True
    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return True  # not a group torch knows: the original call says so; release to be safe


def _wrap_destroy_process_group() -> None:
    for module in (c10d, dist):  # each attribute from its own current value
        original = module.destroy_process_group
        if not getattr(original, _WRAPPED, False):
            module.destroy_process_group = _releasing_first(original)


def _releasing_first(original):
    @functools.wraps(original)
    def destroy_process_group(group=None):
        if _holds_graphs_of(group):
            release_graphs()
        return original(group)

    setattr(destroy_process_group, _WRAPPED, True)
    return destroy_process_group
