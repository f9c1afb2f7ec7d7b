"""``fully_shard(..., verify=True)``: every rank must start from the same weights.

Each rank keeps only its rows of the weights it passes to ``fully_shard``, so a rank that built
its model from another seed (a forgotten ``torch.manual_seed``) trains a model stitched from
different initialisations, without a word. Before sharding, each rank fingerprints each of the
unit's tensors (the sum and the sum of squares of its bit patterns, as wrapping 64-bit integers:
exact, the same on any device and in any order) and compares the fingerprints over the unit's
ranks: one small all-gather per unit, at set-up only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements per step: bounds the temporary int64 copy


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers that equal weights always share and different weights almost never do."""
    flat = tensor.detach().contiguous().view(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        flat = flat.view(_BITS[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        bits = flat[start:start + _CHUNK].to(torch.int64)
        total[0] += bits.sum()
        total[1] += (bits * bits).sum()
    return total


def verify_same_weights(unit_name: str, named: list[tuple[str, torch.Tensor]],
                        groups: list[dist.ProcessGroup]) -> None:
    """Raise on every rank if any of ``named`` differs between the ranks of any of ``groups``."""
    if not named or not groups:
        return
    local = torch.stack([fingerprint(t) for _, t in named])
    problems = []  # raised after every group's all-gather, so that no rank skips one (HSDP: two groups)
    for group in groups:
        size = dist.get_world_size(group)
        gathered = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(gathered, local, group=group)
        for other_rank, other in zip(dist.get_process_group_ranks(group), gathered):
            differs = (other != local).any(dim=1).nonzero()
            if len(differs):
                name = named[int(differs[0])][0]
                more = f" (and {len(differs) - 1} more)" if len(differs) > 1 else ""
                problems.append(f"'{name}'{more} differs between rank {dist.get_rank()} and rank {other_rank}")
    if problems:
        raise ValueError(
            f"fully_shard(verify=True) on {unit_name}: {'; '.join(problems[:3])}. Every rank must pass the same "
            "initial weights: seed the RNG identically on every rank before building the model "
            "(torch.manual_seed(seed)), or load the same checkpoint on every rank before fully_shard."
        )
