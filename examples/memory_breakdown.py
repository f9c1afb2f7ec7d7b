"""Where a system's peak GPU memory goes, from torch.cuda.memory's allocation trace.

For the benchmark's ``--memory``: the system is built and run for a few steps while the CUDA
allocator records every allocation and free with its Python stack. Replaying that trace gives the
moment of the peak of (the blocks alive outside the CUDA graphs' private pools + the pools' size:
a pool is used whole by every replay, whether or not a tensor is allocated in it now) and the
blocks alive then; each block outside the pools is put in one category:

* by the tensor it backs at the end of the run (address match): the parameters (the sharded
  masters), their gradients, the optimizer state;
* as a cuBLAS workspace: a block that ``release_cublas_workspaces`` freed at the end of the run
  (cuBLAS keeps one per thread and stream for the process's life, allocated by the first matmul
  there: otherwise counted as that matmul's activation, or as autograd's for the backward thread);
* by the Python frames that allocated it: the graphs' static inputs and gradient buffers,
  fsdp_graph's persistent unsharded parameter and gradient buffers and its collective staging,
  FSDP2's unsharded parameters and collective buffers, the model's forward (activations), the
  backward (autograd's gradients and temporaries: no Python frame on autograd's thread, torch's
  ``_engine_run_backward`` innermost where the backward runs on the calling thread, as in this
  package's warm-ups and captures).

The pools are one category, and are opened separately at the moment they held the most: what was
alive in them by kind (a forward graph's saved activations and outputs, a backward graph's
gradients and temporaries) and by allocation site; the rest of their size was free then.

One method for every system, FSDP2 included, reading only torch's allocator, the model's
parameters and the optimizer's state.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable

import torch

MASTERS = "parameters (the sharded fp32 masters; floor: the whole bf16 model)"
SHARDED_GRADS, OPT_STATE = "gradients (sharded, fp32; floor: whole, bf16)", "optimizer state"
STAGING = "collective staging (fsdp_graph: shared and persistent, or a wide unit's own)"
BUFFERS = "unsharded parameter and gradient buffers (persistent, fsdp_graph)"
GRAPH_POOL = "CUDA graph pool (the captured step's activations and temporaries)"
STATICS = "graphs' static inputs and gradient buffers (outside the pool)"
INNERMOST_RULES = (  # (file, function, category) of the innermost frame (or the one around a comprehension)
    ("fsdp_graph/graphs/capture.py", "static_copy", STATICS),
    ("fsdp_graph/graphs/capture.py", "backward_pass", STATICS),  # (the static gradient outputs)
    ("fsdp_graph/graphs/segment_graphs.py", "_warm_up_and_capture", STATICS),  # (its gradient outputs)
    ("fsdp_graph/graphs/segment_graphs.py", "_park", STAGING),  # (the reduced shards, until accumulated)
)
FRAME_RULES = (  # (substring of a frame's file, function name or None, category); first frame that matches wins
    ("fsdp_graph/fsdp/buffers.py", "allocate_staging", STAGING),
    ("fsdp_graph/fsdp/param_group.py", "_issue_unshard", STAGING),  # a wide unit's own, per all-gather
    ("fsdp_graph/fsdp/unit_reduce.py", "whole", STAGING),  # ... per reduce-scatter (where not in pieces)
    ("fsdp_graph/fsdp/buffers.py", None, BUFFERS),
    ("fsdp_graph/fsdp/gradients.py", "_accumulation_buffer", BUFFERS),  # no_sync's sum
    ("fsdp_graph/fsdp/sharded_grads.py", None, SHARDED_GRADS),
    ("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", None, "unsharded parameters (FSDP2)"),
    ("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", None,
     "collective buffers and sharded gradients (FSDP2)"),
    ("torch/optim/", None, OPT_STATE),
    ("fsdp_graph/fsdp/", None, "other fsdp_graph engine allocations"),
    ("torch/distributed/fsdp/", None, "other FSDP2 allocations"),
)
FORWARD, BACKWARD = "activations and forward temporaries", "backward: gradients and temporaries (autograd)"
WORKSPACES = "cuBLAS workspaces (one per thread and stream that ran a matmul; a capture stream's kept by its graphs)"


def _storage_categories(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[int, str]:
    """Storage address -> category for the tensors alive at the end of the run."""
    found: dict[int, str] = {}

    def note(t, category):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            local = t.to_local() if hasattr(t, "to_local") else t
            found.setdefault(local.untyped_storage().data_ptr(), category)

    for p in model.parameters():
        note(p.detach(), MASTERS)
        if p.grad is not None:
            note(p.grad, SHARDED_GRADS)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                note(value, OPT_STATE)
    return found


def _private_pool_segments(snapshot: dict) -> list[dict]:
    """The allocator's segments that belong to a CUDA graph's private pool."""
    return [s for s in snapshot["segments"] if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]


def _graph_pool_segments(snapshot: dict) -> list[tuple[int, int]]:
    return [(s["address"], s["address"] + s["total_size"]) for s in _private_pool_segments(snapshot)]


def graph_pool_ids() -> set[tuple[int, int]]:
    """The ids of the CUDA graphs' private pools that hold memory now."""
    return {tuple(s["segment_pool_id"]) for s in _private_pool_segments(torch.cuda.memory._snapshot())}


