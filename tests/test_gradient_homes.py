"""The engine's half of gradient homes, on CPU: each unit's sharded gradient buffer given a home
(``ShardedGrads.set_home``; under graphs, memory of the graphs' pool that the next forward
overwrites: ``fsdp/grad_homes.py``). Here a home is plain memory, and the forward's overwrite is
emulated: before every forward ``GradHomes.vacate`` runs, as a forward replay runs it, and then
every home is filled with NaN. Training at two ranks must stay bitwise equal to the same model
without homes, whatever the user does with ``.grad``: ``zero_grad()`` (the reduce writes the home),
``zero_grad(set_to_none=False)`` and accumulation over two backwards (the values move out at the
forward and stay out), ``.grad`` objects kept across the forward (they move with the values). A
slice of a gradient kept across a forward cannot follow and is refused, naming the fix; pinning
gives the home up."""

from __future__ import annotations

import pytest
import torch

from fsdp_graph.fsdp.capture_interface import GradHomes, root_contexts, units_in
from fsdp_graph.steps.optimizer_graph import CapturedGradients

from dist_harness import run_ranks
from models import RecordingCollectiveBodies, build, local_loss, on_fixed_buffers, shard

pytestmark = pytest.mark.cpu_only  # CPU and gloo: CI runs it; the graphs' half runs in the GPU suite


def _homed(model, busy=None) -> GradHomes:
    homes = GradHomes()
    for unit in units_in(model):
        assert unit.grads.sharded.set_home(homes, busy)
    return homes


def _before_forward(homes: GradHomes) -> None:
    homes.vacate("a forward replay")
    _fill_homes(homes)  # what the forward's activations would do to it


def _fill_homes(homes: GradHomes) -> None:
    for grads in homes.members:
        for piece in grads.home:
            piece.fill_(float("nan"))


def _train(info, homed: bool, set_to_none: bool, accumulate: bool, keep_objects: bool, vocab: int = 301,
           busy_steps: tuple = ()):
    """``busy_steps``: steps whose reduces find a graph that may share the homes' memory awaiting
    its backward (``set_home``'s ``busy``), which then writes the homes (NaN) after the reduce."""
    model, _ = build(info.device, vocab=vocab, n_blocks=3)
    shard(model)
    busy = [False]
    homes = _homed(model, lambda: busy[0]) if homed else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept, values, losses = [], [], []
    for step in range(4):
        for micro in range(2 if accumulate else 1):
            if homes is not None:
                _before_forward(homes)
            loss = local_loss(model, 2 * step + micro, info)
            busy[0] = step in busy_steps
            loss.backward()
            losses.append(loss.detach())
            if busy[0]:
                assert not any(g._at_home for g in homes.members), "a reduce wrote a home a pending graph shares"
                _fill_homes(homes)  # (the pending backward's replay)
                busy[0] = False
        for g, v in zip(kept, values):  # the step before's .grad objects, across this step's forward
            assert torch.equal(_local(g), v), "a kept .grad object changed"
        if keep_objects:
            kept = [p.grad for p in model.parameters() if p.requires_grad]
            values = [_local(g).clone() for g in kept]
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], homes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _homes_train_as_without(info) -> None:
    cases = {"zero_grad()": (True, False, False, 301), "zero_grad(set_to_none=False)": (False, False, False, 301),
             "two backwards per step": (True, True, False, 301), ".grad objects kept": (True, False, True, 301),
             # the root reduced in pieces, one of which holds none of the last rank's embedding rows
             "a piece with no rows here": (True, False, False, 277),
             # a graph that may share the homes' memory awaits its backward at the reduces of steps 1
             # and 2 (two losses over two towers, the second still to come): own memory that step
             "a graph's backward pending": (True, False, False, 301, (1, 2)),
             "a graph's backward pending, two backwards per step": (True, True, False, 301, (1,))}
    for what, (set_to_none, accumulate, keep, vocab, *busy) in cases.items():
        losses, params, homes = _train(info, True, set_to_none, accumulate, keep, vocab, *busy)
        ref_losses, ref_params, _ = _train(info, False, set_to_none, accumulate, keep, vocab)
        assert torch.equal(losses, ref_losses), f"{what}: {losses.tolist()} vs {ref_losses.tolist()}"
        for p, q in zip(params, ref_params):
            assert torch.equal(_local(p), _local(q)), what
        at_home = [g._at_home for g in homes.members]
        if what in ("zero_grad()", "a piece with no rows here", "a graph's backward pending"):
            assert all(at_home), "with .grad set to None the reduce writes the home"
        elif what == "zero_grad(set_to_none=False)":
            assert not any(at_home), "values kept across the forward move out, and stay out"


