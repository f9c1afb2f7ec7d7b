"""Mixed-precision policy, by FSDP2's name and fields: compute, reduce and output dtypes.

``fully_shard(mp_policy=...)`` takes this class, or torch's own
``torch.distributed.fsdp.MixedPrecisionPolicy`` (same fields, converted), so an FSDP2 script
switches by its import alone. ``MixedPrecision`` is this package's earlier name for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: compute dtype of unsharded parameters (None: the parameters' own dtype).
    ``reduce_dtype``: dtype of the gradient reduce-scatter (None: the compute dtype).
    ``output_dtype``: cast a unit's floating-point outputs to it (None: leave them as computed).
    ``cast_forward_inputs``: cast a unit's floating-point inputs to ``param_dtype`` (as FSDP2
    does), so activations that met an fp32 buffer do not reach bf16 weights in fp32.

    The sharded master copy is always at least fp32, whatever these say.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in FIELDS[:3]:
            value = getattr(self, field)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise TypeError(f"MixedPrecisionPolicy.{field} must be a floating torch.dtype or None, got {value!r}")

    @classmethod
    def of(cls, policy) -> MixedPrecisionPolicy:
        """This package's policy for ``policy``: None, one of ours, or torch's FSDP2 policy."""
        if policy is None:
            return cls()
        if isinstance(policy, cls):
            return policy
        if type(policy).__name__ == "MixedPrecisionPolicy" and all(hasattr(policy, f) for f in FIELDS):
            return cls(**{f: getattr(policy, f) for f in FIELDS})  # torch.distributed.fsdp's
        raise TypeError(
            f"mp_policy must be a MixedPrecisionPolicy (fsdp_graph's or torch.distributed.fsdp's), "
            f"got {type(policy).__name__}"
        )


MixedPrecision = MixedPrecisionPolicy  # the earlier name, kept as an alias