def graph_pool_bytes(exclude: set[tuple[int, int]] = frozenset()) -> tuple[int, int]:
    """(size, allocated) in bytes of the CUDA graphs' private pools now, but those of ``exclude``."""
    pools = [s for s in _private_pool_segments(torch.cuda.memory._snapshot())
             if tuple(s["segment_pool_id"]) not in exclude]
    return sum(s["total_size"] for s in pools), sum(s["allocated_size"] for s in pools)


def _from_autograd(frames: list[dict]) -> bool:
    """Allocated by autograd's engine: on its own thread (no Python frame), or on the calling thread
    (innermost frame torch's ``_engine_run_backward``), as this package's warm-ups and captures run
    the backward (one cuBLAS workspace per capture stream)."""
    return not frames or frames[0]["name"] == "_engine_run_backward"


def _by_frames(frames: list[dict]) -> str:
    if _from_autograd(frames):
        return BACKWARD
    innermost = frames[:2] if frames and frames[0]["name"].startswith("<") else frames[:1]
    for frame in innermost:
        for file_part, function, category in INNERMOST_RULES:
            if file_part in frame["filename"] and frame["name"] == function:
                return category
    for frame in frames:
        for file_part, function, category in FRAME_RULES:
            if file_part in frame["filename"] and (function is None or frame["name"] == function):
                return category
    return FORWARD


class _Timeline:
    """Walks the allocator's trace, keeping the live blocks outside and inside the CUDA graphs'
    private pools, and the pools' size (their segments made so far): the peak counts a pool whole,
    as the benchmark's peak column does, since replays use all of it."""

    def __init__(self, trace: list[dict], pool_segments: list[tuple[int, int]]) -> None:
        self.ranges = sorted(pool_segments)
        self.starts = [lo for lo, _ in self.ranges]
        # A pool's segment is the last one made at its address (an ordinary segment may have been
        # there before, and given back): the events that made the pools' segments.
        last = {event["addr"]: i for i, event in enumerate(trace) if event["action"] == "segment_alloc"}
        self.pool_births = {last[lo] for lo in self.starts if lo in last}
        self.pool_alive: set[int] = set()  # starts of the pool segments made so far (and not freed)
        self.outside: dict[int, dict] = {}
        self.inside: dict[int, dict] = {}
        self.outside_bytes = self.inside_bytes = self.pool_size = 0

    def _pool_segment_of(self, addr: int) -> int | None:
        """The start of the alive pool segment holding ``addr``."""
        start = self._pool_range_of(addr)
        return start if start in self.pool_alive else None

    def _pool_range_of(self, addr: int) -> int | None:
        """The start of the pool segment (as the run ends) holding ``addr``, alive or not yet."""
        i = bisect.bisect_right(self.starts, addr) - 1
        return self.starts[i] if i >= 0 and addr < self.ranges[i][1] else None

    def step(self, i: int, event: dict) -> None:
        action, addr, size = event["action"], event["addr"], event["size"]
        if i in self.pool_births:
            self.pool_alive.add(addr)
            self.pool_size += size
        elif action == "segment_free" and addr in self.pool_alive:
            self.pool_alive.discard(addr)
            self.pool_size -= size
        elif action in ("segment_map", "segment_unmap") and (start := self._pool_range_of(addr)) is not None:
            # An expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) grows and shrinks
            # by pages at one address range, which belongs to one pool for its life.
            self.pool_alive.add(start)
            self.pool_size += size if action == "segment_map" else -size
        elif action == "alloc":
            if self._pool_segment_of(addr) is not None:
                self.inside[addr] = event
                self.inside_bytes += size
            else:
                self.outside[addr] = event
                self.outside_bytes += size
        elif action in ("free_requested", "free_completed"):
            for live, attr in ((self.outside, "outside_bytes"), (self.inside, "inside_bytes")):
                if addr in live:
                    setattr(self, attr, getattr(self, attr) - live.pop(addr)["size"])

    @property
    def total(self) -> int:
        return self.outside_bytes + self.pool_size


def _replayed(trace: list[dict], pools: list[tuple[int, int]], stop: int) -> _Timeline:
    timeline = _Timeline(trace, pools)
    for i, event in enumerate(trace[: stop + 1]):
        timeline.step(i, event)
    return timeline


