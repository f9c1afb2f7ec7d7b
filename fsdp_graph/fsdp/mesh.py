"""What a unit shards over: its process groups, and the DTensor mesh and placements of its masters.

A 1-D mesh (or a process group, or the default group) shards every parameter by rows across its
ranks: the masters are ``Shard(0)`` DTensors, as FSDP2's. A 2-D mesh ``(replicate, shard)`` is
HSDP: parameters are sharded within the shard dimension and replicated across the other, so the
masters are ``(Replicate(), Shard(0))`` DTensors and gradients are reduce-scattered within the
shard group, then all-reduced across replicas. One process without a process group (a plain
``python script.py``) has no mesh: its masters are plain full-shape parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .distributed import group_rank_and_size, resolve_group

_meshes: dict[tuple, tuple] = {}  # (id(group), device type) -> (group, the DeviceMesh made from it)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor under a DTensor (the tensor itself otherwise)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class ShardMesh:
    mesh: DeviceMesh | None  # None: one process, no process group (plain parameters)
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None = None  # HSDP's replicas

    @property
    def shard_rank_and_size(self) -> tuple[int, int]:
        return group_rank_and_size(self.shard_group)

    @property
    def replicate_size(self) -> int:
        return group_rank_and_size(self.replicate_group)[1]

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks that hold this unit's shards and replicas (empty without a group)."""
        return () if self.mesh is None else tuple(self.mesh.mesh.flatten().tolist())

    @property
    def placements(self) -> tuple:
        return (Replicate(), Shard(0)) if self.replicate_group is not None else (Shard(0),)

    def wrap(self, local: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """``local`` (this rank's rows) as what the modules and the optimizer see: a DTensor of the
        global ``shape``, sharing ``local``'s memory (``local`` itself without a mesh)."""
        if self.mesh is None:
            return local
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))


def _mesh_of_group(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    if "nccl" in str(dist.get_backend(group)).lower():
        device_type = "cuda"
    key = (id(group), device_type)
    entry = _meshes.get(key)
    if entry is None or entry[0] is not group:  # (the group is kept alive here: its id is not reused)
        entry = _meshes[key] = (group, DeviceMesh.from_group(group, device_type))
    return entry[1]


def resolve_mesh(mesh: DeviceMesh | None, process_group: dist.ProcessGroup | None, device_type: str) -> ShardMesh:
    """The unit's ``ShardMesh`` from ``fully_shard``'s ``mesh=`` / ``process_group=`` (or the default
    group, on a mesh of ``device_type``: NCCL's is always CUDA)."""
    if mesh is None:
        group = resolve_group(process_group)
        return ShardMesh(None if group is None else _mesh_of_group(group, device_type), group)
    if mesh.ndim == 1:
        return ShardMesh(mesh, mesh.get_group())
    if mesh.ndim == 2:
        return ShardMesh(mesh, mesh.get_group(1), mesh.get_group(0))
    raise ValueError(
        f"fully_shard: mesh has {mesh.ndim} dimensions; pass a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh "
        "(HSDP), e.g. init_device_mesh('cuda', (replicas, shards), mesh_dim_names=('replicate', 'shard'))."
    )
