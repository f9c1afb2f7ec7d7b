"""Process-group set-up: one call that works under torchrun, `accelerate launch` and plain python.

torchrun and accelerate both export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
a plain `python script.py` exports none of them and runs as world size 1 *without* a process
group (nothing to rendezvous with, no port to bind). The collectives in this package treat
"no process group and world size 1" as a local no-op, so the same training script runs in both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank, the world size, its local rank and compute device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout: float | timedelta | None = None) -> DistInfo:
    """Initialise the default process group from the launcher's environment (idempotent).

    NCCL on CUDA, gloo on CPU unless ``backend`` says otherwise. Sets the CUDA device from
    LOCAL_RANK. With WORLD_SIZE unset or 1 and no group yet, no group is created.
    ``timeout`` (seconds or a timedelta): how long a collective waits for the other ranks before
    it raises, instead of torch's default (10 to 30 minutes): a collective one rank never joins (a
    state dict taken on one rank only, a branch that skips a unit on one rank) then fails fast.
    It applies when the group is created here.
    """
    if timeout is not None and not isinstance(timeout, timedelta):
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"init_distributed: timeout must be a positive number of seconds or a timedelta, "
                             f"got {timeout!r}")
        timeout = timedelta(seconds=timeout)
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK", rank)
        return DistInfo(rank, world_size, local_rank, _device_for(local_rank))

    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    device = _device_for(local_rank)
    if world_size == 1:
        return DistInfo(0, 1, local_rank, device)

    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed support")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: launch with torchrun "
            "(e.g. `launch/run.sh --nproc-per-node N script.py`) or `accelerate launch`, "
            "which set them"
        )
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {} if timeout is None else {"timeout": timeout}
    if device.type == "cuda" and "nccl" in backend:
        kwargs["device_id"] = device  # eager NCCL init: communicators exist before any capture
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return DistInfo(rank, world_size, local_rank, device)


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group a unit communicates over: the given one, the default one, or None (world size 1).

    Refuses world size > 1 without an initialised group instead of silently training
    unsynchronised replicas.
    """
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    env_world = _env_int("WORLD_SIZE", 1)
    if env_world > 1:
        raise RuntimeError(
            f"WORLD_SIZE={env_world} but no process group is initialised: call "
            "fsdp_graph.init_distributed() (or torch.distributed.init_process_group) "
            "before fully_shard, or pass process_group="
        )
    return None


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
