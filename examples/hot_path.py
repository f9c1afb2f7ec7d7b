"""Host time of fsdp_graph's per-layer hot path: each FSDP unit step and each graph replay.

A CUDA-graphed layer is fast only if the host issues it faster than the GPU runs it. This times
the unit steps and the graphed callables' forward/backward on the wall clock, through the
package's introspection API (``watch_steps``, ``watch_replays``), for the benchmark's
``--hot-path`` report. Host time only: the GPU work they launch runs asynchronously. The timers
add a little overhead of their own, so they run on extra steps, never on the timed ones.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import ExitStack

from fsdp_graph.fsdp.introspect import watch_steps
from fsdp_graph.graphs.introspect import watch_replays

LABELS = {
    "pre_forward": "unit.pre_forward (unshard, prefetch)",
    "post_forward": "unit.post_forward (reshard)",
    "pre_backward": "unit.pre_backward (unshard, zero grads, prefetch)",
    "post_backward": "unit.post_backward (reduce-scatter)",
    "end_backward": "root.end_backward (includes the root's post_backward)",
    "graph_forward": "graph forward (checks, input copy, replay)",
    "graph_backward": "graph backward (grad copy, replay)",
}


class HotPathTimer:
    def __init__(self) -> None:
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self._started: list[float] = []
        self._watching = ExitStack()

    def _before(self, what: str, subject) -> None:
        self._started.append(time.perf_counter())

    def _after(self, what: str, subject) -> None:
        label = LABELS[what]
        self.total[label] += time.perf_counter() - self._started.pop()
        self.calls[label] += 1

    def start(self) -> None:
        self._watching.enter_context(watch_steps(self._before, self._after))
        self._watching.enter_context(watch_replays(self._before, self._after))

    def stop(self) -> None:
        self._watching.close()

    def per_call_us(self) -> dict[str, dict]:
        return {
            label: {"calls": self.calls[label], "us_per_call": 1e6 * self.total[label] / self.calls[label]}
            for label in self.total
        }
