"""A small sharded training job that torchrun restarts after a rank dies.

In the first attempt (TORCHELASTIC_RESTART_COUNT == "0") rank 1 kills itself with SIGKILL in the
middle of step KILL_STEP, after the forward and before the backward; rank 0 then fails in that
step's reduce-scatter, and torchrun (--max-restarts >= 1) starts both again. The restarted
attempt must create its process group and train to the end.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 tests/scripts/restart_job.py

``main()`` is the whole job: build, train, report. A checkpoint/resume version saves in
``train`` and picks ``start_step`` from the checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import fsdp_graph  # noqa: E402

STEPS = 6
KILL_STEP = 3
KILLED_RANK = 1


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    fsdp_graph.fully_shard(model[0])
    fsdp_graph.fully_shard(model[2])
    fsdp_graph.fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, attempt: int, start_step: int = 0) -> float:
    loss = torch.zeros(())
    for step in range(start_step, STEPS):
        torch.manual_seed(1000 * step + rank)
        loss = model(torch.randn(4, 16)).square().mean()
        if attempt == 0 and rank == KILLED_RANK and step == KILL_STEP:
            print(f"attempt {attempt} rank {rank}: SIGKILL at step {step}, between forward and backward", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        fsdp_graph.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def main() -> None:
    info = fsdp_graph.init_distributed(timeout=30)  # a restart that cannot connect fails in 30 s, not 30 min
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"attempt {attempt} rank {info.rank}: process group up", flush=True)
    model, optimizer = build()
    loss = train(model, optimizer, info.rank, attempt)
    print(f"attempt {attempt} rank {info.rank}: finished {STEPS} steps, loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
