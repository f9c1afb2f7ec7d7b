"""The test harness explains a hang: which rank waited in which collective of which unit."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from dist_harness import run_ranks
from models import build, local_loss, shard

pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine: CI runs it; the GPU suite need not


def _rank_one_never_joins(info) -> None:
    """Rank 1 trains one step, then stops taking part; rank 0 starts the next step and waits in
    the root's all-gather for a rank that never comes. On CPU everywhere (gloo), GPUs or not."""
    info = dataclasses.replace(info, device=torch.device("cpu"))
    model, _ = build(info.device)
    shard(model)
    local_loss(model, 0, info).backward()
    if info.rank == 1:
        time.sleep(120)  # killed by the harness first
    local_loss(model, 1, info).backward()


def test_a_hung_rank_is_reported_with_its_last_collective_and_unit():
    with pytest.raises(AssertionError) as failure:
        run_ranks(_rank_one_never_joins, 2, backend="gloo", timeout=20)
    report = str(failure.value)
    assert "ranks [0, 1] did not finish within 20s" in report
    rank0 = report.split("--- rank 0 hung ---")[1].split("--- rank 1 hung ---")[0]
    last = rank0.split("Python stacks")[0].strip().splitlines()[-1]
    assert "all_gather_inplace" in last and "STARTED, NOT RETURNED" in last, last
    assert "unit <root> (TinyLM), pre_forward" in last, last
    rank1 = report.split("--- rank 1 hung ---")[1]
    assert "_rank_one_never_joins" in rank1  # its stacks show where it is (the sleep)
