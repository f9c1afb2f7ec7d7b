"""Full (unsharded) state dicts: what `load_state_dict(strict=True)` of the unwrapped model takes.

Keys are the model's own ``state_dict()`` keys (tied parameters under every name they have,
persistent buffers included); values of sharded parameters are gathered from all ranks and
returned in their original shape and dtype. Both functions are collectives: call them on
every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from .param_group import note_master_writes
from .registry import enclosing_unit, units_in


def _units(model: nn.Module) -> list:
    """The units whose masters ``model``'s state dict may hold: those inside it and, for a module
    inside a unit, the enclosing one."""
    units = units_in(model)
    enclosing = enclosing_unit(model)
    if enclosing is not None and enclosing not in units:
        units.insert(0, enclosing)
    return units


def _masters(units: list) -> dict[int, tuple]:
    """id(master parameter) -> (unit, index in the unit)."""
    return {id(p.master): (unit, i) for unit in units for i, p in enumerate(unit.params)}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{original name: full tensor} on every rank."""
    units = _units(model)
    for unit in units:
        unit.require_idle("full_state_dict")
    full: dict[int, torch.Tensor] = {}
    for unit in units:
        for param, value in zip(unit.params, unit.param_group.full_params()):
            full[id(param.master)] = value
    return {
        key: full[id(value)] if id(value) in full else value.detach().clone()
        for key, value in model.state_dict(keep_vars=True).items()
    }


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict (from ``full_state_dict`` or the unsharded model) into the shards."""
    # Mid-step, a unit's modules hold its unsharded parameters, not the masters: a load would
    # write into the gathered copy and leave the masters as they were.
    units = _units(model)
    for unit in units:
        unit.require_idle("load_full_state_dict")
    current = model.state_dict(keep_vars=True)
    missing = sorted(current.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - current.keys())
    if missing or unexpected:
        raise KeyError(
            "load_full_state_dict: the state dict's keys do not match the model's "
            f"(missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
            f"unexpected: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}). "
            "Pass a dict from full_state_dict() or from the unsharded model's state_dict() "
            "for the same architecture."
        )
    masters = _masters(units)
    note_master_writes()
    for key, target in current.items():
        value = state_dict[key]
        if id(target) in masters:
            unit, index = masters[id(target)]
            unit.param_group.load_full_param(index, value.to(target.device), key)
            continue
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"load_full_state_dict: '{key}' has shape {tuple(value.shape)} but the model's "
                f"tensor has shape {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value)
