"""Deterministic host timers over the FSDP steps of one system's steady-state steps (rank 0)."""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))
import torch
import benchmark as B
import fsdp_graph
import timers

cfg, system = sys.argv[1], sys.argv[2]
info = fsdp_graph.init_distributed()
env = B.Env(info.rank, info.world_size, info.device)
bench = B.bench_config(cfg)
warmup, steps = 4, 20
batches = B.make_batches(bench, env, warmup + 2 * steps)
step, _ = B.BUILDERS[system](bench, env, batches, warmup)
for i in range(warmup):
    step(*batches[i])
B.synchronize(env)
def timed(lo):
    hosts, total = [], []
    for i in range(lo, lo + steps):
        B.synchronize(env); t0 = time.perf_counter(); step(*batches[i]); t1 = time.perf_counter()
        B.synchronize(env); total.append(time.perf_counter() - t0); hosts.append(t1 - t0)
    return sorted(total)[steps // 2] * 1e3, sorted(hosts)[steps // 2] * 1e3
plain = timed(warmup)
timers.install(); timers.reset()
inst = timed(warmup + steps)
if info.is_main:
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, f"timers-{cfg}-{system}.md"), "w") as fh:
        fh.write(f"{cfg} {system}: step/host ms median {plain[0]:.2f}/{plain[1]:.2f} plain, {inst[0]:.2f}/{inst[1]:.2f} with timers\n\n")
        fh.write(timers.report(steps) + "\n")
    print(f"{cfg} {system}: plain {plain}, timed {inst}")
torch.distributed.destroy_process_group()
