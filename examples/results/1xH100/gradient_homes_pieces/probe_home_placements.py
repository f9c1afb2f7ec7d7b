"""Probe (kept with its results): per-layer graphs with the units' sharded gradients homed in the graphs'
pool, placed in different ways (HOMES=none|lag0|lag0r|lag1|lag2|last), to see which keeps the pool
from growing. lag1/lag2/last are memory-only probes (their reduces race with later backward
graphs: losses meaningless). Prints the pool's size after the capture."""
import os
import sys

sys.path.insert(0, "examples")
import torch

import fsdp_graph.graphs.capture as cap
from fsdp_graph.fsdp.capture_interface import GradHomes, enclosing_unit
from fsdp_graph.graphs.gradient_homes import home_gradients

MODE = os.environ.get("HOMES", "none")
KEEP = []


def _pool_bytes():
    return _pool_state()[0]


def _pool_state():
    total = alloc = biggest = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("segment_pool_id", (0, 0)) != (0, 0):
            total += seg["total_size"]
            alloc += seg["allocated_size"]
            for b in seg["blocks"]:
                if b["state"] == "inactive":
                    biggest = max(biggest, b["size"])
    return total, alloc, biggest


def _show(tag):
    t, a, b = _pool_state()
    print(f"[probe {MODE}] {tag}: pool {t / 2**20:.0f} MiB, allocated {a / 2**20:.0f}, largest free {b / 2**20:.0f}",
          flush=True)


def capture_pass(calls, links, forward_only, pool=None, stream=None, capturing=True):
    passes = []
    for i, call in enumerate(calls):
        chained = cap.chained_sources(links[i], cap._tensors(passes[-1])[0]) if links and i else None
        passes.append(cap.forward_pass(call, call.fwd_graph if capturing else None, pool, stream, chained))
    backwards = [None] * len(calls)
    homes = GradHomes()
    lag = {"lag0": 0, "lag0r": 0, "lag0s": 0, "pieces": 0, "lag1": 1, "lag2": 2, "last": 10**6}.get(MODE)
    pending = []
    units = [enclosing_unit(c.module) if c.module is not None else None for c in calls]
    print(f"[probe {MODE}] pool before backward captures {_pool_bytes() / 2**30:.3f} GiB", flush=True)
    for i in reversed(range(len(calls))):
        if forward_only:
            break
        chained = cap._gradients_of_chained(passes, backwards, links, i) if links else None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        backwards[i] = cap.backward_pass(calls[i], passes[i], calls[i].bwd_graph if capturing else None, pool, stream,
                                         chained)
        need = torch.cuda.max_memory_allocated() - before
        if i in (20, 19, 18):
            _show(f"after backward capture {i} (need {need / 2**20:.0f} MiB)")
        if MODE.endswith("s"):
            torch.cuda.synchronize()
            if i in (20, 19, 18):
                _show(f"after backward capture {i}, synchronised")
        if not capturing or lag is None or units[i] is None:
            continue
        pending.append(units[i])
        ready = pending[:max(0, len(pending) - lag)] if i > 0 else pending
        pending = pending[len(ready):] if i > 0 else []
        reserve = None
        if MODE == "lag0r":
            torch._C._cuda_beginAllocateCurrentThreadToPool(stream.device.index, pool)
            try:
                with torch.cuda.stream(stream):
                    reserve = torch.empty(need, dtype=torch.uint8, device=stream.device)
            finally:
                torch._C._cuda_endAllocateToPool(stream.device.index, pool)
                torch._C._cuda_releasePool(stream.device.index, pool)
        if ready and MODE == "pieces":
            torch._C._cuda_beginAllocateCurrentThreadToPool(stream.device.index, pool)
            try:
                with torch.cuda.stream(stream):
                    for unit in ready:
                        for view in unit.grads.sharded.layout.local_views(unit.grads.sharded._like):
                            KEEP.append(torch.empty_like(view))
            finally:
                torch._C._cuda_endAllocateToPool(stream.device.index, pool)
                torch._C._cuda_releasePool(stream.device.index, pool)
        elif ready:
            home_gradients(ready, homes, pool, stream)
        del reserve
        if i in (20, 19, 18):
            _show(f"after homes {i}")
        if i % 6 == 0:
            print(f"[probe {MODE}] after backward {i}: pool {_pool_bytes() / 2**30:.3f} GiB, "
                  f"need {need / 2**20:.0f} MiB", flush=True)
    print(f"[probe {MODE}] pool after capture {_pool_bytes() / 2**30:.3f} GiB", flush=True)
    return passes, backwards


cap.capture_pass = capture_pass
import benchmark  # noqa: E402

benchmark.main()
