"""The example's checkpoint flags, as a user runs them: ``examples/train_gpt.py --checkpoint-dir D
--checkpoint-every 4`` under torchrun (2 CPU ranks), then a second job started from the step-4
checkpoint with ``--resume``: its step-12 checkpoint (model, AdamW, scheduler) is bitwise the
uninterrupted job's, and it prints the same final loss."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_gpt.py")


def _train(checkpoint_dir, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE,
           "--steps", "12", "--batch-size", "4", "--log-every", "4", "--checkpoint-dir", str(checkpoint_dir),
           "--checkpoint-every", "4", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _contents(checkpoint, tmp_path, name: str) -> dict:
    flat = tmp_path / f"{name}.pt"
    dcp_to_torch_save(checkpoint, flat)
    return torch.load(flat, weights_only=False)


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_the_example_resumes_from_its_checkpoint_bitwise(tmp_path):
    whole = _train(tmp_path / "whole")
    assert sorted(os.listdir(tmp_path / "whole")) == ["step_00000004", "step_00000008", "step_00000012"]

    shutil.copytree(tmp_path / "whole" / "step_00000004", tmp_path / "resumed" / "step_00000004")
    resumed = _train(tmp_path / "resumed", "--resume")
    assert "resumed from step 4" in resumed, resumed

    final = re.compile(r"final loss (\S+)")
    assert final.search(resumed).group(1) == final.search(whole).group(1), (whole, resumed)
    _assert_same(_contents(tmp_path / "resumed" / "step_00000012", tmp_path, "resumed"),
                 _contents(tmp_path / "whole" / "step_00000012", tmp_path, "whole"))
    for rank in range(2):  # each rank's data position and generators
        _assert_same(torch.load(tmp_path / "resumed" / "step_00000012" / f"rank_{rank:05d}.pt"),
                     torch.load(tmp_path / "whole" / "step_00000012" / f"rank_{rank:05d}.pt"), f"rank {rank}")
