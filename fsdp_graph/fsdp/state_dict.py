"""Full (unsharded) state dicts: what `load_state_dict(strict=True)` of the unwrapped model takes.

Keys are the model's own ``state_dict()`` keys (tied parameters under every name they have,
persistent buffers included); values of sharded parameters are gathered from all ranks and
returned in their original shape and dtype. Both functions are collectives: call them on
every rank. Each first agrees with the other ranks that they make the same call
(``agreement.py``): a call on one rank only raises, naming the ranks that did not make it,
instead of hanging or loading some shards and not others.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from .agreement import agree
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


def unit_ranks(units: list) -> list[int]:
    """The global ranks that hold shards or replicas of ``units``."""
    return sorted({rank for unit in units for rank in unit.mesh.ranks})


def _masters(units: list) -> dict[int, tuple]:
    """id(master parameter) -> (unit, index in the unit)."""
    return {id(p.master): (unit, i) for unit in units for i, p in enumerate(unit.params)}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{original name: full tensor} on every rank."""
    units = _units(model)
    for unit in units:
        unit.require_idle("full_state_dict")
    agree("full_state_dict", unit_ranks(units))
    full: dict[int, torch.Tensor] = {}
    for unit in units:
        for param, value in zip(unit.params, unit.param_group.full_params()):
            full[id(param.master)] = value
    return {
        key: full[id(value)] if id(value) in full else value.detach().clone()
        for key, value in model.state_dict(keep_vars=True).items()
    }


def _mismatch(current: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> Exception | None:
    """Why ``state_dict`` cannot be loaded into a model whose state dict is ``current`` (or None)."""
    missing = sorted(current.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - current.keys())
    if missing or unexpected:
        return KeyError(
            "load_full_state_dict: the state dict's keys do not match the model's "
            f"(missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
            f"unexpected: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}). "
            "Pass a dict from full_state_dict() or from the unsharded model's state_dict() "
            "for the same architecture."
        )
    for key, target in current.items():  # a sharded master's shape is its full (global) shape
        if tuple(state_dict[key].shape) != tuple(target.shape):
            return ValueError(
                f"load_full_state_dict: '{key}' has shape {tuple(state_dict[key].shape)} but the model's "
                f"tensor has shape {tuple(target.shape)}"
            )
    return None


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict (from ``full_state_dict`` or the unsharded model) into the shards.

    Every rank passes the whole dict (each copies its own rows). The dict is checked first, then
    the ranks agree: a dict refused on one rank is refused on all, so no rank loads alone."""
    # Mid-step, a unit's modules hold its unsharded parameters, not the masters: a load would
    # write into the gathered copy and leave the masters as they were.
    units = _units(model)
    for unit in units:
        unit.require_idle("load_full_state_dict")
    current = model.state_dict(keep_vars=True)
    problem = _mismatch(current, state_dict)
    agree("load_full_state_dict" if problem is None else f"load_full_state_dict (refused there: {problem})",
          unit_ranks(units))
    if problem is not None:
        raise problem
    masters = _masters(units)
    note_master_writes()
    for key, target in current.items():
        value = state_dict[key]
        if id(target) in masters:
            unit, index = masters[id(target)]
            unit.param_group.load_full_param(index, value.to(target.device), key)
            continue
        with torch.no_grad():
            target.copy_(value)
