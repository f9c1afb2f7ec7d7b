"""Each rank's own state in a checkpoint: its random number generators and its data position.

Ranks draw different random numbers (dropout masks, their data shards), so each saves its own:
torch's CPU generator, the CUDA generator of its device, Python's ``random``, and the data
source's ``state_dict()`` when one is given (torchdata's ``StatefulDataLoader``, or any object
with ``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import random
from typing import Any

import torch


def capture(device: torch.device, data: Any | None) -> dict[str, Any]:
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    if data is not None:
        state["data"] = data.state_dict()
    return state


def restore(state: dict[str, Any], device: torch.device, data: Any | None, where: str, *, rng: bool = True) -> None:
    """Put back what ``capture`` saved: the generators (unless ``rng`` is False) and ``data``'s position."""
    if rng:
        _restore_generators(state, device, where)
    if data is not None:
        if "data" not in state:
            raise ValueError(f"{where} holds no data position (it was saved without data=): "
                             "load without data=, or save with it")
        data.load_state_dict(state["data"])


def _restore_generators(state: dict[str, Any], device: torch.device, where: str) -> None:
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(_as_python_state(state["python"]))
    if device.type == "cuda":
        if "torch_cuda" not in state:
            raise ValueError(f"{where} was saved on CPU and has no CUDA generator state for {device}; "
                             "resume on CPU, or load with restore_rng=False")
        torch.cuda.set_rng_state(state["torch_cuda"], device)


def _as_python_state(value) -> tuple:
    """``random.setstate`` wants tuples; a round trip through a checkpoint may give lists."""
    version, internal, gauss = value
    return version, tuple(internal), gauss
