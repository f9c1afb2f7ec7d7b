"""Do the root's reduce inputs sit at the same addresses from step to step? (The premise of keying
its copy-in and write by address: docs/performance.md, "Next, designed, not built".) Records, per
step, the addresses of the root's gradient sources (autograd's tensors) and of its sharded gradient
buffer after the reduce, for one benchmark system. Run from the repository root (2 GPUs):
torchrun --standalone --nproc-per-node 2 examples/results/2xH200/root_pieces_graph/address_probe.py \
    small ours_segment_graphs"""
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "examples"))  # (run from the repository root)
import fsdp_graph  # noqa: E402
from fsdp_graph.fsdp import gradients  # noqa: E402
from fsdp_graph.fsdp.registry import units_in  # noqa: E402

import benchmark as B  # noqa: E402

cfg, system = sys.argv[1], sys.argv[2]
info = fsdp_graph.init_distributed()
env = B.Env(info.rank, info.world_size, info.device)
bench = B.bench_config(cfg)
steps = 12
batches = B.make_batches(bench, env, steps + 4)
seen = []
original = gradients._take_written


def recording(params, layout, zeros, from_graphs):
    sources, fixed = original(params, layout, zeros, from_graphs)
    seen.append(tuple((s.data_ptr(), s.dtype, tuple(s.shape), s.stride()) for s in sources))
    return sources, fixed


gradients._take_written = recording
step, _ = B.BUILDERS[system](bench, env, batches, 2)
root = units_in(step.bench_model)[0]
per_step, sharded = [], []
for i in range(steps):
    seen.clear()
    step(*batches[i])
    per_step.append(seen[-1] if seen else None)  # the root reduces last
    flat = root.grads.sharded.flat
    sharded.append(None if flat is None else flat.data_ptr())
if info.is_main:
    print(f"{cfg} {system}: root sources distinct per step: {len(set(per_step))} of {steps}; "
          f"sharded buffer addresses distinct: {len(set(sharded))} of {steps}")
    for i, (s, f) in enumerate(zip(per_step, sharded)):
        print(i, [hex(a[0]) for a in s] if s else None, hex(f) if f else None)
fsdp_graph.shutdown()
