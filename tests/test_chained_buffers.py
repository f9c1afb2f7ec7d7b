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
    assert graphed[0].chain_source is None and graphed[1].chain_source is graphed[0] and graphed[0].feeds_chain
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


def test_a_call_that_would_overwrite_a_readable_chained_output_is_refused_and_one_that_would_not_is_copied():
    model, reference = _pair(1)
    graphed = chained_emulated(list(model.blocks), torch.randn(2, 3, requires_grad=True), [[], [(0, 0)], [(0, 0)]])
    x = torch.randn(2, 3, requires_grad=True)
    h0 = graphed[0](x)
    with pytest.raises(RuntimeError, match=r"block 1: its input args\[0\] is read where graphed block 0 writes its "
                                           r"output.*chain_static_buffers=False"):
        graphed[1](h0 * 2)  # h0 is alive (and block 0's backward pending): it would be overwritten
    del h0
    with torch.no_grad():  # nothing pending, nothing handed out alive: the copy is safe
        graphed[0](x)
        out = graphed[2](graphed[1](torch.full((2, 3), 0.5)))
        assert torch.equal(out, reference.blocks[2](reference.blocks[1](torch.full((2, 3), 0.5))))
