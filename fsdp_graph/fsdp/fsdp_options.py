"""FSDP2's ``fully_shard`` options, mapped onto this package's, or refused with the fix named.

* ``mesh``: a 1-D ``DeviceMesh`` shards over its group; a 2-D ``(replicate, shard)`` mesh is HSDP
  (``mesh.py``). The masters are DTensors on that mesh, as FSDP2's.
* ``reshard_after_forward=True`` (and ``None``, the default): reshard after forward. ``None`` is
  ``True`` here: the root, which FSDP2's ``None`` keeps unsharded, has a dedicated buffer that
  backward never gathers again anyway.
* ``reshard_after_forward=False``: the unit stays gathered from forward to backward (one
  all-gather per step), in its own persistent buffer instead of a shared slot. Its modules hold
  the sharded parameters in between (FSDP2's hold the unsharded ones).
* ``reshard_after_forward=<int>``: refused (resharding to a smaller world is not implemented).
* ``mp_policy``: ``MixedPrecisionPolicy``, ours or torch's (same fields).
* ``offload_policy``: ``OffloadPolicy()`` (no offload) accepted; ``CPUOffloadPolicy`` refused.
* ``ignored_params``: left unsharded and unmanaged, as in FSDP2 (their gradients are not reduced),
  also by ``fully_shard`` calls on enclosing modules later.
* ``shard_placement_fn``: refused (every unit shards one flat buffer evenly).
* a list of modules: each is sharded as its own unit, with the same training results and one
  collective per module instead of one for all; refused if they share a parameter. Module methods
  (``unshard``, ``set_gradient_divide_factor``, ...) then act on the module they are called on,
  where FSDP2's act on the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

from .mixed_precision import MixedPrecisionPolicy


@dataclass(frozen=True)
class Options:
    mesh: object  # a DeviceMesh or None
    process_group: dist.ProcessGroup | None
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    ignored_params: tuple  # left unsharded and unmanaged by this and every later fully_shard


def _check_mesh(mesh, process_group) -> None:
    if mesh is None:
        return
    if process_group is not None:
        raise ValueError("fully_shard: pass mesh= or process_group=, not both (a 1-D mesh is a process group)")
    if not hasattr(mesh, "ndim") or not hasattr(mesh, "get_group"):
        raise TypeError(f"fully_shard: mesh must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}")


def _reshard_after_forward(value) -> bool:
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    raise ValueError(
        f"fully_shard: reshard_after_forward={value!r}; fsdp_graph takes True, False or None. Resharding to a "
        "smaller world after forward (an int) is not implemented: use True (reshard, all-gather again in "
        "backward) or False (stay gathered until backward)."
    )


def _check_offload(policy) -> None:
    if policy is None or type(policy).__name__ == "OffloadPolicy":
        return  # torch's base OffloadPolicy: no offload
    raise ValueError(
        f"fully_shard: offload_policy={type(policy).__name__}(...) is not supported: fsdp_graph keeps sharded "
        "parameters on the device (its persistent buffers are what CUDA graphs replay). Drop offload_policy."
    )


def resolve_options(mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
                    ignored_params, process_group) -> Options:
    if shard_placement_fn is not None:
        raise ValueError(
            "fully_shard: shard_placement_fn is not supported: every unit's parameters are laid out in one "
            "flat buffer and sharded evenly across ranks. Drop shard_placement_fn."
        )
    _check_offload(offload_policy)
    _check_mesh(mesh, process_group)
    return Options(mesh, process_group, _reshard_after_forward(reshard_after_forward),
                   MixedPrecisionPolicy.of(mp_policy), tuple(ignored_params or ()))


def list_of_modules(modules) -> list[nn.Module]:
    """FSDP2's ``fully_shard([a, b])``: each becomes its own unit. Refused when they share a
    parameter (one unit must own it: shard their common ancestor)."""
    modules = list(modules)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError("fully_shard expects an nn.Module or a non-empty list of nn.Module")
    owners: dict[int, int] = {}
    for i, module in enumerate(modules):
        for param in module.parameters():
            j = owners.setdefault(id(param), i)
            if j != i:
                raise ValueError(
                    f"fully_shard([...]): modules {j} and {i} of the list share a parameter; fsdp_graph shards each "
                    "listed module as its own unit, and a parameter belongs to one unit. Shard their common "
                    "ancestor instead (or the list without the shared one)."
                )
    return modules
