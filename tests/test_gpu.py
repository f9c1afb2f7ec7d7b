"""GPU-only checks (skipped without CUDA). The rest of the suite also runs on NCCL when there
are enough GPUs: these cover what only a GPU can show."""

from __future__ import annotations

import pytest
import torch

import fsdp_graph
from fsdp_graph.fsdp.introspect import watch_steps

from dist_harness import run_ranks
from models import build, local_loss, shard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "end_backward")


TRANSIENT_LIMIT = 4096  # bytes: the copy-out / copy-in kernels' pointer tables, nothing buffer-sized


def _steady_state_allocations(info, mp_policy) -> None:
    model, _ = build(info.device, d=64, hidden=256, n_blocks=4, big_block=3)
    shard(model, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts: dict = {}
    transient: dict = {}
    started: list = []

    def before(step, unit):
        torch.cuda.reset_peak_memory_stats()
        started.append(torch.cuda.memory_allocated())

    def after(step, unit):
        start = started.pop()
        counts[step] = counts.get(step, 0) + torch.cuda.memory_allocated() - start
        transient[step] = max(transient.get(step, 0), torch.cuda.max_memory_allocated() - start)

    with watch_steps(before, after):
        for step in range(6):
            if step == 3:
                counts.clear()  # warm-up done: slots, dedicated buffers, staging, optimizer state exist
                transient.clear()
            loss = local_loss(model, step, info)
            loss.backward()
            fsdp_graph.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of zeroing keep the same buffers
        torch.cuda.synchronize()
    assert set(counts) == set(STEPS), counts
    # Every buffer a hook touches is persistent: no hook keeps memory, and the only allocations
    # are the metadata tables split_with_sizes_copy / _chunk_cat (FSDP2's copy kernels) allocate
    # and free within the call (inside a whole-step capture they come from the graph's pool).
    assert all(v == 0 for v in counts.values()), f"memory kept by hooks in steady state (bytes): {counts}"
    assert all(v <= TRANSIENT_LIMIT for v in transient.values()), f"transient bytes in hooks: {transient}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_steady_state_hooks_keep_no_memory_and_allocate_no_buffers(dtype):
    policy = (
        None if dtype == "fp32" else fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    run_ranks(_steady_state_allocations, min(2, torch.cuda.device_count()), policy)
