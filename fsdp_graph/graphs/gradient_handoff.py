"""A graphed module's backward hands its parameters' gradients to their FSDP units.

The backward graph writes each parameter's gradient into a static buffer of its own. Returned to
autograd, AccumulateGrad would copy it into a fresh ``.grad`` (a new address every step, which the
unit's reduce cannot replay as a graph) or add it into a persistent gradient buffer (an extra pass
and the buffer's memory). Offered to the unit instead, its reduce reads the static buffer where it
lies (``fsdp/graph_gradients.py`` says when a unit takes them and why that is safe). A unit that
declines (``no_sync`` accumulation) gets them through autograd as before, and so does every unit in a
backward that accumulates no gradient into some of its parameters (``torch.autograd.grad`` of the
inputs, ``backward(inputs=...)``): autograd would drop those, so must the reduce.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..fsdp.capture_interface import unsharded_owner
from .backward_probe import engine_runs


def plan_handoffs(params: list[torch.Tensor], module: nn.Module | None, static_grads: list,
                  first: int) -> list[tuple]:
    """Per FSDP unit whose unsharded parameters the graph reads: (the unit's receiver, the positions of
    their static gradients in ``static_grads``, the unit's parameter indices). ``params``: the graph's
    parameters, whose static gradients start at ``first``."""
    if module is None:
        return []
    by_unit: dict[int, tuple] = {}
    for j, param in enumerate(params):
        unit = unsharded_owner(param)
        if unit is not None:
            by_unit.setdefault(id(unit), (unit, []))[1].append(j)
    modules = list(module.modules())
    plan = []
    for unit, positions in by_unit.values():
        receiver = unit.grads.from_graphs
        indices = receiver.cover([params[j] for j in positions], modules)
        handed = [(first + j, i) for j, i in zip(positions, indices) if i >= 0 and static_grads[first + j] is not None]
        if handed:
            plan.append((receiver, [p for p, _ in handed], [i for _, i in handed]))
    return plan


def hand_over(plan: list[tuple], static_grads: list, edges: tuple, plain: bool) -> list:
    """At a backward replay: offer each unit its gradients, where this backward accumulates into every
    one of those parameters (``plain``: a plain ``backward()``, which accumulates into all; else autograd
    is asked per parameter. ``edges``: the replay node's ``next_functions``, one per tensor input, in
    the order of ``static_grads``); what autograd should still get (None where a unit took them)."""
    grads = static_grads
    for receiver, positions, indices in plan:
        if (plain or all(engine_runs(edges[p][0]) for p in positions)) and receiver.receive(
                indices, [static_grads[p] for p in positions]):
            if grads is static_grads:
                grads = list(static_grads)
            for p in positions:
                grads[p] = None
    return grads
