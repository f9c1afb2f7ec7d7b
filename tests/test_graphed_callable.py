"""CPU: a graphed callable's replay-time checks, with the CUDA graphs emulated.

The emulated forward "graph" re-runs the module on the static inputs and copies the result into
the static outputs; the emulated backward differentiates that run into the static gradients.
Everything else (input checks, parameter checks, one backward per forward, how gradients
reach autograd) is the real code path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from fsdp_graph.graphs.capture import (
    CaptureTarget,
    backward_pass,
    captured_call,
    forward_pass,
    normalize_capture_time_hooks,
)
from fsdp_graph.graphs.graphed_callable import GraphedCallable


class _EmulatedGraphs:
    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.captured = None
        self.replays = {"forward": 0, "backward": 0}

    def forward_graph(self):
        return _Replayer(self, "forward")

    def backward_graph(self):
        return _Replayer(self, "backward")

    def run(self, which: str) -> None:
        c = self.captured
        self.replays[which] += 1
        args, kwargs = _tree(c)
        if which == "forward":
            with torch.enable_grad():
                self._out = self.module(*args, **kwargs)
            c.output_leaves[0].copy_(self._out.detach())
            return
        inputs = [x for x in c.input_leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        inputs += [p for p in c.params if p.requires_grad]
        grads = torch.autograd.grad(self._out, inputs, c.static_grad_outputs[0])
        targets = [g for g in c.static_grad_inputs if g is not None]
        for target, grad in zip(targets, grads):
            target.copy_(grad)


class _Replayer:
    def __init__(self, graphs: _EmulatedGraphs, which: str) -> None:
        self.graphs, self.which = graphs, which

    def replay(self) -> None:
        self.graphs.run(self.which)


def _tree(c):
    from torch.utils._pytree import tree_unflatten

    return tree_unflatten(c.input_leaves, c.input_spec)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, *, scale: float = 1.0, bias=None):
        y = self.lin(x) * scale
        return y if bias is None else y + bias


def emulated(module: nn.Module, args: tuple, kwargs: dict | None = None):
    """Capture ``module`` the way make_graphed_callables does, with emulated graphs."""
    call = CaptureTarget(
        module, "Scaled", args, kwargs or {}, {k: {} for k in ("pre_forward", "forward", "pre_backward", "backward")}
    )
    fwd = forward_pass(call)
    bwd = backward_pass(call, fwd)
    graphs = _EmulatedGraphs(module)
    call.fwd_graph, call.bwd_graph = graphs.forward_graph(), graphs.backward_graph()
    captured = captured_call(call, fwd, bwd, grad_enabled=True)
    graphs.captured = captured
    return GraphedCallable(captured, eager=module.forward, module=module), graphs


def test_emulated_replay_matches_eager_and_grad_never_aliases_static_buffers():
    torch.manual_seed(0)
    module, reference = Scaled(), Scaled()
    reference.load_state_dict(module.state_dict())
    graphed, _ = emulated(module, (torch.randn(2, 3, requires_grad=True),), {"scale": 2.0})
    for _ in range(2):  # two micro-batches accumulate into .grad, as in eager
        x = torch.randn(2, 3, requires_grad=True)
        graphed(x, scale=2.0).square().sum().backward()
        reference(x.detach(), scale=2.0).square().sum().backward()
    static_grads = {g.data_ptr() for g in graphed.captured.static_grad_inputs if g is not None}
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        assert p.grad.data_ptr() not in static_grads  # adopted would mean overwritten by the next replay


def _graphed(**kwargs):
    module = Scaled()
    graphed, graphs = emulated(module, (torch.randn(2, 3, requires_grad=True),), kwargs)
    return module, graphed, graphs


@pytest.mark.parametrize(
    "live, expected",
    [
        (torch.randn(4, 3, requires_grad=True), r"expected shape \(2, 3\).*got shape \(4, 3\)"),
        (torch.randn(2, 3, dtype=torch.float64, requires_grad=True), r"expected .*torch.float32.*got .*torch.float64"),
        (torch.randn(2, 3), "expected .*requires_grad=True, got .*requires_grad=False"),
        ("not a tensor", "expected .*got str 'not a tensor'"),
    ],
)
def test_input_that_differs_from_the_sample_is_refused(live, expected):
    _, graphed, graphs = _graphed()
    with pytest.raises(
        ValueError, match=r"graphed Scaled: input args\[0\] does not match the captured sample: " + expected
    ):
        graphed(live)
    assert graphs.replays["forward"] == 0


def test_keyword_structure_and_frozen_values_are_checked():
    _, graphed, _ = _graphed(scale=2.0)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"argument kwargs\['scale'\] is 3.0 but was 2.0 at capture"):
        graphed(x, scale=3.0)
    with pytest.raises(ValueError, match=r"called with 1 positional argument\(s\) and keyword arguments \[\]"):
        graphed(x)
    with pytest.raises(ValueError, match=r"keyword arguments \['bias', 'scale'\]"):
        graphed(x, scale=2.0, bias=torch.zeros(3))
    graphed(x, scale=2.0).sum().backward()


def test_forward_twice_before_backward_is_refused_until_the_first_graph_is_gone():
    _, graphed, graphs = _graphed()
    x = torch.randn(2, 3, requires_grad=True)
    out = graphed(x)
    with pytest.raises(
        RuntimeError, match="forward called again while the previous forward's backward is still pending"
    ):
        graphed(x)
    assert graphs.replays["forward"] == 1
    del out  # the first forward's autograd graph is gone: its backward can never come
    graphed(x).sum().backward()
    graphed(x).sum().backward()
    assert graphs.replays == {"forward": 3, "backward": 2}


def test_backward_twice_for_one_forward_is_refused():
    _, graphed, _ = _graphed()
    loss = graphed(torch.randn(2, 3, requires_grad=True)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward without a matching forward"):
        loss.backward()


def test_forward_under_no_grad_leaves_nothing_pending():
    _, graphed, _ = _graphed()
    with torch.no_grad():
        out = graphed(torch.randn(2, 3))  # requires_grad does not matter without autograd
        graphed(torch.randn(2, 3))
    assert not out.requires_grad
    graphed(torch.randn(2, 3, requires_grad=True)).sum().backward()


def test_other_training_mode_runs_eagerly():
    module, graphed, graphs = _graphed()
    module.eval()
    out = graphed(torch.randn(5, 3))  # another shape is fine: this is the eager forward
    assert out.shape == (5, 3) and graphs.replays["forward"] == 0


def test_replaced_parameter_is_refused():
    module, graphed, _ = _graphed()
    module.lin.weight = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(RuntimeError, match="parameter 'lin.weight' is not the tensor the graph was captured with"):
        graphed(torch.randn(2, 3, requires_grad=True))


def test_output_modified_in_place_before_backward_is_refused():
    _, graphed, _ = _graphed()
    out = graphed(torch.randn(2, 3, requires_grad=True))
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match="output was modified in place"):
        out.sum().backward()


def test_backwards_must_run_in_reverse_capture_order_within_one_pool():
    first, second = Scaled(), Scaled()
    graphed_first, _ = emulated(first, (torch.randn(2, 3, requires_grad=True),))
    graphed_second, _ = emulated(second, (torch.randn(2, 3, requires_grad=True),))
    group = graphed_first.group  # as make_graphed_callables groups callables captured together
    graphed_second.group, graphed_second.index = group, 1
    group.members.append(graphed_second)
    a = graphed_first(torch.randn(2, 3, requires_grad=True))
    b = graphed_second(torch.randn(2, 3, requires_grad=True))
    with pytest.raises(RuntimeError, match="captured after it into the same memory pool"):
        a.sum().backward()
    b.sum().backward()  # reverse capture order: fine
    a.sum().backward()
    graphed_first(torch.randn(2, 3, requires_grad=True)).sum().backward()  # the second one has nothing pending
    assert graphed_first.replays == 2 and graphed_second.replays == 1


def _four_in_one_pool_block_2_prefetching_block_0():
    """Four emulated graphs captured into one pool, as activation offload of every other block
    links them (``capture._link_prefetches``): block 2's backward graph prefetches block 0's."""
    graphed = [emulated(Scaled(), (torch.randn(2, 3, requires_grad=True),))[0] for _ in range(4)]
    group = graphed[0].group
    for index, g in enumerate(graphed[1:], 1):
        g.group, g.index = group, index
        group.members.append(g)
    graphed[0].prefetched_by, graphed[2].prefetches = graphed[2], graphed[0]
    return graphed


def test_a_prefetch_survives_the_backwards_between_it_and_its_reader_not_a_forward_replay():
    graphed = _four_in_one_pool_block_2_prefetching_block_0()
    for _ in range(2):  # backward 3, 2 (prefetches 0), 1 (prefetches nothing), 0 (reads): allowed
        h = [torch.randn(2, 3, requires_grad=True)]
        for g in graphed:
            h.append(g(h[-1]))
        h[4].sum().backward()
    assert graphed[0].group.prefetched_for is graphed[0]
    h = [torch.randn(2, 3, requires_grad=True)]
    for g in graphed:
        h.append(g(h[-1]))
    (grad,) = torch.autograd.grad(h[4].sum(), h[2])  # backward 3 and 2: block 0's tensors are back
    with torch.no_grad():
        graphed[3](torch.randn(2, 3))  # an evaluation replay of block 3 may overwrite them
    with pytest.raises(RuntimeError, match="a forward graph of the group or another prefetching backward replayed"):
        h[2].backward(grad)


def test_replay_under_another_autocast_setting_is_refused():
    _, graphed, graphs = _graphed()
    graphed.captured.autocast = (True, torch.bfloat16)  # as if captured inside torch.autocast("cuda")
    with pytest.raises(RuntimeError, match=r"autocast is \(False, None\) but was \(True, torch.bfloat16\) at capture"):
        graphed(torch.randn(2, 3, requires_grad=True))
    assert graphs.replays["forward"] == 0


def test_capture_time_pre_forward_hook_must_return_args_and_kwargs():
    bad = {"pre_forward": {0: lambda m, a, k: a}, "forward": {}, "pre_backward": {}, "backward": {}}
    call = CaptureTarget(Scaled(), "Scaled", (torch.zeros(1, 3),), {}, bad)
    with pytest.raises(TypeError, match="pre_forward hook of Scaled must return None or \\(args, kwargs\\)"):
        call.run_pre_forward((torch.zeros(1, 3),), {})


def test_transformer_engines_hook_names_run_where_ours_of_their_kind_run():
    """TE's ``capture_time_hooks`` form (``hook(module)``, returning None) beside ours in one dict:
    each runs where ours of its kind runs, in the dict's order, through a warm-up-style pass."""
    log = []

    def te(tag):
        return lambda module: log.append((tag, type(module).__name__))

    entry = {
        "pre_forward": {0: lambda m, a, k: log.append(("pre_forward", len(a)))},
        "forward_pre_hooks": {0: te("forward_pre_hooks")},
        "forward_hooks": {0: te("forward_hooks")},
        "backward_pre_hooks": {0: te("backward_pre_hooks")},
        "backward": {0: lambda m: log.append(("backward", None))},
        "backward_hooks": {0: te("backward_hooks")},
    }
    (hooks,) = normalize_capture_time_hooks([entry], 1)
    call = CaptureTarget(Scaled(), "Scaled", (torch.randn(2, 3, requires_grad=True),), {}, hooks)
    backward_pass(call, forward_pass(call))
    assert log == [
        ("pre_forward", 1), ("forward_pre_hooks", "Scaled"), ("forward_hooks", "Scaled"),
        ("backward_pre_hooks", "Scaled"), ("backward", None), ("backward_hooks", "Scaled"),
    ]


