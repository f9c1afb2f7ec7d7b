"""Which unit a module is, which unit encloses it, which root it answers to, who holds its addresses.

``fully_shard`` writes these marks into the modules' ``__dict__``; everything else reads them
through the functions here, so the attribute names live in one place.

Address pins: code outside the engine that keeps the addresses of a module's parameters (a
CUDA graph captured on it) pins the module, naming itself. ``fully_shard`` refuses to re-plan a
subtree that holds a pinned module, saying who pinned it: the pinned addresses would go stale.
"""

from __future__ import annotations

import torch.nn as nn

from .root import RootContext
from .unit import FSDPUnit

UNIT_ATTR = "_fsdp_unit"  # on a unit's module: its unit
ENCLOSING_ATTR = "_fsdp_enclosing_unit"  # on every module under a unit: the innermost unit enclosing it
ROOT_ATTR = "_fsdp_root"  # on a unit's module: the RootContext of its tree
PIN_ATTR = "_fsdp_pinned_by"  # on a module whose parameter addresses someone keeps: who


def unit_of(module: nn.Module) -> FSDPUnit:
    return module.__dict__[UNIT_ATTR]


def enclosing_unit(module: nn.Module) -> FSDPUnit | None:
    """The innermost unit whose subtree holds ``module`` (its own unit, if it is one)."""
    return module.__dict__.get(ENCLOSING_ATTR)


def units_in(module: nn.Module) -> list[FSDPUnit]:
    """Every unit in ``module``'s subtree (itself included), outermost first, module order."""
    seen: dict[int, FSDPUnit] = {}
    for sub in module.modules():
        unit = sub.__dict__.get(UNIT_ATTR)
        if unit is not None:
            seen.setdefault(id(unit), unit)
    return list(seen.values())


def root_of(module: nn.Module) -> RootContext:
    return module.__dict__[ROOT_ATTR]


def root_contexts(model: nn.Module) -> list[RootContext]:
    """The root contexts of the units under ``model`` (one per tree), initialised."""
    contexts = {}
    for sub in model.modules():
        ctx = sub.__dict__.get(ROOT_ATTR)
        if ctx is not None:
            contexts.setdefault(id(ctx), ctx)
    for ctx in contexts.values():
        ctx.lazy_init()
    return list(contexts.values())


def leaf_units(model: nn.Module) -> list[FSDPUnit]:
    """The units under ``model`` that contain no other unit and are not a root (the blocks)."""
    units = units_in(model)
    parents = {id(u.parent) for u in units if u.parent is not None}
    return [u for u in units if id(u) not in parents and u.parent is not None]


def pin_addresses(module: nn.Module, by: str) -> None:
    module.__dict__[PIN_ATTR] = by


def pinned_by(module: nn.Module) -> str | None:
    return module.__dict__.get(PIN_ATTR)
