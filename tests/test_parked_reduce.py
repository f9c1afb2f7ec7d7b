"""The engine's half of a segment graph's reduce, on CPU: with ``grads.parking`` set, a unit's reduce
leaves its summed shard there and touches no ``.grad``; ``accumulate_parked`` then adds it in, and
the result is bitwise that of the ordinary reduce. A segment's backward graph records the first
part and its replay runs the second (``graphs/segment_graphs.py``, GPU-only); here both run eagerly
at three ranks, with the wide root reduced in pieces, on every way ``.grad`` may stand before a
backward (None, kept zeros, the user's own tensor) and with a divide factor and a
post-accumulate-grad hook."""

from __future__ import annotations

import pytest
import torch

from fsdp_graph.fsdp.capture_interface import local_tensor, units_in

from dist_harness import run_ranks
from models import build, local_loss, shard

pytestmark = pytest.mark.cpu_only  # CPU and gloo (three ranks): CI runs it; the GPU suite need not


def _parked_backward(model, step: int, info, parking: list[torch.Tensor]) -> None:
    units = units_in(model)
    before = [[p.master.grad for p in u.params] for u in units]
    for unit, buffer in zip(units, parking):
        unit.grads.parking = buffer
    try:
        local_loss(model, step, info).backward()
    finally:
        for unit in units:
            unit.grads.parking = None
    for unit, grads in zip(units, before):
        assert all(p.master.grad is g for p, g in zip(unit.params, grads)), f"{unit.name}: .grad changed"
    for unit, buffer in zip(units, parking):
        unit.grads.accumulate_parked(buffer)


def _parked_equals_direct(info) -> None:
    parked, _ = build(info.device, vocab=301, n_blocks=3)
    direct, _ = build(info.device, vocab=301, n_blocks=3)
    shard(parked)
    shard(direct)
    models = (parked, direct)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    seen = ([], [])
    for model, log in zip(models, seen):
        hooked = units_in(model.blocks[1])[0].params[2].master
        hooked.register_post_accumulate_grad_hook(lambda p, log=log: log.append(local_tensor(p.grad).clone()))
    parking = None
    for step, how in enumerate(["fresh", "kept_zeros", "users_tensor", "divide_factor", "fresh"]):
        if how == "users_tensor":  # accumulated into the user's own tensor, as autograd would
            for model in models:
                master = units_in(model.blocks[0])[0].params[1].master
                master.grad = master.grad.clone()
        if how == "divide_factor":
            for model in models:
                model.blocks[2].set_gradient_divide_factor(5.0)
        if parking is None:  # (the staging is planned at the first forward)
            local_loss(parked, 1000, info)  # a forward only: no gradient
            parking = [torch.full((u.grads.layout.shard_numel,), float("nan"), dtype=u.param_group.dtypes.reduce)
                       for u in units_in(parked)]
        _parked_backward(parked, step, info, parking)
        local_loss(direct, step, info).backward()
        for (name, p), q in zip(parked.named_parameters(), direct.parameters()):
            if p.requires_grad:
                assert torch.equal(local_tensor(p.grad), local_tensor(q.grad)), (how, name)
        if step == 0:
            root = parked.fsdp_unit
            assert root.grads.reduce.pieces(root.param_group.scratch) is not None  # the root goes in pieces
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=how in ("users_tensor", "divide_factor"))  # else kept as zeros
    assert len(seen[0]) == 5 and all(torch.equal(a, b) for a, b in zip(*seen))


def test_a_parked_reduce_accumulated_afterwards_equals_the_direct_reduce():
    run_ranks(_parked_equals_direct, 3)
