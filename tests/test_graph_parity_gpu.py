"""GPU, two devices on NCCL: a sharded GPT in bf16 trains bitwise identically eager and graphed.

Same seed, same batches, AdamW: 20 steps eager, 20 steps with graphed modules; every step's loss
and the final full state dict must be equal bit for bit (atol = rtol = 0), for several choices of
what is graphed, and for a model whose oversized block cannot use the double-buffer slots. The
units' unshard and reduce bodies are replayed as graphs too (``collective_graphs``, the default),
except for the oversized block (it stages its collectives on its own) and where switched off.
Two variants change the training itself, the same way in both runs: two micro-batches per step
under ``no_sync`` (the reduce then reads the accumulation buffer), and a full state dict saved at
one step and loaded back at a later one, after the capture (the masters change in place under
the replayed all-gathers). A wider vocabulary makes the root reduce through the shared staging in
pieces, whose reduce-scatters replay as graphs too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.fsdp.introspect import unit_buffers
from fsdp_graph.fsdp.registry import root_contexts, units_in

from dist_harness import run_ranks
from examples.gpt import GPT, GPTConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)

CFG = GPTConfig(vocab_size=512, d_model=128, n_heads=4, n_layers=4, seq_len=64)
MICRO_BATCH, STEPS = 4, 20
SELECTIONS = {
    "blocks": lambda model: list(model.blocks),
    "attention": lambda model: [block.attn for block in model.blocks],
    "mlp": lambda model: [block.mlp for block in model.blocks],
    "blocks_1_3": lambda model: [model.blocks[1], model.blocks[3]],
}


def _build(info, oversized_block: bool, mesh_shape: tuple | None = None, wide_root: bool = False,
           cfg: GPTConfig = CFG) -> GPT:
    """``wide_root``: a vocabulary of 4096 (the batches use its first 512 tokens), so the root unit
    is wider than the shared staging and reduces through it in pieces."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(cfg, vocab_size=4096) if wide_root else cfg)
    if oversized_block:  # block 1's MLP is twice as wide: its unit does not fit a slot
        mlp, d = model.blocks[1].mlp, cfg.d_model
        mlp.fc, mlp.proj = nn.Linear(d, 8 * d), nn.Linear(8 * d, d)
        mlp.apply(GPT._init_weights)
    model.to(info.device)
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = None
    if mesh_shape is not None:  # HSDP: (replicate, shard)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", mesh_shape, mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fsdp_graph.fully_shard(block, mp_policy=policy, mesh=mesh)
    return fsdp_graph.fully_shard(model, mp_policy=policy, mesh=mesh)


def _batch(step: int, info) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    shape = (MICRO_BATCH * info.world_size, CFG.seq_len)
    idx = torch.randint(0, CFG.vocab_size, shape, generator=g)
    targets = (idx * 7 + 3) % CFG.vocab_size  # learnable, so the steps visibly train
    return (
        idx.chunk(info.world_size)[info.rank].to(info.device),
        targets.chunk(info.world_size)[info.rank].to(info.device),
    )


SAVE_AT, LOAD_AT = 5, 12  # the "reload" variant


