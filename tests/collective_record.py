"""A per-rank record of the last collectives issued, so that a hung test says where each rank waits.

The test harness installs it in every rank (``record_collectives``). It wraps the package's three
collectives where the engine calls them, and torch.distributed's own (DCP, tests), and notes for
each call: which collective, over how many ranks, on what tensor, in which unit and step of the
package (found on the calling frames), and whether it returned. ``dump`` writes the record; the
harness calls it on a timer just before it kills a hung rank, beside the rank's Python stacks.
Test code only: the package's hot path carries nothing of this.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
import time

import torch
import torch.distributed as dist

_PACKAGE_SITES = {  # module -> names it imported from fsdp_graph.fsdp.collectives
    "fsdp_graph.fsdp.param_group": ("all_gather_inplace",),
    "fsdp_graph.fsdp.unit_reduce": ("reduce_scatter_sum", "all_reduce"),
    "fsdp_graph.fsdp.clip_grad": ("all_reduce",),
}
_TORCH = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "broadcast", "barrier",
          "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


class CollectiveRecord:
    def __init__(self, keep: int = 12) -> None:
        self.entries: collections.deque = collections.deque(maxlen=keep)
        self.count = 0
        self.started = time.monotonic()

    def wrap(self, name: str, fn, group_arg: int | None = None):
        """``group_arg``: the position of the package function's process-group argument (None there
        means no collective: world size 1, or no HSDP replicas)."""

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            group = kwargs.get("group", args[group_arg] if group_arg is not None and len(args) > group_arg else None)
            if group_arg is not None and group is None:
                return fn(*args, **kwargs)
            self.count += 1
            entry = {"n": self.count, "collective": name, "at_s": round(time.monotonic() - self.started, 2),
                     "where": _where(), "tensor": _describe(args), "returned": False}
            self.entries.append(entry)
            result = fn(*args, **kwargs)
            entry["returned"] = True
            return result

        return recorded

    def lines(self) -> list[str]:
        if not self.entries:
            return ["no collective issued"]
        return [f"#{e['n']} {e['collective']} {e['tensor']} in {e['where']} at {e['at_s']}s: "
                f"{'returned' if e['returned'] else 'STARTED, NOT RETURNED'}" for e in self.entries]

    def dump(self, path: str) -> None:
        with open(path, "w") as fh:
            fh.write("\n".join(self.lines()) + "\n")


def _describe(args) -> str:
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return "" if tensor is None else f"[{tensor.numel()} x {str(tensor.dtype).replace('torch.', '')}]"


def _where() -> str:
    """The innermost unit step of the package on the calling frames ("unit blocks.1 (Block), pre_forward"),
    else the nearest caller outside this file and torch.distributed."""
    frame = sys._getframe(2)
    inner = fallback = None
    while frame is not None:
        code, module = frame.f_code, frame.f_globals.get("__name__", "")
        in_engine = module.startswith("fsdp_graph.fsdp.")
        name = getattr(frame.f_locals.get("self"), "name", None) if in_engine else None
        if in_engine and isinstance(name, str):
            if module == "fsdp_graph.fsdp.unit":  # the unit's step (pre_forward, post_backward, ...)
                return f"unit {name}, {code.co_name}"
            inner = inner or f"unit {name}, {code.co_name}"
        elif fallback is None and not in_engine and not module.startswith(("torch.distributed", __name__)):
            fallback = f"{module}.{code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return inner or fallback or "?"


def _record_replays(record: CollectiveRecord) -> None:
    """A unit step replayed as a graph (``collective_graphs.py``) issues its collective without
    calling the functions above: note the replay (or capture) of the body by its name instead."""
    from fsdp_graph.fsdp.collective_graphs import CollectiveGraphs

    run = CollectiveGraphs.run

    @functools.wraps(run)
    def recorded_run(self, name, key, body):
        return record.wrap(f"graph of {name}", lambda *_: run(self, name, key, body))()

    CollectiveGraphs.run = recorded_run


def record_collectives(path: str, dump_after_s: float) -> CollectiveRecord:
    """Install the record in this process; it is written to ``path`` after ``dump_after_s`` seconds
    (a rank still running then is about to be reported as hung)."""
    import importlib
    import inspect

    record = CollectiveRecord()
    for module_name, names in _PACKAGE_SITES.items():
        module = importlib.import_module(module_name)
        for name in names:
            fn = getattr(module, name)
            group_arg = list(inspect.signature(fn).parameters).index("group")
            setattr(module, name, record.wrap(name, fn, group_arg))
    for name in _TORCH:
        setattr(dist, name, record.wrap(f"torch.distributed.{name}", getattr(dist, name)))
    _record_replays(record)
    timer = threading.Timer(dump_after_s, record.dump, args=(path,))
    timer.daemon = True
    timer.start()
    return record
