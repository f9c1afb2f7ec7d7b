"""Two ranks under torchrun; rank 1 never joins rank 0's all-reduce. With
init_distributed(timeout=2), rank 0's collective must raise within seconds, not after 30 minutes.
gloo on every machine: gloo raises in the call. (NCCL's timeout is its watchdog's; on 2 H200s, with
TORCH_NCCL_BLOCKING_WAIT=1 and a host sync, a skipped all-reduce had not raised after 40 s.)"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import fsdp_graph  # noqa: E402

info = fsdp_graph.init_distributed(timeout=2, backend="gloo")
if info.rank == 0:
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        print("NO ERROR", flush=True)
    except RuntimeError as err:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {str(err).splitlines()[0][:200]}", flush=True)
else:
    time.sleep(8)  # busy elsewhere: never joins
sys.stdout.flush()
os._exit(0)  # the group is broken by design: skip its shutdown
