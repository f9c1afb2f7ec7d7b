"""Host cost of the CUDA driver calls a per-layer step makes: graph launches of a few sizes, events
(new vs reused), stream waits; the GPU idle, and busy (a long kernel queued first)."""
import os
import threading
import time

import torch

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
s = torch.cuda.Stream()
side = torch.cuda.Stream()
x = torch.randn(256, 256, device=dev)
big = torch.randn(8192, 8192, device=dev)


def graph_of(n):
    g = torch.cuda.CUDAGraph()
    y = x.clone()
    with torch.cuda.stream(s):
        for _ in range(3):
            for _ in range(n):
                y.mul_(1.0)
        s.synchronize()
        with torch.cuda.graph(g, stream=s):
            for _ in range(n):
                y.mul_(1.0)
    torch.cuda.synchronize()
    return g


def timeit(fn, reps=400, busy=False):
    torch.cuda.synchronize()
    if busy:
        for _ in range(20):
            big @ big  # ~20 x 1 ms of GPU work queued
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


graphs = {n: graph_of(n) for n in (1, 10, 50, 200)}
ev = torch.cuda.Event()
cur = torch.cuda.current_stream()
rows = []
for busy in (False, True):
    tag = "busy" if busy else "idle"
    for n, g in graphs.items():
        rows.append((f"graph replay, {n} kernels", tag, timeit(g.replay, 200, busy)))
    rows.append(("torch.cuda.Event() + record", tag, timeit(lambda: torch.cuda.Event().record(side), 400, busy)))
    rows.append(("reused event record", tag, timeit(lambda: ev.record(side), 400, busy)))
    rows.append(("stream.wait_event(reused)", tag, timeit(lambda: cur.wait_event(ev), 400, busy)))
    rows.append(("side.wait_stream(current)", tag, timeit(lambda: side.wait_stream(cur), 400, busy)))
    rows.append(("torch.cuda.current_stream(dev)", tag, timeit(lambda: torch.cuda.current_stream(dev), 400, busy)))
    rows.append(("torch.cuda.set_stream x2", tag,
                 timeit(lambda: (torch.cuda.set_stream(side), torch.cuda.set_stream(cur)), 400, busy)))
    rows.append(("small kernel launch (mul_)", tag, timeit(lambda: x.mul_(1.0), 400, busy)))

# the same from a second thread (autograd's backward runs on one)
out = {}
def on_thread():
    torch.cuda.set_device(dev)
    out["replay 50, other thread"] = timeit(graphs[50].replay, 200)
    out["Event()+record, other thread"] = timeit(lambda: torch.cuda.Event().record(side), 400)
t = threading.Thread(target=on_thread)
t.start()
t.join()
for k, v in out.items():
    rows.append((k, "idle", v))
with open(os.path.join(os.environ.get("OUT", "."), "driver_costs.md"), "w") as fh:
    fh.write(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}\n\n")
    fh.write("| call | GPU | host µs per call |\n|---|---|---|\n")
    for name, tag, us in rows:
        fh.write(f"| {name} | {tag} | {us:.1f} |\n")
print(open(os.path.join(os.environ.get("OUT", "."), "driver_costs.md")).read())
