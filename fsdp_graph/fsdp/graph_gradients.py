"""Gradients a graphed module's backward hands straight to its unit, at the graph's own addresses.

A per-layer graph's backward writes each parameter's gradient into a static buffer of its own, at
a fixed address, which the next replay of that backward overwrites. Returned to autograd, it would
reach the reduce through AccumulateGrad: copied into a fresh tensor when ``.grad`` is unset (then
the reduce reads a new address every step and cannot replay as a graph), or added into a
persistent gradient buffer (an extra pass, the buffer's zeroing, and the buffer's memory for
good). So the graph offers these gradients to their unit instead (``receive``), and the unit's
reduce reads the static buffers themselves: fixed addresses, no copy, no buffer.

A static buffer lives in the graphs' shared pool and holds its value only until the pool's next
forward replay, whose temporaries may reuse its memory (graphs sharing a pool replay in capture
order, and every forward was captured before every backward). Autograd copied it at once; the
reduce reads it later, on its own stream. The backward graphs replayed after it were captured
after it, while it was alive, so they never write it; a forward replay inside the backward (an
activation-checkpoint recompute) is refused (``GraphedCallable``: it would overwrite it before the
unit's reduce, perhaps not yet queued, reads it); and at the end of every backward, before any
later forward, the compute stream waits for every reduce (as it does after a failed step, at the
next forward).

A unit takes its gradients this way only for a whole synchronised backward whose graphs cover all
its trainable parameters (``cover``, at graph construction): while ``no_sync`` accumulates, the
graph's gradients go to autograd as before, into the accumulation buffer's views; so they do in a
backward that accumulates no gradient into some of the parameters (``torch.autograd.grad`` of the
inputs, ``backward(inputs=...)``: the graph layer asks autograd which it will accumulate). A parameter a
graph reads is covered only where every module holding it lies inside that graph, so no other
module adds a gradient to it in the same backward (whose order of summation the graph's would
change); one that still gets a gradient from elsewhere (a functional use) is summed with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class GraphGradients:
    def __init__(self, params: list) -> None:
        self.params = params  # the unit's ShardedParams
        self.covered: set[int] = set()  # parameter indices some graph's backward hands over
        self.taken: dict[int, torch.Tensor] | None = None  # this backward's handed gradients, while open

    def cover(self, unsharded: Sequence[torch.Tensor], modules: Iterable) -> list[int]:
        """At graph construction: which of ``unsharded`` (a graph's parameters, in its order) the graph
        may hand over, as this unit's parameter indices (-1: not handed). ``modules``: every module
        inside the graph."""
        inside = {id(m) for m in modules}
        index = {id(p.unsharded): i for i, p in enumerate(self.params) if p.unsharded is not None}
        found = []
        for param in unsharded:
            i = index.get(id(param), -1)
            if i >= 0 and not all(id(module) in inside for module, _ in self.params[i].refs):
                i = -1  # held by a module outside the graph too (a tie): autograd sums its gradients
            found.append(i)
        self.covered.update(i for i in found if i >= 0)
        return found

    def open(self, trainable: Sequence[int], accumulate: bool) -> bool:
        """At the unit's pre-backward: take this backward's gradients from its graphs, if they cover it."""
        take = not accumulate and bool(self.covered) and self.covered.issuperset(trainable)
        self.taken = {} if take else None
        return take

    def receive(self, indices: Sequence[int], grads: Sequence[torch.Tensor]) -> bool:
        """A graph's backward offers these parameters' gradients (its static buffers); False: returned
        to autograd instead (the unit does not take gradients from graphs in this backward)."""
        taken = self.taken
        if taken is None:
            return False
        for i, grad in zip(indices, grads):
            if i in taken:  # (cover admits one graph per parameter, and a graph one backward per forward)
                raise RuntimeError(
                    f"parameter '{self.params[i].name}' was handed a gradient twice in one backward; its first "
                    "gradient may be overwritten already. This is a bug in fsdp_graph: please report it.")
            taken[i] = grad
        return True

    def gradient(self, i: int) -> torch.Tensor | None:
        """Parameter ``i``'s gradient of this backward: handed, or left by autograd in ``.grad``, or
        their sum; None if neither."""
        handed = self.taken.get(i) if self.taken else None
        grad = self.params[i].unsharded.grad
        if handed is None or grad is None:
            return grad if handed is None else handed
        return grad + handed

    def got(self, i: int) -> bool:
        return self.taken is not None and i in self.taken

    def close(self) -> None:
        self.taken = None