def test_gradients_with_a_home_train_bitwise_as_without_whatever_the_user_does_with_grad():
    run_ranks(_homes_train_as_without, 2)


def _refusals(info) -> None:
    model, _ = build(info.device, vocab=301, n_blocks=3)
    shard(model)
    homes = _homed(model)
    _before_forward(homes)
    local_loss(model, 0, info).backward()
    block = next(iter(model.blocks[0].parameters()))
    piece = block.grad.to_local()[:1]  # a tensor made from the gradient: it cannot follow a move
    with pytest.raises(RuntimeError, match=r"a forward replay: a tensor made from a sharded gradient .* still "
                                           r"alive.*Clone it \(\.clone\(\)\)"):
        homes.vacate("a forward replay")
    del piece
    homes.written = True
    homes.vacate("a forward replay")  # (now it moves: .grad is set)
    unit = units_in(model.blocks[0])[0]
    assert not unit.grads.sharded._at_home
    # A vacate inside a bracket that restores the gradients afterwards (an eval step built between
    # backward and the next forward): the restored state follows where the values now are.
    model.zero_grad()
    local_loss(model, 1, info).backward()
    assert unit.grads.sharded._at_home
    with root_contexts(model)[0].outside_training_step():
        homes.vacate("a forward replay")
    assert not unit.grads.sharded._at_home
    _before_forward(homes)
    local_loss(model, 2, info).backward()  # (adds into the moved values: .grad was kept)
    homes.vacate("a forward replay")
    unit.grads.pin_sharded()
    assert unit.grads.sharded.home is None and unit.grads.sharded not in homes.members


def test_a_slice_of_a_homed_gradient_kept_across_a_forward_is_refused_and_pinning_gives_the_home_up():
    run_ranks(_refusals, 2)


def _user_grads(info) -> None:
    """A ``.grad`` the user sets on one parameter while its unit's buffer is at home: the reduce adds
    into it (and zeros for the others) exactly as without a home. After values moved out of a home,
    the buffer counts as ours again once nobody else holds it (so its memory goes back as usual)."""
    results = []
    for homed in (True, False):
        model, _ = build(info.device, vocab=301, n_blocks=3)
        shard(model)
        homes = _homed(model) if homed else GradHomes()
        _before_forward(homes)
        local_loss(model, 0, info).backward()
        model.zero_grad()
        _before_forward(homes)
        loss = local_loss(model, 1, info)
        param = next(p for p in model.blocks[0].parameters() if p.requires_grad)
        param.grad = torch.ones_like(param)  # (set by the user between the forward and the backward)
        loss.backward()
        results.append([_local(p.grad).clone() for p in model.parameters() if p.grad is not None])
        if homed:
            sharded = units_in(model.blocks[1])[0].grads.sharded
            assert sharded._at_home
            _before_forward(homes)  # (.grad set: the values move out)
            assert not sharded._at_home
            model.zero_grad()
            assert sharded._only_ours(), "after the move, and .grad None, the buffer is ours alone"
    assert len(results[0]) == len(results[1])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_a_grad_set_by_the_user_at_home_and_the_count_after_a_move():
    run_ranks(_user_grads, 2)


def _writer_keeps_no_dead_source(info) -> None:
    """The home's writer keeps a source's split parts only while that tensor object lives: a shared
    staging's row (made once) is split once, a unit's own staging (made per reduce) is not kept."""
    model, _ = build(info.device, vocab=301, n_blocks=3)
    shard(model)
    _homed(model)
    sharded = units_in(model.blocks[0])[0].grads.sharded
    rows, pieces = sharded._home_rows, sharded.home
    staging = torch.randn(sharded._like.numel())
    rows.write(pieces, 0, staging, 1.0, True)
    parts = rows._source[2]
    rows.write(pieces, 0, staging, 1.0, True)
    assert rows._source[2] is parts, "a live source is split once"
    own = torch.randn(sharded._like.numel())
    rows.write(pieces, 0, own, 0.5, True)
    assert all(torch.equal(p, v * 0.5) for p, v in zip(pieces, sharded.layout.local_views(own)))
    del own  # (its reduce is over: nothing may keep its memory)
    assert rows._source is None, "the parts of a dead source are still held"


