"""Gradient accumulation, clipping and full state dicts, each against the replicated reference."""

from __future__ import annotations

import pytest
import torch

import fsdp_graph

from dist_harness import run_ranks
from models import (
    TinyLM,
    assert_full_state_matches,
    build,
    global_batch,
    lm_loss,
    local_loss,
    local_part,
    shard,
    train_beside_reference,
)


def _accumulation(info, api: str) -> None:
    """Two micro-batches under no_sync (or set_requires_gradient_sync) == one double batch."""
    ws, rank = info.world_size, info.rank
    accumulated, _ = build(info.device)
    single, _ = build(info.device)
    shard(accumulated)
    shard(single)
    idx, targets = global_batch(0, ws, info.device, per_rank=4)
    idx, targets = local_part(idx, rank, ws), local_part(targets, rank, ws)

    halves = list(zip(idx.chunk(2), targets.chunk(2)))
    if api == "no_sync":
        with accumulated.no_sync():
            (lm_loss(accumulated, *halves[0]) / 2).backward()
    else:
        accumulated.set_requires_gradient_sync(False)
        (lm_loss(accumulated, *halves[0]) / 2).backward()
        accumulated.set_requires_gradient_sync(True)
    assert all(p.grad is None for p in accumulated.parameters()), "no_sync must not reduce"
    (lm_loss(accumulated, *halves[1]) / 2).backward()
    lm_loss(single, idx, targets).backward()

    for (name, a), (_, s) in zip(accumulated.named_parameters(), single.named_parameters()):
        if s.grad is None:
            assert a.grad is None, name
            continue
        torch.testing.assert_close(a.grad, s.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")

    # the accumulation buffer is reused, not re-allocated, and starts from zero next time
    for _ in range(2):
        accumulated.zero_grad()
        with accumulated.no_sync():
            (lm_loss(accumulated, *halves[0]) / 2).backward()
        (lm_loss(accumulated, *halves[1]) / 2).backward()
    for (name, a), (_, s) in zip(accumulated.named_parameters(), single.named_parameters()):
        if s.grad is not None:
            torch.testing.assert_close(a.grad, s.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("api", ["no_sync", "set_requires_gradient_sync"])
def test_accumulating_two_micro_batches_equals_one_double_batch(api):
    run_ranks(_accumulation, 2, api)


def _clip(info, norm_type: float) -> None:
    model, ref = build(info.device)
    shard(model)
    local_loss(model, 0, info).backward()
    lm_loss(ref, *global_batch(0, info.world_size, info.device)).backward()
    norm = fsdp_graph.clip_grad_norm_(model, 0.5, norm_type=norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type=norm_type)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7)
    assert norm.item() > 0.5, "test must actually clip"
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    assert_full_state_matches(model, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_equals_reference_norm(norm_type):
    run_ranks(_clip, 3, norm_type)


def _state_dict_round_trip(info) -> None:
    model, ref = build(info.device, seed=0)
    shard(model)
    full = fsdp_graph.full_state_dict(model)
    assert "head.weight" in full and "emb.weight" in full and "pos" in full  # tied names and buffers
    fresh = TinyLM().to(info.device)
    fresh.load_state_dict(full, strict=True)  # loads into the unsharded model
    for key, value in ref.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
        assert full[key].dtype == value.dtype and full[key].shape == value.shape, key

    other, _ = build(info.device, seed=1)
    shard(other)
    fsdp_graph.load_full_state_dict(other, full)
    reloaded = fsdp_graph.full_state_dict(other)
    for key in full:
        assert torch.equal(reloaded[key], full[key]), key
    # loaded weights train like the original
    assert torch.equal(local_loss(model, 0, info), local_loss(other, 0, info))

    bad = dict(full)
    del bad["ln_f.bias"]
    bad["not.a.key"] = torch.zeros(1)
    with pytest.raises(KeyError, match=r"missing: \['ln_f.bias'\].*unexpected: \['not.a.key'\]"):
        fsdp_graph.load_full_state_dict(other, bad)
    wrong_shape = dict(full, **{"blocks.0.fc.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="blocks.0.fc.weight.*shape"):
        fsdp_graph.load_full_state_dict(other, wrong_shape)


def test_full_state_dict_round_trip():
    run_ranks(_state_dict_round_trip, 2)


def test_single_process_training_matches_reference_without_process_group():
    """World size 1, plain python: no process group, same numbers as the unwrapped model."""
    model, ref = build(torch.device("cpu"))
    shard(model)
    train_beside_reference(model, ref, steps=3,
                           optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       torch.optim.AdamW(ref.parameters(), lr=1e-2)))
