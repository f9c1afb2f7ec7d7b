"""A distributed script exits cleanly: exit code 0 on every rank, never "terminate called without
an active exception" (gloo's worker threads and interpreter finalisation: fsdp_graph/fsdp/shutdown.py).

Real processes: every rank of every run ends through full interpreter finalisation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import fsdp_graph

from dist_harness import run_ranks

pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine: CI runs it; the GPU suite need not

SCRIPTS = Path(__file__).parent / "scripts"
# gloo's exit problem, on CPU: no GPU for the jobs even on a GPU machine (where they would pick NCCL).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    result = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def test_a_hundred_two_rank_jobs_exit_cleanly():
    """100 runs of exit_job.py, 4 at a time, ending in turn with fsdp_graph.shutdown(),
    torch.distributed.destroy_process_group() and nothing (the atexit hook), under the schedule that
    made the bug show (--starve-gloo: 22 of 100 runs aborted before the fix)."""
    cmd = [sys.executable, str(SCRIPTS / "many_exits.py"), "--runs", "100", "--jobs", "4", "--starve-gloo"]
    result = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "SUMMARY " in result.stdout, out[-4000:]
    # Only the summary line: stderr may follow (Python 3.12 warns about fork() in a threaded process).
    summary = json.loads(result.stdout.split("SUMMARY ")[-1].splitlines()[0])
    assert summary["ranks"] == 200 and summary["failed_ranks"] == 0, out[-6000:]


@pytest.mark.parametrize("end", ["none", "destroy"])
def test_a_script_under_torchrun_exits_cleanly(end):
    """Under torchrun, a script that just ends (the atexit hook) or that calls
    torch.distributed.destroy_process_group() itself, without a sleep."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / "exit_job.py"), "--end", end]
    code, out = _run(cmd, timeout=120)
    assert code == 0, out[-4000:]
    assert "terminate called" not in out, out[-4000:]
    assert out.count(f"steps, end={end}") == 2, out[-4000:]


def test_shutdown_without_a_group_does_nothing():
    fsdp_graph.shutdown()
    fsdp_graph.shutdown()
    assert not dist.is_initialized()


class _CountingReplays:
    """Stands in for a captured CUDA graph on CPU: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _graphs_released_before_destroy(info) -> None:
    from fsdp_graph.fsdp.communicator_graphs import hold
    from fsdp_graph.graphs.whole_graph import ReleasableGraph

    inner = _CountingReplays()
    graph = ReleasableGraph(inner, "make_train_step")
    graph.replay()
    released_while_initialized = []

    class Holder:
        def release(self) -> None:
            released_while_initialized.append(dist.is_initialized())

    holder = Holder()
    hold(holder)
    metrics = dist.new_group(backend="gloo")  # a gloo group's destroy waits for no graph: nothing released
    dist.destroy_process_group(metrics)
    assert released_while_initialized == [] and graph.replay() is None
    dist.destroy_process_group()  # the script's own call, through torch's module attribute
    assert released_while_initialized == [True], released_while_initialized
    with pytest.raises(RuntimeError, match="make_train_step: this CUDA graph was released when a process group was "
                                           r"destroyed \(destroy_process_group or fsdp_graph.shutdown"):
        graph.replay()
    assert inner.replays == 2


def test_graphs_holding_collectives_are_released_before_a_group_is_destroyed():
    """NCCL's destroy waits forever for a graph that captured its collectives (GPU:
    test_full_iteration_gpu.py::test_destroy_process_group_returns_with_whole_step_graphs_alive);
    here, on gloo, the order: every holder releases its graph while the group still exists, and
    not when a gloo subgroup is destroyed."""
    run_ranks(_graphs_released_before_destroy, 2, backend="gloo")
