"""Process-group set-up: one call that works under torchrun, `accelerate launch` and plain python.

torchrun and accelerate both export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
a plain `python script.py` exports none of them and runs as world size 1 *without* a process
group (nothing to rendezvous with, no port to bind). The collectives in this package treat
"no process group and world size 1" as a local no-op, so the same training script runs in both.

Under torchrun the group's store keys get a namespace of their own per restart attempt
(``_join_store``), and the group is destroyed at exit before Python finalises (``shutdown.py``).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import constants

from .shutdown import register_shutdown_at_exit


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
    It applies when the group is created here. Waiting for every rank to arrive is not bounded by
    it but by torch's default, or ``timeout`` where longer: ranks start seconds apart.
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
    collective_timeout = timeout or _default_timeout(backend)
    store, group_store = _join_store(rank, world_size, max(collective_timeout, _default_timeout(backend)))
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, store=group_store, **kwargs)
    store.set_timeout(collective_timeout)  # what torch's own rendezvous leaves it at
    register_shutdown_at_exit()
    return DistInfo(rank, world_size, local_rank, device)


_NAMESPACE = "fsdp_graph/attempt"


def _default_timeout(backend: str) -> timedelta:
    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    return nccl if "nccl" in backend and nccl is not None else constants.default_pg_timeout


def _join_store(rank: int, world_size: int, timeout: timedelta) -> tuple[dist.Store, dist.Store]:
    """The launcher's store, and the store to create the group over; ``timeout`` bounds the wait
    for every rank to arrive.

    Why not torch's own rendezvous: it waits for the ranks with the *collective* timeout, so
    ``init_distributed(timeout=2)`` failed whenever one rank took 2 s longer than another to import
    torch and start CUDA (seen on 2 H200s). Arriving is bounded by at least torch's default instead.

    Under torchrun's agent (c10d rendezvous, its default, ``TORCHELASTIC_USE_AGENT_STORE=True``) the
    group's keys also get a prefix new to this attempt: the agent keeps one store for the whole job
    and hands the same MASTER_PORT to every restart attempt, so the keys of an attempt that died are
    still there: gloo's listening addresses, NCCL's unique id, torch's and this package's own. A
    restarted rank that reads a dead peer's address before the live peer overwrites it fails with
    "connectFullMesh ... Connection refused" (a race: some restarts work). Under a fresh prefix
    there is nothing stale to read.
    """
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store, dist.PrefixStore("default_pg", store)  # as torch's own rendezvous prefixes it
    token = _fresh_token(store, rank, world_size, timeout)
    return store, dist.PrefixStore(f"{_NAMESPACE}/{token}/", store)


def _fresh_token(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A random token every rank of this attempt agrees on, through a store that may hold an
    earlier attempt's keys.

    Rank 0 draws the token and sends it to each rank in reply to a random nonce that rank has
    just written: a reply to a fresh nonce can only come from this attempt's rank 0.
    TORCHELASTIC_RESTART_COUNT would be simpler, but each node's agent counts its own restarts,
    so it differs across nodes (pytorch/pytorch#135712).
    """
    hello = [f"{_NAMESPACE}/hello/{r}" for r in range(1, world_size)]
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(hello[rank - 1], nonce)
        try:
            token = store.get(f"{_NAMESPACE}/welcome/{nonce}").decode()  # waits up to the timeout
        except RuntimeError as err:
            raise _not_joined(f"rank {rank} got no reply from rank 0", timeout) from err
        store.add(f"{_NAMESPACE}/{token}/joined", 1)
        return token
    token = uuid.uuid4().hex
    joined = f"{_NAMESPACE}/{token}/joined"
    answered: set[bytes] = set()
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        store.wait(hello)  # every rank wrote a nonce once: this attempt's, or a dead attempt's
    except RuntimeError as err:
        raise _not_joined("some ranks never reached init_distributed", timeout) from err
    while (count := store.add(joined, 0)) < world_size - 1:
        fresh = [nonce for nonce in store.multi_get(hello) if nonce not in answered]
        if fresh:
            store.multi_set([f"{_NAMESPACE}/welcome/{nonce.decode()}" for nonce in fresh], [token] * len(fresh))
            answered.update(fresh)
        elif time.monotonic() > deadline:
            raise _not_joined(f"only {count} of the {world_size - 1} other ranks joined rank 0", timeout)
        time.sleep(0.005)
    return token


def _not_joined(what: str, timeout: timedelta) -> RuntimeError:
    return RuntimeError(
        f"init_distributed: {what} within {timeout}: did every rank start (see their logs), and is this "
        f"job the only one using MASTER_ADDR:MASTER_PORT={os.environ.get('MASTER_ADDR')}:"
        f"{os.environ.get('MASTER_PORT')}? (It waits torch's default timeout, or "
        "init_distributed(timeout=...) where longer.)")


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
