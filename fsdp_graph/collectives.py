"""The three collectives FSDP needs, with a local path for world size 1 (no process group).

All of them read and write caller-owned tensors: no collective here allocates, which is what
lets the unshard/reduce paths keep fixed addresses (and later run inside CUDA graphs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older versions have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_inplace(flat: torch.Tensor, shard_numel: int, group: dist.ProcessGroup | None) -> None:
    """Gather every rank's shard into ``flat``; this rank's shard is already in place in ``flat``."""
    if group is None or flat.numel() == 0:
        return
    rank = dist.get_rank(group)
    local = flat.narrow(0, rank * shard_numel, shard_numel)
    _all_gather_single(flat, local, group=group)


def reduce_scatter_sum(out_shard: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out_shard`` = this rank's shard of the sum of ``flat`` over the group."""
    if group is None:
        out_shard.copy_(flat)
        return
    if flat.numel() == 0:
        return
    _reduce_scatter_single(out_shard, flat, op=dist.ReduceOp.SUM, group=group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