def test_a_transformer_engine_style_hook_that_returns_a_value_is_an_error_naming_ours():
    (hooks,) = normalize_capture_time_hooks([{"forward_hooks": {"cast": lambda module: 1.0}}], 1)
    call = CaptureTarget(Scaled(), "Scaled", (torch.randn(2, 3, requires_grad=True),), {}, hooks)
    with pytest.raises(TypeError, match=r"capture_time_hooks\[0\]\['forward_hooks'\]\['cast'\] returned a value.*"
                                        r"hook\(module\) and must return None.*'forward' \(module, args, outputs\)"):
        forward_pass(call)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['forward_post_hooks'\].*TransformerEngine's"):
        normalize_capture_time_hooks([{"forward_post_hooks": {}}], 1)


def test_a_forward_replayed_inside_a_backward_is_refused_naming_the_fix():
    """Activation checkpointing's recompute would replay the graph inside the backward, overwriting
    pool memory the backward still needs; checkpointing a graphed module saves no memory anyway."""
    graphed, graphs = emulated(Scaled(), (torch.randn(2, 3, requires_grad=True),))
    x = torch.randn(2, 3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(graphed, x, use_reentrant=True)  # (the first forward: no grad, allowed)
    assert graphs.replays["forward"] == 1
    with pytest.raises(RuntimeError, match="forward ran inside a backward .*out of activation checkpointing"):
        out.sum().backward()
    assert graphs.replays["forward"] == 1, "the refused recompute replayed the graph"


def test_autograd_grad_returns_gradients_that_the_next_replay_leaves_alone():
    """``torch.autograd.grad`` hands the caller what the backward returns: as eagerly, a tensor of its own,
    not a static buffer that the next replay overwrites (the module's input, a parameter, and a
    non-leaf input reached through a view, whose gradient is a view of what the replay returned)."""
    torch.manual_seed(0)
    module, reference = Scaled(), Scaled()
    reference.load_state_dict(module.state_dict())
    graphed, graphs = emulated(module, (torch.randn(2, 3, requires_grad=True),))
    xs = [torch.randn(2, 3, requires_grad=True) for _ in range(3)]
    got = [torch.autograd.grad(graphed(x).square().sum(), [x, module.lin.weight]) for x in xs]
    flat = [x.detach().reshape(6).mul(2).requires_grad_() for x in xs]
    hidden = [f * 1 for f in flat]  # (non-leaf)
    got += [torch.autograd.grad(graphed(h.view(2, 3)).square().sum(), [h]) for h in hidden]
    want = [torch.autograd.grad(reference(x).square().sum(), [x, reference.lin.weight]) for x in xs]
    want += [torch.autograd.grad(reference(h.view(2, 3)).square().sum(), [h]) for h in hidden]
    assert graphs.replays["backward"] == 6
    for i, (g, w) in enumerate(zip(got, want)):
        assert all(torch.equal(a, b) for a, b in zip(g, w)), f"call {i}: a later replay overwrote its gradients"
    graphed(xs[0]).square().sum().backward()  # (a plain backward still accumulates, as eagerly)
    reference(xs[0]).square().sum().backward()
    assert torch.equal(module.lin.weight.grad, reference.lin.weight.grad)


def test_a_leaf_reached_through_a_view_keeps_its_own_gradient_over_micro_batches():
    """A plain backward: the input is a view of a leaf, so the leaf's gradient is a view of what the
    replay returned, which AccumulateGrad adopts as ``.grad`` unless it is a copy; the next
    micro-batch's replay would overwrite it before adding to it."""
    torch.manual_seed(0)
    module, reference = Scaled(), Scaled()
    reference.load_state_dict(module.state_dict())
    graphed, _ = emulated(module, (torch.randn(2, 3, requires_grad=True),))
    leaf = torch.randn(6, requires_grad=True)
    leaf_ref = leaf.detach().clone().requires_grad_()
    for power in (2, 3):  # (two micro-batches with different gradients)
        graphed(leaf.view(2, 3)).pow(power).sum().backward()
        reference(leaf_ref.view(2, 3)).pow(power).sum().backward()
    assert torch.equal(leaf.grad, leaf_ref.grad)
    assert torch.equal(module.lin.weight.grad, reference.lin.weight.grad)


def test_between_graphed_modules_the_static_gradient_is_handed_on_without_a_copy():
    """In a plain backward one graph's input gradient goes to the graph before it as the static buffer
    itself (that replay copies it into its own): no copy per block. Eager code between them gets a copy."""
    first, second = Scaled(), Scaled()
    g1, _ = emulated(first, (torch.randn(2, 3, requires_grad=True),))
    g2, _ = emulated(second, (torch.randn(2, 3, requires_grad=True),))
    seen = []
    h = g1(torch.randn(2, 3, requires_grad=True))
    h.register_hook(lambda grad: seen.append(grad.data_ptr()))
    g2(h).sum().backward()
    assert seen == [g2.captured.static_grad_inputs[0].data_ptr()]
    seen.clear()
    h = g1(torch.randn(2, 3, requires_grad=True))
    h2 = h * 1.0  # (eager code between the two graphs)
    h2.register_hook(lambda grad: seen.append(grad.data_ptr()))
    g2(h2).sum().backward()
    assert seen and seen[0] != g2.captured.static_grad_inputs[0].data_ptr()


def test_a_leaf_hook_returning_a_view_of_the_gradient_leaves_the_static_buffer_alone():
    """A tensor hook on a parameter or a leaf input may return a view of the gradient it is shown
    (harmless eagerly); AccumulateGrad adopts that view as ``.grad``, so it must not be a static buffer."""
    torch.manual_seed(0)
    module, reference = Scaled(), Scaled()
    reference.load_state_dict(module.state_dict())
    graphed, _ = emulated(module, (torch.randn(2, 3, requires_grad=True),))
    x = torch.randn(2, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    for t in (module.lin.weight, reference.lin.weight, x, x_ref):
        t.register_hook(lambda g: g.detach())
    for power in (2, 3):  # (two micro-batches with different gradients)
        graphed(x).pow(power).sum().backward()
        reference(x_ref).pow(power).sum().backward()
    assert torch.equal(module.lin.weight.grad, reference.lin.weight.grad)
    assert torch.equal(x.grad, x_ref.grad)


class _Passing(torch.autograd.Function):
    """Shaped as FSDP's post-backward trigger: a non-tensor first, then tensors passed on unchanged."""

    @staticmethod
    def forward(ctx, tag, *inputs):
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


def test_the_walk_through_a_pass_through_node_follows_the_gradient_s_position():
    """Through a trigger with two inputs, a graph's input gradient is handed on as the static buffer only
    where that position leads to the graph before it; where it leads to eager code, a copy."""
    from fsdp_graph.graphs.backward_probe import PASS_THROUGH

    g1, _ = emulated(Scaled(), (torch.randn(2, 3, requires_grad=True),))
    g2, _ = emulated(Scaled(), (torch.randn(2, 3, requires_grad=True),))
    static = g2.captured.static_grad_inputs[0].data_ptr()
    PASS_THROUGH.add(_Passing._backward_cls)
    try:
        for graph_first in (False, True):
            seen = {}
            eager = torch.randn(2, 3, requires_grad=True) * 1.0
            h = g1(torch.randn(2, 3, requires_grad=True))
            eager.register_hook(lambda grad: seen.update(eager=grad.data_ptr()))
            h.register_hook(lambda grad: seen.update(graph=grad.data_ptr()))
            pair = _Passing.apply("tag", *((h, eager) if graph_first else (eager, h)))
            g2(pair[1]).sum().backward()  # (the second position: eager's when the graph's is first)
            if graph_first:  # (the unused position gets zeros, materialised by autograd)
                assert seen["eager"] != static, seen
            else:
                assert seen["graph"] == static, seen
    finally:
        PASS_THROUGH.discard(_Passing._backward_cls)
