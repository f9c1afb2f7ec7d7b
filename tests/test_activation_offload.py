"""Activation offload's refusals, each naming the fix (CPU; the offload itself: test_activation_offload_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.graphs.activation_offload import ActivationOffload, HostPlan
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


def test_offload_inside_a_training_graph_is_refused_where_it_cannot_work():
    model, handle = _offloaded_model()
    # A per-layer graph of an offloaded module records its offload: no offload refusal (this machine or the
    # CPU model refuses it for other reasons).
    with pytest.raises((RuntimeError, ValueError)) as refused:
        fsdp_graph.graph_modules([model.blocks[0]], [(torch.zeros(2, 8, 10),)])
    assert "offload" not in str(refused.value)
    with pytest.raises(ValueError, match="a module inside it offloads.*Offload the graphed modules"):
        fsdp_graph.graph_modules([model], [(torch.zeros(2, 8, dtype=torch.long),)])
    with pytest.raises(ValueError, match="a block of this segment offloads.*segment_size=1"):
        fsdp_graph.graph_segments(list(model.blocks), [(torch.zeros(2, 8, 10),)] * 3, segment_size=3)
    with pytest.raises(RuntimeError) as refused:  # the whole step records offload too: refused for CUDA only
        validate_graph_config(fsdp_graph.GraphConfig(strategy="full_iteration"), model)
    assert "offload" not in str(refused.value)
    handle.remove()


def test_graph_config_offload_is_checked_before_any_work():
    model, _ = build(torch.device("cpu"))
    shard(model)
    config = fsdp_graph.GraphConfig
    with pytest.raises(ValueError, match="offload_activations with segment_size=2.*segment_size=1"):
        validate_graph_config(config(strategy="layer", segment_size=2, offload_activations=type(model.blocks[0])),
                              model)
    with pytest.raises(ValueError, match=r"offload_activations selects a Linear inside a graphed \w*Block"):
        validate_graph_config(config(strategy="layer", offload_activations=nn.Linear), model)
    with pytest.raises(ValueError, match="offload_activations=.*selects no module"):
        validate_graph_config(config(offload_activations=nn.Conv1d), model)
    with pytest.raises(ValueError, match="offload_min_bytes must be an int >= 0"):
        validate_graph_config(config(offload_activations=nn.Linear, offload_min_bytes=-1), model)
    with pytest.raises(ValueError, match="not part of the model"):
        validate_graph_config(config(offload_activations=[nn.Linear(2, 2)]), model)
    if not torch.cuda.is_available():  # eager offload: installed by make_train_step, which needs CUDA
        with pytest.raises(RuntimeError, match="offload_activations needs a CUDA device"):
            fsdp_graph.make_train_step(lambda x: model(x).sum(), model,
                                       config=config(offload_activations=type(model.blocks[0])))


def test_a_capture_sees_the_tensors_the_warm_up_saved_or_is_refused():
    plan = HostPlan("graphed module 0 (Block)")
    plan.buffers = [torch.empty(4, 8), torch.empty(4, 8)]  # (as a warm-up pass left them; pinned on CUDA)
    plan.start_pass()
    assert plan.take(torch.zeros(4, 8), capturing=True) is plan.buffers[0]
    with pytest.raises(RuntimeError, match=r"tensor #1 \(\(4, 9\).*a different one there.*same saved tensors"):
        plan.take(torch.zeros(4, 9), capturing=True)
    with pytest.raises(RuntimeError, match="tensor #2.*saved only 2"):
        plan.take(torch.zeros(4, 8), capturing=True)
