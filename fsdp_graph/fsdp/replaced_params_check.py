"""Refuse an optimizer step over parameters that ``fully_shard`` replaced.

``fully_shard`` swaps every parameter of a unit for its sharded master under the same name. An
optimizer built before that still holds the originals: they receive no gradient again, so its
steps silently skip them and the model stops training (FSDP2 behaves the same way, silently).
A global optimizer step pre-hook, registered by the first ``fully_shard``, refuses such a step
and names the fix. It re-checks an optimizer only when its parameter list changed.
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .sharded_param import replaced_by

_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> parameter ids checked
_installed = [False]


def install() -> None:
    if not _installed[0]:
        register_optimizer_step_pre_hook(_refuse_replaced)
        _installed[0] = True


def _refuse_replaced(optimizer, args, kwargs) -> None:
    signature = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
    if _checked.get(optimizer) == signature:
        return
    stale = [p for group in optimizer.param_groups for p in group["params"] if replaced_by(p) is not None]
    if stale:
        names = [_name(p) for p in stale[:3]]
        raise RuntimeError(
            f"{type(optimizer).__name__} holds {len(stale)} parameter(s) that fully_shard replaced by sharded "
            f"ones ({', '.join(names)}{', ...' if len(stale) > 3 else ''}): they receive no gradient any more, "
            "so this step would not train them. Build the optimizer after fully_shard, from "
            "model.parameters() (as with FSDP2)."
        )
    _checked[optimizer] = signature


def _name(param) -> str:
    unit = replaced_by(param)
    for sharded in unit.params:
        if sharded.original() is param:
            return f"{sharded.name} of unit {unit.name}"
    return f"a parameter of unit {unit.name}"
