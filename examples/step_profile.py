"""Where a step's GPU time goes: kernel time by kind, from a torch.profiler trace.

For the benchmark's ``--profile``: what separates a whole-step graph from the floor is GPU time
(its host time is ~0), so the question is which kernels run besides the floor's forward and
backward, and how much of the communication hides behind compute. Kernels are grouped by name;
``exposed`` is the step time not covered by compute-stream kernels (communication or gaps the
compute waits on). Copies between device and host memory (activation offload's, or a step's own)
are a kind of their own, ``host_copy`` their time, and ``host_copy_hidden`` the part of it during
which compute kernels ran (the offload's overlap, read off the trace). They do not count as compute
(before 2026-11-24 they did: ``exposed`` of a step without offload is now its own copies larger,
about 0.5 ms on medium).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import torch

HOST_COPIES = "host copies (DtoH / HtoD)"
KINDS = (  # first match wins
    ("nccl (all-gather, reduce-scatter)", ("nccl",)),
    (HOST_COPIES, ("memcpy dtoh", "memcpy htod")),  # the profiler's "Memcpy DtoH (Device -> Pinned)" and back
    ("optimizer (multi-tensor AdamW)", ("multi_tensor", "adam")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90", "sm100", "cublas")),
    ("copy / cast / fill", ("copy", "fill", "cast", "memset", "memcpy")),
)


TOP_KERNELS, MAX_NAME = 12, 110  # the heaviest kernels by name, names cut to this length


def covered_us(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Total length of ``intervals`` that lies inside the union of ``cover`` (each a (start, end))."""
    merged: list[list[float]] = []
    for start, end in sorted(cover):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = [m[0] for m in merged]
    total = 0.0
    for start, end in intervals:
        i = max(bisect.bisect_right(starts, start) - 1, 0)  # the first merged interval that can overlap
        while i < len(merged) and merged[i][0] < end:
            total += max(0.0, min(end, merged[i][1]) - max(start, merged[i][0]))
            i += 1
    return total


def _kind(name: str) -> str:
    lower = name.lower()
    for kind, keys in KINDS:
        if any(k in lower for k in keys):
            return kind
    return "other elementwise / reductions"


def kernel_breakdown(step, batches, steps: int = 5) -> dict:
    """Run ``step`` on ``batches[:steps]`` under the profiler; per step: ms of kernel time by kind,
    the wall time, and the part of it not covered by compute kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    compute_us, start, end = 0.0, None, None
    copies, computes = [], []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.time_range.elapsed_us() <= 0:
            continue
        us = event.time_range.elapsed_us()
        kind = _kind(event.name)
        by_kind[kind] += us
        by_name[event.name] += us
        span = (event.time_range.start, event.time_range.end)
        if kind == HOST_COPIES:
            copies.append(span)
        elif not kind.startswith("nccl"):
            compute_us += us
            computes.append(span)
        start = event.time_range.start if start is None else min(start, event.time_range.start)
        end = event.time_range.end if end is None else max(end, event.time_range.end)
    if start is None:
        return {"note": "the profiler recorded no kernels (CUPTI unavailable?)"}
    wall_ms = (end - start) / 1e3 / steps
    per_step = {kind: us / 1e3 / steps for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    record = {"kernel_ms_per_step": per_step, "gpu_span_ms_per_step": wall_ms,
              "top_kernels_ms_per_step": {name[:MAX_NAME]: us / 1e3 / steps for name, us in top},
              "exposed_ms_per_step": max(wall_ms - compute_us / 1e3 / steps, 0.0)}
    if copies:
        record["host_copy_ms_per_step"] = sum(e - s for s, e in copies) / 1e3 / steps
        record["host_copy_hidden_ms_per_step"] = covered_us(copies, computes) / 1e3 / steps
    return record
