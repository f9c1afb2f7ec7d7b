"""GPU, two devices on NCCL: a run checkpointed with ``Checkpointer`` and resumed in fresh processes
is bitwise the uninterrupted run under every graph strategy: the whole-step graph (captured again
after the resume, over the capturable AdamW state loaded before the capture) and per-layer graphs.

The checkpoint is taken mid-run, after the whole-step graph has replayed (state read in place);
the resumed run builds another model (another seed), loads, then builds its step.
"""

from __future__ import annotations

import os

import pytest
import torch

import fsdp_graph
from fsdp_graph import GraphConfig

from dist_harness import run_ranks
from test_graph_parity_gpu import STEPS, _batch, _build

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
SAVE_AT = 8  # after 3 warm-up steps and 5 replays


def _run(info, root: str, strategy: str, part: str) -> None:
    """part: "whole" (STEPS steps, saving at SAVE_AT), "first" (stops after SAVE_AT), "rest" (resumes)."""
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = _build(info, oversized_block=False)
    if part == "rest":  # other initial values: the checkpoint must set them
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), capturable=True,
                                  fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    ckpt = fsdp_graph.Checkpointer(os.path.join(root, part if part == "whole" else "cut"))
    start = ckpt.load(model, optimizer, scheduler=scheduler) or 0
    assert start == (SAVE_AT if part == "rest" else 0)
    config = GraphConfig(strategy=strategy)  # layer: every block
    step = fsdp_graph.make_train_step(lambda idx, targets: model(idx, targets)[1], model, optimizer, config=config,
                                      example_batch=_batch(start, info), max_grad_norm=1.0)
    losses = {}
    for i in range(start, SAVE_AT if part == "first" else STEPS):
        losses[i] = step(*_batch(i, info))
        scheduler.step()
        if i + 1 == SAVE_AT and part != "rest":
            ckpt.save(SAVE_AT, model, optimizer, scheduler=scheduler)
    if strategy == "full_iteration" and part != "first":
        assert step.replays > 0
    state = fsdp_graph.full_state_dict(model)
    torch.save({"losses": {i: v.cpu() for i, v in losses.items()}, "state": {k: v.cpu() for k, v in state.items()}},
               os.path.join(root, f"{part}.rank{info.rank}.pt"))


@pytest.mark.parametrize("strategy", ["full_iteration", "layer"])
def test_a_resumed_graphed_run_is_bitwise_the_uninterrupted_one(tmp_path, strategy):
    for part in ("whole", "first", "rest"):
        run_ranks(_run, 2, str(tmp_path), strategy, part)
    for rank in range(2):
        whole = torch.load(tmp_path / f"whole.rank{rank}.pt")
        rest = torch.load(tmp_path / f"rest.rank{rank}.pt")
        assert sorted(rest["losses"]) == list(range(SAVE_AT, STEPS))
        differing = [i for i in rest["losses"] if not torch.equal(rest["losses"][i], whole["losses"][i])]
        assert not differing, f"rank {rank}: losses differ from step {differing[0]}"
        for key, value in whole["state"].items():
            assert torch.equal(rest["state"][key], value), f"rank {rank}: {key} differs"
