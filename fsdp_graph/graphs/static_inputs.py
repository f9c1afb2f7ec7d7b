"""The static input tensors a whole-step (or whole-model) graph reads, and the copy into them.

A graph reads its inputs from fixed addresses, so every call copies the live batch into these
tensors (rebinding would leave the graph reading stale data). A batch whose shape, dtype or
device differs from the example cannot be copied: the error says how to make shapes static.
"""

from __future__ import annotations

import torch


class StaticInputs:
    def __init__(self, what: str, example: tuple, device: torch.device) -> None:
        self.what = what
        for i, x in enumerate(example):
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"{what}: argument {i} is a {type(x).__name__}; a graph's inputs are tensors copied in at "
                    "every call. Pass constants through a closure (functools.partial or a lambda) instead."
                )
        self.tensors = [x.detach().to(device, copy=True) for x in example]

    def copy_in(self, batch: tuple) -> None:
        if len(batch) != len(self.tensors):
            raise TypeError(f"{self.what}: called with {len(batch)} argument(s), captured with {len(self.tensors)}")
        for i, (live, static) in enumerate(zip(batch, self.tensors)):
            if not (isinstance(live, torch.Tensor) and live.shape == static.shape and live.dtype == static.dtype):
                raise ValueError(self.mismatch(i, live, static))
            static.copy_(live, non_blocking=True)

    def mismatch(self, index: int, live, static: torch.Tensor) -> str:
        got = f"shape {tuple(live.shape)}, {live.dtype}" if isinstance(live, torch.Tensor) else type(live).__name__
        return (
            f"{self.what}: argument {index} is {got}, but the graph was captured with shape "
            f"{tuple(static.shape)}, {static.dtype}. A CUDA graph replays fixed shapes: pad every batch to "
            "the captured shape (a fixed sequence length; drop_last=True in the DataLoader), capture one "
            "step per shape, or run this part eagerly (GraphConfig(strategy='none'), or strategy='layer' "
            "with only the fixed-shape modules selected)."
        )