def test_the_homes_writer_keeps_no_dead_source():
    run_ranks(_writer_keeps_no_dead_source, 2)


def _fresh_write_as_accumulate(info) -> None:
    """Per-layer graphs record a homed unit's fresh write in its reduce-scatter's graph
    (``ShardedGrads.fresh_write``; ``UnitReduce.whole``), then ``accumulate`` of no pieces sets
    ``.grad``. Here the body runs eagerly, on the summed shard a parked reduce leaves, beside a twin
    model that accumulates the shard itself: equal bit for bit. Where the write is not a fresh copy
    into the home (``.grad`` kept as zeros, the home given up by a pin), no body is offered."""
    models = []
    for _ in range(2):
        model, _ = build(info.device, vocab=301, n_blocks=3)
        shard(model)
        _homed(model)
        models.append(model)
    local_loss(models[0], 1000, info)  # a forward only (plans the staging)
    units = [units_in(m) for m in models]
    parking = [torch.full((u.grads.layout.shard_numel,), float("nan"), dtype=u.param_group.dtypes.reduce)
               for u in units[0]]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    steps = ["fresh", "fresh", "kept_zeros", "pinned"]  # (pinned: every .grad None, but no home)
    for step, how in enumerate(steps):
        if how == "pinned":
            for unit in units[0]:
                unit.grads.pin_sharded()
        offered = []
        for model, twins in zip(models, units):
            for unit, buffer in zip(twins, parking):
                unit.grads.parking = buffer
            local_loss(model, step, info).backward()
            for unit, buffer in zip(twins, parking):
                unit.grads.parking = None
                grads = unit.grads
                if model is models[1]:
                    grads.accumulate_parked(buffer)
                    continue
                current = grads._take_sharded(None)
                write = grads.sharded.fresh_write(current, grads._scale())
                offered.append(write is not None)
                if write is None:
                    grads.sharded.accumulate([(0, buffer)], current, grads.trainable, grads._scale())
                else:
                    write[1](buffer)
                    grads.sharded.accumulate([], current, grads.trainable, grads._scale())
        assert all(offered) if how == "fresh" else not any(offered), (how, offered)
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            if p.requires_grad:
                assert torch.equal(_local(p.grad), _local(q.grad)), (how, name)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=step + 1 < len(steps) and steps[step + 1] != "kept_zeros")


def test_a_fresh_write_offered_to_the_graphs_equals_the_accumulate_it_replaces():
    run_ranks(_fresh_write_as_accumulate, 2)


