"""Collective calls that not every rank makes, or that ranks make differently, are refused with
the ranks named, instead of hanging for the group's timeout or loading some shards and not others.

Seen before: ``load_full_state_dict`` on rank 0 only loaded 9 of 22 tensors without a word.
Each test re-creates the group with a 5-second timeout (``init_distributed(timeout=5)``), as a user
who wants hangs to surface quickly does.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdp_graph
from fsdp_graph.fsdp.agreement import AgreementError

from dist_harness import run_ranks
from models import TinyLM, shard

TIMEOUT_S = 5


def _model_with_timeout(info, seed: int = 0) -> TinyLM:
    dist.destroy_process_group()
    fsdp_graph.init_distributed(timeout=TIMEOUT_S)
    torch.manual_seed(seed)
    return shard(TinyLM(n_blocks=2))


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().clone() if isinstance(p, DTensor) else p.detach().clone()
            for n, p in model.named_parameters()}


def _load_on_rank0_only(info) -> None:
    model = _model_with_timeout(info)
    source = TinyLM(n_blocks=2).state_dict()  # other values (the generator moved on)
    before = _snapshot(model)
    if info.rank == 0:
        start = time.monotonic()
        with pytest.raises(AgreementError, match=r"load_full_state_dict is a collective call, and rank\(s\) \[1\]"):
            fsdp_graph.load_full_state_dict(model, source)
        assert time.monotonic() - start < 4 * TIMEOUT_S
    else:
        time.sleep(TIMEOUT_S + 2)  # busy elsewhere: never calls it
    after = _snapshot(model)
    assert all(torch.equal(after[n], v) for n, v in before.items()), "a refused load changed the weights"


def test_load_full_state_dict_on_one_rank_only_is_refused_and_loads_nothing():
    run_ranks(_load_on_rank0_only, 2, backend="gloo")


def _different_calls(info) -> None:
    model = _model_with_timeout(info)
    with pytest.raises(AgreementError) as raised:
        if info.rank == 0:
            fsdp_graph.full_state_dict(model)
        else:
            fsdp_graph.load_full_state_dict(model, TinyLM(n_blocks=2).state_dict())
    other = "load_full_state_dict" if info.rank == 0 else "full_state_dict"
    assert f"rank {1 - info.rank}: {other}" in str(raised.value), str(raised.value)


def test_ranks_calling_different_state_dict_functions_are_refused_at_once():
    run_ranks(_different_calls, 2, backend="gloo", timeout=60)


def _bad_dict_on_one_rank(info) -> None:
    model = _model_with_timeout(info)
    before = _snapshot(model)
    source = TinyLM(n_blocks=2).state_dict()
    if info.rank == 1:
        del source["pos"]
    with pytest.raises((AgreementError, KeyError), match="missing: \\['pos'\\]"):
        fsdp_graph.load_full_state_dict(model, source)
    after = _snapshot(model)
    assert all(torch.equal(after[n], v) for n, v in before.items()), "rank 0 loaded although rank 1 refused"


def test_a_state_dict_refused_on_one_rank_is_loaded_by_none():
    run_ranks(_bad_dict_on_one_rank, 2, backend="gloo", timeout=60)


def _checkpoint_at_different_steps(info, root: str) -> None:
    model = _model_with_timeout(info)
    ckpt = fsdp_graph.Checkpointer(root)
    mine, theirs = 1 + info.rank, 2 - info.rank
    with pytest.raises(AgreementError, match=rf"save\(step={mine}\), but at the same point rank {1 - info.rank}: "
                                             rf"Checkpointer.save\(step={theirs}\)"):
        ckpt.save(mine, model)
    if info.rank == 0:
        with pytest.raises(AgreementError, match=r"rank\(s\) \[1\] did not make it"):
            ckpt.save(3, model)
    else:
        time.sleep(TIMEOUT_S + 2)
    assert ckpt.latest() is None


def test_checkpoints_saved_at_different_steps_or_on_one_rank_are_refused(tmp_path):
    run_ranks(_checkpoint_at_different_steps, 2, str(tmp_path), backend="gloo", timeout=90)
