"""On CPU with gloo (the jobs see no GPU): torchrun restarts a job whose rank was killed (SIGKILL)
mid-step, or mid-checkpoint, and the restarted job resumes from the newest complete checkpoint and
ends bitwise equal to a run that was never interrupted: the same final weights, and the same loss
at every step it trained again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine: CI runs it; the GPU suite need not

SCRIPT = Path(__file__).parent / "scripts" / "restart_resume_job.py"


def _job(out: Path, kill: str, max_restarts: int) -> str:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts), str(SCRIPT), str(out), kill]
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    return text


def _losses(out: Path, rank: int) -> dict[int, tuple[int, str]]:
    """step -> (attempt, loss): the last attempt that trained each step."""
    losses = {}
    for line in (out / f"losses.rank{rank}").read_text().splitlines():
        attempt, step, loss = line.split()
        losses[int(step)] = (int(attempt), loss)
    return losses


@pytest.mark.parametrize("kill, resumed_from", [("step", 4), ("checkpoint", 4)])
def test_a_restarted_job_resumes_from_its_last_checkpoint_bitwise(tmp_path, kill, resumed_from):
    _job(tmp_path / "plain", "none", max_restarts=0)
    text = _job(tmp_path / "killed", kill, max_restarts=1)
    assert "attempt 0 rank 1: SIGKILL" in text, text[-6000:]
    for rank in range(2):
        assert f"attempt 1 rank {rank}: starts at step {resumed_from}" in text, text[-6000:]
        plain, killed = _losses(tmp_path / "plain", rank), _losses(tmp_path / "killed", rank)
        assert sorted(killed) == sorted(plain) == list(range(8))
        for step in range(resumed_from, 8):
            assert killed[step][0] == 1, f"step {step} was not trained again after the restart"
            assert killed[step][1] == plain[step][1], f"rank {rank} step {step}: {killed[step]} vs {plain[step]}"
    final_plain = torch.load(tmp_path / "plain" / "final.pt")
    final_killed = torch.load(tmp_path / "killed" / "final.pt")
    for name, value in final_plain.items():
        assert torch.equal(final_killed[name], value), f"{name} differs from the uninterrupted run's"
    leftovers = sorted(os.listdir(tmp_path / "killed" / "ckpt"))
    assert leftovers == ["step_00000006", "step_00000008"], leftovers
