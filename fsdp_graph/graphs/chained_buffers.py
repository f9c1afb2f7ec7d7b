"""Chained static buffers: a graphed module reads its input where the previous one wrote its output.

A captured module reads fixed addresses, so each graph used to keep a static copy of its input and a
static buffer for the gradient of its output, outside the pool, and copy into both at every replay.
In a chain of blocks (``x = block(x)``) the input of block i *is* the output of block i-1, which
lives in the pool anyway, and the gradient of block i-1's output *is* the gradient block i's
backward wrote for its input. So, where the example forward shows that identity
(``record_sample_args`` finds it: the very tensor object, before any hook could replace it), the
capture makes block i's static input an alias of block i-1's static output, and block i-1's static
gradient output an alias of block i's static input gradient. A replay then finds the live tensor
already in place (no copy), and the two activation-sized buffers per block are gone (medium GPT:
2 × 24 × 8 MiB).

What a chain must not do silently: overwrite an output someone still reads. So a chained input
must be the previous graph's output in place (same address and strides): a call that passes
another tensor is refused rather than copied over that output (an alias made with ``.detach()``
would leave no trace to check), and so is a forward replay of the previous graph while the chained
graph's backward, which reads that output, is pending. A model whose code between the blocks
changes from call to call captures with ``GraphConfig(chain_static_buffers=False)``
(``graph_modules(chained_inputs=None)``).

Segment graphs (``graph_segments``) chain the same way at their boundaries: a segment's first
input is read where the previous segment's last block wrote its output, and that output's gradient
where the segment's backward wrote its input's (inside a segment, each block already feeds the
next within the graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

Links = list[list[tuple[int, int]]]  # per module: (its input tensor, the previous module's output tensor) pairs


class SampleCalls(list):
    """``record_sample_args``' result: one ``(args, kwargs)`` per module, and ``links``: per module, the
    pairs (index among its input tensors, index among the previous module's output tensors) that
    were the same tensor object in the example forward."""

    links: Links


def tensors_of(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class LinkRecorder:
    """Hooks for one example forward: each module's first output (held, so no later tensor can
    reuse its memory and look the same) against the next module's first input."""

    def __init__(self, count: int) -> None:
        self.outputs: list[list[torch.Tensor] | None] = [None] * count
        self.links: Links = [[] for _ in range(count)]
        self._seen_input = [False] * count

    def note_input(self, i: int, args: tuple, kwargs: dict) -> None:
        if self._seen_input[i]:
            return
        self._seen_input[i] = True
        previous = self.outputs[i - 1] if i > 0 else None
        if previous:
            self.links[i] = [(j, next(k for k, o in enumerate(previous) if o is x))
                             for j, x in enumerate(tensors_of((args, kwargs))) if any(o is x for o in previous)]

    def output_hook(self, i: int) -> Callable:
        def hook(module: nn.Module, args, output) -> None:
            if self.outputs[i] is None:
                self.outputs[i] = tensors_of(output)
        return hook


def chained_sources(links: list[tuple[int, int]], previous_outputs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Input tensor index -> the previous module's captured output it aliases."""
    return {j: previous_outputs[k] for j, k in links}


def alias_if_fits(sample: torch.Tensor, before_hooks: torch.Tensor, source: torch.Tensor | None) -> torch.Tensor | None:
    """A static input sharing ``source``'s memory (a leaf of its own), or None where a pre-forward
    hook replaced the recorded input (``sample`` is not ``before_hooks`` in place: a cast, say) or
    the capture sees another layout: that input then gets a copy of its own."""
    if source is None or not _in_place(sample, before_hooks) or (
            sample.shape, sample.dtype, sample.device, sample.stride()) != (
            source.shape, source.dtype, source.device, source.stride()):
        return None
    return source.detach().requires_grad_(sample.requires_grad)


def _in_place(after: torch.Tensor, before: torch.Tensor) -> bool:
    return after is before or (after.data_ptr() == before.data_ptr() and after.shape == before.shape
                               and after.stride() == before.stride() and after.dtype == before.dtype)


CHAIN_FIX = "GraphConfig(chain_static_buffers=False), or graph_modules / graph_segments(..., chained_inputs=None)"


def overwrite_refused(consumer: str, input_name: str, producer: str) -> str:
    return (
        f"graphed {consumer}: its input {input_name} is read where graphed {producer} writes its output (chained "
        f"at capture: in the example forward {consumer} received that output itself, so no copy of it is kept). "
        f"This call passes another tensor (or that output with other strides), which would have to be copied over "
        f"{producer}'s output while something may still read it. Pass {producer}'s output to {consumer} unchanged, "
        f"or capture without chaining: {CHAIN_FIX}."
    )


def forward_refused(producer: str, consumer: str) -> str:
    return (
        f"graphed {producer}: its forward would overwrite its output, which graphed {consumer} reads in place "
        f"(chained at capture) and whose backward, still pending, reads again. Run {consumer}'s backward first, "
        f"or capture without chaining: {CHAIN_FIX}."
    )
