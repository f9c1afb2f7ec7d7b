"""GPU: per-layer and segment graphs take each block's sharded gradients from their memory pool
(and those of a root that reduces in pieces between them).

The memory is the graphs' own (the allocator's snapshot puts every parameter's piece in the graphs'
pool), the gradients land there when ``.grad`` was set to None, and training stays bitwise equal to
eager: ``test_graph_parity_gpu.py`` (per-layer) and ``test_segment_graphs_gpu.py`` train with homes
(the latter's hand-written loop keeps ``.grad`` with ``zero_grad(set_to_none=False)``, so its values
move out at the forward). Here: a user's loop that keeps the ``.grad`` objects across the next
forward reads the right values, and a slice of a gradient kept across a forward is refused, naming
the fix. Design: ``fsdp/grad_homes.py``."""

from __future__ import annotations

import os
import types

import pytest
import torch

import fsdp_graph
from fsdp_graph import GraphConfig
from fsdp_graph.fsdp.registry import units_in

from dist_harness import run_ranks
from test_graph_parity_gpu import CFG, _batch, _build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pool_of(address: int) -> tuple | None:
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return tuple(segment.get("segment_pool_id", (0, 0)))
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # (a plain tensor at one rank)


def _homes(info, segment_size: int | None, wide_root: bool = False) -> None:
    """``segment_size`` None: per-layer graphs; 1: segments of one block (``graph_segments``).
    ``wide_root``: the root reduces in pieces between the graphs, and is homed in their pool too."""
    model = _build(info, oversized_block=False, wide_root=wide_root)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if segment_size == 1:
        hidden = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device, dtype=torch.bfloat16, requires_grad=True)
        fsdp_graph.graph_segments(list(model.blocks), [(hidden,)] * CFG.n_layers, segment_size=1, num_warmup_iters=2)
    else:
        config = GraphConfig(strategy="layer", segment_size=segment_size or 1, num_warmup_iters=2)
        fsdp_graph.make_train_step(lambda idx, targets: model(idx, targets)[1], model, opt, config=config,
                                   example_batch=_batch(0, info))
    for i in range(3):
        model(*_batch(i, info))[1].backward()
        opt.step()
        opt.zero_grad()
    homed = [units_in(block)[0] for block in model.blocks] + ([units_in(model)[0]] if wide_root else [])
    assert wide_root == (units_in(model)[0].grads.sharded.home is not None), "only a root in pieces is homed"
    model(*_batch(3, info))[1].backward()  # (.grad None before it: the step's zero_grad)
    pools = {_pool_of(v.data_ptr()) for u in homed for v in u.grads.sharded.local_views if v.numel()}
    assert all(u.grads.sharded._at_home for u in homed), "the reduces wrote the homes"
    assert len(pools) == 1 and None not in pools and (0, 0) not in pools, f"not in one graph pool: {pools}"
    # .grad objects kept across the next forward (as a user logging them would): their values follow.
    kept = [p.grad for p in model.parameters() if p.grad is not None]
    values = [_local(g).clone() for g in kept]
    opt.zero_grad()
    model(*_batch(4, info))[1].backward()
    assert all(torch.equal(_local(g), v) for g, v in zip(kept, values)), "a kept .grad object changed"
    del kept
    # A slice of a gradient kept across a forward: refused (it would read the pool's activations).
    piece = _local(next(model.blocks[0].parameters()).grad)[:1]
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"a tensor made from a sharded gradient .* still alive.*Clone it"):
        model(*_batch(5, info))
    del piece


def _homes_in_every_layer_strategy(info) -> None:
    _homes(info, None)  # per-layer graphs
    _homes(info, 1)  # segments of one block, through graph_segments
    _homes(info, 2)
    _homes(info, None, wide_root=True)
    _homes(info, 2, wide_root=True)


def test_block_gradients_live_in_the_graph_pool_and_what_the_user_keeps_is_kept():
    run_ranks(_homes_in_every_layer_strategy, min(2, torch.cuda.device_count()))


