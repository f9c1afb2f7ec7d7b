"""Persistent buffers: fixed addresses across iterations, two alternating slots, placement rules."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from fsdp_graph.buffers import Placement
from fsdp_graph.flat_layout import ALIGN_NUMEL, FlatLayout
from models import build, local_loss, shard


def _addresses_per_iteration(model, info, iterations: int = 3) -> list[dict]:
    """For every unit and iteration: addresses of its unsharded parameters (seen by the module
    during forward) and of their gradients (after backward)."""
    units = model.fsdp_unit.subtree_units
    seen: list[dict] = []
    handles = []

    def record_forward(module, args, output):
        unit = module.fsdp_unit
        seen[-1][unit.name] = {"params": tuple(p.data_ptr() for p in unit._unsharded)}

    for unit in units:
        handles.append(unit.module.register_forward_hook(record_forward, prepend=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(iterations):
        seen.append({})
        local_loss(model, step, info).backward()
        for unit in units:
            seen[-1][unit.name]["grads"] = tuple(
                p.grad.data_ptr() if p.grad is not None else None for p in unit._unsharded
            )
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.remove()
    return seen


def _stable_addresses(info, big_block, persist: bool) -> None:
    model, _ = build(info.device, big_block=big_block)
    shard(model, persist_buffer_on_alloc_fail=persist)
    seen = _addresses_per_iteration(model, info)
    units = {u.name: u for u in model.fsdp_unit.subtree_units}
    placements = {name: u.placement for name, u in units.items()}

    expected = {"<root> (TinyLM)": Placement.DEDICATED if persist else Placement.DYNAMIC}
    for i in range(3):
        fits = i != big_block
        expected[f"blocks.{i} (Block)"] = Placement.SLOT if fits else (Placement.DEDICATED if persist else Placement.DYNAMIC)
    assert placements == expected

    for name, placement in placements.items():
        if placement is Placement.DYNAMIC:
            continue
        first = seen[0][name]
        for later in seen[1:]:
            assert later[name] == first, f"{name}: addresses moved between iterations"
        unit = units[name]
        grads = unit._buffers.grads.tensor
        lo, hi = grads.data_ptr(), grads.data_ptr() + grads.numel() * grads.element_size()
        for i, ptr in enumerate(first["grads"]):
            if i in unit._trainable:
                assert ptr is not None and lo <= ptr < hi, f"{name}: gradient {i} outside the unit's buffer"
            else:
                assert ptr is None, f"{name}: frozen parameter {i} got a gradient"

    slot_units = [n for n, p in placements.items() if p is Placement.SLOT]
    slot_bases = {units[n]._buffers.params.data_ptr() for n in slot_units}
    assert len(slot_bases) == 2, "slot units share exactly two slots"
    # consecutive slot units alternate
    ordered = [n for n in (f"blocks.{i} (Block)" for i in range(3)) if n in slot_units]
    for a, b in zip(ordered, ordered[1:]):
        assert units[a]._buffers is not units[b]._buffers
    for name in placements:
        if placements[name] is Placement.DEDICATED:
            assert units[name]._buffers.params.data_ptr() not in slot_bases


@pytest.mark.parametrize("big_block,persist", [(None, True), (1, True), (1, False)])
def test_unsharded_params_and_grads_keep_their_addresses(big_block, persist):
    run_ranks(_stable_addresses, 2, big_block, persist)


def _dynamic_without_double_buffer(info) -> None:
    model, _ = build(info.device)
    shard(model, double_buffer=False)
    local_loss(model, 0, info).backward()
    assert {u.placement for u in model.fsdp_unit.subtree_units} == {Placement.DYNAMIC}  # decided at lazy init
    for unit in model.fsdp_unit.subtree_units:
        assert unit._buffers.params.untyped_storage().nbytes() == 0, f"{unit.name}: memory not freed at reshard"
        assert unit._buffers.grads.tensor.untyped_storage().nbytes() == 0, unit.name


def test_double_buffer_false_allocates_per_unshard():
    run_ranks(_dynamic_without_double_buffer, 2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_flat_layout_covers_every_element_once(world_size):
    shapes = [torch.Size(s) for s in [(5, 3), (7,), (1,), (130, 2), (3, 3, 3)]]
    covered = []
    for rank in range(world_size):
        layout = FlatLayout(shapes, world_size, rank)
        assert layout.padded_numel % (world_size * ALIGN_NUMEL) == 0
        assert layout.shard_numel * world_size == layout.padded_numel
        for i, span in enumerate(layout.spans):
            assert span.offset % ALIGN_NUMEL == 0
            covered += [(i, span.piece_start + k) for k in range(span.piece_numel)]
    expected = [(i, k) for i, s in enumerate(shapes) for k in range(s.numel())]
    assert sorted(covered) == expected
