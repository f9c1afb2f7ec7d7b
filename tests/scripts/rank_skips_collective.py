"""Two ranks under torchrun; rank 1 never joins rank 0's all-reduce. With
init_distributed(timeout=2), rank 0's collective must raise within seconds, not after 30 minutes.
The tensor is on the rank's device, so on GPUs the NCCL group is the one that times out (the test
sets TORCH_NCCL_BLOCKING_WAIT=1 so NCCL's timeout surfaces in the waiting call)."""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import fsdp_graph  # noqa: E402

info = fsdp_graph.init_distributed(timeout=2)
if info.rank == 0:
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1, device=info.device))
        torch.ones(1, device=info.device).tolist()  # the host waits for the device
        print("NO ERROR", flush=True)
    except RuntimeError as err:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {str(err).splitlines()[0][:200]}", flush=True)
else:
    time.sleep(8)  # busy elsewhere: never joins
sys.stdout.flush()
os._exit(0)  # the group is broken by design: skip its shutdown
