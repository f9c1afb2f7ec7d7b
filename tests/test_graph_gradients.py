"""Gradients a graphed module hands straight to its unit (``fsdp/graph_gradients.py``,
``graphs/gradient_handoff.py``), on CPU: the blocks' backward graphs emulated by an autograd function
that writes each gradient into a static buffer of its own, as a replayed backward does, and then
offers them with the graph layer's own ``hand_over``. Training at two ranks must stay bitwise equal to
the same emulation returning every gradient to autograd (today's fixed gradient buffer), and match the
replicated reference, whatever the user does with ``.grad``; the units that take the graphs'
gradients never allocate a gradient buffer, and their reduce reads the static buffers in place."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.fsdp.capture_interface import units_in
from fsdp_graph.fsdp.introspect import unit_buffers
from fsdp_graph.graphs.backward_probe import CONSUMERS, PROBE, engine_runs, returnable
from fsdp_graph.graphs.gradient_handoff import hand_over, plan_handoffs

from dist_harness import run_ranks
from models import EagerCollectiveBodies, RecordingCollectiveBodies, build, local_loss, on_fixed_buffers, shard

pytestmark = pytest.mark.cpu_only  # CPU and gloo: CI runs it; the real graphs' half runs in the GPU suite


class _Replayed(torch.autograd.Function):
    """A graphed module's replay: the forward without autograd, the backward into static buffers."""

    @staticmethod
    def forward(ctx, graphed, x, *args):
        ctx.graphed = graphed  # (args: the parameters, then the probe, as a replay takes them)
        ctx.save_for_backward(x)
        return graphed.forward(x)

    @staticmethod
    def backward(ctx, grad):
        graphed = ctx.graphed
        (x,) = ctx.saved_tensors
        params = list(graphed.module.parameters())  # (the unsharded ones: the unit's pre-backward swapped them in)
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            wrt = [x] + [p for p in params if p.requires_grad]
            grads = iter(torch.autograd.grad(graphed.forward(x), wrt, grad, allow_unused=True))
        for static in graphed.static:
            if static is not None:
                static.copy_(next(grads))
        plain = engine_runs(ctx.next_functions[-1][0])
        edges = ctx.next_functions
        return (None, *returnable(hand_over(graphed.plan, graphed.static, edges, plain), edges, plain), None)


CONSUMERS.add(_Replayed._backward_cls)  # (as a replay's: reads the gradient it is given, keeps nothing)


class _Graphed:
    """Installed as a module's forward: FSDP's hooks run around it as around a graphed module."""

    def __init__(self, module: nn.Module, hand: bool) -> None:
        self.module, self.forward, self.hand = module, module.forward, hand
        self.static: list | None = None  # the input's, then each parameter's static gradient buffer
        self.plan: list = []
        module.forward = self

    def __call__(self, x):
        params = list(self.module.parameters())
        if self.static is None:  # (the first call, as a capture: FSDP's unshard swapped the unsharded ones in)
            self.static = [torch.zeros_like(x)] + [torch.zeros_like(p) if p.requires_grad else None for p in params]
            self.plan = plan_handoffs(params, self.module, self.static, 1) if self.hand else []
        return _Replayed.apply(self, x, *params, PROBE)


def _graphed_model(info, hand: bool):
    """(TinyLM sharded, its reduces as collective graphs would run them, every block "graphed"; its reference)."""
    model, ref = build(info.device, n_blocks=3)
    shard(model)
    on_fixed_buffers(model)
    for block in model.blocks:
        _Graphed(block, hand)
    return model, ref


def _train(info, hand: bool, variant: str):
    model, ref = _graphed_model(info, hand)
    bodies = {}
    for block in model.blocks:
        unit = units_in(block)[0]
        bodies[unit] = RecordingCollectiveBodies()
        unit.replay_collectives(bodies[unit])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        micro = 2 if variant in ("two_backwards", "no_sync") else 1
        for m in range(micro):
            quiet = model.no_sync() if variant == "no_sync" and m == 0 else contextlib.nullcontext()
            with quiet:
                loss = local_loss(model, 2 * step + m, info)
                loss.backward()
            losses.append(loss.detach())
            for r in range(info.world_size):  # the reference sees every rank's part, averaged
                info_r = type("R", (), {"rank": r, "world_size": info.world_size, "device": info.device})
                (local_loss(ref, 2 * step + m, info_r) / info.world_size).backward()
        grads = [p.grad.full_tensor().clone() for p in model.parameters() if p.grad is not None]
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if p.grad is not None:
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda s, name=name: f"step {step} {name}: {s}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=variant != "kept")
        ref_opt.zero_grad()
    blocks = [units_in(b)[0] for b in model.blocks]
    return torch.stack(losses), grads, [p.full_tensor() for p in model.parameters()], blocks, bodies


