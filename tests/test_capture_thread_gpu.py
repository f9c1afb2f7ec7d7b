"""GPU, one device: warm-ups and captures run their backward on the calling thread.

cuBLAS keeps a workspace (32 MiB on Hopper) per (thread, stream) for the life of the process, and
a graph keeps the one it was captured with. Autograd runs a CUDA backward on a thread of its own,
so a capture stream whose forward and backward ran on two threads would hold two workspaces
(``docs/performance.md``, *cuBLAS workspaces*). A probe in every block records the (thread,
stream) of its forward and backward while the step is built and run: on every stream but the
caller's, one thread. The caller's stream, where the user's eager code runs its backward on
autograd's thread, shows that the probe sees that thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph import GraphConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SEEN: list[tuple[int, int, str]] = []  # (thread, stream, "forward" or "backward") of every probe call


def _note(what: str) -> None:
    SEEN.append((threading.get_ident(), torch.cuda.current_stream().cuda_stream, what))


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        _note("forward")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _note("backward")
        return grad


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + _Probe.apply(torch.tanh(self.lin(x)))


class Model(nn.Module):
    def __init__(self, d: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)  # (so the blocks' hidden state requires grad, as segments need)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, d)

    def forward(self, x, y):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x), y)


def _sharded() -> Model:
    torch.manual_seed(0)
    model = Model().cuda()
    for block in model.blocks:
        fsdp_graph.fully_shard(block)
    return fsdp_graph.fully_shard(model)


def _by_stream(what: str | None = None) -> dict[int, set[int]]:
    """Stream -> the threads the probe ran on there (its forwards and backwards, or only ``what``)."""
    by_stream: dict[int, set[int]] = {}
    for thread, stream, kind in SEEN:
        if what in (None, kind):
            by_stream.setdefault(stream, set()).add(thread)
    return by_stream


@pytest.mark.parametrize("config", [
    GraphConfig(strategy="layer"),
    GraphConfig(strategy="layer", segment_size=2),
    GraphConfig(strategy="full_iteration"),
], ids=["per_layer", "segments", "whole_step"])
def test_warm_ups_and_captures_run_the_backward_on_the_calling_thread(config):
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    batch = (torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda"))
    SEEN.clear()
    step = fsdp_graph.make_train_step(lambda x, y: model(x, y), model, opt, config=config, example_batch=batch)
    for _ in range(config.num_warmup_iters + 3):
        step(*batch)
    torch.cuda.synchronize()
    caller = torch.cuda.current_stream().cuda_stream
    elsewhere = {s: threads for s, threads in _by_stream().items() if s != caller}
    backwards = {s for s in _by_stream("backward") if s != caller}
    assert backwards, "no backward ran on a warm-up or capture stream"
    main = threading.get_ident()
    assert all(threads == {main} for threads in elsewhere.values()), elsewhere

    # The probe sees autograd's own thread where a backward runs there: an eager model's, on the caller's stream.
    SEEN.clear()
    _sharded()(*batch).backward()
    torch.cuda.synchronize()
    assert len(_by_stream().get(caller, set())) == 2
