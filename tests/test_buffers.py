"""Persistent buffers: fixed addresses across iterations, two alternating slots, placement rules."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fsdp_graph.fsdp.buffers import BufferDtypes, Placement, PlacementRequest, plan_placements, plan_scratch
from fsdp_graph.fsdp.flat_layout import ALIGN_NUMEL, FlatLayout
from fsdp_graph.fsdp.introspect import unit_buffers, unsharded_grad_addresses, unsharded_param_addresses
from fsdp_graph.fsdp.registry import units_in

from dist_harness import run_ranks
from models import build, local_loss, on_fixed_buffers, shard


def _addresses_per_iteration(model, info, iterations: int = 3) -> list[dict]:
    """For every unit and iteration: addresses of its unsharded parameters (seen by the module
    during forward) and of their gradients (where the unit's backward left them for its reduce)."""
    units = units_in(model)
    seen: list[dict] = []
    handles = []

    def record_forward(module, args, output):
        unit = module.fsdp_unit
        seen[-1][unit.name] = {"params": tuple(unsharded_param_addresses(unit))}

    def record_grads(unit):
        finish = unit.grads.finish

        def recorded(*args):
            seen[-1][unit.name]["grads"] = tuple(unsharded_grad_addresses(unit))
            finish(*args)

        unit.grads.finish = recorded

    for unit in units:
        handles.append(unit.module.register_forward_hook(record_forward, prepend=True))
        record_grads(unit)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(iterations):
        seen.append({})
        local_loss(model, step, info).backward()
        for unit in units:  # after the backward, no unit keeps unsharded gradients
            assert all(ptr is None for ptr in unsharded_grad_addresses(unit)), unit.name
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.remove()
    for unit in units:
        del unit.grads.finish
    return seen



def _stable_addresses(info, big_block, persist: bool, fixed_grads: bool) -> None:
    model, _ = build(info.device, big_block=big_block)
    shard(model, persist_buffer_on_alloc_fail=persist)
    if fixed_grads:
        on_fixed_buffers(model)
    seen = _addresses_per_iteration(model, info)
    units = {u.name: u for u in units_in(model)}
    placements = {name: u.placement for name, u in units.items()}

    expected = {"<root> (TinyLM)": Placement.DEDICATED if persist else Placement.DYNAMIC}
    for i in range(3):
        fits = i != big_block
        expected[f"blocks.{i} (Block)"] = (
            Placement.SLOT if fits else (Placement.DEDICATED if persist else Placement.DYNAMIC)
        )
    assert placements == expected

    for name, placement in placements.items():
        if placement is Placement.DYNAMIC:
            continue
        first = seen[0][name]
        for later in seen[1:]:
            assert later[name]["params"] == first["params"], f"{name}: parameter addresses moved between iterations"
        unit = units[name]
        lo, hi = unit_buffers(unit).grads
        group = unit.param_group
        if not (fixed_grads and group.scratch.fits(group.layout.gathered_numel)):
            # The reduce read autograd's own gradients (also a unit whose reduce cannot replay: one
            # larger than the shared staging), in no buffer of ours.
            for step in seen:
                for param, ptr in zip(unit.params, step[name]["grads"]):
                    assert (ptr is not None) == param.requires_grad, f"{name}: {param.name}"
            assert (lo, hi) == (0, 0), f"{name}: a gradient buffer was allocated, and no graph reads it"
            continue
        for later in seen[1:]:
            assert later[name]["grads"] == first["grads"], f"{name}: gradient addresses moved between iterations"
        for param, ptr in zip(unit.params, first["grads"]):
            if param.requires_grad:
                assert ptr is not None and lo <= ptr < hi, f"{name}: gradient of {param.name} outside the unit's buffer"
            else:
                assert ptr is None, f"{name}: frozen parameter {param.name} got a gradient"

    slot_units = [n for n, p in placements.items() if p is Placement.SLOT]
    slot_bases = {unit_buffers(units[n]).params[0] for n in slot_units}
    assert len(slot_bases) == 2, "slot units share exactly two slots"
    # consecutive slot units alternate
    ordered = [n for n in (f"blocks.{i} (Block)" for i in range(3)) if n in slot_units]
    for a, b in zip(ordered, ordered[1:]):
        assert unit_buffers(units[a]).params != unit_buffers(units[b]).params
    for name in placements:
        if placements[name] is Placement.DEDICATED:
            assert unit_buffers(units[name]).params[0] not in slot_bases


@pytest.mark.parametrize("big_block,persist", [(None, True), (1, True), (1, False)])
def test_unsharded_params_and_grads_keep_their_addresses(big_block, persist):
    """Units whose reduce replays as a graph: parameters and gradients at fixed addresses (the wide
    block, larger than the shared staging, cannot replay and keeps no gradient buffer)."""
    run_ranks(_stable_addresses, 2, big_block, persist, True)


@pytest.mark.parametrize("big_block,persist", [(None, True), (1, False)])
def test_other_units_keep_their_parameter_addresses_and_no_gradient_buffer(big_block, persist):
    """Every other unit: fixed parameter addresses; the reduce reads autograd's gradients, so no
    unsharded gradient stays after a backward and no gradient buffer is ever allocated."""
    run_ranks(_stable_addresses, 2, big_block, persist, False)


def _dynamic_without_double_buffer(info) -> None:
    model, _ = build(info.device)
    shard(model, double_buffer=False)
    local_loss(model, 0, info).backward()
    assert {u.placement for u in units_in(model)} == {Placement.DYNAMIC}  # decided at lazy init
    for unit in units_in(model):
        assert unit_buffers(unit).nbytes_held == 0, f"{unit.name}: memory not freed at reshard"


def test_double_buffer_false_allocates_per_unshard():
    run_ranks(_dynamic_without_double_buffer, 2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_flat_layout_follows_the_chunk_rule_and_round_trips(world_size):
    """Each rank holds torch.chunk's rows of every parameter (FSDP2's Shard(0)); the gathered shards
    copied out give every parameter back whole, at aligned offsets; copied back in (with a cast)
    they give the gathered shards again, which is the reduce-scatter's input order."""
    shapes = [torch.Size(s) for s in [(5, 3), (7,), (1,), (130, 2), (3, 3, 3), (0, 4)]]
    params = [torch.randn(s) for s in shapes]
    shards = []
    for rank in range(world_size):
        layout = FlatLayout(shapes, world_size, rank)
        shard = torch.zeros(layout.shard_numel)
        for p, view, span in zip(params, layout.local_views(shard), layout.spans):
            view.copy_(p.narrow(0, span.row_start, span.local_rows))
            chunks = list(torch.chunk(p, world_size)) if p.shape[0] else []
            expected = chunks[rank] if rank < len(chunks) else p[:0]
            assert torch.equal(view, expected), (span, rank)
        shards.append(shard)
    gathered = torch.cat(shards)
    assert gathered.numel() == layout.gathered_numel
    unsharded = torch.zeros(layout.unsharded_numel)
    layout.copy_out(layout.by_rank(gathered), layout.rank_major_views(unsharded))
    for p, view, span in zip(params, layout.param_views(unsharded), layout.spans):
        assert span.offset % ALIGN_NUMEL == 0 and torch.equal(view, p)
    back = torch.zeros(layout.gathered_numel, dtype=torch.float64)
    layout.copy_in(layout.padded_views(unsharded), layout.by_rank(back))
    assert torch.equal(back, gathered.double())
    assert all(torch.equal(full, p) for full, p in zip(layout.full_from_gathered(gathered), params))


def _request(numel: int, **kwargs) -> PlacementRequest:
    fields = dict(numel=numel, world_size=2, dtypes=BufferDtypes(torch.bfloat16, torch.float32),
                  device=torch.device("cpu"), group_id=0, double_buffer=True, persist_buffer_on_alloc_fail=True,
                  has_inner_units=False)
    return PlacementRequest(**{**fields, **kwargs})


def test_placement_plan_is_a_pure_function_of_the_requests():
    """The rule, without a process group: leaf units of the most common size share two slots; a
    larger one and a unit with units inside get dedicated buffers (or dynamic ones without
    persist_buffer_on_alloc_fail); double_buffer=False is dynamic; other dtypes get their own pool."""
    requests = [
        _request(512, has_inner_units=True),  # a root
        _request(256), _request(256), _request(256), _request(128), _request(1024),  # blocks, a small and a large one
        _request(1024, persist_buffer_on_alloc_fail=False),
        _request(256, double_buffer=False),
        _request(64, dtypes=BufferDtypes(torch.float32, torch.float32)),  # alone in its pool
    ]
    plan = plan_placements(requests)
    assert [p for p, _ in plan] == [
        Placement.DEDICATED, Placement.SLOT, Placement.SLOT, Placement.SLOT, Placement.SLOT, Placement.DEDICATED,
        Placement.DYNAMIC, Placement.DYNAMIC, Placement.SLOT,
    ]
    pools = [pool for _, pool in plan]
    assert pools[1] is pools[2] is pools[3] is pools[4] and pools[1].numel == 256
    assert pools[8] is not pools[1] and pools[8].numel == 64

    # The shared collective staging is sized for the largest slot unit of its pool key; larger
    # units (the root, the wide block) stage on their own; a key without slot units shares none.
    requests = [replace(r, gathered_numel=r.numel) for r in requests]
    scratch = plan_scratch(requests, plan)
    assert scratch[0] is scratch[1] is scratch[5] and scratch[0].gathered_numel == 256
    assert [s.fits(r.gathered_numel) for s, r in zip(scratch, requests)] == [
        False, True, True, True, True, False, False, True, True,
    ]
    assert scratch[8] is not scratch[0] and scratch[8].gathered_numel == 64
    alone = [_request(512, has_inner_units=True, gathered_numel=512)]
    assert not plan_scratch(alone, plan_placements(alone))[0].fits(512)


@pytest.mark.parametrize("double_buffer", [True, False])
def test_reshard_after_forward_false_gathers_once_per_step(monkeypatch, double_buffer):
    """FSDP2's reshard_after_forward=False: the unit stays gathered from forward to backward, so a
    step all-gathers it once. With True, units whose slot was reused in forward (and every dynamic
    unit, freed at reshard) gather again in backward."""
    import fsdp_graph.fsdp.param_group as param_group

    def gathers_per_step(reshard_after_forward: bool) -> int:
        model, _ = build(torch.device("cpu"))
        shard(model, double_buffer=double_buffer, reshard_after_forward=reshard_after_forward)
        calls = []
        original = param_group.all_gather_inplace
        monkeypatch.setattr(param_group, "all_gather_inplace", lambda *a: calls.append(1) or original(*a))
        info = type("Info", (), {"world_size": 1, "rank": 0, "device": torch.device("cpu")})
        for step in range(2):
            calls.clear()
            local_loss(model, step, info).backward()
        monkeypatch.setattr(param_group, "all_gather_inplace", original)
        if not reshard_after_forward:
            expected = Placement.DEDICATED if double_buffer else Placement.DYNAMIC
            assert {u.placement for u in units_in(model)} == {expected}
        return len(calls)

    units = 4  # the root and three blocks
    assert gathers_per_step(False) == units
    assert gathers_per_step(True) == (units + 1 if double_buffer else 2 * units)


def test_unshard_before_a_step_saves_that_units_gather_and_keeps_slots_alternating(monkeypatch):
    """module.unshard() before the first step takes slots in module order (neighbours still
    alternate), and the next forward uses the unsharded parameters without gathering again."""
    import fsdp_graph.fsdp.param_group as param_group

    model, _ = build(torch.device("cpu"), n_blocks=4)
    shard(model)
    model.blocks[3].unshard()  # before any forward
    model.blocks[3].reshard()
    info = type("Info", (), {"world_size": 1, "rank": 0, "device": torch.device("cpu")})
    calls = []
    original = param_group.all_gather_inplace
    monkeypatch.setattr(param_group, "all_gather_inplace", lambda *a: calls.append(1) or original(*a))
    counts = []
    for step in range(3):
        if step == 2:
            model.blocks[0].unshard(async_op=True).wait()
        calls.clear()
        local_loss(model, step, info).backward()
        counts.append(len(calls))
    assert counts[2] == counts[1] - 1, counts  # blocks.0 was not gathered again
    slots = [unit_buffers(b.fsdp_unit).params for b in model.blocks]
    assert slots[0] == slots[2] and slots[1] == slots[3] and slots[0] != slots[1]


def test_a_slot_held_by_unshard_names_reshard_as_the_fix():
    model, _ = build(torch.device("cpu"), n_blocks=3)
    shard(model)
    info = type("Info", (), {"world_size": 1, "rank": 0, "device": torch.device("cpu")})
    local_loss(model, 0, info).backward()
    model.blocks[2].unshard()  # blocks 0 and 2 share a slot
    with pytest.raises(RuntimeError, match=r"module.unshard\(\) left blocks.2 \(Block\) unsharded: call its reshard"):
        local_loss(model, 1, info)
    model.blocks[2].reshard()
    local_loss(model, 1, info).backward()


def _reduce_scatter_in_place(info, big_block) -> None:
    from fsdp_graph.fsdp import unit_reduce

    calls = []
    original = unit_reduce.reduce_scatter_sum

    def recording(output, input, group):
        calls.append((output.data_ptr(), input.data_ptr(), output.numel(), output.element_size()))
        return original(output, input, group)

    unit_reduce.reduce_scatter_sum = recording
    try:
        model, _ = build(info.device, big_block=big_block)
        shard(model)
        local_loss(model, 0, info).backward()
    finally:
        unit_reduce.reduce_scatter_sum = original
    if info.world_size == 1:  # no process group: nothing to reduce, so no reduce-scatter runs at all
        assert calls == [], calls
        return
    units = units_in(model)
    groups = [u.param_group for u in units]
    wide = [g for g in groups if not g.scratch.fits(g.layout.gathered_numel)]
    assert len(wide) == (big_block is not None), wide  # the case covers a unit wider than the shared staging
    # Every reduce-scatter, a wide unit's pieces included (reduce_pieces.py), reads the shared staging,
    # and each unit's together cover its shard.
    assert {input for _, input, _, _ in calls} == {groups[0].scratch.reduce_in.data_ptr()}, calls
    assert sum(numel for _, _, numel, _ in calls) == sum(g.layout.shard_numel for g in groups), calls
    assert len(calls) > len(units) if wide else len(calls) == len(units), calls
    for output, input, numel, itemsize in calls:  # NCCL's in-place form: output = input + rank * shard
        assert output == input + info.rank * numel * itemsize, (output, input, numel, info.rank)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("big_block", [None, 1], ids=["shared_staging", "a_wide_unit_reduces_in_pieces"])
def test_the_reduce_scatter_writes_into_this_ranks_row_of_its_input(world_size, big_block):
    run_ranks(_reduce_scatter_in_place, world_size, big_block)
