"""GPU-only checks (skipped without CUDA). The rest of the suite also runs on NCCL when there
are enough GPUs: these cover what only a GPU can show."""

from __future__ import annotations

import pytest
import torch

import fsdp_graph
from fsdp_graph.fsdp.capture_interface import leaf_units
from fsdp_graph.fsdp.gradients import UnitGradients
from fsdp_graph.fsdp.introspect import sharded_grad_bytes, unit_buffers, watch_methods, watch_steps
from fsdp_graph.fsdp.param_group import ParamGroup
from fsdp_graph.fsdp.registry import unit_of

from dist_harness import run_ranks
from models import build, local_loss, shard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "end_backward")


TRANSIENT_LIMIT = 4096  # bytes: the copy-out / copy-in kernels' pointer tables, nothing buffer-sized


def _rounded(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the caching allocator's block sizes


def _steady_state_allocations(info, mp_policy, set_to_none) -> None:
    model, _ = build(info.device, d=64, hidden=256, n_blocks=4, big_block=3)
    shard(model, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = leaf_units(model) + [unit_of(model)]
    unit_of_part = {id(part): u for u in units for part in (u.param_group, u.grads)}
    counts: dict = {}
    transient: dict = {}
    # Per open hook: [memory at its start, the most its collectives staged on their own, what hooks
    # nested in it kept, the level its peak is measured from] (the end of the backward, or another
    # unit's pre-backward, runs the post-backward of units fed token ids: counted once, as its own).
    started: list = []

    def before(step, unit):
        torch.cuda.reset_peak_memory_stats()
        level = torch.cuda.memory_allocated()
        started.append([level, 0, 0, level])

    def after(step, unit):
        start, own_staging, nested, base = started.pop()
        end = torch.cuda.memory_allocated()
        counts[step] = counts.get(step, 0) + end - start - nested
        excess = torch.cuda.max_memory_allocated() - max(base, end) - own_staging
        transient[step] = max(transient.get(step, 0), excess)
        if started:  # the enclosing hook goes on: its peak is measured afresh from here
            started[-1][2] += end - start
            started[-1][3] = end
            torch.cuda.reset_peak_memory_stats()

    def collective(what, part):
        """A unit larger than the shared staging (the wide block, the root) stages its all-gather on
        its own (its reduce goes through the shared staging in pieces), taking and giving back
        memory within the collective, which may run in a neighbour's hook (a prefetch)."""
        own = _rounded(unit_buffers(unit_of_part[id(part)]).own_staging_bytes)
        for frame in started:
            frame[1] = max(frame[1], own)

    collectives = [(ParamGroup, "_issue_unshard", "unshard", lambda args: args[0]),
                   (UnitGradients, "_reduce", "reduce", lambda args: args[0])]
    counted = 3
    with watch_steps(before, after), watch_methods(collectives, before=collective):
        for step in range(3 + counted):
            if step == 3:
                counts.clear()  # warm-up done: slots, dedicated buffers, staging, optimizer state exist
                transient.clear()
            loss = local_loss(model, step, info)
            loss.backward()
            fsdp_graph.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        torch.cuda.synchronize()
    assert set(counts) == set(STEPS), counts
    own = [unit_buffers(u).own_staging_bytes for u in units]  # blocks 0-3 (3 is the wide one), the root
    assert own[3] > 0 and own[0] == own[1] == own[2] == 0, own  # (this root is smaller than a block)
    # The sharded gradients are the user's, as in FSDP2: zero_grad(set_to_none=True) gives them back
    # at the next forward (the root's), and each unit's reduce makes them again. Nothing else is kept:
    # every buffer a hook touches is persistent, or (staging of a unit larger than the shared one)
    # taken and given back within the hook.
    grads = sum(_rounded(sharded_grad_bytes(u)) for u in units) * counted if set_to_none else 0
    assert counts["pre_forward"] == -grads, counts
    # The unsharded gradients are autograd's own tensors, allocated by the backward outside the
    # hooks; the reduce reads them, and they are given back once the compute stream has waited for
    # it: at the slot's next pre-backward, or at the end of the backward.
    compute = torch.bfloat16 if mp_policy is not None else torch.float32
    autograd_grads = counted * sum(_rounded(p.unsharded.numel() * compute.itemsize)
                                   for u in units for p in u.params if p.requires_grad)
    assert counts["pre_backward"] <= 0, counts
    assert counts["pre_backward"] + counts["post_backward"] + counts["end_backward"] == grads - autograd_grads, counts
    assert counts["post_forward"] == 0, counts
    # The only other allocations are the metadata tables split_with_sizes_copy / _chunk_cat (FSDP2's
    # copy kernels) allocate and free within the call (inside a whole-step capture: the graph's pool).
    assert all(v <= TRANSIENT_LIMIT for v in transient.values()), f"transient bytes in hooks: {transient}"


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zero_grad_keeps", "zero_grad_set_to_none"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_steady_state_hooks_keep_only_the_users_gradients_and_allocate_no_buffers(dtype, set_to_none):
    policy = (
        None if dtype == "fp32" else fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    run_ranks(_steady_state_allocations, min(2, torch.cuda.device_count()), policy, set_to_none)
