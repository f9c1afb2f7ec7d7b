"""Mixed-precision policy: the dtype parameters are computed in and the dtype gradients are reduced in."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: compute dtype of unsharded parameters (None: the parameters' own dtype).
    ``reduce_dtype``: dtype of the gradient reduce-scatter (None: the compute dtype).
    ``cast_forward_inputs``: cast a unit's floating-point inputs to ``param_dtype`` (as FSDP2
    does), so activations that met an fp32 buffer do not reach bf16 weights in fp32.

    The sharded master copy is always at least fp32, whatever these say.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise TypeError(f"MixedPrecision.{field} must be a floating torch.dtype or None, got {value!r}")
