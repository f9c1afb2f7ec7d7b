"""``examples/train_hf.py`` as a user runs it (CPU, gloo): ``--smoke`` trains an HF model and its
loss falls; the same global batch of 4 rows gives the same losses, to float rounding, whether one
process takes the 4 rows, or one process 2 micro-batches of 2 (``--grad-accum 2``), or 2 ranks 2
rows each under ``launch/run.sh`` or under ``accelerate launch --multi_gpu`` with ``--accelerate``.

Runs are cached by command, so each one is made once per session whichever tests select it.
"""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "train_hf.py")
SUMMARY = re.compile(r"final loss (\S+) \| first loss (\S+) \|.*\| world size (\d+) \| (\d+) steps")


@functools.cache
def _run(*cmd: str) -> dict:
    """Runs ``cmd`` in the repo on CPU; returns the summary line's numbers and the output."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    where = f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, where
    found = SUMMARY.search(done.stdout)
    assert found, where
    final, first, world, steps = found.groups()
    return {"final": float(final), "first": float(first), "world": int(world), "steps": int(steps),
            "out": done.stdout, "where": where}


def _python(*args: str) -> dict:
    return _run(sys.executable, EXAMPLE, "--smoke", *args)


def _same_losses(a: dict, b: dict) -> None:
    for key in ("first", "final"):
        assert math.isclose(a[key], b[key], rel_tol=1e-5), (key, a["where"], b["where"])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_smoke_trains(arch):
    run = _python("--arch", arch)
    assert run["world"] == 1 and run["steps"] == 20, run["where"]
    assert f"{arch} tiny" in run["out"] and "no accelerate" in run["out"], run["where"]
    assert math.isfinite(run["first"]) and math.isfinite(run["final"]), run["where"]
    assert run["final"] < run["first"] - 0.3, run["where"]  # ln(256) = 5.55 at the start


def test_grad_accum_of_half_micro_batches_gives_the_same_losses():
    _same_losses(_python("--batch", "2", "--grad-accum", "2"), _python())


def _torchrun_two_ranks() -> dict:
    return _run("bash", str(REPO / "launch" / "run.sh"), "--nproc-per-node", "2", EXAMPLE, "--smoke", "--batch", "2")


def test_two_ranks_under_torchrun_train_like_one_process_on_their_rows():
    run = _torchrun_two_ranks()
    assert run["world"] == 2 and "world size 2 | no accelerate" in run["out"], run["where"]
    _same_losses(run, _python())


def test_two_ranks_under_accelerate_launch_with_prepared_loader_optimizer_and_scheduler():
    run = _run(sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", "0", EXAMPLE, "--smoke", "--batch", "2", "--accelerate")
    assert run["world"] == 2 and "world size 2 | accelerate MULTI_CPU x2" in run["out"], run["where"]
    _same_losses(run, _python())
    _same_losses(run, _torchrun_two_ranks())
