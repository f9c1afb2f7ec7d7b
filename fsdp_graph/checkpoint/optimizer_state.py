"""An optimizer's state made ready for a checkpoint load, and the load checked for completeness.

``torch.distributed.checkpoint`` loads into the entries of the state dict it is given and ignores
checkpoint entries that state dict lacks. A fresh optimizer has no state yet, so its state dict
lists no moments to load into: torch's ``get_state_dict`` creates them with a zero-gradient step
at learning rate 0, but skips that step when any parameter already has a gradient (then nothing
of the optimizer's state would be loaded, silently), and replaces tensor learning rates with CPU
tensors. ``ensure_state`` does the same step for the parameters without state only, with tensor
learning rates zeroed in place and every gradient put back; ``check_covered`` then refuses a
checkpoint holding entries the load would skip.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter of ``optimizer`` its state (moments, step), values unchanged."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not missing:
        return
    grads = [p.grad for p in params]
    rates = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = None
        for p in missing:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"] = group["lr"].clone()  # the live tensor keeps its value; this one is zeroed
                group["lr"].zero_()
            else:
                group["lr"] = 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, rates):
            group["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def flat_keys(state_dict: dict) -> set[str]:
    """The keys DCP stores ``state_dict`` under (nested dicts joined with dots)."""
    return set(flatten_state_dict(state_dict)[0])


def check_covered(saved: Iterable[str], loading: set[str], path: str) -> None:
    """Every entry of the checkpoint under a section being loaded has a place in ``loading``."""
    sections = {key.split(".", 1)[0] for key in loading}
    skipped = sorted(k for k in saved if k.split(".", 1)[0] in sections and k not in loading)
    if skipped:
        raise ValueError(
            f"checkpoint {path} holds {len(skipped)} entries the model/optimizer being loaded has no place for "
            f"(e.g. {skipped[:4]}): they would be skipped silently. Build the same model (same "
            "parameter names) and an optimizer over the same parameters and param groups before loading."
        )
