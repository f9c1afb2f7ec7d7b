"""Run code around every graph replay (for host-time measurements), like ``fsdp.introspect.watch_steps``."""

from __future__ import annotations

from ..fsdp.introspect import Watcher, watch_methods
from .graphed_callable import GraphedCallable, _Replay

REPLAYS = (
    (GraphedCallable, "__call__", "graph_forward", lambda args: args[0]),  # checks, input copy, replay
    (_Replay, "backward", "graph_backward", lambda args: args[0].runner),  # gradient copy, replay
)


def watch_replays(before: Watcher | None = None, after: Watcher | None = None):
    """Around every graphed forward call and backward replay: ``before(kind, graphed_callable)`` /
    ``after(kind, graphed_callable)``, ``kind`` being ``graph_forward`` or ``graph_backward``."""
    return watch_methods(list(REPLAYS), before, after)
