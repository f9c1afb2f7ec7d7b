"""Collective calls that not every rank makes, or that ranks make differently, are refused with
the ranks named, instead of hanging for the group's timeout or loading some shards and not others.

Seen before: ``load_full_state_dict`` on rank 0 only loaded 9 of 22 tensors without a word.
Each test's group has a 5-second timeout (``init_distributed(timeout=5)``), as a user who wants
hangs to surface quickly sets.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.distributed.tensor import DTensor

import fsdp_graph
import fsdp_graph.checkpoint.directory
from fsdp_graph.fsdp.agreement import AgreementError

from dist_harness import run_ranks
from models import TinyLM, global_batch, lm_loss, local_part, shard

TIMEOUT_S = 5


def _model(info, seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return shard(TinyLM(n_blocks=2))


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().clone() if isinstance(p, DTensor) else p.detach().clone()
            for n, p in model.named_parameters()}


def _load_on_rank0_only(info) -> None:
    model = _model(info)
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
    run_ranks(_load_on_rank0_only, 2, backend="gloo", group_timeout=TIMEOUT_S)


def _different_calls(info) -> None:
    model = _model(info)
    with pytest.raises(AgreementError) as raised:
        if info.rank == 0:
            fsdp_graph.full_state_dict(model)
        else:
            fsdp_graph.load_full_state_dict(model, TinyLM(n_blocks=2).state_dict())
    other = "load_full_state_dict" if info.rank == 0 else "full_state_dict"
    assert f"rank {1 - info.rank}: {other}" in str(raised.value), str(raised.value)


def test_ranks_calling_different_state_dict_functions_are_refused_at_once():
    run_ranks(_different_calls, 2, backend="gloo", group_timeout=TIMEOUT_S, timeout=60)


def _bad_dict_on_one_rank(info) -> None:
    model = _model(info)
    before = _snapshot(model)
    source = TinyLM(n_blocks=2).state_dict()
    if info.rank == 1:
        del source["pos"]
    with pytest.raises((AgreementError, KeyError), match="missing: \\['pos'\\]"):
        fsdp_graph.load_full_state_dict(model, source)
    after = _snapshot(model)
    assert all(torch.equal(after[n], v) for n, v in before.items()), "rank 0 loaded although rank 1 refused"


def test_a_state_dict_refused_on_one_rank_is_loaded_by_none():
    run_ranks(_bad_dict_on_one_rank, 2, backend="gloo", group_timeout=TIMEOUT_S, timeout=60)


def _checkpoint_at_different_steps(info, root: str) -> None:
    model = _model(info)
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
    run_ranks(_checkpoint_at_different_steps, 2, str(tmp_path), backend="gloo", group_timeout=TIMEOUT_S, timeout=90)


# -- a step that raised on some ranks only --------------------------------------------------------
def _train(model, optimizer, step: int, info, bad: bool = False) -> torch.Tensor:
    idx, targets = global_batch(step, 2, torch.device("cpu"))
    idx, targets = local_part(idx, info.rank, 2), local_part(targets, info.rank, 2)
    if bad:
        idx = torch.full_like(idx, 999)  # out-of-range token ids: the embedding raises
    loss = lm_loss(model, idx, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _one_rank_fails(info, failing_ranks: tuple[int, ...]) -> None:
    import fsdp_graph.fsdp.root as root

    root.FAILED_STEP_WAIT_S = 3.0  # the default (60 s) bounds the wait of a real job
    model = _model(info)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, optimizer, 0, info)
    if info.rank in failing_ranks:
        with pytest.raises(IndexError):
            _train(model, optimizer, 1, info, bad=True)  # the user catches it and goes on
    if failing_ranks == (0, 1):  # every rank failed the same step: training goes on, as if it never ran
        losses = [_train(model, optimizer, step, info) for step in (1, 2)]
        torch.manual_seed(0)
        reference = shard(TinyLM(n_blocks=2))
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        expected = [_train(reference, ref_optimizer, step, info) for step in (0, 1, 2)][1:]
        assert all(torch.equal(a, b) for a, b in zip(losses, expected)), (losses, expected)
        return
    if info.rank == 0:
        with pytest.raises(RuntimeError, match=r"a training step raised on this rank \(.*IndexError.*\) but not on "
                                               r"every rank: .*rank\(s\) \[1\] did not make it") as raised:
            _train(model, optimizer, 2, info)
        assert "torchrun --max-restarts" in str(raised.value)
    else:
        with pytest.raises(RuntimeError):  # waits in the forward's all-gather, which rank 0 never joins
            _train(model, optimizer, 1, info)
    # The group is out of step by design: gloo aborts when it next matches mismatched messages, so
    # the process ends here, as the job would after the error (the harness then sees exit code 0).
    os._exit(0)


def test_a_step_that_failed_on_one_rank_only_ends_in_a_clear_error():
    run_ranks(_one_rank_fails, 2, (0,), backend="gloo", group_timeout=TIMEOUT_S, timeout=90)


def test_a_step_that_failed_on_every_rank_lets_training_go_on():
    run_ranks(_one_rank_fails, 2, (0, 1), backend="gloo", group_timeout=TIMEOUT_S, timeout=90)


# -- the same initial weights on every rank -------------------------------------------------------
def _verify(info, same_seed: bool) -> None:
    torch.manual_seed(0 if same_seed else info.rank)  # a forgotten seed: each rank its own weights
    model = TinyLM(n_blocks=2)
    if same_seed:
        shard(model, verify=True)
        return
    expected = (rf"fully_shard\(verify=True\) on Block: 'qkv.weight' \(and 6 more\) differs between rank {info.rank} "
                rf"and rank {1 - info.rank}.*torch.manual_seed")
    with pytest.raises(ValueError, match=expected):
        fsdp_graph.fully_shard(model.blocks[0], verify=True)


@pytest.mark.parametrize("same_seed", [True, False])
def test_verify_refuses_different_initial_weights_on_different_ranks(same_seed):
    run_ranks(_verify, 2, same_seed, backend="gloo", timeout=60)


# -- a collective one rank never joins ------------------------------------------------------------
def _skips_the_forward(info) -> None:
    model = _model(info)
    idx, targets = global_batch(0, 2, torch.device("cpu"))
    if info.rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 0: the all-gather of FSDP unit <root> \(TinyLM\) failed: .*"
                                               r"another rank did not join it.*init_distributed\(timeout=...\)"):
            lm_loss(model, idx, targets)
        assert time.monotonic() - start < 6 * TIMEOUT_S
    else:
        time.sleep(TIMEOUT_S + 3)  # skips this step's forward: never joins the root's all-gather
    os._exit(0)  # the group is out of step by design


def test_a_collective_a_rank_never_joins_names_the_rank_the_collective_and_the_unit():
    run_ranks(_skips_the_forward, 2, backend="gloo", group_timeout=TIMEOUT_S, timeout=90)


def _late_rank(info) -> None:
    from fsdp_graph.fsdp.agreement import agree

    if info.rank == 0:
        with pytest.raises(AgreementError, match=r"rank\(s\) \[1\] did not make it"):
            agree("first call", timeout=2)
        time.sleep(3)  # rank 1 arrives now, late: it must not agree with the call rank 0 withdrew
        agree("first call")  # rank 0 tries again: the two meet
    else:
        time.sleep(3)
        start = time.monotonic()
        agree("first call")
        assert time.monotonic() - start > 1, "agreed with a call rank 0 had given up"
    agree("second call")  # the sequence stays in step afterwards


def test_a_rank_arriving_after_another_gave_up_does_not_agree_with_the_withdrawn_call():
    run_ranks(_late_rank, 2, backend="gloo", group_timeout=30, timeout=60)


def _save_refused_on_rank0(info, root: str) -> None:
    model = _model(info)
    ckpt = fsdp_graph.Checkpointer(root)
    ckpt.save(6, model)
    expected = ValueError if info.rank == 0 else RuntimeError  # rank 0 decides; the others hear why
    with pytest.raises(expected, match=r"already holds checkpoints of later steps \[6\]"):
        ckpt.save(2, model)
    assert [step for step, _ in fsdp_graph.checkpoint.directory.complete_checkpoints(ckpt.root)] == [6]


def test_a_save_rank_0_refuses_is_refused_on_every_rank_with_its_reason(tmp_path):
    run_ranks(_save_refused_on_rank0, 2, str(tmp_path), backend="gloo", group_timeout=TIMEOUT_S, timeout=60)
