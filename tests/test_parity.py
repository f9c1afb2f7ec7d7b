"""Sharded training equals a replicated single-process reference on the same global batch.

Every rank trains the sharded model on its slice of the global batch and, beside it, an
unsharded copy on the whole global batch. Losses (averaged over ranks) and final weights must
agree to float rounding (fp32), or to bf16 rounding with bf16 compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_graph

from dist_harness import run_ranks
from models import assert_full_state_matches, build, global_batch, lm_loss, local_loss, shard

STEPS = 4


def _optimizers(kind: str, model, ref):
    if kind == "sgd":
        make = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    else:
        make = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # noqa: E731
    return make(model.parameters()), make(ref.parameters())


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def _train_and_compare(info, opt_kind: str, mp_policy, rtol: float, atol: float, model_kwargs: dict,
                       shard_kwargs: dict | None = None, mesh_shape: tuple | None = None) -> None:
    model, ref = build(info.device, **model_kwargs)
    frozen_before = ref.blocks[1].ln.weight.detach().clone()
    shard_kwargs = dict(shard_kwargs or {})
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        names = ("replicate", "shard")[-len(mesh_shape):]
        shard_kwargs["mesh"] = init_device_mesh(info.device.type, mesh_shape, mesh_dim_names=names)
    shard(model, mp_policy=mp_policy, **shard_kwargs)
    if mesh_shape is not None:
        from torch.distributed.tensor import Replicate, Shard

        expected = (Replicate(), Shard(0)) if len(mesh_shape) == 2 else (Shard(0),)
        assert all(tuple(p.placements) == expected for p in model.parameters())
        assert model.fsdp_unit.world_size == mesh_shape[-1]
    opt, ref_opt = _optimizers(opt_kind, model, ref)
    ref_dtype = mp_policy.param_dtype if mp_policy and mp_policy.param_dtype else torch.float32
    for step in range(STEPS):
        idx, targets = global_batch(step, info.world_size, info.device)
        loss = local_loss(model, step, info)
        loss.backward()
        with torch.autocast(info.device.type, dtype=ref_dtype, enabled=ref_dtype != torch.float32):
            ref_loss = lm_loss(ref, idx, targets)
        ref_loss.backward()
        torch.testing.assert_close(_mean_over_ranks(loss), ref_loss.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"step {step} loss: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()

    full = fsdp_graph.full_state_dict(model)
    expected = ref.state_dict()
    assert full.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(full[key], expected[key], rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
    # the frozen parameter never changed and never got a gradient
    assert torch.equal(full["blocks.1.ln.weight"], frozen_before)
    assert model.blocks[1].ln.weight.grad is None
    # the tie survives sharding: one master under both names
    assert model.head.weight is model.emb.weight


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_fp32_parity_with_replicated_reference(world_size, opt_kind):
    run_ranks(_train_and_compare, world_size, opt_kind, None, 1e-5, 1e-6, {})


def test_bf16_compute_fp32_reduce_matches_reference_at_bf16_tolerance():
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    run_ranks(_train_and_compare, 2, "adamw", policy, 2e-2, 2e-2, {})


@pytest.mark.parametrize("persist", [True, False])
def test_parity_with_a_block_that_does_not_fit_the_slot(persist):
    run_ranks(_train_and_compare, 2, "adamw", None, 1e-5, 1e-6, {"big_block": 2},
              {"persist_buffer_on_alloc_fail": persist})


@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 4), (4, 1)])
def test_hsdp_parity_with_replicated_reference(mesh_shape):
    """A 2-D (replicate, shard) mesh: sharded within each replica, all-reduced across replicas."""
    run_ranks(_train_and_compare, 4, "adamw", None, 1e-5, 1e-6, {}, {}, mesh_shape)


def test_parity_without_double_buffer():
    """FSDP2-like dynamic buffers: freed at reshard, re-allocated at the next unshard."""
    run_ranks(_train_and_compare, 2, "adamw", None, 1e-5, 1e-6, {}, {"double_buffer": False})


def _tied_across_units(info) -> None:
    """Embedding and head sharded as units of their own: the tied weight moves to the root."""
    model, ref = build(info.device)
    fsdp_graph.fully_shard(model.emb)
    fsdp_graph.fully_shard(model.head)
    shard(model)
    assert model.head.weight is model.emb.weight
    root_names = [mp.name for mp in model.fsdp_unit.params]
    assert "emb.weight" in root_names, root_names
    assert not model.emb.fsdp_unit.params and not model.head.fsdp_unit.params
    opt, ref_opt = _optimizers("sgd", model, ref)
    for step in range(2):
        local_loss(model, step, info).backward()
        lm_loss(ref, *global_batch(step, info.world_size, info.device)).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_full_state_matches(model, ref, rtol=1e-5, atol=1e-6)


def test_parameter_tied_across_units_is_owned_by_common_ancestor():
    run_ranks(_tied_across_units, 2)
