"""Host cost of what ShardedGrads.accumulate does with no write (set 12 masters' .grad), on CPU and
CUDA tensors, plain and DTensor, and a pure-Python baseline: is the H200 host slow, or CUDA's setter?
Run: torchrun --standalone --nproc-per-node 1 setter_probe.py"""
import os
import platform
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
N, REPS = 12, 2000

def per_call(fn, reps=REPS):
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6

def baseline():
    s = 0
    for i in range(1000):
        s += i * i
    return s

rows = [("pure Python, 1000-iteration loop", per_call(baseline))]
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for dev in devices:
    mesh = init_device_mesh(dev, (1,))
    flat = torch.zeros(N * 1000, device=dev)
    views = [flat[i * 1000:(i + 1) * 1000] for i in range(N)]
    params = [torch.nn.Parameter(torch.zeros(1000, device=dev)) for _ in range(N)]
    dparams = [torch.nn.Parameter(DTensor.from_local(torch.zeros(1000, device=dev), mesh, [Shard(0)]))
               for _ in range(N)]
    dviews = [DTensor.from_local(v, mesh, [Shard(0)]) for v in views]
    def set_plain():
        for p, v in zip(params, views):
            p.grad = v
        for p in params:
            p.grad = None
    def set_dtensor():
        for p, v in zip(dparams, dviews):
            p.grad = v
        for p in dparams:
            p.grad = None
    def read_dtensor():
        return [p.grad for p in dparams]
    def data_ptr():
        return [v.data_ptr() for v in views]
    def empty_like():
        return torch.empty_like(flat)
    def narrow():
        return flat.narrow(0, 5, 100)
    def launch():
        flat.add_(1.0)
    rows += [(f"{dev}: set and clear .grad of {N} plain parameters", per_call(set_plain)),
             (f"{dev}: set and clear .grad of {N} DTensor parameters", per_call(set_dtensor)),
             (f"{dev}: read .grad of {N} DTensor parameters", per_call(read_dtensor)),
             (f"{dev}: data_ptr of {N} views", per_call(data_ptr)),
             (f"{dev}: empty_like (48 KB)", per_call(empty_like)),
             (f"{dev}: narrow", per_call(narrow)),
             (f"{dev}: one add_ (launch)", per_call(launch))]
    if dev == "cuda":
        torch.cuda.synchronize()
print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
try:
    print([line for line in open('/proc/cpuinfo') if line.startswith('model name')][0].strip())
except Exception:
    pass
for name, us in rows:
    print(f"| {name} | {us:.2f} µs |")
dist.destroy_process_group()
