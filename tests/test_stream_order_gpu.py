"""GPU, two devices on NCCL: stream ordering holds with every cross-stream window widened.

The sharded bf16 GPT (one block twice as wide, so that its unit falls back to a dedicated
persistent buffer; neighbour prefetch on) trains a few steps eagerly, with per-block graphs, with
segment graphs of two blocks (their FSDP steps, and so the delays, inside), and as a whole-step
graph (optimizer inside with accumulation and clipping, and optimizer outside).
Then it trains again with ``torch.cuda._sleep`` queued at every hook boundary on the compute
stream, then on the all-gather stream, then on the reduce stream (``stream_delays.py``), also
inside the capture. A missing dependency between the streams would let a reader see a buffer
before its writer finished, or a writer overwrite it before its reader was done. With
deterministic kernels, every loss and the final weights must stay bit for bit those of the run
without delays (``docs/stream_handoffs.md`` lists the hand-offs exercised).
"""

from __future__ import annotations

import os

import pytest
import torch

import fsdp_graph
from fsdp_graph import GraphConfig

from dist_harness import run_ranks
from stream_delays import STREAMS, inject, queued
from test_full_iteration_gpu import _stacked_batch
from test_graph_parity_gpu import _build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
STEPS, WARMUP = 6, 2
CASES = {  # strategy, micro-batches per step, max_grad_norm, optimizer inside the step, segment_size
    "eager_clip": ("none", 1, 1.0, True, 1),
    "eager_accumulate_clip": ("none", 2, 1.0, True, 1),
    "layer_graphs_clip": ("layer", 1, 1.0, True, 1),
    "segment_graphs_clip": ("layer", 1, 1.0, True, 2),  # two blocks per graph, their FSDP steps inside
    "whole_step_accumulate_clip": ("full_iteration", 2, 1.0, True, 1),
    "whole_step_optimizer_outside": ("full_iteration", 1, None, False, 1),
}


def _train(info, case: str, delays: str | None):
    strategy, accum, max_grad_norm, optimizer_in_step, segment_size = CASES[case]
    model = _build(info, oversized_block=True)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), capturable=True)
    config = GraphConfig(strategy=strategy, num_warmup_iters=WARMUP, segment_size=segment_size,
                         modules=list(model.blocks) if strategy == "layer" else None)
    losses = []
    with inject(delays):
        step = fsdp_graph.make_train_step(
            lambda idx, targets: model(idx, targets)[1], model, opt if optimizer_in_step else None,
            config=config, example_batch=_stacked_batch(0, info, accum), grad_accum_steps=accum,
            max_grad_norm=max_grad_norm,
        )
        for i in range(STEPS):
            losses.append(step(*_stacked_batch(i, info, accum)))
            if not optimizer_in_step:
                opt.step()
                opt.zero_grad()
        torch.cuda.synchronize()
    return torch.stack(losses), fsdp_graph.full_state_dict(model)


def _delays_change_nothing(info, case: str) -> None:
    torch.use_deterministic_algorithms(True)
    losses, state = _train(info, case, None)
    assert losses[-1] < losses[0], f"the model should be learning: {losses.tolist()}"
    for stream in STREAMS:
        before = queued[0]
        delayed_losses, delayed_state = _train(info, case, stream)
        assert queued[0] - before > 4 * STEPS, f"{case}: only {queued[0] - before} sleeps on the {stream} stream"
        differing = [i for i in range(STEPS) if not torch.equal(delayed_losses[i], losses[i])]
        assert not differing, (f"{case}, delays on the {stream} stream: losses differ from step {differing[0]}: "
                               f"{delayed_losses.tolist()} vs {losses.tolist()}")
        for key, value in state.items():
            assert torch.equal(delayed_state[key], value), f"{case}, delays on the {stream} stream: {key} differs"


@two_gpus
@pytest.mark.parametrize("case", sorted(CASES))
def test_delays_on_every_stream_change_no_bit(case):
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_delays_change_nothing, 2, case)


def _delays_change_nothing_without_a_group(info, case: str) -> None:
    # init_distributed makes no group for one process: nothing orders the streams but our events
    assert not torch.distributed.is_initialized(), "the case needs a process without a process group"
    _delays_change_nothing(info, case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_delays_change_no_bit_on_one_gpu_without_a_process_group(case):
    """One GPU, no process group: the unshard and the reduce run no collective, so no NCCL stream
    orders a reduce before the next all-gather. Within one backward, the unit that takes a slot
    after another (block 0 after block 3 here) gives back, at its pre-backward, the gradients the
    other unit's reduce read on the reduce stream (autograd's own tensors, held on the slot), and
    its backward allocates new ones from that memory; only the wait on ``reduce_done``
    (``GradBuffer.release_held``) orders the two. This is the edge the two-GPU runs cannot
    isolate (``docs/stream_handoffs.md``). The cases with two micro-batches do not have this edge
    (each unit accumulates into a buffer of its own); under layer graphs the blocks hand their
    graphs' static gradients to the reduce (``fsdp/graph_gradients.py``), and the slot's next unit
    waits on the same event at its ``prepare`` (``release_held``). In a process of its own, as the
    other cases: deterministic cuBLAS needs its workspace setting before the process first uses cuBLAS."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_delays_change_nothing_without_a_group, 1, case)
