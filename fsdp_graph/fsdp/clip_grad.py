"""Gradient-norm clipping over sharded gradients: the norm of the *full* gradient.

torch's ``clip_grad_norm_(model.parameters(), ...)`` gives the same result on the DTensor masters;
this one works on their local tensors (no DTensor dispatch) and can be captured in a whole-step
graph.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from .collectives import all_reduce
from .mesh import local_tensor
from .registry import units_in


def _reduce_norms(grads: list[torch.Tensor], p: float) -> torch.Tensor | None:
    """sum |g|^p (or max |g| for p = inf) over ``grads``, in fp32; None when there are none."""
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return None
    norms = torch.stack(torch._foreach_norm(grads, p)).float()  # one fused kernel, not one per tensor
    return norms.max() if math.isinf(p) else norms.pow(p).sum()


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients so their global ``norm_type``-norm is at most ``max_norm``; return that norm.

    Sharded gradients contribute their local pieces, combined across ranks; gradients of
    parameters outside any unit are replicated and counted once.
    """
    p = float(norm_type)
    units = units_in(model)
    for unit in units:
        unit.require_idle("clip_grad_norm_")  # mid-step (or after unshard()), .grad is not the masters'
    groups = {id(u.group): u.group for u in units if u.params}
    if len(groups) > 1:
        raise ValueError("clip_grad_norm_: the model's units use different process groups; clip each part separately")
    group = next(iter(groups.values()), None)
    master_ids = {id(p.master) for u in units for p in u.params}
    params = [q for q in model.parameters() if q.grad is not None]
    sharded = [local_tensor(q.grad) for q in params if id(q) in master_ids]
    replicated = [local_tensor(q.grad) for q in params if id(q) not in master_ids]
    device = params[0].grad.device if params else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float32, device=device)

    local = _reduce_norms(sharded, p)
    local = zero.clone() if local is None else local
    all_reduce(local, group, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM)
    rest = _reduce_norms(replicated, p)
    if rest is not None:
        local = torch.maximum(local, rest) if math.isinf(p) else local + rest
    total = local if math.isinf(p) else local.pow(1.0 / p)

    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = sharded + replicated
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
