"""A unit wider than the shared reduce staging (the root with a large embedding) reduces in pieces
through it (``fsdp/reduce_pieces.py``): the plan, the copy-in of each piece against the whole
unit's, and training at three ranks (an embedding whose rows do not divide by them, split across
pieces) against the replicated reference, on each way the gradients reach the reduce."""

from __future__ import annotations

import pytest
import torch

import fsdp_graph
from fsdp_graph.fsdp.capture_interface import replay_collectives, replayable_roots, root_contexts, units_in
from fsdp_graph.fsdp.flat_layout import FlatLayout
from fsdp_graph.fsdp.introspect import unit_buffers
from fsdp_graph.fsdp.reduce_pieces import copy_piece_in, plan_pieces

from dist_harness import run_ranks
from models import (
    RecordingCollectiveBodies,
    assert_same_grads,
    build,
    global_batch,
    lm_loss,
    local_loss,
    not_capturing,
    shard,
)

pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine (three ranks): CI runs it; the GPU suite need not

SHAPES = [torch.Size(s) for s in [(301, 10), (10,), (0, 4), (7, 3), (40, 25), (5,)]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("staging_per_rank", [25, 64, 333, 5000])
def test_pieces_cover_the_shard_in_order_in_whole_rows_each_within_the_staging(world, staging_per_rank):
    layout = FlatLayout(SHAPES, world, 0)
    pieces = plan_pieces(layout, staging_per_rank * world)
    assert pieces is not None
    assert [p.start for p in pieces] == [0] + [p.start + p.numel for p in pieces[:-1]]
    assert pieces[-1].start + pieces[-1].numel == layout.shard_numel
    assert all(0 < p.numel <= staging_per_rank for p in pieces), pieces
    for piece in pieces:
        first, stop = piece.params
        spans = layout.moved_spans[first:stop]
        if piece.rows is None:  # whole parameters
            assert piece.start == spans[0].shard_offset and piece.numel == sum(s.chunk_numel for s in spans)
        else:  # rows of one parameter too large for the staging
            (span,), (a, b) = spans, piece.rows
            assert span.chunk_numel > staging_per_rank and 0 <= a < b <= span.chunk_rows
            assert piece.start == span.shard_offset + a * span.row_numel
    if staging_per_rank >= layout.shard_numel:
        assert len(pieces) == 1


def test_no_pieces_where_one_row_does_not_fit():
    assert plan_pieces(FlatLayout(SHAPES, 2, 0), 2 * 24) is None  # a row of (40, 25) is 25 elements


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("padded_sources", [False, True], ids=["autograd_tensors", "padded_buffer_views"])
def test_each_piece_copies_in_what_the_whole_copy_in_puts_there(world, padded_sources):
    layout = FlatLayout(SHAPES, world, 0)
    torch.manual_seed(0)
    grads = [torch.randn(s, dtype=torch.bfloat16) for s in SHAPES]
    if padded_sources:  # a unit's gradient buffer: every parameter padded to world · c rows with zeros
        flat = torch.zeros(layout.unsharded_numel, dtype=torch.bfloat16)
        for view, grad in zip(layout.param_views(flat), grads):
            view.copy_(grad)
        sources = layout.padded_views(flat)
    else:
        sources = [grads[i] for i in layout.moved_indices]
    whole = torch.full((world, layout.shard_numel), float("nan"))
    layout.copy_in(sources, whole)
    for staging_per_rank in (25, 64, 333):
        staging = torch.full((staging_per_rank * world,), float("nan"))
        for piece in plan_pieces(layout, staging.numel()):
            by_rank = staging[: world * piece.numel].view(world, piece.numel)
            copy_piece_in(layout, piece, sources, by_rank)
            assert torch.equal(by_rank, whole[:, piece.start : piece.start + piece.numel]), piece


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _train_wide_root(info, mesh_shape: tuple | None) -> None:
    """Three models: sharded (the root reduced in pieces, its bodies run through collective graphs,
    which here run them eagerly and record their keys), sharded with the root reduced whole (its
    plan made while ``plan_pieces`` answers None), and the replicated reference. ``mesh_shape``:
    HSDP's (replicate, shard), each piece all-reduced across the replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_graph.fsdp import unit_reduce

    vocab = 301  # the tied embedding: 101 rows per rank at three ranks (151 at two), the last rank's short
    model, ref = build(info.device, vocab=vocab, n_blocks=2)
    whole, _ = build(info.device, vocab=vocab, n_blocks=2)
    kwargs = {} if mesh_shape is None else {
        "mesh": init_device_mesh(info.device.type, mesh_shape, mesh_dim_names=("replicate", "shard"))}
    shard(model, **kwargs)
    shard(whole, **kwargs)
    models = (model, whole, ref)
    bodies = RecordingCollectiveBodies()
    not_capturing()
    assert replayable_roots(root_contexts(model)) == [model.fsdp_unit]  # (also plans the staging)
    model.fsdp_unit.replay_collectives(bodies)
    scratch = model.fsdp_unit.param_group.scratch
    pieces = model.fsdp_unit.grads.reduce.pieces(scratch)
    assert pieces is not None and any(p.rows is not None for p in pieces) and len(pieces) > 2, pieces
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]

    def backward_all(step: int) -> None:
        local_loss(model, step, info).backward()
        planned = unit_reduce.plan_pieces
        unit_reduce.plan_pieces = lambda layout, numel: None  # (kept by the root from its first reduce)
        try:
            local_loss(whole, step, info).backward()
        finally:
            unit_reduce.plan_pieces = planned
        idx, targets = global_batch(step, info.world_size, info.device)
        lm_loss(ref, idx, targets).backward()

    # (the second no_sync round starts from an accumulation buffer the first one's pieces read and zeroed)
    for step, how in enumerate(["fresh", "no_sync", "one_grad_dropped", "no_sync", "fresh"]):
        if how == "no_sync":  # the first micro-batch's sum waits in the accumulation buffer
            for m in models[:2]:
                m.set_requires_gradient_sync(False)
            backward_all(100 + step)
            for m in models[:2]:
                m.set_requires_gradient_sync(True)
        if how == "one_grad_dropped":  # the others' .grad are ours (kept zeros), the final norm's is None
            for m in models:
                m.ln_f.weight.grad = None
        backward_all(step)
        trained = [(name, p, q, r) for (name, p), q, r in zip(model.named_parameters(), whole.parameters(),
                                                              ref.parameters()) if p.requires_grad]
        for name, p, q, _ in trained:  # the same sums, bitwise (each over at most three ranks)
            assert torch.equal(_local(p.grad), _local(q.grad)), (how, name)
        for name, p, _, q in trained:  # several ranks: summed in another order than the reference
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{how} {name}: {m}")
        # Each piece's reduce-scatter (and nothing else) went through the root's graphs, keyed by the
        # staging and the piece's size: a graph per size, replayed at every step after the first two.
        runs, bodies.runs = bodies.runs, []
        assert runs == [("reduce_scatter_piece", (scratch.reduce_in.data_ptr(), p.numel)) for p in pieces], runs
        if step == 0:
            root = model.fsdp_unit
            assert whole.fsdp_unit.grads.reduce.pieces(scratch) is None
            assert unit_buffers(root).own_staging_bytes == root.param_group.layout.gathered_numel * 4  # the gather's
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=how == "one_grad_dropped")  # else kept as zeros, added into
    for unit in units_in(model):
        assert not unit.grads.accumulation_pending


@pytest.mark.parametrize("world, mesh_shape", [(3, None), (4, (2, 2))], ids=["three_ranks", "hsdp_2x2"])
def test_a_wide_root_reduced_in_pieces_trains_like_the_reference(world, mesh_shape):
    run_ranks(_train_wide_root, world, mesh_shape)


def test_the_whole_model_as_one_unit_keeps_staging_of_its_own():
    """With no shared staging (no unit fits one), the unit reduces in staging of its own, as before."""
    model, ref = build(torch.device("cpu"), vocab=301, n_blocks=2)
    fsdp_graph.fully_shard(model)
    idx, targets = global_batch(0, 1, torch.device("cpu"))
    lm_loss(model, idx, targets).backward()
    lm_loss(ref, idx, targets).backward()
    assert model.fsdp_unit.grads.reduce.pieces(model.fsdp_unit.param_group.scratch) is None
    assert_same_grads(model, ref)


def test_only_a_root_that_reduces_in_pieces_at_fixed_addresses_is_replayed_and_an_earlier_choice_holds():
    """``replayable_roots``: a root wider than the shared staging, with persistent buffers; not one that
    fits the staging (its copy-in could replay only from a persistent gradient buffer), nor one sharded
    without persistent buffers. A root a call switched to eager stays so under a later default."""
    cpu = torch.device("cpu")
    wide = shard(build(cpu, vocab=301, n_blocks=2)[0])
    narrow = shard(build(cpu, vocab=7, n_blocks=2)[0])
    loose = build(cpu, vocab=301, n_blocks=2)[0]
    for block in loose.blocks:
        fsdp_graph.fully_shard(block)
    fsdp_graph.fully_shard(loose, double_buffer=False)
    contexts = root_contexts(wide)
    assert replayable_roots(contexts) == [wide.fsdp_unit]
    assert replayable_roots(root_contexts(narrow)) == [] and replayable_roots(root_contexts(loose)) == []
    assert narrow.fsdp_unit.grads.reduce.pieces(narrow.fsdp_unit.param_group.scratch) is None
    assert loose.fsdp_unit.grads.reduce.pieces(loose.fsdp_unit.param_group.scratch) is not None
    replay_collectives(replayable_roots(contexts), False)  # graph_modules(..., collective_graphs=False)
    replay_collectives(replayable_roots(contexts), None)  # then graph_segments(...) with the default
    assert wide.fsdp_unit.grads.collective_graphs is None
    replay_collectives(replayable_roots(contexts), True)
    assert wide.fsdp_unit.grads.collective_graphs is not None