def _train(info, selection: str | None, oversized_block: bool, graph_at_step: int = 0, mesh_shape=None,
           collective_graphs: bool = True, variant: str | None = None):
    model = _build(info, oversized_block, mesh_shape, wide_root=variant == "wide_root")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    micro_batches = 2 if variant == "accumulate" else 1
    graphed = []
    losses = []
    saved = None
    for step in range(STEPS):
        if selection is not None and step == graph_at_step:
            modules = SELECTIONS[selection](model)
            # A whole unit casts its inputs itself; a module inside one receives bf16 activations.
            dtype = torch.float32 if selection.startswith("blocks") else torch.bfloat16
            sample = torch.randn(MICRO_BATCH // micro_batches, CFG.seq_len, CFG.d_model, device=info.device,
                                 dtype=dtype, requires_grad=True)
            graphed = fsdp_graph.graph_modules(modules, [(sample,)] * len(modules),
                                               collective_graphs=collective_graphs)
        if variant == "reload" and step == SAVE_AT:
            saved = fsdp_graph.full_state_dict(model)
        if variant == "reload" and step == LOAD_AT:
            fsdp_graph.load_full_state_dict(model, saved)
        idx, targets = _batch(step, info)
        loss = 0
        for i, (part_idx, part_targets) in enumerate(zip(idx.chunk(micro_batches), targets.chunk(micro_batches))):
            with model.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
                part = model(part_idx, part_targets)[1] / micro_batches
                part.backward()
            loss = loss + part.detach()
        opt.step()
        opt.zero_grad(set_to_none=variant != "grads_kept")
        losses.append(loss)
    forwards = micro_batches * (STEPS - graph_at_step)
    assert all(g.replays == forwards for g in graphed), [g.replays for g in graphed]  # no silent eager
    if selection is not None:
        _check_collective_replays(model, selection, oversized_block, STEPS - graph_at_step, collective_graphs,
                                  gradients_dropped=variant != "grads_kept")
        root = root_contexts(model)[0].root
        pieces = check_piece_replays(root, STEPS - graph_at_step, collective_graphs)
        assert pieces or root.grads.collective_graphs is None, "a root that fits the staging stays eager"
        assert (root.grads.sharded.home is not None) == bool(pieces), "a root reducing in pieces has a home"
        assert (pieces > 0) == (variant == "wide_root"), f"the root reduces in {pieces} pieces"
        # The end-of-backward exchange of which parameters got a gradient replays where the steps do:
        # every parameter used, so each rank fills the flags with ones first and reads nothing back.
        exchange = root_contexts(model)[0]._exchange
        if collective_graphs:
            replays = exchange[1].graphs.replays
            assert replays.get("use_exchange", 0) >= STEPS - graph_at_step - 2, replays
        else:
            assert exchange is None, "the exchange replayed although no unit's steps do"
    return torch.stack(losses), fsdp_graph.full_state_dict(model)


def _check_collective_replays(model: GPT, selection: str, oversized_block: bool, steps: int, on: bool,
                              gradients_dropped: bool) -> None:
    """The units of the graphed modules replayed their unshard and reduce bodies (at least the
    reduce's two bodies from the second step on), or never, where nothing may. A unit graphed whole
    took its gradients from its graph's static buffers: it never needed a gradient buffer. Its
    sharded gradients live in the graphs' pool (a home), and where ``zero_grad`` dropped them each
    step, the reduce-scatter's graph also wrote them there."""
    graphed_blocks = {1, 3} if selection == "blocks_1_3" else set(range(CFG.n_layers))
    for i, block in enumerate(model.blocks):
        unit = units_in(block)[0]
        if selection.startswith("blocks") and i in graphed_blocks:
            assert unit_buffers(unit).grads == (0, 0), f"block {i} allocated a gradient buffer"
        graphs = unit.param_group.collective_graphs
        replays = {} if graphs is None else graphs.replays
        if on and i in graphed_blocks and not (oversized_block and i == 1):
            homed = unit.grads.sharded.home is not None
            if selection.startswith("blocks"):
                assert homed, f"block {i}'s sharded gradients have no home in its graphs' pool"
            if not homed:
                reduce = ("reduce_scatter", steps - 1)
            elif gradients_dropped:
                reduce = ("reduce_scatter_and_write", steps - 1)
            else:  # (the first step's gradients, with no .grad yet, were written into the home, eagerly)
                reduce = ("reduce_scatter", steps - 2)
            # Each body runs eagerly once and is captured (and replayed) at its second run.
            for name, least in (("unshard", steps - 1), ("copy_in", steps - 1), reduce):
                assert replays.get(name, 0) >= least, f"block {i} replayed {replays} in {steps} steps"
        elif on and i in graphed_blocks:  # (too wide for the slots: it stages on its own, but reduces in pieces)
            assert check_piece_replays(unit, steps, on) > 0, f"block {i} should reduce in pieces"
        else:
            assert not replays, f"block {i} replayed {replays} FSDP steps but may not"


