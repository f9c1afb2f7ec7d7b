"""GPU: parameters no loss reaches (a pooler in every block and in the root) keep ``.grad = None``
under every graph strategy, as in the eager step, so AdamW's weight decay leaves them as they were
initialised; losses and weights stay bitwise equal to eager (one or two devices, NCCL)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph import GraphConfig
from fsdp_graph.fsdp.registry import root_contexts

from dist_harness import run_ranks
from examples.gpt import GPT
from test_graph_parity_gpu import CFG, _batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS, WARMUP = 8, 3


def _build(info) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        block.pooler = nn.Linear(CFG.d_model, CFG.d_model)  # never called
    model.pooler = nn.Linear(CFG.d_model, CFG.d_model)
    model.to(info.device)
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fsdp_graph.fully_shard(block, mp_policy=policy)
    return fsdp_graph.fully_shard(model, mp_policy=policy)


def _poolers(model: GPT) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters() if "pooler" in n}


def _train(info, strategy: str, optimizer_in_step: bool):
    model = _build(info)
    initial = _poolers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), weight_decay=0.1,
                            capturable=True)
    step = fsdp_graph.make_train_step(
        lambda idx, targets: model(idx, targets)[1], model, opt if optimizer_in_step else None,
        config=GraphConfig(strategy=strategy, num_warmup_iters=WARMUP), example_batch=_batch(0, info))
    losses = []
    for i in range(STEPS):
        losses.append(step(*_batch(i, info)))
        if not optimizer_in_step:
            with_grad = [n for n, p in model.named_parameters() if p.grad is not None]
            assert with_grad and not [n for n in with_grad if "pooler" in n], f"{strategy} step {i}: {with_grad}"
            opt.step()
            opt.zero_grad()
    after = _poolers(model)
    for name, value in initial.items():
        assert torch.equal(after[name], value), f"{strategy}: {name} changed although it never got a gradient"
    if strategy == "layer" and info.world_size > 1:  # (one rank exchanges nothing)
        # The exchange replayed with the steps: every rank has candidates (the poolers), so each copies
        # its flags in and reads the sums back, from the second step of training on.
        replays = root_contexts(model)[0]._exchange[1].graphs.replays
        assert replays.get("use_exchange", 0) >= STEPS - 2, replays
    return torch.stack(losses), fsdp_graph.full_state_dict(model)


def _graphs_match_eager(info, optimizer_in_step: bool) -> None:
    torch.use_deterministic_algorithms(True)
    eager_losses, eager_state = _train(info, "none", optimizer_in_step)
    for strategy in ("layer", "full_iteration"):
        losses, state = _train(info, strategy, optimizer_in_step)
        assert torch.equal(losses, eager_losses), f"{strategy}: {losses.tolist()} vs eager {eager_losses.tolist()}"
        for key, value in eager_state.items():
            assert torch.equal(state[key], value), f"{strategy}: {key} differs from eager"


@pytest.mark.parametrize("optimizer_in_step", [True, False], ids=["optimizer_in_step", "optimizer_outside"])
def test_unused_parameters_keep_no_gradient_under_graphs(optimizer_in_step):
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_graphs_match_eager, min(2, torch.cuda.device_count()), optimizer_in_step)
