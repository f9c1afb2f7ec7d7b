"""Situations real training runs hit: exceptions mid-step, inference first, freezing after
sharding, units whose inputs need no gradient, and structures fully_shard must refuse."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.fsdp.registry import units_in

from dist_harness import run_ranks
from models import (
    assert_full_state_matches,
    assert_same_grads,
    build,
    global_batch,
    lm_loss,
    local_part,
    on_fixed_buffers,
    sgd_pair,
    shard,
    shard_beside_reference,
    train_beside_reference,
)

CPU = torch.device("cpu")


def test_training_continues_after_an_exception_in_forward():
    model, ref = build(CPU)
    shard(model)
    bad = torch.full((2, 8), 999)  # out-of-range token ids
    with pytest.raises(IndexError):
        model(bad)
    holders = [(m, a, p.master) for u in units_in(model) for p in u.params for m, a in p.refs]
    assert len(holders) > 20 and all(m._parameters[a] is master for m, a, master in holders)
    train_beside_reference(model, ref)  # optimizer built after the failure sees the masters


def test_training_continues_after_an_exception_in_backward():
    model, ref = build(CPU)
    shard(model)
    optimizers = sgd_pair(model, ref)
    idx, targets = global_batch(0, 1, CPU)
    logits = model(idx)

    def fail(grad):
        raise RuntimeError("boom")

    logits.register_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    for o in optimizers:
        o.zero_grad()  # the failed step is skipped
    train_beside_reference(model, ref, optimizers=optimizers)



@pytest.mark.parametrize("fixed", [False, True], ids=["autograd_tensors", "fixed_buffer"])
def test_a_backward_that_fails_midway_through_a_unit_leaves_no_stale_gradient(fixed, monkeypatch):
    """The failure comes after block 2's ``out`` got its gradient and before the unit's reduce.
    With the fixed buffer (a reduce that replays as a graph) that gradient sits in the buffer,
    which only the reduce zeroes; with autograd's tensors it sits on ``.grad``. The next step must
    not add it in either way."""
    model, ref = build(CPU)
    shard(model)
    if fixed:
        on_fixed_buffers(model, monkeypatch)
    optimizers = sgd_pair(model, ref)
    idx, targets = global_batch(0, 1, CPU)

    def fail(grad):
        raise RuntimeError("boom")

    def arm(module, args, out):
        out.register_hook(fail)

    handle = model.blocks[2].fc.register_forward_hook(arm)
    with pytest.raises(RuntimeError, match="boom"):
        nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
    handle.remove()
    for o in optimizers:
        o.zero_grad()
    train_beside_reference(model, ref, optimizers=optimizers)


def test_first_call_under_inference_mode_then_training():
    model, ref = build(CPU)
    shard(model)
    idx, _ = global_batch(0, 1, CPU)
    with torch.inference_mode():
        torch.testing.assert_close(model(idx), ref(idx), rtol=1e-6, atol=1e-7)
    train_beside_reference(model, ref)


def test_freezing_and_unfreezing_after_sharding():
    model, ref = build(CPU)
    shard(model)
    model.blocks[0].fc.weight.requires_grad_(False)
    ref.blocks[0].fc.weight.requires_grad_(False)
    model.blocks[1].ln.weight.requires_grad_(True)  # frozen at construction
    ref.blocks[1].ln.weight.requires_grad_(True)
    train_beside_reference(model, ref)
    assert model.blocks[0].fc.weight.grad is None


class Towers(nn.Module):
    """Two towers fed raw inputs: the first unit of each has inputs that need no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
        self.b = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))

    def forward(self, x, y):
        return (self.a(x) * self.b(y)).sum()


def _towers(info) -> None:
    torch.manual_seed(0)
    model = Towers().to(info.device)
    ref = copy.deepcopy(model)
    for tower in (model.a, model.b):
        for layer in tower:
            fsdp_graph.fully_shard(layer)
    fsdp_graph.fully_shard(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(4 * info.world_size, 6, generator=g).to(info.device) for _ in range(2))
        mine = slice(4 * info.rank, 4 * (info.rank + 1))
        loss = model(x[mine], y[mine])
        loss.backward()
        (ref(x, y) / info.world_size).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_full_state_matches(model, ref, rtol=1e-5, atol=1e-6)


def test_units_whose_inputs_need_no_gradient_release_their_slot():
    run_ranks(_towers, 2)


class DetachedLayers(nn.Module):
    """Each layer fed a detached input: no unit's input needs a gradient, so every post-backward
    waits for the end of the backward, or for another unit's backward to need its slot."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x):
        total = 0
        for layer in self.layers:
            x = torch.tanh(layer(x.detach()))
            total = total + x.pow(2).sum()
        return total


def test_a_no_grad_forward_before_the_backward_keeps_units_waiting_for_the_end_of_it():
    """A forward under no_grad between the training forward and its backward (a target computed
    without gradient) must not forget that the first forward's units finish at the end."""
    torch.manual_seed(0)
    model = DetachedLayers()
    ref = shard_beside_reference(model, model.layers)
    x = torch.randn(3, 6)
    loss = model(x)
    with torch.no_grad():
        model(2 * x)
    loss.backward()
    ref(x).backward()
    assert_same_grads(model, ref)