def check_piece_replays(unit, steps: int, on: bool) -> int:
    """A unit that reduces in pieces through the shared staging replayed each piece's reduce-scatter
    from the second step on, and nothing else (its unshard and copy-in stage on their own or read
    autograd's tensors), with collective graphs ``on``; nothing without. Where its sharded gradients
    have a home in the graphs' pool (and ``zero_grad()`` drops them each step), each piece's write
    into them replayed in the same graph. Returns its pieces."""
    pieces = unit.grads.reduce.pieces(unit.param_group.scratch) or []
    graphs = unit.grads.collective_graphs
    replays = {} if graphs is None else graphs.replays
    if on and pieces:
        name = "reduce_scatter_piece" if unit.grads.sharded.home is None else "reduce_scatter_and_write_piece"
        assert set(replays) == {name}, (unit.name, replays)
        assert replays[name] >= (steps - 1) * len(pieces), (unit.name, replays, len(pieces), steps)
    elif pieces:
        assert not replays, f"{unit.name} replayed {replays} but may not"
    return len(pieces)


def _eager_and_graphed_agree(info, selection: str, oversized_block: bool, graph_at_step: int,
                             mesh_shape=None, collective_graphs: bool = True, variant: str | None = None) -> None:
    torch.use_deterministic_algorithms(True)  # flash attention's backward is otherwise nondeterministic
    eager_losses, eager_state = _train(info, None, oversized_block, mesh_shape=mesh_shape, variant=variant)
    losses, state = _train(info, selection, oversized_block, graph_at_step, mesh_shape, collective_graphs, variant)
    differing = [i for i in range(STEPS) if not torch.equal(losses[i], eager_losses[i])]
    assert not differing, (
        f"losses differ from step {differing[0]}: graphed {losses.tolist()} eager {eager_losses.tolist()}"
    )
    assert eager_losses[-1] < eager_losses[0] - 0.1, f"the model should be learning: {eager_losses.tolist()}"
    assert state.keys() == eager_state.keys()
    for key, value in eager_state.items():
        assert torch.equal(state[key], value), f"{key} differs after {STEPS} steps"


@pytest.mark.parametrize(
    "selection, oversized_block, graph_at_step, mesh_shape, collective_graphs, variant",
    [
        ("blocks", False, 0, None, True, None),
        ("blocks", False, 0, None, False, None),  # the FSDP steps eager between the graphed blocks
        ("attention", False, 0, None, True, None),
        ("mlp", False, 0, None, True, None),
        ("blocks", True, 0, None, True, None),  # block 1 does not fit a slot: its own persistent buffer
        ("blocks_1_3", False, 3, None, True, None),  # a subset, graphed between steps of a running training
        ("blocks", False, 0, (2, 1), True, None),  # HSDP: replicated across the two GPUs, all-reduced
        ("blocks", False, 0, None, True, "accumulate"),  # no_sync: the reduce reads the accumulation buffer
        ("blocks", False, 0, None, True, "reload"),  # a state dict loaded into the masters after the capture
        ("blocks", False, 0, None, True, "grads_kept"),  # zero_grad(set_to_none=False): out of the pool's homes
        ("blocks", False, 0, None, True, "wide_root"),  # the root reduces in pieces: their reduce-scatters replay
        ("blocks", False, 0, (2, 1), True, "wide_root"),  # ... each all-reduced across HSDP replicas
        ("blocks", False, 0, None, False, "wide_root"),  # ... or run eagerly
    ],
)
def test_graphed_training_is_bitwise_equal_to_eager(selection, oversized_block, graph_at_step, mesh_shape,
                                                    collective_graphs, variant):
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # inherited by the ranks; needed by deterministic cuBLAS
    run_ranks(_eager_and_graphed_agree, 2, selection, oversized_block, graph_at_step, mesh_shape,
              collective_graphs, variant)
