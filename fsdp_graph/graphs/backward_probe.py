"""What a replay's backward may give autograd: its static gradient buffers, or copies of them.

A replay's backward produces its gradients in static buffers, which the next replay overwrites.
Autograd may keep what it is given past that point:
* ``torch.autograd.grad`` *returns* the gradients of its ``inputs`` to the caller;
* AccumulateGrad adopts an unreferenced tensor as ``.grad``, and a view of a static buffer (a
  graphed module's input that is a view of a leaf, or a ``cat`` of one) is such a tensor;
* a hook (a tensor's, a module's full backward hook) may keep the tensor it is shown.
So a replay returns a static buffer only where autograd hands it straight to a consumer that never
keeps it: another replay's backward (which copies it into its own static buffer, or reads it in
place where the two are chained), through FSDP's identity triggers, or the AccumulateGrad of a
leaf without tensor hooks (it copies or adds, since the replay still references the buffer; a hook
may return a view of it, which AccumulateGrad would adopt). Everywhere else it returns a copy:
one activation-sized copy where eager code meets a graph, none between graphed blocks.

Which backward runs decides the rest, and autograd does not say it directly. The probe: every replay
that records a backward also takes ``PROBE``, a leaf that requires a gradient and never gets one.
Autograd's engine runs every node only in a plain ``loss.backward()`` (its per-task list of nodes to
execute is empty), so ``torch._C._will_engine_execute_node`` answers True for the probe's
AccumulateGrad node there, and False under ``autograd.grad`` or ``backward(inputs=...)``, where only
the nodes toward the requested inputs run. There, a gradient whose edge leads nowhere needed is
dropped (None), and any other is copied: asked about a non-leaf node, the engine answers yes both
where the node runs and where ``autograd.grad`` captures its input, so the two cannot be told apart.
"""

from __future__ import annotations

import torch

from ..fsdp.capture_interface import POST_BACKWARD_TRIGGER_NODE

PROBE = torch.zeros((), device="cpu", requires_grad=True)  # (never gets a gradient: replays return None for it)

_will_execute = getattr(torch._C, "_will_engine_execute_node", None)
_ACCUMULATE_GRAD = type(torch.zeros(1, requires_grad=True).view(1).grad_fn.next_functions[0][0])
# Backward nodes that copy (or read in place) the gradient they are given and keep nothing: the replays'
# (registered by graphed_callable.py and graphed_segment.py; a leaf's AccumulateGrad is judged by its
# hooks); and those that pass each input's gradient on unchanged to the same position (FSDP's trigger).
CONSUMERS: set[type] = set()
PASS_THROUGH: set[type] = {POST_BACKWARD_TRIGGER_NODE}


def probe_input(records_backward: bool) -> torch.Tensor | None:
    """The extra replay input (the last tensor argument): the probe where the replay records a backward
    (it must not make outputs require a gradient that eager would not)."""
    return PROBE if records_backward else None


def engine_runs(node, unknown: bool = False) -> bool:
    """Whether the running backward executes ``node`` (a ``next_functions`` entry of a replay node: the
    probe's, or a parameter's AccumulateGrad, which then accumulates into it); False for no node.
    ``unknown``: the answer where torch cannot say, or refuses the question (``autograd.grad`` of that
    very leaf, which it then returns)."""
    if node is None:
        return False
    if _will_execute is None:
        return unknown
    try:
        return _will_execute(node)
    except RuntimeError:  # ("A leaf node was passed ... autograd.grad()")
        return unknown


def returnable(grads: list, edges: tuple, plain: bool) -> list:
    """What a replay's backward gives autograd for ``grads`` (its static buffers, None where nothing
    is owed; ``edges``: the replay node's ``next_functions``, in the same order; ``plain``: the probe's
    answer): each buffer itself where its edge's consumer never keeps it, else a copy, or None under
    ``autograd.grad`` / ``backward(inputs=)`` where the edge leads to nothing that runs."""
    if plain:
        return [g if g is None or _consumed_at_once(*edges[i]) else g.clone() for i, g in enumerate(grads)]
    # (a gradient autograd.grad may capture is copied: torch refuses the question for a captured leaf)
    return [None if g is None or not engine_runs(edges[i][0], unknown=True) else g.clone()
            for i, g in enumerate(grads)]


def _consumed_at_once(node, input_nr: int) -> bool:
    while node is not None and type(node) in PASS_THROUGH:
        node, input_nr = node.next_functions[input_nr]
    if type(node) is _ACCUMULATE_GRAD:  # (a hook of the leaf may return a view of the buffer, which it adopts)
        return not node.variable._backward_hooks
    return type(node) in CONSUMERS

