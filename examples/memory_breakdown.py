"""Where a system's peak GPU memory goes, from torch.cuda.memory's allocation trace.

For the benchmark's ``--memory``: the system is built and run for a few steps while the CUDA
allocator records every allocation and free with its Python stack. Replaying that trace gives the
moment of the peak and the blocks alive at it; each block is put in one category:

* by the tensor it backs at the end of the run (address match): the parameters (the sharded
  masters), their gradients, the optimizer state;
* by its memory pool: the private pool of a CUDA graph (the captured step's activations and
  temporaries);
* by the Python frames that allocated it: fsdp_graph's persistent unsharded parameter and
  gradient buffers and its collective staging, FSDP2's unsharded parameters and collective
  buffers, the model's forward (activations), the backward (no Python frame: autograd's
  gradients and temporaries).

One method for every system, FSDP2 included, reading only torch's allocator, the model's
parameters and the optimizer's state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

MASTERS = "parameters (the sharded fp32 masters; floor: the whole bf16 model)"
SHARDED_GRADS, OPT_STATE = "gradients (sharded, fp32; floor: whole, bf16)", "optimizer state"
STAGING = "collective staging (fsdp_graph: shared and persistent, or a wide unit's own)"
BUFFERS = "unsharded parameter and gradient buffers (persistent, fsdp_graph)"
GRAPH_POOL = "CUDA graph pool (the captured step's activations and temporaries)"
FRAME_RULES = (  # (substring of a frame's file, function name or None, category); first frame that matches wins
    ("fsdp_graph/fsdp/buffers.py", "allocate_staging", STAGING),
    ("fsdp_graph/fsdp/param_group.py", "_issue_unshard", STAGING),  # a wide unit's own, per all-gather
    ("fsdp_graph/fsdp/gradients.py", "_reduce", STAGING),  # ... per reduce-scatter
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


def graph_pool_bytes() -> tuple[int, int]:
    """(size, allocated) in bytes of the CUDA graphs' private pools now."""
    pools = _private_pool_segments(torch.cuda.memory._snapshot())
    return sum(s["total_size"] for s in pools), sum(s["allocated_size"] for s in pools)


def _by_frames(frames: list[dict]) -> str:
    for frame in frames:
        for file_part, function, category in FRAME_RULES:
            if file_part in frame["filename"] and (function is None or frame["name"] == function):
                return category
    return FORWARD if frames else BACKWARD


def _live_at_peak(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """The largest sum of live allocations in the trace, and the allocations alive then."""
    def replay(stop: int | None):
        live, total, best, best_at = {}, 0, -1, 0
        for i, event in enumerate(trace):
            if stop is not None and i > stop:
                break
            action, addr = event["action"], event["addr"]
            if action == "alloc":
                live[addr] = event
                total += event["size"]
                if total > best:
                    best, best_at = total, i
            elif action in ("free_requested", "free_completed") and addr in live:
                total -= live.pop(addr)["size"]
        return best, best_at, live

    best, best_at, _ = replay(None)
    _, _, live = replay(best_at)
    return best, live


def breakdown(run: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer | None]]) -> dict:
    """Run ``run()`` (build a system and train a few steps; returns its model and optimizer) with
    the allocator recording, and return {"peak_gib", "categories": {category: GiB}} at the peak."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        model, optimizer = run()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    by_storage = _storage_categories(model, optimizer)
    pools = _graph_pool_segments(snapshot)
    peak, live = _live_at_peak(trace)
    categories: dict[str, float] = defaultdict(float)
    for addr, event in live.items():
        if addr in by_storage:
            category = by_storage[addr]
        elif any(lo <= addr < hi for lo, hi in pools):
            category = GRAPH_POOL
        else:
            category = _by_frames(event.get("frames", []))
        categories[category] += event["size"] / 2**30
    return {"peak_gib": peak / 2**30,
            "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1]))}
