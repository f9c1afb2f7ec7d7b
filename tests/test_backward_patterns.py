"""Backward patterns found by an adversarial review, one process against a replicated reference: a
plain dataclass output, one layer shared by several reentrant checkpoint segments inside one unit,
a tied weight used inside and outside a reentrant checkpoint, and a double backward
(create_graph=True), which cannot be right and must be refused."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import fsdp_graph

from models import assert_same_grads, shard_beside_reference


@dataclass
class Hidden:  # not registered with pytree (an HF ModelOutput is)
    states: torch.Tensor


class DataclassBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return Hidden(torch.tanh(self.lin(x)))


class DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DataclassBlock() for _ in range(3))
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x).states
        return self.head(x)


def test_a_unit_returning_a_plain_dataclass_matches_the_reference():
    torch.manual_seed(0)
    model = DataclassNet()
    ref = shard_beside_reference(model, model.blocks)
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    for m in (model, ref):
        F.mse_loss(m(x), y).backward()
    assert_same_grads(model, ref)


def _one_unit_on_token_ids_matches_the_reference(model: nn.Module, vocab: int) -> None:
    ref = shard_beside_reference(model)
    idx, targets = torch.randint(0, vocab, (4, 5)), torch.randint(0, vocab, (4, 5))
    for m in (model, ref):
        F.cross_entropy(m(idx).flatten(0, 1), targets.flatten()).backward()
    assert_same_grads(model, ref)


class SharedLayer(nn.Module):
    """One layer run by three reentrant checkpoint segments (ALBERT-style), token-id inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.layer = nn.Linear(6, 6)
        self.head = nn.Linear(6, 13)

    def forward(self, idx):
        x = self.emb(idx)
        for _ in range(3):
            x = x + cp.checkpoint(lambda t: torch.tanh(self.layer(t)), x, use_reentrant=True)
        return self.head(x)


def test_a_layer_shared_by_reentrant_checkpoint_segments_matches_the_reference():
    """The unit's inputs need no gradient (its post-backward runs at the end of the backward): the
    shared layer accumulates once per segment."""
    torch.manual_seed(0)
    _one_unit_on_token_ids_matches_the_reference(SharedLayer(), vocab=13)


class TiedHeadCheckpointed(nn.Module):
    """The embedding's weight is also the head's, and the head runs inside a checkpoint: with a
    reentrant one, that use accumulates into the weight in the checkpoint's own backward, before the
    lookup's accumulation."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.a = nn.Linear(6, 6)
        self.reentrant = reentrant

    def forward(self, idx):
        x = cp.checkpoint(lambda t: torch.tanh(self.a(t)), self.emb(idx), use_reentrant=self.reentrant)
        return cp.checkpoint(lambda t: t @ self.emb.weight.T, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_tied_weight_used_inside_and_outside_a_checkpoint_matches_the_reference(reentrant):
    """The unit's inputs need no gradient. It finished once every parameter had accumulated, so a
    reentrant checkpoint's second accumulation into the tied weight came after it (refused as a
    stray gradient). It now finishes at the end of the backward, as FSDP2's units do."""
    torch.manual_seed(0)
    _one_unit_on_token_ids_matches_the_reference(TiedHeadCheckpointed(reentrant), vocab=11)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def test_a_double_backward_through_units_is_refused():
    """A gradient penalty: with three units sharing two slots the second backward read parameters a
    later unit had overwritten (wrong gradients, no error, before)."""
    model = nn.Sequential(*(Residual() for _ in range(3)), nn.Linear(6, 1))
    for block in model[:3]:
        fsdp_graph.fully_shard(block)
    fsdp_graph.fully_shard(model)
    x = torch.randn(8, 6, requires_grad=True)
    out = model(x)
    with pytest.raises(RuntimeError, match=r"create_graph=True.*Compute the penalty outside"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    model(torch.randn(8, 6)).sum().backward()  # the next step trains as before
