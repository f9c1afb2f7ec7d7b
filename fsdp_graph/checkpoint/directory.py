"""A checkpoint directory on disk: names, the atomic publish, the newest complete one, pruning.

Pure filesystem work, no process group: ``Checkpointer`` decides which rank calls what.
``step_<n>`` directories are only ever created by one ``rename(2)`` of a finished temporary
directory, and only ever removed by renaming them to ``.trash-*`` first, so a kill at any moment
leaves every ``step_<n>`` complete (the next save sweeps the leftovers).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

_STEP = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
TRAINER_FILE = "trainer.pt"  # written last by rank 0: its presence (with DCP's) marks a complete save
DCP_METADATA = ".metadata"


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def rank_filename(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def is_complete(path: Path) -> bool:
    return (path / TRAINER_FILE).is_file() and (path / DCP_METADATA).is_file()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP.match(entry.name)
        if match and entry.is_dir() and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def newest_complete(root: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def new_temporary(root: Path, step: int) -> Path:
    """A fresh, empty temporary directory for the save of ``step`` (leftovers of killed saves swept)."""
    root.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(root)
    path = root / f"{TMP_PREFIX}{step_dirname(step)}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def sweep_leftovers(root: Path) -> None:
    """Delete temporary directories of saves that never finished, and trash not yet deleted."""
    for entry in root.iterdir():
        if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)


def _to_trash(path: Path) -> Path:
    """Take a checkpoint directory out of sight in one rename (deleted later: never a partial ``step_<n>``)."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    return trash


def publish(temporary: Path, step: int) -> Path:
    """Make the finished ``temporary`` visible as ``step_<n>`` in one rename. An earlier save of the
    same step is renamed away just before and deleted only after (a kill in between leaves the
    older checkpoints)."""
    final = temporary.parent / step_dirname(step)
    fsync_dir(temporary)
    replaced = _to_trash(final) if final.exists() else None
    os.rename(temporary, final)
    fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def newer_than(root: Path, step: int) -> list[int]:
    """Steps of complete checkpoints after ``step`` (from another run, if this one saves ``step``)."""
    return [s for s, _ in complete_checkpoints(root) if s > step]


def prune(root: Path, keep_last: int | None) -> None:
    """Discard all but the newest ``keep_last`` complete checkpoints (None: keep all)."""
    if keep_last is None:
        return
    found = complete_checkpoints(root)
    for _, path in found[: max(0, len(found) - keep_last)]:
        shutil.rmtree(_to_trash(path), ignore_errors=True)