def _handed_over_like_autograd(info, variant: str) -> None:
    losses, grads, weights, through_autograd, _ = _train(info, False, variant)
    h_losses, h_grads, h_weights, blocks, bodies = _train(info, True, variant)
    assert torch.equal(losses, h_losses), (losses, h_losses)
    assert all(torch.equal(a, b) for a, b in zip(grads, h_grads)), "gradients differ from autograd's path"
    assert all(torch.equal(a, b) for a, b in zip(weights, h_weights)), "weights differ from autograd's path"
    synced = variant != "no_sync"  # (under no_sync every backward of a step accumulates: autograd's path)
    for unit, other in zip(blocks, through_autograd):
        # Through autograd a synchronised backward adds into the fixed gradient buffer; handed over, none
        # exists (under no_sync both accumulate in the accumulation buffer instead).
        assert unit_buffers(other).grads != (0, 0) or not synced
        assert unit_buffers(unit).grads == (0, 0), f"{unit.name}: {unit_buffers(unit).grads}"
        statics = unit.module.forward.static  # (the _Graphed installed on the block)
        read = {ptr for name, key in bodies[unit].runs if name == "copy_in" and isinstance(key[0], tuple)
                for ptr in key[0]}
        handed = {s.data_ptr() for s in statics[1:] if s is not None}
        assert (handed <= read) == synced, f"{unit.name}: the reduce read {read}, the static buffers are {handed}"


@pytest.mark.parametrize("variant", ["zero_grad", "kept", "two_backwards", "no_sync"])
def test_gradients_handed_over_train_bitwise_as_through_autograd(variant):
    run_ranks(_handed_over_like_autograd, 2, variant)


def _input_gradients_then_a_step(info, hand: bool):
    model = _graphed_model(info, hand)[0]
    inputs = []
    hook = model.blocks[0].register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    loss = local_loss(model, 0, info)
    hook.remove()
    (embedding,) = torch.autograd.grad(loss, inputs)  # the blocks' input: accumulates into no parameter
    kept = embedding.clone()
    untouched = [p.grad is None for b in model.blocks for p in b.parameters()]
    local_loss(model, 1, info).backward()
    assert torch.equal(embedding, kept), "the next backward overwrote the gradient autograd.grad returned"
    return embedding, untouched, [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]


def _autograd_grad_leaves_the_parameters_alone(info) -> None:
    embedding, untouched, grads = _input_gradients_then_a_step(info, False)
    h_embedding, h_untouched, h_grads = _input_gradients_then_a_step(info, True)
    assert all(untouched) and all(h_untouched), "autograd.grad of another tensor gave the blocks' parameters a .grad"
    assert torch.equal(embedding, h_embedding)
    assert len(grads) == len(h_grads) and all(torch.equal(a, b) for a, b in zip(grads, h_grads)), (
        "the next backward's gradients differ: the graphs handed over gradients autograd.grad did not accumulate")


def test_autograd_grad_of_other_tensors_hands_no_gradient_over():
    run_ranks(_autograd_grad_leaves_the_parameters_alone, 2)


def _a_parameters_own_gradient_inside_the_forward(info, hand: bool):
    model = _graphed_model(info, hand)[0]
    held, inner = [], []
    model.blocks[0].register_forward_pre_hook(lambda m, args: held.append(m.ln.weight))  # (the unsharded one now)
    hook = model.blocks[0].register_forward_hook(
        lambda m, args, out: inner.append(torch.autograd.grad(out.sum(), held, retain_graph=True)[0].clone()))
    loss = local_loss(model, 0, info)
    hook.remove()
    loss.backward()
    return inner[0], [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]


def _autograd_grad_of_a_parameter_is_answered_as_without_handoff(info) -> None:
    inner, grads = _a_parameters_own_gradient_inside_the_forward(info, False)
    h_inner, h_grads = _a_parameters_own_gradient_inside_the_forward(info, True)  # (torch refused the question)
    assert torch.equal(inner, h_inner)
    assert len(grads) == len(h_grads) and all(torch.equal(a, b) for a, b in zip(grads, h_grads))


def test_autograd_grad_of_a_graphed_parameter_itself_works_with_the_handoff():
    run_ranks(_autograd_grad_of_a_parameter_is_answered_as_without_handoff, 2)


class _Tied(nn.Module):
    """One unit whose graphed part shares a weight with a module beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _tied(info, hand: bool):
    torch.manual_seed(0)
    model = nn.Sequential(_Tied(), nn.Linear(6, 2))
    fsdp_graph.fully_shard(model[0])
    fsdp_graph.fully_shard(model)
    on_fixed_buffers(model)
    graphed = _Graphed(model[0].a, hand)
    unit = units_in(model[0])[0]
    unit.replay_collectives(EagerCollectiveBodies())
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(info.rank))
    model(x).sum().backward()
    model(x).sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()], graphed, unit


def _a_tie_outside_the_graph_keeps_autograds_path(info) -> None:
    grads, _, _ = _tied(info, False)
    h_grads, graphed, unit = _tied(info, True)
    assert graphed.plan, "the graph offers the untied bias"
    assert not unit.grads.from_graphs.covered.issuperset(unit.grads.trainable), "the tied weight was covered"
    assert unit_buffers(unit).grads != (0, 0), "the unit, not covered, keeps its fixed gradient buffer"
    assert all(torch.equal(a, b) for a, b in zip(grads, h_grads))


def test_a_weight_tied_outside_the_graph_is_not_handed_over():
    run_ranks(_a_tie_outside_the_graph_keeps_autograds_path, 2)
