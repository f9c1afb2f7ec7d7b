"""CPU: what ``graph_segments`` and ``GraphConfig(segment_size=)`` refuse before any capture, each
naming the fix. (The segments themselves, bitwise against eager: ``test_segment_graphs_gpu.py``.)"""

from __future__ import annotations

import pytest
import torch

import fsdp_graph
from fsdp_graph import GraphConfig
from fsdp_graph.steps.graph_config import validate_graph_config

from models import TinyLM, shard


def _samples(model: TinyLM) -> list[tuple]:
    return [(torch.zeros(2, 8, 10, requires_grad=True),)] * len(model.blocks)


def test_segment_size_is_checked_and_belongs_to_layer_graphs():
    model = shard(TinyLM())
    for size in (0, 1.5, True):
        with pytest.raises(ValueError, match="segment_size must be an int >= 1"):
            fsdp_graph.graph_segments(list(model.blocks), _samples(model), segment_size=size)
        with pytest.raises(ValueError, match="GraphConfig.segment_size must be an int >= 1"):
            validate_graph_config(GraphConfig(strategy="layer", segment_size=size), model)
    with pytest.raises(ValueError, match="segment_size=2 groups the blocks of strategy='layer'.*Use strategy='layer'"):
        validate_graph_config(GraphConfig(strategy="full_iteration", segment_size=2), model)
    for choice in (True, False):  # accepted (the root's reduce-scatters in pieces, outside the segments):
        with pytest.raises(RuntimeError, match="needs CUDA"):  # what remains to refuse on a CPU machine
            validate_graph_config(GraphConfig(strategy="layer", collective_graphs=choice, segment_size=2), model)
    with pytest.raises(TypeError, match="graph_segments: collective_graphs must be True, False or None, got 'no'"):
        fsdp_graph.graph_segments(list(model.blocks), _samples(model), segment_size=2, collective_graphs="no")
    with pytest.raises(ValueError, match="forward_only='layer'.*Use forward_only='model'.*or 'none'"):
        validate_graph_config(GraphConfig(strategy="layer", forward_only="layer", segment_size=2), model)


def test_chained_inputs_need_one_list_of_pairs_per_module():
    model = shard(TinyLM())
    with pytest.raises(ValueError, match=r"chained_inputs needs one list of pairs per module \(record_sample_args"):
        fsdp_graph.graph_segments(list(model.blocks), _samples(model), segment_size=2, chained_inputs=[[]])


def test_modules_that_are_not_fsdp_units_of_their_own_are_refused():
    model = shard(TinyLM())
    with pytest.raises(ValueError, match=r"is not an FSDP unit of its own.*fully_shard\(block\) on every block"):
        fsdp_graph.graph_segments([model.blocks[0].ln], [(torch.zeros(2, 8, 10),)], segment_size=1)
    with pytest.raises(ValueError, match="contains FSDP unit"):
        fsdp_graph.graph_segments([model], [(torch.zeros(2, 8, dtype=torch.long),)], segment_size=1)
    with pytest.raises(ValueError, match="a module appears twice"):
        fsdp_graph.graph_segments([model.blocks[0]] * 2, _samples(model)[:2], segment_size=2)
    with pytest.raises(ValueError, match="3 modules, 1 sample_args"):
        fsdp_graph.graph_segments(list(model.blocks), _samples(model)[:1], segment_size=2)
    samples = _samples(model)
    samples[1] = (torch.zeros(2, 8, 10, requires_grad=True), torch.zeros(2, 8))  # called otherwise than the first
    with pytest.raises(ValueError, match=r"block 1 of segment modules 0..1 is called with other arguments.*modules="):
        fsdp_graph.graph_segments(list(model.blocks), samples, segment_size=2)


def test_a_block_reading_a_parameter_of_another_unit_is_refused():
    model = TinyLM()
    model.blocks[1].ln.weight = model.blocks[0].ln.weight  # tied across two blocks
    shard(model)
    with pytest.raises(ValueError, match=r"module 0 reads parameter 'ln.weight'.*Untie it"):
        fsdp_graph.graph_segments(list(model.blocks), _samples(model), segment_size=3)


def test_blocks_with_hooks_of_their_own_or_kept_parameters_are_refused():
    model = shard(TinyLM())
    handle = model.blocks[1].register_forward_hook(lambda m, a, o: None)
    with pytest.raises(ValueError, match=r"module 1 has hooks of its own.*Remove them, or graph this block"):
        fsdp_graph.graph_segments(list(model.blocks), _samples(model), segment_size=3)
    handle.remove()
    model.blocks[2].set_reshard_after_backward(False)
    with pytest.raises(ValueError, match=r"set_reshard_after_backward\(False\).*Leave it at True"):
        fsdp_graph.graph_segments(list(model.blocks), _samples(model), segment_size=3)


def test_a_valid_request_on_cpu_says_that_graphs_need_cuda():
    model = shard(TinyLM())
    refusal = (ValueError, "is on the CPU; CUDA graphs need the model on a GPU") if torch.cuda.is_available() else (
        RuntimeError, "graph_segments needs a CUDA device")
    with pytest.raises(refusal[0], match=refusal[1]):
        fsdp_graph.graph_segments(list(model.blocks), _samples(model), segment_size=2)
    assert all("forward" not in block.__dict__ for block in model.blocks)  # nothing installed
    assert all(len(block._forward_pre_hooks) for block in model.blocks)  # FSDP's hooks still on



def test_graphing_while_gradients_accumulate_without_sync_is_refused():
    """Under no_sync the capture would record no reduce-scatter, and every replay would add whatever
    the parking buffer holds into ``.grad``."""
    model = shard(TinyLM())
    with model.no_sync():
        with pytest.raises(ValueError, match=r"accumulates gradients without synchronising.*outside no_sync"):
            fsdp_graph.graph_segments(list(model.blocks), _samples(model), segment_size=2)
    model.set_requires_gradient_sync(False)
    with pytest.raises(ValueError, match=r"accumulates gradients without synchronising"):
        fsdp_graph.graph_segments(list(model.blocks), _samples(model), segment_size=2)
