"""``Checkpointer``: save and resume a whole training state through ``torch.distributed.checkpoint``.

    ckpt = fsdp_graph.Checkpointer("ckpt", keep_last=3)
    start = ckpt.load(model, optimizer, scheduler=scheduler, data=loader) or 0
    for step in range(start, total_steps):
        ...
        ckpt.save(step + 1, model, optimizer, scheduler=scheduler, data=loader)

The model and optimizer go through torch's own state-dict functions and DCP (sharded: no rank
gathers the full model; loadable at another world size, and by FSDP2). Each rank's RNG states
and data position, and rank 0's step and scheduler state, go beside them in the same directory,
which becomes visible in one rename once everything is written (``directory.py``).
``docs/reliability.md`` has the design and the rules (load before ``make_train_step``).
Both calls are collectives: every rank makes them, with the same step.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..fsdp.agreement import agree
from . import directory, rank_state
from .optimizer_state import check_covered, ensure_state, flat_keys

FORMAT = 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _device_of(model: nn.Module) -> torch.device:
    """The device whose CUDA generator this rank saves and restores (CPU for a CPU model)."""
    device = next(model.parameters(), torch.empty(0)).device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _dcp(fn, state: dict, path: Path) -> None:
    """``dcp.save`` / ``dcp.load``; without a process group in DCP's single-process mode, which is
    what a plain ``python script.py`` means (DCP would warn that it assumes so)."""
    if _distributed():
        fn(state, checkpoint_id=str(path))
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        fn(state, checkpoint_id=str(path), no_dist=True)


def _on_rank0(what: str, fn):
    """Run ``fn`` on rank 0 and give its result to every rank; an error there is raised everywhere
    (on rank 0 itself, with its traceback)."""
    result: list[Any] = [None]
    error = None
    if _rank_and_world()[0] == 0:
        try:
            result[0] = ("ok", fn())
        except Exception as err:
            error, result[0] = err, ("error", f"{type(err).__name__}: {err}")
    if _distributed():
        dist.broadcast_object_list(result, src=0)
    if error is not None:
        raise error
    status, value = result[0]
    if status == "error":
        raise RuntimeError(f"Checkpointer: {what} failed on rank 0: {value}")
    return value


def _every_rank_ok(what: str, error: BaseException | None) -> None:
    """Raise on every rank if ``what`` failed on any (the failed ones raise their own error)."""
    if not _distributed():
        if error is not None:
            raise error
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = {r: e for r, e in enumerate(gathered) if e is not None}
    if failed:
        raise RuntimeError(f"Checkpointer: {what} failed on rank(s) {sorted(failed)}: {failed}")


class Checkpointer:
    """Checkpoints of a training run under ``directory``, the newest ``keep_last`` kept (None: all)."""

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = 3) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"Checkpointer: keep_last must be an int >= 1 or None (keep all), got {keep_last!r}")
        self.root = Path(directory)
        self.keep_last = keep_last

    # -- reading the directory (any rank, no collectives) --------------------------------------
    def latest(self) -> tuple[int, Path] | None:
        """(step, path) of the newest complete checkpoint, or None."""
        return directory.newest_complete(self.root)

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             scheduler: Any | None = None, data: Any | None = None) -> Path:
        """Save the state after ``step`` completed optimizer steps; returns the published directory.

        A collective: every rank calls it with the same ``step``, between training steps."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"Checkpointer.save: step must be an int >= 0 (completed steps), got {step!r}")
        rank, world = _rank_and_world()
        agree(f"Checkpointer.save(step={step})")
        temporary = Path(_on_rank0("creating the temporary directory", lambda: self._temporary_for(step)))
        state = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        _dcp(dcp.save, state, temporary)
        error = None
        try:
            path = temporary / directory.rank_filename(rank)
            torch.save(rank_state.capture(_device_of(model), data), path)
            directory.fsync_file(path)
        except Exception as err:
            error = err
        _every_rank_ok("writing each rank's state", error)

        def finish() -> str:
            trainer = {"format": FORMAT, "step": step, "world_size": world, "time": time.time(),
                       "scheduler": None if scheduler is None else scheduler.state_dict(),
                       "has_optimizer": optimizer is not None, "has_data": data is not None}
            torch.save(trainer, temporary / directory.TRAINER_FILE)
            directory.fsync_file(temporary / directory.TRAINER_FILE)
            final = directory.publish(temporary, step)
            directory.prune(self.root, self.keep_last)
            return str(final)

        return Path(_on_rank0("publishing the checkpoint", finish))

    def _temporary_for(self, step: int) -> str:
        later = directory.newer_than(self.root, step)
        if later:
            raise ValueError(
                f"Checkpointer.save(step={step}): {self.root} already holds checkpoints of later steps {later}, "
                "from another run (or this run started over without loading them). Saving would mix the two "
                "runs (and keep_last would prune the new checkpoint first). Resume with load() first, or use a "
                "fresh directory."
            )
        return str(directory.new_temporary(self.root, step))

    # -- loading ------------------------------------------------------------------------------
    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             scheduler: Any | None = None, data: Any | None = None, restore_rng: bool = True) -> int | None:
        """Load the newest complete checkpoint into the given objects; return its step (None: there
        is none, nothing changed). A collective. Call it before ``make_train_step``."""
        rank, world = _rank_and_world()
        agree("Checkpointer.load")
        found = _on_rank0("finding the newest checkpoint", lambda: self._newest_as_strings())
        if found is None:
            return None
        step, path = found[0], Path(found[1])
        device = _device_of(model)
        # weights_only=False: these files are this package's, written by the job itself, and may hold
        # any picklable scheduler or data state (numpy values, say). Load checkpoints you trust.
        trainer = torch.load(path / directory.TRAINER_FILE, map_location=device, weights_only=False)
        if trainer.get("format") != FORMAT:
            raise ValueError(f"checkpoint {path} has format {trainer.get('format')!r}; this version reads {FORMAT}")
        if optimizer is not None and not trainer["has_optimizer"]:
            raise ValueError(f"checkpoint {path} was saved without an optimizer; load it with optimizer=None "
                             "(the optimizer then starts fresh)")
        if scheduler is not None and trainer["scheduler"] is None:
            raise ValueError(f"checkpoint {path} was saved without a scheduler; load it with scheduler=None")

        if optimizer is not None:
            ensure_state(optimizer)
        state = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        saved_keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys()
        check_covered(saved_keys, flat_keys(state), str(path))
        _dcp(dcp.load, state, path)
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optim"])
        if scheduler is not None:
            scheduler.load_state_dict(trainer["scheduler"])

        if trainer["world_size"] == world:
            ranked = torch.load(path / directory.rank_filename(rank), map_location="cpu", weights_only=False)
            rank_state.restore(ranked, device, data, str(path), rng=restore_rng)
        else:
            warnings.warn(
                f"checkpoint {path} was saved by {trainer['world_size']} ranks and is loaded by {world}: the model, "
                "optimizer, scheduler and step are resharded and loaded, but each rank's RNG states and data "
                "position are not (they belong to ranks of the old layout); draw this run's data from the step.",
                stacklevel=2,
            )
        return step

    def _newest_as_strings(self) -> tuple[int, str] | None:
        found = self.latest()
        return None if found is None else (found[0], str(found[1]))
