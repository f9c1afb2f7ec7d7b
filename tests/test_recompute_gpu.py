"""GPU, two devices on NCCL: per-layer graphs under activation checkpointing, whose recompute
replays a block's forward graph inside the backward.

That forward writes memory of the graphs' pool while the reduces of the blocks after it may still
run on the reduce stream: reading the static gradients their graphs handed over
(``fsdp/graph_gradients.py``) and writing the sharded gradients' homes (``fsdp/grad_homes.py``).
So the replay first waits for the collectives queued so far (``GraphedCallable``). With the reduce
stream delayed at every hook boundary (``stream_delays.py``), training must stay bit for bit that of
eager training with the same checkpointing.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fsdp_graph

from dist_harness import run_ranks
from stream_delays import inject
from test_graph_parity_gpu import CFG, MICRO_BATCH, _batch, _build

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
STEPS = 6


def _train(info, graphed: bool, delays: str | None):
    model = _build(info, oversized_block=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if graphed:
        sample = torch.randn(MICRO_BATCH, CFG.seq_len, CFG.d_model, device=info.device, requires_grad=True)
        fsdp_graph.graph_modules(list(model.blocks), [(sample,)] * len(model.blocks))
    for block in model.blocks:  # the block's forward (graphed or not) recomputed in the backward
        block.forward = lambda x, forward=block.forward: checkpoint(forward, x, use_reentrant=True)
    losses = []
    with inject(delays):
        for step in range(STEPS):
            loss = model(*_batch(step, info))[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.cuda.synchronize()
    return torch.stack(losses), fsdp_graph.full_state_dict(model)


def _recomputed_graphs_train_as_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    losses, state = _train(info, False, None)
    assert losses[-1] < losses[0], f"the model should be learning: {losses.tolist()}"
    graphed_losses, graphed_state = _train(info, True, "reduce")
    differing = [i for i in range(STEPS) if not torch.equal(graphed_losses[i], losses[i])]
    assert not differing, f"losses differ from step {differing[0]}: {graphed_losses.tolist()} vs {losses.tolist()}"
    for key, value in state.items():
        assert torch.equal(graphed_state[key], value), f"{key} differs"


def test_checkpointed_graphs_recompute_bitwise_as_eager_with_the_reduce_stream_delayed():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_recomputed_graphs_train_as_eager, 2)
