"""A training job that checkpoints, is killed, and is restarted by torchrun, resuming exactly.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/scripts/restart_resume_job.py OUT KILL

KILL: "none" (an uninterrupted run), "step" (in the first attempt rank 1 kills itself with SIGKILL
mid-step KILL_STEP, after the forward), or "checkpoint" (in the first attempt rank 1 kills itself
while DCP writes its data for the checkpoint of step KILL_STEP). Every attempt resumes from the
newest complete checkpoint in OUT/ckpt. Each rank appends "attempt step loss" lines to
OUT/losses.rank<r>; at the end rank 0 writes the full weights to OUT/final.pt.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
import fsdp_graph  # noqa: E402

from models import TinyLM, global_batch, lm_loss, local_part, shard  # noqa: E402

STEPS, EVERY, KILL_STEP, KILLED_RANK = 8, 2, 5, 1


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def main(out: str, kill: str) -> None:
    info = fsdp_graph.init_distributed(timeout=30)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    killer = attempt == 0 and info.rank == KILLED_RANK
    torch.manual_seed(0)
    model = shard(TinyLM(n_blocks=2), verify=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.2 * s))
    ckpt = fsdp_graph.Checkpointer(os.path.join(out, "ckpt"), keep_last=2)
    start = ckpt.load(model, optimizer, scheduler=scheduler) or 0
    print(f"attempt {attempt} rank {info.rank}: starts at step {start}", flush=True)
    with open(os.path.join(out, f"losses.rank{info.rank}"), "a") as log:
        for step in range(start, STEPS):
            idx, targets = global_batch(step, info.world_size, torch.device("cpu"))
            loss = lm_loss(model, local_part(idx, info.rank, info.world_size),
                           local_part(targets, info.rank, info.world_size))
            if killer and kill == "step" and step == KILL_STEP:
                print(f"attempt {attempt} rank {info.rank}: SIGKILL mid-step {step}", flush=True)
                die()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            log.write(f"{attempt} {step} {loss.item().hex()}\n")
            log.flush()
            if (step + 1) % EVERY == 0:
                if killer and kill == "checkpoint" and step + 1 == KILL_STEP + 1:
                    print(f"attempt {attempt} rank {info.rank}: SIGKILL while saving step {step + 1}", flush=True)
                    dcp.FileSystemWriter.write_data = die
                ckpt.save(step + 1, model, optimizer, scheduler=scheduler)
    weights = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
    if info.rank == 0:
        torch.save(weights, os.path.join(out, "final.pt"))
    print(f"attempt {attempt} rank {info.rank}: finished {STEPS} steps", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