def _two_models(info, graphed: bool):
    """Two GPTs whose blocks are graphed in one call (one pool), each with its own loss and optimizer.
    Backwards run B then A (B's graphs were captured after A's): B's root reduces into its home while
    A's activations wait for A's backward. Homed after the last capture, that home overlapped them
    (A's gradients off from the first step); homed after B's first block's capture, it cannot."""
    models = [_build(info, oversized_block=False, wide_root=True) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    if graphed:
        blocks = [block for m in models for block in m.blocks]
        sample = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device, requires_grad=True)
        fsdp_graph.graph_modules(blocks, [(sample,)] * len(blocks))
        assert all(units_in(m)[0].grads.sharded.home is not None for m in models), "the roots should be homed"
    losses = []
    for i in range(8):
        idx, targets = _batch(i, info)
        loss_a = models[0](idx, targets)[1]
        loss_b = models[1](idx, (targets + 1) % CFG.vocab_size)[1]
        loss_b.backward()
        loss_a.backward()  # (A's backward replays after B's root wrote its home)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(torch.stack([loss_a.detach(), loss_b.detach()]))
    return torch.stack(losses), [fsdp_graph.full_state_dict(m) for m in models]


def _second_backward_keeps_the_root_gradients(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager_losses, eager_states = _two_models(info, False)
    losses, states = _two_models(info, True)
    assert torch.equal(losses, eager_losses), f"{losses.tolist()} vs eager {eager_losses.tolist()}"
    for state, eager in zip(states, eager_states):
        for key, value in eager.items():
            assert torch.equal(state[key], value), f"{key} differs from eager"


def test_a_backward_replayed_after_a_root_reduced_leaves_its_gradients_as_eager():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_second_backward_keeps_the_root_gradients, min(2, torch.cuda.device_count()))


def _towers(model, idx, targets):
    """One root, two towers over its embedding: blocks 0-1 and 2-3, each with its own loss (run as
    the root's forward: ``register_fsdp_forward_method``)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    h = model.tok_emb(idx) + model.pos_emb(pos)
    losses = []
    for tower, shift in ((model.blocks[:2], 0), (model.blocks[2:], 1)):
        x = h
        for block in tower:
            x = block(x)
        logits = model.lm_head(model.ln_f(x)).float()
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ((targets + shift) % CFG.vocab_size)
                                                        .flatten()))
    return tuple(losses)


def _train_towers(info, graphed: bool, dtype=torch.float32):
    model = _build(info, oversized_block=False, wide_root=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    root = units_in(model)[0]
    model.towers = types.MethodType(_towers, model)
    fsdp_graph.register_fsdp_forward_method(model, "towers")
    if graphed:
        sample = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device, dtype=dtype, requires_grad=True)
        fsdp_graph.graph_modules(list(model.blocks), [(sample,)] * CFG.n_layers)
        assert root.grads.sharded.home is not None, "the root should be homed"
    losses = []
    for i in range(6):
        loss_v, loss_t = model.towers(*_batch(i, info))
        loss_t.backward(retain_graph=True)  # (the root reduces here, tower v's backward still to come)
        loss_v.backward()
        assert not root.grads.sharded._at_home, "the root wrote its home while tower v's graphs needed it"
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack([loss_v.detach(), loss_t.detach()]))
    return torch.stack(losses), fsdp_graph.full_state_dict(model)


def _towers_match_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager_losses, eager_state = _train_towers(info, False)
    for dtype in (torch.float32, torch.bfloat16):  # (two samples, two layouts of the pool)
        losses, state = _train_towers(info, True, dtype)
        assert torch.equal(losses, eager_losses), f"{dtype}: {losses.tolist()} vs eager {eager_losses.tolist()}"
        for key, value in eager_state.items():
            assert torch.equal(state[key], value), f"{dtype}: {key} differs from eager"


def test_a_root_reduced_before_its_other_towers_backward_leaves_their_graphs_memory_alone():
    """One root, two towers graphed in one call, two losses: the first backward reaches the root while
    the other tower's graphs still await theirs, and its home may share their memory (taken after
    tower v's first block's capture, the last). That reduce takes memory of its own; bitwise as eager."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_towers_match_eager, min(2, torch.cuda.device_count()))
