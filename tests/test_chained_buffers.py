"""CPU: chained static buffers (``graphs/chained_buffers.py``), with the CUDA graphs emulated as in
``test_graphed_callable.py``: the links the example forward finds, the capture's aliasing, replays
bitwise equal to eager, and the refusal of a call that would overwrite an output still readable."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_graph.graphs.capture import CaptureTarget, capture_pass, captured_call, link_chains
from fsdp_graph.graphs.graphed_callable import CaptureGroup, GraphedCallable
from fsdp_graph.graphs.module_graphs import record_sample_args

from test_graphed_callable import Scaled, _EmulatedGraphs

HOOKS = ("pre_forward", "forward", "pre_backward", "backward")


class Chain(nn.Module):
    def __init__(self, count: int = 3, between=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Scaled() for _ in range(count))
        self.between = between

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.between is not None and i == 0:
                x = self.between(x)
        return x


def test_the_example_forward_links_an_input_to_the_previous_output_only_where_it_is_that_tensor():
    x = torch.randn(2, 3, requires_grad=True)
    chain = Chain()
    samples = record_sample_args(list(chain.blocks), lambda: chain(x))
    assert samples.links == [[], [(0, 0)], [(0, 0)]]
    scaled = Chain(between=lambda h: h * 2)  # code between blocks 0 and 1 makes a new tensor
    assert record_sample_args(list(scaled.blocks), lambda: scaled(x)).links == [[], [], [(0, 0)]]
    same_values = Chain(between=lambda h: h.detach().clone().requires_grad_())
    assert record_sample_args(list(same_values.blocks), lambda: same_values(x)).links == [[], [], [(0, 0)]]
    flip = iter([False, True])  # the code differs between the two example calls: no link there
    varying = Chain(between=lambda h: h + 0 if next(flip) else h)
    assert record_sample_args(list(varying.blocks), lambda: varying(x)).links == [[], [], [(0, 0)]]


def chained_emulated(modules: list[nn.Module], sample: torch.Tensor, links) -> list[GraphedCallable]:
    """Capture ``modules`` as ``capture._capture`` does (one pool, chained per ``links``), graphs emulated."""
    calls = [CaptureTarget(m, f"block {i}", (sample,), {}, {k: {} for k in HOOKS}) for i, m in enumerate(modules)]
    emulations = [_EmulatedGraphs(m) for m in modules]
    for call, graphs in zip(calls, emulations):
        call.fwd_graph, call.bwd_graph = graphs.forward_graph(), graphs.backward_graph()
    passes, backwards = capture_pass(calls, links, forward_only=False, capturing=False)
    group = CaptureGroup()
    graphed = []
    for call, fwd, bwd, graphs, module in zip(calls, passes, backwards, emulations, modules):
        graphs.captured = captured_call(call, fwd, bwd, grad_enabled=True)
        graphed.append(GraphedCallable(graphs.captured, eager=module.forward, module=module, group=group))
    link_chains(graphed, passes)
    return graphed


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    model = Chain()
    reference = Chain()
    reference.load_state_dict(model.state_dict())
    return model, reference


def test_chained_graphs_share_their_buffers_and_train_bitwise_as_eager():
    model, reference = _pair()
    graphed = chained_emulated(list(model.blocks), torch.randn(2, 3, requires_grad=True), [[], [(0, 0)], [(0, 0)]])
    for before, after in zip(graphed, graphed[1:]):
        assert after.static_inputs[0].data_ptr() == before.static_outputs[0].data_ptr()
        assert before.captured.static_grad_outputs[0].data_ptr() == after.captured.static_grad_inputs[0].data_ptr()
    assert graphed[0].chain_source is None and graphed[1].chain_source is graphed[0]
    assert graphed[0].chained_reader is graphed[1] and graphed[2].chained_reader is None
    for step in range(3):
        x = torch.randn(2, 3, requires_grad=True)
        h = x
        for g in graphed:
            h = g(h)
        h.square().sum().backward()
        expected = reference(x.detach().requires_grad_())
        expected.square().sum().backward()
        assert torch.equal(h, expected), step
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), step


def test_a_chained_input_that_is_not_the_previous_output_in_place_is_refused_never_copied_over_it():
    model, _ = _pair(1)
    graphed = chained_emulated(list(model.blocks), torch.randn(3, 3, requires_grad=True), [[], [(0, 0)], [(0, 0)]])
    x = torch.randn(3, 3, requires_grad=True)
    fix = r"chain_static_buffers=False"
    h0 = graphed[0](x)
    with pytest.raises(RuntimeError, match=r"block 1: its input args\[0\] is read where graphed block 0 writes its "
                                           r"output.*" + fix):
        graphed[1](h0 * 2)  # a copy would overwrite h0, which this code still holds
    with pytest.raises(RuntimeError, match=fix):
        graphed[1](h0.t())  # the output itself, read with other strides: no copy either
    del h0
    with torch.no_grad():
        kept = graphed[0](x).detach()  # an alias that leaves no trace on the graph's output
        before = kept.clone()
        with pytest.raises(RuntimeError, match=fix):
            graphed[1](torch.full((3, 3), 0.5))
        assert torch.equal(kept, before), "the refused call must not have written anything"


def test_the_previous_forward_is_refused_while_the_chained_block_s_backward_reads_its_output():
    model, _ = _pair(2)
    graphed = chained_emulated(list(model.blocks), torch.randn(2, 3, requires_grad=True), [[], [(0, 0)], [(0, 0)]])
    h = graphed[0](torch.randn(2, 3, requires_grad=True)).detach().requires_grad_()  # block 0's own graph let go
    out = graphed[1](h)  # block 1's backward reads block 0's output memory
    with pytest.raises(RuntimeError, match=r"block 0: its forward would overwrite its output, which graphed block 1 "
                                           r"reads in place.*Run block 1's backward first.*chain_static_buffers=False"):
        graphed[0](torch.randn(2, 3, requires_grad=True))
    out.sum().backward()
    graphed[0](torch.randn(2, 3, requires_grad=True))  # nothing pending reads it now


def test_an_input_a_pre_forward_hook_replaced_at_capture_gets_a_copy_of_its_own():
    model, _ = _pair(3)
    calls = [CaptureTarget(m, f"block {i}", (torch.randn(2, 3, requires_grad=True),), {}, {k: {} for k in HOOKS})
             for i, m in enumerate(model.blocks)]
    calls[1].hooks["pre_forward"]["scale"] = lambda module, args, kwargs: ((args[0] * 2,), kwargs)
    passes, _ = capture_pass(calls, [[], [(0, 0)], [(0, 0)]], forward_only=False, capturing=False)
    assert [fwd.chained for fwd in passes] == [[], [], [0]]


def test_graph_modules_refuses_chained_inputs_it_cannot_use():
    from fsdp_graph import graph_modules

    blocks, sample = [Scaled(), Scaled()], (torch.randn(2, 3, requires_grad=True),)
    with pytest.raises(ValueError, match="one list of pairs per module.*got 1 for 2 modules"):
        graph_modules(blocks, [sample] * 2, chained_inputs=[[]])
    with pytest.raises(ValueError, match="training graphs.*forward_only=True. Drop chained_inputs"):
        graph_modules(blocks, [sample] * 2, forward_only=True, chained_inputs=[[], [(0, 0)]])


def test_chain_static_buffers_is_a_bool():
    from fsdp_graph import GraphConfig
    from fsdp_graph.steps.graph_config import validate_graph_config

    with pytest.raises(TypeError, match="chain_static_buffers must be True or False"):
        validate_graph_config(GraphConfig(strategy="layer", chain_static_buffers="no"), Chain())