class CheckpointRegion(nn.Module):
    """One non-reentrant checkpoint region holds two units that share a slot; one of them (fed a
    raw input) returns its output out of the region directly."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.v, self.x, self.u = (nn.Linear(6, 6) for _ in range(4))

    def forward(self, inp, side):
        import torch.utils.checkpoint as cp

        def region(h, side):
            return torch.tanh(self.x(torch.tanh(self.v(h)))), self.u(side)

        xo, uo = cp.checkpoint(region, torch.tanh(self.a(inp)), side, use_reentrant=False)
        return (xo * uo).sum()


def test_a_recompute_never_finishes_a_unit_whose_backward_has_not_run():
    """u's backward starts by recomputing the region, whose v needs u's slot: u's backward has not
    run, so u must not give the slot up (its gradients would come after its reduce). The slot
    conflict is refused, naming the fix, which trains like the reference."""
    torch.manual_seed(0)
    model = CheckpointRegion()
    shard_beside_reference(model, (model.a, model.v, model.x, model.u))
    with pytest.raises(RuntimeError, match="share a double-buffer slot.*double_buffer=False"):
        model(torch.randn(3, 6), torch.randn(3, 6)).backward()
    torch.manual_seed(0)
    model = CheckpointRegion()
    ref = shard_beside_reference(model, (model.a, model.v, model.x, model.u), double_buffer=False)
    inputs = torch.randn(3, 6), torch.randn(3, 6)
    model(*inputs).backward()
    ref(*inputs).backward()
    assert_same_grads(model, ref)


def test_submodule_shared_by_two_units_is_refused():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.Tanh()))
    fsdp_graph.fully_shard(model[0])
    with pytest.raises(ValueError, match=r"submodule '0' is shared with unit .*common ancestor"):
        fsdp_graph.fully_shard(model[1])


def test_forward_without_backward_leaves_no_stale_post_backward_trigger():
    """A forward whose unit inputs need no gradient (frozen embedding) leaves the unit's post-backward
    to the end of the backward; without a backward, the next step (embedding trainable again) must
    not run post-backward twice."""
    model, ref = build(CPU)
    shard(model)
    opt, ref_opt = sgd_pair(model, ref)
    idx, targets = global_batch(0, 1, CPU)
    model.emb.weight.requires_grad_(False)
    model(idx)  # grad enabled, no backward
    model.emb.weight.requires_grad_(True)
    train_beside_reference(model, ref, optimizers=(opt, ref_opt))


def test_failed_parent_fully_shard_leaves_rebuilt_units_training():
    """fully_shard(parent) rebuilds a unit holding a tie, then fails on its own parameters: the
    rebuilt unit still trains (as its own root), and the error names the fix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64))
    model[1].weight = model[0].weight
    fsdp_graph.fully_shard(model[0])
    fsdp_graph.fully_shard(model[1])
    with pytest.raises(TypeError, match="mixed dtypes"):
        fsdp_graph.fully_shard(model)
    x = torch.randn(2, 4)
    model[1](model[0](x)).sum().backward()  # the rebuilt units train
    assert model[0].fsdp_unit.name == "<root> (Linear)", model[0].fsdp_unit.name  # its own class, not FSDPLinear
    assert all(p.grad is not None for p in model[0].parameters())


def test_lazy_init_that_failed_is_tried_again(monkeypatch):
    """An out-of-memory error while binding buffers at the first step must not leave the root
    half-initialised forever: the next step initialises again."""
    from fsdp_graph.fsdp.unit import FSDPUnit

    model, ref = build(CPU)
    shard(model)
    original = FSDPUnit.bind
    calls = {"n": 0}

    def bind_fails_once(self, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, *args)

    monkeypatch.setattr(FSDPUnit, "bind", bind_fails_once)
    idx, targets = global_batch(0, 1, CPU)
    with pytest.raises(torch.OutOfMemoryError):
        lm_loss(model, idx, targets)
    train_beside_reference(model, ref)


def _dropped_models_are_freed(info) -> None:
    """A script that builds, trains and drops models in one process (a sweep, a test suite) gets
    their memory back: nothing of the package keeps a sharded model alive."""
    import functools
    import gc
    import weakref

    cuda = info.device.type == "cuda"
    for strategy in ("none", "layer", "full_iteration") if cuda else ("none",):
        model, _ = build(info.device)
        shard(model)
        lr = torch.tensor(1e-3, device=info.device) if cuda else 1e-3
        opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=cuda)
        modules = type(model.blocks[0]) if strategy == "layer" else None
        config = fsdp_graph.GraphConfig(strategy=strategy, modules=modules, num_warmup_iters=2)
        batch = tuple(local_part(t, info.rank, info.world_size) for t in global_batch(0, info.world_size, info.device))
        step = fsdp_graph.make_train_step(functools.partial(lm_loss, model), model, opt, config=config,
                                          example_batch=batch)
        for _ in range(4):
            step(*batch)
        alive = [weakref.ref(model), weakref.ref(opt), weakref.ref(next(model.parameters()))]
        del model, opt, step
        gc.collect()
        assert all(ref() is None for ref in alive), f"strategy {strategy}: a dropped sharded model is still alive"


def test_a_dropped_model_is_freed():
    run_ranks(_dropped_models_are_freed, 2)
