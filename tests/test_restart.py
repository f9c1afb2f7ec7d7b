"""On CPU with gloo (the jobs see no GPU): torchrun's first restart works: a rank SIGKILLed
mid-step, the job restarted once, runs to the end.

Before the fix the restarted ranks often read the dead attempt's gloo addresses from torchrun's
store and failed ("connectFullMesh ... Connection refused"): see ``_join_store`` in
fsdp_graph/fsdp/distributed.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine: CI runs it; the GPU suite need not

SCRIPT = Path(__file__).parent / "scripts" / "restart_job.py"


def test_the_first_restart_runs_to_the_end():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", str(SCRIPT)]
    result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                            capture_output=True, text=True,
                            timeout=120)
    out = result.stdout + result.stderr
    assert "attempt 0 rank 1: SIGKILL at step 3" in out, out[-6000:]
    assert "connectFullMesh failed" not in out, out[-6000:]
    for rank in range(2):
        assert f"attempt 1 rank {rank}: finished 6 steps" in out, out[-6000:]
    assert result.returncode == 0, out[-6000:]
