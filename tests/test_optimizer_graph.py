"""CPU: what ``graph_optimizer_step`` and ``GraphConfig(optimizer_graph=True)`` refuse before any
capture, and the checks a captured optimizer step makes before each replay, each naming the fix.
(The graphs themselves, bitwise against eager: ``test_optimizer_graph_gpu.py``.)"""

from __future__ import annotations

import pytest
import torch

import fsdp_graph
from fsdp_graph import GraphConfig
from fsdp_graph.steps.captured_optimizer import CapturedOptimizer
from fsdp_graph.steps.graph_config import validate_graph_config
from fsdp_graph.steps.optimizer_graph import CapturedGradients

from models import TinyLM, shard


def test_optimizer_graph_belongs_to_the_layer_strategy():
    model = shard(TinyLM())
    with pytest.raises(ValueError, match="strategy is 'none', which runs eagerly. Use strategy='layer'"):
        validate_graph_config(GraphConfig(optimizer_graph=True), model)
    with pytest.raises(ValueError, match=r"has the optimizer step inside already\). Drop optimizer_graph"):
        validate_graph_config(GraphConfig(strategy="full_iteration", optimizer_graph=True), model)
    with pytest.raises(TypeError, match="optimizer_graph must be True or False"):
        validate_graph_config(GraphConfig(strategy="layer", optimizer_graph="yes"), model)


def test_graph_optimizer_step_refuses_what_it_cannot_graph():
    model = shard(TinyLM())
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        fsdp_graph.graph_optimizer_step(model, model.parameters())
    with pytest.raises(ValueError, match="num_warmup_iters must be an int >= 1"):
        fsdp_graph.graph_optimizer_step(model, opt, num_warmup_iters=0)
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="call fsdp_graph.fully_shard on its blocks and its root first"):
        fsdp_graph.graph_optimizer_step(plain, torch.optim.AdamW(plain.parameters()))
    with pytest.raises(RuntimeError, match="needs CUDA.*Call optimizer.step"):
        fsdp_graph.graph_optimizer_step(model, opt)


def _captured(**group):
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([param], lr=1e-3, **group)
    captured = CapturedOptimizer(opt, torch.device("cpu"), "graph_optimizer_step", "build it again")
    return opt, captured


def test_the_learning_rate_becomes_a_tensor_that_schedulers_fill_in_place():
    opt, captured = _captured()
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)  # (adds initial_lr, a tensor)
    captured.refuse_tensor_hyperparameters()  # initial_lr is the scheduler's, not read by the step
    captured.freeze()
    opt.step()
    scheduler.step()
    captured.check()  # filled in place: the captured tensor holds the new value
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(5e-4)
    opt.param_groups[0]["lr"] = 0.1
    with pytest.raises(RuntimeError, match=r"learning rate was replaced.*group\['lr'\].fill_\(value\)"):
        captured.check()


def test_hyperparameters_held_in_tensors_are_refused_before_the_capture():
    opt, captured = _captured(betas=(torch.tensor(0.9), torch.tensor(0.999)))
    with pytest.raises(ValueError, match="'betas' holds a tensor.*Pass betas as a Python number"):
        captured.refuse_tensor_hyperparameters()


def test_state_made_by_a_captured_step_is_undone():
    """What the optimizer-step graph does when a capture made state (a parameter's first gradient)."""
    opt, captured = _captured()
    first, second = opt.param_groups[0]["params"][0], torch.nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [second]})
    first.grad = torch.ones_like(first)
    opt.step()  # state for the first parameter only: the second has no gradient yet
    keys = captured.state_keys()
    second.grad = torch.ones_like(second)
    opt.step()  # (in a capture: the second's state made inside the graph)
    assert captured.drop_state_made_since(keys) == 1
    assert not opt.state.get(second) and set(opt.state[first]) == {"step", "exp_avg", "exp_avg_sq"}


def test_hyperparameters_changed_after_the_capture_are_refused():
    opt, captured = _captured(betas=(0.9, 0.95), weight_decay=0.1)
    opt.param_groups[0]["weight_decay"] = 0.2  # before the capture: the eager steps use it
    captured.check()
    captured.freeze()
    captured.check()
    opt.param_groups[0]["betas"] = (0.85, 0.95)  # what OneCycleLR(cycle_momentum=True) does
    with pytest.raises(RuntimeError, match=r"'betas' changed from \(0.9, 0.95\) to \(0.85, 0.95\).*cycle_momentum"):
        captured.check()
    opt.param_groups[0]["betas"] = (0.9, 0.95)
    captured.check()
    opt.param_groups[0]["weight_decay"] = 0.0
    with pytest.raises(RuntimeError, match="'weight_decay' changed from 0.2 to 0.0"):
        captured.check()


def test_a_changed_list_of_parameters_is_refused():
    opt, captured = _captured()
    captured.freeze()
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(RuntimeError, match="param group 0's list of parameters changed.*Build it again"):
        captured.check()


def test_groups_or_state_replaced_after_the_capture_are_refused():
    opt, captured = _captured()
    opt.step()
    captured.freeze()
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(RuntimeError, match="param groups were replaced, or its state.*build it again"):
        captured.check()
    opt, captured = _captured()
    captured.freeze()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(RuntimeError, match="param groups were replaced, or its state"):
        captured.check()


def test_the_gradient_check_tells_a_missing_gradient_from_an_empty_one_and_follows_places_not_objects():
    """``CapturedGradients``, the optimizer graph's check before each replay: a ``.grad`` None now where
    the capture read an empty one (a rank holding no rows of a parameter: address 0, like nothing) is
    refused, even once the captured object is gone; a new object at the captured place, shape and dtype
    (homed gradients back home after a move) is accepted; another shape at that place is not."""
    big = torch.zeros(6)
    check = CapturedGradients([big, torch.empty(0, 3)])  # (the empty one dies at once: only a weak reference)
    assert check.differs([big, None]) == "parameter 1's .grad is None, a tensor at the capture"
    assert check.differs([big, torch.empty(0, 3)]) is None
    assert check.differs([big.view(2, 3), torch.empty(0, 3)]) == "parameter 0's .grad is not where the capture " \
                                                                  "read it (its memory moved)"
    assert check.differs([big[:6], torch.empty(0, 3)]) is None  # (a new view of the same memory)
    assert check.differs([torch.zeros(6), torch.empty(0, 3)]) is not None
