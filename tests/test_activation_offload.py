"""Activation offload's refusals, each naming the fix (CPU; the offload itself: test_activation_offload_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.graphs.activation_offload import ActivationOffload
from fsdp_graph.steps.graph_config import validate_graph_config

from models import build, shard


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="min_bytes must be an int >= 0"):
        fsdp_graph.offload_activations([nn.Linear(2, 2)], min_bytes=-1)
    with pytest.raises(TypeError, match="expects nn.Module objects; item 0 is a Tensor"):
        fsdp_graph.offload_activations([torch.zeros(2)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_offload_without_cuda_is_refused():
    with pytest.raises(RuntimeError, match="needs a CUDA device.*drop it"):
        fsdp_graph.offload_activations([nn.Linear(2, 2)])


def _offloaded_model():
    model, _ = build(torch.device("cpu"))
    shard(model)
    handle = ActivationOffload(list(model.blocks), ["blocks"], 0)  # (installed as offload_activations would)
    return model, handle


def test_a_module_offloaded_twice_is_refused():
    model, _handle = _offloaded_model()
    with pytest.raises(ValueError, match="offloaded already; call remove"):
        fsdp_graph.offload_activations([model.blocks[0]])


def test_a_training_graph_of_an_offloaded_module_is_refused():
    model, handle = _offloaded_model()
    with pytest.raises(ValueError, match="offloads its activations.*not built yet.*remove\\(\\)"):
        fsdp_graph.graph_modules([model.blocks[0]], [(torch.zeros(2, 8, 10),)])
    with pytest.raises(ValueError, match="offloads its activations"):
        validate_graph_config(fsdp_graph.GraphConfig(strategy="full_iteration"), model)
    handle.remove()
    with pytest.raises((RuntimeError, ValueError)) as refused:  # now for other reasons: CPU model or machine
        fsdp_graph.graph_modules([model.blocks[0]], [(torch.zeros(2, 8, 10),)])
    assert "offload" not in str(refused.value)