def _peaks(trace: list[dict], pools: list[tuple[int, int]]) -> tuple[int, int]:
    """The events after which (live outside the pools + the pools' size) and the pools' own live
    bytes are largest."""
    timeline, best, best_pool, at, at_pool = _Timeline(trace, pools), -1, -1, 0, 0
    for i, event in enumerate(trace):
        timeline.step(i, event)
        if timeline.total > best:
            best, at = timeline.total, i
        if timeline.inside_bytes > best_pool:
            best_pool, at_pool = timeline.inside_bytes, i
    return at, at_pool


def _site(frames: list[dict]) -> str:
    """The innermost frame outside torch: where a block was allocated, for the pool's table."""
    if _from_autograd(frames):
        return "autograd (a backward's gradients and temporaries)"
    for frame in frames:
        if "/torch/" not in frame["filename"]:
            return f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
    return "torch (no frame outside it)"


def _pool_kind(frames: list[dict]) -> str:
    names = {frame["name"] for frame in frames}
    if _from_autograd(frames):
        return "backward graphs: gradients and temporaries (autograd)"
    if names & {"forward_pass", "_run_forward"}:
        return "forward graphs: saved activations and outputs"
    return f"other graphs ({_site(frames)})"


def _top_sites(events, count: int = 12) -> list[dict]:
    """The allocation sites of ``events`` holding the most, with their block counts."""
    sites: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in events:
        site = sites[_site(event.get("frames", []))]
        site[0] += 1
        site[1] += event["size"] / 2**30
    top = sorted(sites.items(), key=lambda kv: -kv[1][1])[:count]
    return [{"site": site, "blocks": n, "gib": gib} for site, (n, gib) in top]


def _pool_contents(timeline: _Timeline) -> dict:
    """At the moment the pools held the most: their size, what was alive by kind and by site."""
    kinds: dict[str, float] = defaultdict(float)
    for event in timeline.inside.values():
        kinds[_pool_kind(event.get("frames", []))] += event["size"] / 2**30
    return {"pool_gib": timeline.pool_size / 2**30, "alive_gib": timeline.inside_bytes / 2**30,
            "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "sites": _top_sites(timeline.inside.values())}


def release_cublas_workspaces() -> None:
    """Free cuBLAS's workspaces (once no graph that captured with them replays again): each system
    then allocates, and is charged, its own, instead of the first system paying for all."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()


def _workspace_allocations(trace: list[dict]) -> set[int]:
    """The ids of the alloc events of the blocks ``release_cublas_workspaces`` freed."""
    last_alloc: dict[int, dict] = {}
    found = set()
    for event in trace:
        if event["action"] == "alloc":
            last_alloc[event["addr"]] = event
        elif event["action"] == "free_requested" and event["addr"] in last_alloc and any(
                frame["name"] == release_cublas_workspaces.__name__ for frame in event.get("frames", [])):
            found.add(id(last_alloc.pop(event["addr"])))
    return found


def breakdown(run: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer | None]]) -> dict:
    """Run ``run()`` (build a system and train a few steps; returns its model and optimizer) with
    the allocator recording, and return, at the peak of (live outside the graph pools + the pools'
    size): {"peak_gib", "categories": {category: GiB}, "peak_site"}, and "pool": the pools at their
    fullest (what was alive in them, by kind and by allocation site) when there are any."""
    release_cublas_workspaces()  # (so the system's own are allocated, and seen, while recording)
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        model, optimizer = run()
        release_cublas_workspaces()  # (their frees name them in the trace; no empty_cache: the pools stay listed)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return categorized(snapshot["device_traces"][torch.cuda.current_device()], _graph_pool_segments(snapshot),
                       _storage_categories(model, optimizer))


def categorized(trace: list[dict], pools: list[tuple[int, int]], by_storage: dict[int, str]) -> dict:
    """``breakdown``'s result from a trace, the pools' segments and the storages' categories."""
    at, at_pool = _peaks(trace, pools)
    timeline = _replayed(trace, pools, at)
    workspaces = _workspace_allocations(trace)
    categories: dict[str, float] = defaultdict(float)
    for addr, event in timeline.outside.items():
        category = by_storage.get(addr) or (
            WORKSPACES if id(event) in workspaces else _by_frames(event.get("frames", [])))
        categories[category] += event["size"] / 2**30
    if timeline.pool_size:
        categories[GRAPH_POOL] += timeline.pool_size / 2**30
    result = {"peak_gib": timeline.total / 2**30,
              "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
              "peak_site": _site(trace[at].get("frames", [])) if trace else None,
              "outside_sites": _top_sites(e for a, e in timeline.outside.items()
                                          if a not in by_storage and id(e) not in workspaces)}
    if pools:
        result["pool"] = _pool_contents(_replayed(trace, pools, at_pool))
        result["pool"]["pools_gib_at_end"] = _replayed(trace, pools, len(trace) - 1).pool_size / 2**30
    return result
