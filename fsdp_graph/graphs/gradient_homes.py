"""Each unit's sharded gradients homed in its graphs' pool, right after its backward capture.

Per-layer and segment captures record backwards in reverse order. Once the backward of a unit's
graph is captured (per layer: its first module's, ``capture._homing``; a segment: the unit's
segment's), the pool's free memory is what the graphs captured so far use only between
the next forward and that backward (the later blocks' activations, every forward's temporaries),
so the unit's gradient buffer, live from its reduce to the optimizer step, is taken from there
(``fsdp/grad_homes.py`` says why and what keeps it safe). A root that reduces in pieces between the
graphs (``replayable_roots``) reduces after every graph's backward: it is homed after the last
capture, and each piece's write then replays with its reduce-scatter. Routing an allocation into a graph pool
outside a capture uses torch's private binding, as ``torch.cuda.use_mem_pool`` and inductor's
CUDA graph trees do; where it is missing the gradients stay where they were.
"""

from __future__ import annotations

import torch

from ..fsdp.capture_interface import FSDPUnit, GradHomes


def home_gradients(units: list[FSDPUnit], homes: GradHomes, pool, stream: torch.cuda.Stream) -> None:
    """Take each unit's gradient buffer from ``pool`` (on the capture ``stream``, whose freed blocks
    the allocator hands out), for units with trainable parameters."""
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    units = [u for u in units if u.grads.trainable]
    if not units or begin is None or end is None or release is None:
        return
    device = stream.device.index
    with torch.cuda.stream(stream):
        begin(device, pool)
        try:
            for unit in units:
                unit.grads.sharded.set_home(homes)
        finally:
            end(device, pool)
            release(device, pool)
