"""Two ranks under torchrun; rank 1 reaches init_distributed 4 s after rank 0, longer than the
collective timeout of 2 s. The ranks must still form the group: arriving is not a collective."""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import fsdp_graph  # noqa: E402

if os.environ["RANK"] == "1":
    time.sleep(4)  # a slow import, a slow CUDA start
info = fsdp_graph.init_distributed(timeout=2)
total = torch.ones(1, device=info.device)
dist.all_reduce(total)
print(f"rank {info.rank} SUM {total.item():.1f}", flush=True)
