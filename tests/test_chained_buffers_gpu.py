"""GPU: per-layer graphs chain their blocks' static buffers (``graphs/chained_buffers.py``).

The sharded GPT through ``make_train_step(GraphConfig(strategy="layer"))``: each block after the
first reads its input where the previous block's graph wrote its output, and that block's backward
reads its output gradient where the next one wrote it; training stays bitwise equal to eager and
to the same strategy without chaining, which holds two activation-sized buffers more per block.
A call that would copy another tensor over a readable output is refused, naming the setting.
Runs on two GPUs (NCCL) where there are two, else on one.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import fsdp_graph
from fsdp_graph import GraphConfig

from dist_harness import run_ranks
from test_graph_parity_gpu import CFG, MICRO_BATCH, _batch, _build
from test_segment_graphs_gpu import _compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 8


def _ranks() -> int:
    return min(2, torch.cuda.device_count())


def _train(info, config: GraphConfig | None):
    model = _build(info, oversized_block=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = torch.cuda.memory_allocated()
    step = fsdp_graph.make_train_step(lambda idx, targets: model(idx, targets)[1], model, opt, config=config,
                                      max_grad_norm=1.0, example_batch=_batch(0, info))
    built = torch.cuda.memory_allocated() - before
    losses = torch.stack([step(*_batch(i, info)) for i in range(STEPS)])
    runners = [block.forward for block in model.blocks] if config is not None else []
    result = (losses, fsdp_graph.full_state_dict(model)), runners, built
    return result


def _chained(runners) -> list[bool]:
    return [after.static_inputs[0].data_ptr() == before.static_outputs[0].data_ptr()
            and before.captured.static_grad_outputs[0].data_ptr() == after.captured.static_grad_inputs[0].data_ptr()
            for before, after in zip(runners, runners[1:])]


def _chaining_saves_two_buffers_per_block_bitwise(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager, _, _ = _train(info, None)
    chained, runners, chained_bytes = _train(info, GraphConfig(strategy="layer"))
    _compare("per-layer graphs, chained", chained, eager)
    assert _chained(runners) == [True] * (CFG.n_layers - 1)
    assert all(r.replays == STEPS for r in runners)
    del runners
    gc.collect()
    copied, runners, copied_bytes = _train(info, GraphConfig(strategy="layer", chain_static_buffers=False))
    _compare("per-layer graphs, not chained", copied, eager)
    assert _chained(runners) == [False] * (CFG.n_layers - 1)
    activation = MICRO_BATCH * CFG.seq_len * CFG.d_model * 2  # one block's output, bf16
    assert copied_bytes - chained_bytes >= 2 * (CFG.n_layers - 1) * activation, (copied_bytes, chained_bytes)


def test_per_layer_graphs_chain_their_blocks_buffers_and_train_bitwise_as_eager():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_chaining_saves_two_buffers_per_block_bitwise, _ranks())


def _a_tensor_other_than_the_previous_output_is_refused(info) -> None:
    model = _build(info, oversized_block=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = fsdp_graph.make_train_step(lambda idx, targets: model(idx, targets)[1], model, opt,
                                      config=GraphConfig(strategy="layer"), example_batch=_batch(0, info))
    step(*_batch(0, info))
    handle = model.blocks[0].register_forward_hook(lambda module, args, output: output * 1)  # new code between
    with pytest.raises(RuntimeError, match=r"read where graphed module 0 .* writes its output.*"
                                           r"chain_static_buffers=False"):
        step(*_batch(1, info))
    handle.remove()


def test_a_call_that_would_overwrite_a_chained_output_is_refused_with_the_setting_that_allows_it():
    run_ranks(_a_tensor_other_than_the_previous_output_is_refused, 1)
