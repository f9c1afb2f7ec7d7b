"""A user's script killed (SIGKILL) at one point of ``Checkpointer.save``: ``python kill_during_save.py
DIR PHASE``. It trains 2 steps and saves (step 2), trains 2 more and saves again (step 4) with
``keep_last=1``, dying at PHASE of that second save. Before dying it writes what each step's
checkpoint must hold (``DIR/expected_<step>.pt``). PHASE: after_data (DCP's data files written,
its metadata not), rank_state (this rank's file written, not synced), before_publish (everything
written, not renamed), while_pruning (published, the old one renamed to trash and not deleted).
"""

import os
import shutil
import signal
import sys

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fsdp_graph  # noqa: E402
from fsdp_graph.checkpoint import directory  # noqa: E402

from models import TinyLM, global_batch, lm_loss, shard  # noqa: E402


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def build():
    torch.manual_seed(0)
    model = shard(TinyLM(n_blocks=2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def expected(model, optimizer) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "exp_avg": [optimizer.state[p]["exp_avg"].clone() for p in model.parameters() if p.requires_grad]}


def main(root: str, phase: str) -> None:
    fsdp_graph.init_distributed()
    model, optimizer = build()
    ckpt = fsdp_graph.Checkpointer(os.path.join(root, "ckpt"), keep_last=1)
    for step in range(4):
        lm_loss(model, *global_batch(step, 1, torch.device("cpu"))).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == 2:
            ckpt.save(2, model, optimizer)
            torch.save(expected(model, optimizer), os.path.join(root, "expected_2.pt"))
    torch.save(expected(model, optimizer), os.path.join(root, "expected_4.pt"))
    if phase == "after_data":
        dcp.FileSystemWriter.finish = die
    elif phase == "rank_state":
        directory.fsync_file = die
    elif phase == "before_publish":
        directory.publish = die
    elif phase == "while_pruning":
        directory.shutil = type("killing_shutil", (), {"rmtree": staticmethod(die)})
    elif phase != "none":
        raise SystemExit(f"unknown phase {phase}")
    ckpt.save(4, model, optimizer)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    shutil.os._exit(0)
