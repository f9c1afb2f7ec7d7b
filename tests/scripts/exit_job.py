"""A user's script as the README shows it, ending the way scripts end.

init_distributed, a small model sharded with fully_shard (two blocks, then the root), a few steps
(forward; backward, whose reduce-scatters run on gloo's worker threads; clip_grad_norm_, an
all-reduce), then the end, by ``--end``: ``shutdown`` (fsdp_graph.shutdown()), ``destroy``
(torch.distributed.destroy_process_group(), no sleep), or ``none`` (the script just ends: the
atexit hook of init_distributed). It passes if every rank exits with 0 and nothing aborts.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/exit_job.py --end none
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import fsdp_graph  # noqa: E402

ENDS = ("shutdown", "destroy", "none")
STEPS = 2


def main(end: str) -> None:
    info = fsdp_graph.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    fsdp_graph.fully_shard(model[0])
    fsdp_graph.fully_shard(model[2])
    fsdp_graph.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(STEPS):
        loss = model(torch.randn(4, 16)).square().mean()
        loss.backward()
        fsdp_graph.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    print(f"rank {info.rank}: {STEPS} steps, end={end}", flush=True)
    if end == "shutdown":
        fsdp_graph.shutdown()
    elif end == "destroy" and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--end", choices=ENDS, default="none")
    main(parser.parse_args().end)