def _train_reduces(info, graphs: bool, variant: str):
    model, _ = build(info.device, vocab=301, n_blocks=3)
    shard(model)
    homes, bodies = (_homed(model), []) if graphs else (None, [])
    if graphs:
        on_fixed_buffers(model)
        for unit in units_in(model):
            bodies.append(RecordingCollectiveBodies())
            unit.replay_collectives(bodies[-1])
    if variant == "divide_factor":
        model.blocks[1].set_gradient_divide_factor(3.0)
    hooked = []
    master = units_in(model.blocks[1])[0].params[2].master
    master.register_post_accumulate_grad_hook(lambda p: hooked.append(_local(p.grad).clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(4):
        if homes is not None:
            _before_forward(homes)
        local_loss(model, step, info).backward()
        grads.append([_local(p.grad).clone() for p in model.parameters() if p.requires_grad])
        opt.step()
        opt.zero_grad(set_to_none=variant != "grads_kept")
    root = model.fsdp_unit
    return grads, hooked, bodies, root.grads.reduce.pieces(root.param_group.scratch)


def _reduce_writes_in_its_graph(info) -> None:
    for variant in ("grads_dropped", "grads_kept", "divide_factor"):
        graphed, hooked, bodies, pieces = _train_reduces(info, True, variant)
        eager, eager_hooked, _, _ = _train_reduces(info, False, variant)
        for step, (a, b) in enumerate(zip(graphed, eager)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (variant, step)
        assert len(hooked) == 4 and all(torch.equal(x, y) for x, y in zip(hooked, eager_hooked)), variant
        # The root goes through the staging in pieces: each piece's reduce-scatter and write in one
        # body, under one key per piece from step to step, where its .grad were all None.
        assert pieces is not None and len(pieces) > 2, pieces
        combined = [key for name, key in bodies[0].runs if name == "reduce_scatter_and_write_piece"]
        alone = [key for name, key in bodies[0].runs if name == "reduce_scatter_piece"]
        steps_fresh = 1 if variant == "grads_kept" else 4
        assert len(combined) == steps_fresh * len(pieces) and len(set(combined)) == len(pieces), (variant, combined)
        assert len(alone) == (4 - steps_fresh) * len(pieces), (variant, bodies[0].runs)
        blocks = bodies[1:]
        for i, recorded in enumerate(blocks):
            combined = [key for name, key in recorded.runs if name == "reduce_scatter_and_write"]
            if variant == "grads_dropped" or (variant == "divide_factor" and i != 1):
                assert len(combined) == 4 and len(set(combined)) == 1, (variant, i, recorded.runs)  # one graph
            elif variant == "grads_kept":  # (only the first step starts with every .grad None)
                assert len(combined) == 1, (variant, i, recorded.runs)
            else:  # the unit with a divide factor writes eagerly
                assert not combined, (variant, i, recorded.runs)


def test_a_homed_units_reduce_writes_the_shard_in_its_reduce_scatter_graph_bitwise_as_eagerly():
    """With collective graphs (their bodies run eagerly here, at fixed addresses as for real graphs)
    a homed unit whose ``.grad`` are all None writes the reduced shard inside its reduce-scatter's
    body, under one key from step to step (the root, which reduces in pieces, each piece's rows in
    that piece's body); kept ``.grad`` and a divide factor write outside it.
    Gradients and post-accumulate-grad hooks equal a model without homes or graphs, bit for bit, with
    each home filled with NaN before every forward as a forward replay may."""
    run_ranks(_reduce_writes_in_its_graph, 2)


def _home_again(info) -> None:
    homed, _ = build(info.device, vocab=301, n_blocks=3)
    plain, _ = build(info.device, vocab=301, n_blocks=3)
    shard(homed)
    shard(plain)
    homes = _homed(homed)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (homed, plain)]
    for step in range(3):
        if step == 1:  # graphs dropped (a failed capture gives every home up), then graphed again
            homes.drop()
            homes = _homed(homed)
        _before_forward(homes)
        for model in (homed, plain):
            local_loss(model, step, info).backward()
        for p, q in zip(homed.parameters(), plain.parameters()):
            if p.requires_grad:
                assert torch.equal(_local(p.grad), _local(q.grad)), step
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_a_home_given_up_and_taken_again_is_written_where_grad_reads():
    """The writer's plan (views of the home's pieces) is made for one home: a unit that gives its
    home up and later takes a new one (graphs dropped, then graphed again) writes the new one."""
    run_ranks(_home_again, 2)


def test_the_capture_homes_each_block_after_its_backward_and_a_root_in_pieces_with_its_first_block():
    """Per-layer graphs home a unit's gradients after the backward capture of its first module (the
    last of its modules captured: captures run in reverse), and a root that reduces in pieces between
    the graphs with its model's first graphed module: it reduces at the end of its backward, right
    after that one's. A root that fits the staging has no graphs of its own and is not homed."""
    from fsdp_graph.graphs.capture import CaptureTarget, _homing

    for vocab, root_homed in ((301, True), (7, False)):
        model = shard(build(torch.device("cpu"), vocab=vocab, n_blocks=3)[0])
        root_contexts(model)  # (plans the staging, as the capture finds it)
        calls = [CaptureTarget(block, f"block {i}", (), {}, {}) for i, block in enumerate(model.blocks)]
        blocks = [units_in(block)[0] for block in model.blocks]
        expected = {0: [blocks[0]] + ([model.fsdp_unit] if root_homed else []), 1: [blocks[1]], 2: [blocks[2]]}
        assert _homing(calls) == expected, vocab


def test_two_models_graphed_in_one_call_home_each_root_after_its_own_first_graph():
    """Two models in one call (two losses): A's blocks, then B's. B's root reduces at the end of B's
    backward, which replays before A's, while A's saved activations are still to be read: homed
    after B's first block's capture, when those are still allocated, not after the last capture,
    whose free memory they are (found on GPU: B's root overwrote A's activations). Interleaved calls
    home each root with the first call that holds one of its units."""
    from fsdp_graph.graphs.gradient_homes import roots_homed_after

    models = []
    for _ in range(2):
        models.append(shard(build(torch.device("cpu"), vocab=301, n_blocks=3)[0]))
        root_contexts(models[-1])
    a, b = ([units_in(block)[0] for block in m.blocks] for m in models)
    roots = [m.fsdp_unit for m in models]
    assert roots_homed_after([[u] for u in a + b]) == {0: [roots[0]], 3: [roots[1]]}
    assert roots_homed_after([[b[0]], [a[0]], [b[1]], [a[1]]]) == {0: [roots[1]], 1: [roots[0]]}
    assert roots_homed_after([[a[0], roots[0]], [a[1]]]) == {}  # (a root a graph holds is homed as a unit)


def test_a_home_is_busy_while_a_graph_from_its_homing_index_on_awaits_its_backward():
    """The guard's predicate: a home taken after member ``i``'s backward capture may share the memory
    of members ``i`` and later (captured before it), not of earlier ones (whose activations were still
    allocated). It holds the group weakly: a home does not keep its graphs alive."""
    import gc
    import weakref

    from fsdp_graph.graphs.gradient_homes import _backward_pending
    from fsdp_graph.graphs.graphed_callable import CaptureGroup

    class Member:
        pending = False

        def backward_pending(self) -> bool:
            return self.pending

    group = CaptureGroup()
    group.members = [Member() for _ in range(4)]
    ref = weakref.ref(group)
    assert not any(_backward_pending(ref, i) for i in range(4))
    group.members[1].pending = True  # (its forward replayed, its backward not yet)
    assert [_backward_pending(ref, i) for i in range(4)] == [True, True, False, False]
    group.members[3].pending = True
    assert [_backward_pending(ref, i) for i in range(4)] == [True, True, True, True]
    group.members[1].pending = False
    assert [_backward_pending(ref, i) for i in range(4)] == [True, True, True, True]
    group.members[3].pending = False
    assert not any(_backward_pending(ref, i) for i in range(4))
    group.members[0].pending = True
    del group
    gc.collect()
    assert not _backward_pending(ref, 0), "a group that is gone has no graph to wait for"


def _optimizer_graph_reads_the_homes(info) -> None:
    """What the optimizer graph relies on to read the gradients at their home instead of pinning them:
    with ``zero_grad()`` each step every reduce writes the home, so ``CapturedGradients`` (its check,
    taken at its capture) finds each ``.grad`` where it captured it and the graph may replay. A forward
    between the backward and the step (an evaluation) moves them out: that step the check refuses,
    and once they are back home (next step, under new ``.grad`` objects) it replays again. The check
    holds no ``.grad`` strongly: a reader that did would count as a user holding the views, and the
    values would move out at every forward (a copy each step). With ``zero_grad(set_to_none=False)``
    they move out once, at the first forward, and stay out where the capture finds them."""
    cases = {"zero_grad()": (True, ()), "a forward before the step, at step 2": (True, (2,)),
             "set_to_none=False": (False, ())}
    for what, (set_to_none, forward_between) in cases.items():
        model, _ = build(info.device, vocab=301, n_blocks=3)
        shard(model)
        homes = _homed(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        params = [p for p in model.parameters() if p.requires_grad]
        captured, differs, moves, ours = None, [], [], []
        for step in range(5):
            _before_forward(homes)
            home_at_forward = all(g._at_home for g in homes.members)  # (what a holder of the views moves out)
            local_loss(model, step, info).backward()
            if step in forward_between:
                _before_forward(homes)
                with torch.no_grad():
                    local_loss(model, step, info)
            moves.append(not any(g._at_home for g in homes.members))
            grads = [p.grad for p in params]
            if step == 1:  # (the capture, after a warm-up step)
                captured = CapturedGradients(grads)
            elif captured is not None:
                differs.append(captured.differs(grads) is not None)
            del grads
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            if captured is not None:
                ours.append((home_at_forward, all(g._only_ours() for g in homes.members)))
        if what == "zero_grad()":
            assert differs == [False, False, False] and not any(moves), f"{what}: {differs}, moved {moves}"
            # Nothing but the views' owner holds them, at every step after the capture: the check holds no .grad
            # (else it would count as the user's, and the values would move out at every forward).
            assert ours[1:] == [(True, True)] * 3 and ours[0][1], f"{what}: {ours}"
        elif what == "set_to_none=False":
            assert differs == [False, False, False] and moves[1:] == [True] * 4, f"{what}: {differs}, {moves}"
        else:  # (step 2 differs; steps 3 and 4 are home again, under other .grad objects than at the capture)
            assert differs == [True, False, False] and moves == [False, False, True, False, False], (differs, moves)


def test_the_optimizer_graph_finds_homed_gradients_where_it_captured_them_while_zero_grad_drops_them():
    run_ranks(_optimizer_graph_reads_the_homes, 2)
