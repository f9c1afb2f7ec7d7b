"""Host time of fsdp_graph's per-layer hot path: each FSDP unit step and each graph replay.

A CUDA-graphed layer is fast only if the host issues it faster than the GPU runs it. This
wraps the unit's four steps and the graphed callable's forward/backward with wall-clock
timers (host time only: the GPU work they launch runs asynchronously), for the benchmark's
``--hot-path`` report. The timers add a little overhead of their own, so they run on extra
steps, never on the timed ones.
"""

from __future__ import annotations

import time
from collections import defaultdict

from fsdp_graph.graphed_callable import GraphedCallable, _Replay
from fsdp_graph.unit import FSDPUnit

TARGETS = (
    (FSDPUnit, "pre_forward", "unit.pre_forward (unshard)"),
    (FSDPUnit, "post_forward", "unit.post_forward (reshard)"),
    (FSDPUnit, "pre_backward", "unit.pre_backward (unshard, zero grads)"),
    (FSDPUnit, "post_backward", "unit.post_backward (reduce-scatter)"),
    (GraphedCallable, "__call__", "graph forward (checks, input copy, replay)"),
    (_Replay, "backward", "graph backward (grad copy, replay)"),
)


class HotPathTimer:
    def __init__(self) -> None:
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self._originals = []

    def start(self) -> None:
        for owner, attr, label in TARGETS:
            original = owner.__dict__[attr]
            function = original.__func__ if isinstance(original, staticmethod) else original

            def timed(*args, _function=function, _label=label, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _function(*args, **kwargs)
                finally:
                    self.total[_label] += time.perf_counter() - t0
                    self.calls[_label] += 1

            setattr(owner, attr, staticmethod(timed) if isinstance(original, staticmethod) else timed)
            self._originals.append((owner, attr, original))

    def stop(self) -> None:
        for owner, attr, original in reversed(self._originals):
            setattr(owner, attr, original)
        self._originals.clear()

    def per_call_us(self) -> dict[str, dict]:
        return {
            label: {"calls": self.calls[label], "us_per_call": 1e6 * self.total[label] / self.calls[label]}
            for label in self.total
        }
