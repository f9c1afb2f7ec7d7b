"""GPU, one device: every warm-up and capture of the package runs on one stream per device, so
cuBLAS's per-(thread, stream) workspaces (32 MiB each on Hopper, kept for the process's life and used
by the graphs captured with them) are paid once, not once per capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph import GraphConfig
from fsdp_graph.graphs.capture_stream import capture_stream

from dist_harness import run_ranks
from examples.gpt import GPT
from test_graph_parity_gpu import CFG, MICRO_BATCH

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _capture_growth(module: nn.Module, sample: torch.Tensor) -> int:
    """Device memory still allocated after graphing ``module`` (its pool's tensors, workspaces)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fsdp_graph.make_graphed_callables([module], [(sample,)])
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def _second_capture_pays_no_workspace(info) -> None:
    workspace = 4 << 20  # (at least: 32 MiB on Hopper, 8 MiB before, each; torch 2.13 names it)
    mlps = []
    for seed in range(3):
        torch.manual_seed(seed)
        mlps.append(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(info.device))
    sample = torch.randn(64, 256, device=info.device, requires_grad=True)
    mlps[0](sample).sum().backward()  # eager first: the default stream's workspaces exist
    first, second = _capture_growth(mlps[1], sample), _capture_growth(mlps[2], sample)
    assert first - second >= workspace, (
        f"the first capture kept {first} bytes and the second {second}: the second paid cuBLAS's "
        f"workspaces (at least {workspace} bytes each) again")


def test_a_second_capture_does_not_pay_cublas_workspaces_again():
    run_ranks(_second_capture_pays_no_workspace, 1)  # (a fresh process: no capture ran in it yet)


def _model_seeing_streams(seen: set) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    for block in model.blocks:
        fsdp_graph.fully_shard(block)
    fsdp_graph.fully_shard(model)
    attn = model.blocks[0].attn  # (inside a graphed block: its Python runs in warm-ups and captures only)
    forward = attn.forward

    def seeing(*args, **kwargs):
        seen.add(torch.cuda.current_stream())
        return forward(*args, **kwargs)

    attn.forward = seeing  # (not a hook: graph_modules refuses hooks inside a graphed module)
    return model


@pytest.mark.parametrize("what", ["eval_whole_model", "train_full_iteration", "train_layer", "train_segments"])
def test_every_warm_up_and_capture_runs_on_the_one_capture_stream(what):
    seen = set()
    model = _model_seeing_streams(seen)
    idx = torch.randint(0, CFG.vocab_size, (MICRO_BATCH, CFG.seq_len), device="cuda")
    batch = (idx, (idx * 7 + 3) % CFG.vocab_size)
    if what == "eval_whole_model":
        fsdp_graph.make_eval_step(model, config=GraphConfig(forward_only="model", num_warmup_iters=1),
                                  example_args=batch)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
        strategy, segment_size = {"train_full_iteration": ("full_iteration", 1), "train_layer": ("layer", 1),
                                  "train_segments": ("layer", 2)}[what]
        config = GraphConfig(strategy=strategy, segment_size=segment_size, num_warmup_iters=1,
                             optimizer_graph=strategy == "layer")
        step = fsdp_graph.make_train_step(lambda i, t: model(i, t)[1], model, opt, config=config, example_batch=batch)
        for _ in range(2):
            step(*batch)
    assert seen - {torch.cuda.current_stream()} == {capture_stream()}, seen
