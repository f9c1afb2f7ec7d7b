"""Which kind of backward reaches a replay: a plain ``loss.backward()``, or one that autograd limits.

A replay's backward hands autograd its static gradient buffers, which the next replay overwrites.
In a plain ``backward()`` every node runs and autograd consumes them at once (AccumulateGrad copies
or adds; the next node reads them). ``torch.autograd.grad`` instead *returns* the gradients of its
``inputs`` to the caller, who may keep them past the next replay, and it accumulates into no
parameter. So a replay must know which backward runs, and autograd does not say directly.

The probe: every replay that records a backward also takes ``PROBE``, a leaf that requires a
gradient and never gets one. Autograd's engine runs every node of the graph only in a plain
``backward()`` (its per-task list of nodes to execute is empty), so
``torch._C._will_engine_execute_node`` answers True for the probe's AccumulateGrad node there and
False under ``autograd.grad`` or ``backward(inputs=...)``, where only the nodes toward the
requested inputs run. One question per replay, whatever the module holds.
"""

from __future__ import annotations

import torch

PROBE = torch.zeros((), requires_grad=True)  # (its gradient is always None: the replays return none for it)

_will_execute = getattr(torch._C, "_will_engine_execute_node", None)


def probe_input(records_backward: bool) -> torch.Tensor | None:
    """The extra replay input: the probe where the replay records a backward (it must not make outputs
    require a gradient that eager would not)."""
    return PROBE if records_backward else None


def engine_runs(node) -> bool:
    """Whether the running backward executes ``node`` (a ``next_functions`` entry of a replay node: the
    probe's, or a parameter's AccumulateGrad, which then accumulates into it). False where torch
    cannot say, or refuses the question (``autograd.grad`` of that very leaf)."""
    if node is None or _will_execute is None:
        return False
    try:
        return _will_execute(node)
    except RuntimeError:  # ("A leaf node was passed ... autograd.grad()")
        return False


def returnable(grads: list, plain: bool) -> list:
    """What a replay's backward may give autograd: its static buffers in a plain backward; outside one,
    copies where a buffer could reach the caller of ``autograd.grad`` (as eager, a fresh tensor)."""
    return grads if plain else [None if g is None else g.clone() for g in grads]
