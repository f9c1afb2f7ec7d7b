"""The two ways a unit's gradients reach its reduce (autograd's own tensors; the fixed buffer of a
unit whose reduce replays as a graph), on the cases a review found: no_sync switched on in the middle
of a unit's backward, and a sparse embedding gradient. Against a replicated reference, one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.fsdp.capture_interface import units_in

from models import EagerCollectiveBodies, on_fixed_buffers


def _full(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 7)
        self.a = nn.Sequential(nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 7))
        self.b = nn.Sequential(nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 7))

    def forward(self, x):
        return self.b(self.a(self.first(x))).pow(2).sum()


@pytest.mark.parametrize("fixed", [False, True], ids=["autograd_tensors", "fixed_buffer"])
def test_no_sync_switched_on_inside_a_units_backward_keeps_that_gradient(fixed, monkeypatch):
    torch.manual_seed(0)
    model = Two()
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model.a)
    fsdp_graph.fully_shard(model.b)
    fsdp_graph.fully_shard(model)
    if fixed:
        on_fixed_buffers(model, monkeypatch)
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(s)) for s in range(2)]

    def flip(grad):
        model.a.set_requires_gradient_sync(False)

    handle = model.a[1].register_forward_hook(lambda m, i, o: o.register_hook(flip) and None)
    model(xs[0]).backward()  # unit a's pre-backward ran with sync on, its post-backward sees it off
    handle.remove()
    model.a.set_requires_gradient_sync(True)
    model(xs[1]).backward()
    for x in xs:
        ref(x).backward()
    for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.grad), rp.grad, msg=lambda m: f"{name}: {m}")


def test_a_sparse_embedding_gradient_is_reduced_like_a_dense_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4, sparse=True), nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model)
    idx = torch.tensor([[1, 2, 3], [4, 1, 0]])
    model(idx).sum().backward()
    ref(idx).sum().backward()
    torch.testing.assert_close(_full(model[0].weight.grad), ref[0].weight.grad.to_dense())


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(4))

    def forward(self, x):
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).sum()


def _fail_in_backward_of(module: nn.Module, action):
    """A hook on ``module``'s output gradient (inside the enclosing unit's backward)."""
    return module.register_forward_hook(lambda m, i, o: o.register_hook(action) and None)


def test_a_slot_shared_by_both_paths_keeps_no_stale_gradient(monkeypatch):
    """Blocks 0 and 2 share a slot; only block 0's reduce replays (fixed buffer). A backward that
    fails inside block 0 leaves the buffer dirty; then no_sync switched on inside block 2's backward
    (autograd's tensors) must not mark the slot's buffer zero: block 0 would add the stale sum in."""
    torch.manual_seed(0)
    model = Chain()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        fsdp_graph.fully_shard(block)
    fsdp_graph.fully_shard(model)
    x1, x2 = (torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in range(2))
    model(x1)  # lazy init: slots taken in execution order
    units = {u.module: u for u in units_in(model)}
    assert units[model.blocks[0]].param_group.buffers is units[model.blocks[2]].param_group.buffers
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    units[model.blocks[0]].replay_collectives(EagerCollectiveBodies())

    def boom(grad):
        raise RuntimeError("boom")

    handle = _fail_in_backward_of(model.blocks[0][0], boom)  # after block 0's last Linear accumulated
    with pytest.raises(RuntimeError, match="boom"):
        model(x1).backward()
    handle.remove()
    model.zero_grad()

    def flip(grad):
        model.blocks[2].set_requires_gradient_sync(False)

    handle = _fail_in_backward_of(model.blocks[2][0], flip)
    model(x2).backward()
    handle.remove()
    ref(x2).backward()
    for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
        if not name.startswith("blocks.2."):  # (block 2's sum waits for the next synchronised backward)
            torch.testing.assert_close(_full(p.grad), rp.grad, msg=lambda m: f"{name}: {m}")
