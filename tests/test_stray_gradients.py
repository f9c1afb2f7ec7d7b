"""A loss term computed from a tensor a unit kept but did not return: its gradient reaches the
unit's parameters or inputs without passing through its outputs, so the unit's backward never
starts. Each such case must raise (the gradient would be lost, silently, before); the legitimate
pattern (the kept tensor's unit also gets a gradient through its outputs) must match a replicated
reference. One process, both gradient paths (autograd's tensors; the fixed buffer)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.fsdp.stray_gradients import StrayGradientError

from models import on_fixed_buffers


class KeepsAux(nn.Module):
    """Keeps a tensor of its forward on itself (an aux-loss pattern); returns it, a tensor computed
    from it, or a detached copy (``returned``)."""

    def __init__(self, returned: str) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.returned = returned
        self.kept: torch.Tensor | None = None

    def forward(self, x):
        y = self.lin(x)
        self.kept = y
        if self.returned == "downstream":
            return torch.tanh(y)  # the kept tensor is upstream of the output
        return y if self.returned == "output" else y.detach()


class Model(nn.Module):
    def __init__(self, returned: str, input_grad: bool) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.block = KeepsAux(returned)
        self.last = nn.Linear(6, 6)
        self.input_grad = input_grad

    def forward(self, x):
        h = self.first(x)
        return self.last(self.block(h if self.input_grad else h.detach()))


def _sharded(returned: str, input_grad: bool, fixed: bool, monkeypatch) -> tuple[Model, Model]:
    torch.manual_seed(0)
    model = Model(returned, input_grad)
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model.block)
    fsdp_graph.fully_shard(model)
    if fixed:
        on_fixed_buffers(model, monkeypatch)
    return model, ref


def _loss(model: Model, x: torch.Tensor, use_output: bool = True) -> torch.Tensor:
    out = model(x)
    aux = model.block.kept.pow(2).mean()
    return out.pow(2).mean() + aux if use_output else aux


def _full(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


paths = pytest.mark.parametrize("fixed", [False, True], ids=["autograd_tensors", "fixed_buffer"])


@paths
def test_an_aux_loss_on_a_kept_tensor_whose_unit_output_gets_no_gradient_is_refused(fixed, monkeypatch):
    """Inputs need no gradient: the unit's parameters get one, found at the end of the backward."""
    model, _ = _sharded("detached", input_grad=False, fixed=fixed, monkeypatch=monkeypatch)
    x = torch.randn(4, 6)
    with pytest.raises(StrayGradientError, match=r"block \(KeepsAux\).*lin.weight, lin.bias.*end of the backward"):
        _loss(model, x).backward()
    # Dropped with the error: after the fix (detaching the kept tensor), training goes on.
    model(x).pow(2).mean().backward()
    assert model.block.lin.weight.grad is None and model.last.weight.grad is not None


@paths
def test_an_aux_loss_reaching_a_units_inputs_around_its_outputs_is_refused(fixed, monkeypatch):
    """Inputs need a gradient: the unit's post-backward trigger fires while the unit is idle (a
    TransitionError about hand-driven hooks before)."""
    model, _ = _sharded("detached", input_grad=True, fixed=fixed, monkeypatch=monkeypatch)
    with pytest.raises(StrayGradientError, match=r"block \(KeepsAux\): a gradient reached its inputs"):
        _loss(model, torch.randn(4, 6)).backward()


@paths
def test_a_backward_that_starts_no_units_backward_is_refused_at_the_next_forward(fixed, monkeypatch):
    """Only the kept tensor in the loss: no unit's output gets a gradient, so no end-of-backward
    step runs; the next forward finds the gradients and refuses."""
    model, _ = _sharded("detached", input_grad=False, fixed=fixed, monkeypatch=monkeypatch)
    x = torch.randn(4, 6)
    _loss(model, x, use_output=False).backward()
    with pytest.raises(StrayGradientError, match=r"lin.weight, lin.bias.*next forward"):
        model(x)


@paths
@pytest.mark.parametrize("returned", ["output", "downstream"])
def test_an_aux_loss_on_a_kept_tensor_of_a_unit_whose_outputs_get_a_gradient_matches_the_reference(
        returned, fixed, monkeypatch):
    """The usual aux-loss pattern (the block's output is used too) is legitimate and stays exact,
    over two steps with an optimizer."""
    model, ref = _sharded(returned, input_grad=True, fixed=fixed, monkeypatch=monkeypatch)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((model, ref), opts):
            _loss(m, x).backward()
        for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(_full(p.grad), rp.grad, msg=lambda m: f"step {step} {name}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()


@paths
def test_a_gradient_left_before_the_units_backward_starts_is_refused_there(fixed, monkeypatch):
    """The kept tensor's term backpropagated first (its own backward call), the output's after: the
    unit's backward finds the gradients waiting on its parameters."""
    model, _ = _sharded("downstream", input_grad=False, fixed=fixed, monkeypatch=monkeypatch)
    out = model(torch.randn(4, 6))
    model.block.kept.pow(2).mean().backward(retain_graph=True)
    with pytest.raises(StrayGradientError, match=r"lin.weight, lin.bias.*as its backward started"):
        out.pow(2).mean().backward()
