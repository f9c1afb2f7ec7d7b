"""GPU: the clipping and the optimizer step replayed as graphs of their own train bitwise as eager.

The sharded GPT in bf16 (fp32 reduce), capturable fused AdamW, clipping, 12 steps:

* through ``make_train_step`` with ``GraphConfig(strategy="layer", optimizer_graph=True)``, per-layer
  graphs and segments of three, against the eager step;
* a hand-written loop with ``graph_optimizer_step``: a learning-rate scheduler, a step post-hook, the
  root keeping its gathered parameters across the step (so the replay must run this package's
  own step hook, which tells it the masters changed), with and without ``set_to_none``;
* a model whose auxiliary head gets no gradient every other step: those steps run eagerly (with a
  warning), the others replay;
* the refusals a user can meet on a GPU, each naming the fix.

Runs on two GPUs (NCCL) where there are two, else on one.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import warnings

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph import GraphConfig
from fsdp_graph.fsdp.capture_interface import units_in
from fsdp_graph.steps import optimizer_graph

from dist_harness import run_ranks
from examples.gpt import GPT
from test_graph_parity_gpu import CFG, _batch, _build
from test_segment_graphs_gpu import _compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS, WARMUP = 12, 2


def _ranks() -> int:
    return min(2, torch.cuda.device_count())


def _adamw(model: nn.Module, device) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=device), capturable=True, fused=True)


def _train_step(info, config: GraphConfig):
    model = _build(info, oversized_block=False)
    opt = _adamw(model, info.device)
    step = fsdp_graph.make_train_step(lambda idx, targets: model(idx, targets)[1], model, opt, config=config,
                                      max_grad_norm=1.0, example_batch=_batch(0, info))
    losses = torch.stack([step(*_batch(i, info)) for i in range(STEPS)])
    if config.optimizer_graph:
        graphed = step.optimizer_step
        assert (graphed.eager_steps, graphed.replays, graphed.eager_after_capture) == (WARMUP, STEPS - WARMUP, 0)
        # Read where the module graphs homed them, not pinned: every unit's (the root's too, which
        # reduces in pieces only with a wide vocabulary; else it stays eager, with no home: pinned).
        sharded = [unit.grads.sharded for unit in units_in(model)]
        homed = [g for g in sharded if g.home is not None]
        assert len(homed) >= len(model.blocks), "the blocks' gradients have no home in the graphs' pool"
        assert not any(g.pinned for g in homed), "the optimizer graph pinned gradients that have a home"
        assert all(g.pinned for g in sharded if g.home is None), "gradients without a home must be pinned"
    return losses, fsdp_graph.full_state_dict(model)


def _make_train_step_matches_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager = _train_step(info, GraphConfig())
    for k in (1, 3):
        config = GraphConfig(strategy="layer", segment_size=k, optimizer_graph=True, num_warmup_iters=WARMUP)
        _compare(f"optimizer_graph, segment_size={k}", _train_step(info, config), eager)


def test_optimizer_graph_in_make_train_step_is_bitwise_eager():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_make_train_step_matches_eager, _ranks())


def _peak_of_training(info, optimizer_graph: bool) -> int:
    """Peak bytes allocated, above what was allocated before, of six steps of a GPT of 12.6 M parameters
    under per-layer graphs."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    model = _build(info, oversized_block=False, cfg=dataclasses.replace(CFG, d_model=512, n_heads=8))
    config = GraphConfig(strategy="layer", optimizer_graph=optimizer_graph, num_warmup_iters=WARMUP)
    step = fsdp_graph.make_train_step(lambda idx, targets: model(idx, targets)[1], model,
                                      _adamw(model, info.device), config=config, example_batch=_batch(0, info))
    for i in range(6):
        step(*_batch(i, info))
    if optimizer_graph:
        assert step.optimizer_step.replays == 6 - WARMUP
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def _optimizer_graph_memory(info) -> None:
    without = _peak_of_training(info, False)
    gc.collect()  # (the first model's graphs and pool go: they sit in reference cycles)
    with_graph = _peak_of_training(info, True)
    # The blocks' fp32 sharded gradients (what a pin would keep through the forward): 12.6 M parameters.
    blocks_grads = 4 * 12 * 512 * 512 * 4 // info.world_size
    assert with_graph - without < blocks_grads // 4, (
        f"the optimizer graph raised the peak by {(with_graph - without) / 2**20:.1f} MiB (the blocks' sharded "
        f"gradients: {blocks_grads / 2**20:.1f} MiB)")


def test_the_optimizer_graph_under_per_layer_graphs_costs_no_gradient_memory():
    run_ranks(_optimizer_graph_memory, _ranks())


def _hand_loop(info, graphed: bool, set_to_none: bool):
    """A user's loop with a scheduler, a step post-hook and an evaluation forward between backward and
    step. The root stays gathered after that forward (reshard_after_forward=False) and keeps it for the
    next forward (set_reshard_after_backward(False)) unless told the masters changed: eagerly their
    version counters tell it, under a replay only this package's step pre-hook does."""
    torch.manual_seed(0)
    model = GPT(CFG).to(info.device)
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fsdp_graph.fully_shard(block, mp_policy=policy)
    fsdp_graph.fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    model.set_reshard_after_backward(False, recurse=False)
    opt = _adamw(model, info.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    post_hook_calls = []
    opt.register_step_post_hook(lambda *_: post_hook_calls.append(1))
    opt_step = fsdp_graph.graph_optimizer_step(model, opt, max_grad_norm=0.5, num_warmup_iters=WARMUP) \
        if graphed else None
    losses, norms = [], []
    for i in range(STEPS):
        idx, targets = _batch(i, info)
        loss = model(idx, targets)[1]
        loss.backward()
        with torch.no_grad():
            model(idx)  # (evaluation between backward and step: the root gathers, and keeps it)
        if graphed:
            norms.append(opt_step())
        else:
            norms.append(fsdp_graph.clip_grad_norm_(model, 0.5))
            opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(loss.detach())
    assert len(post_hook_calls) == STEPS
    if graphed:
        assert (opt_step.replays, opt_step.eager_after_capture) == (STEPS - WARMUP, 0)
    return torch.stack(losses), fsdp_graph.full_state_dict(model), torch.stack(norms)


def _hand_loop_matches_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    for set_to_none in (True, False):
        eager = _hand_loop(info, False, set_to_none)
        graphed = _hand_loop(info, True, set_to_none)
        _compare(f"graph_optimizer_step, set_to_none={set_to_none}", graphed[:2], eager[:2])
        assert torch.equal(graphed[2], eager[2]), "the gradient norms the step returns differ from clip_grad_norm_'s"
    # Without the step pre-hooks around the replay, the root's kept parameters go stale: the test sees it.
    real = optimizer_graph._run_pre_hooks
    optimizer_graph._run_pre_hooks = lambda opt: False
    try:
        stale = _hand_loop(info, True, True)
    finally:
        optimizer_graph._run_pre_hooks = real
    assert not torch.equal(stale[0], eager[0]), "skipping the step hooks should have left the root's copy stale"


def test_graph_optimizer_step_in_a_hand_written_loop_is_bitwise_eager():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_hand_loop_matches_eager, _ranks())


def _layer_loop(info, graphed: bool, forward_at: tuple = (), optimizer_first: bool = False):
    """A hand-written loop over per-layer graphs (``graph_modules`` on the blocks) and the optimizer graph,
    which reads the blocks' gradients at their home in the graphs' pool. At the steps in ``forward_at``
    a forward between the backward and the step (an evaluation in train mode) moves them out of the
    home: that step runs eagerly, and the next ones, whose gradients are home again (under other
    ``.grad`` objects), replay. ``optimizer_first``: the optimizer graph built before the module graphs
    pins the gradients, which then get no home (a warning says so and names the order)."""
    model = _build(info, oversized_block=False)
    opt = _adamw(model, info.device)
    hidden = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device, dtype=torch.bfloat16, requires_grad=True)
    graph_blocks = lambda: fsdp_graph.graph_modules(list(model.blocks), [(hidden,)] * CFG.n_layers,  # noqa: E731
                                                    num_warmup_iters=WARMUP)
    opt_step = None
    if graphed and optimizer_first:
        opt_step = fsdp_graph.graph_optimizer_step(model, opt, max_grad_norm=0.5, num_warmup_iters=WARMUP)
        with pytest.warns(UserWarning, match=r"pinned .*Build graph_optimizer_step after graph_modules") as caught:
            graph_blocks()
        pinned = [w for w in caught if "are pinned for good" in str(w.message)]
        assert len(pinned) == 1 and pinned[0].filename == __file__, "one warning, at the user's line"
    elif graphed:
        graph_blocks()
        opt_step = fsdp_graph.graph_optimizer_step(model, opt, max_grad_norm=0.5, num_warmup_iters=WARMUP)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            loss = model(*_batch(i, info))[1]
            loss.backward()
            if i in forward_at:
                with torch.no_grad():
                    model(*_batch(i, info))
            if graphed:
                opt_step()
            else:
                fsdp_graph.clip_grad_norm_(model, 0.5)
                opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    if graphed:
        sharded = [units_in(block)[0].grads.sharded for block in model.blocks]
        assert all((g.home is None) == optimizer_first for g in sharded), "homed exactly when built in order"
        moved_steps = 0 if optimizer_first else len([i for i in forward_at if i >= WARMUP])
        counts = (opt_step.eager_steps, opt_step.replays, opt_step.eager_after_capture)
        assert counts == (WARMUP, STEPS - WARMUP - moved_steps, moved_steps), counts
        fallbacks = [w for w in caught if "steps eagerly, as optimizer.step() would" in str(w.message)]
        assert len(fallbacks) == (1 if moved_steps else 0), [str(w.message) for w in caught]
    return torch.stack(losses), fsdp_graph.full_state_dict(model)


def _layer_loop_matches_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    for forward_at in ((), (5,)):
        eager = _layer_loop(info, False, forward_at)
        _compare(f"per-layer graphs, forward between backward and step at {forward_at}",
                 _layer_loop(info, True, forward_at), eager)
    _compare("optimizer graph built before the module graphs", _layer_loop(info, True, (5,), True),
             _layer_loop(info, False, (5,)))


def test_per_layer_graphs_and_the_optimizer_graph_in_a_hand_written_loop_replay_again_after_a_move():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_layer_loop_matches_eager, _ranks())


class _WithAux(nn.Module):
    """The GPT plus a head that only some steps use (an auxiliary loss, an MoE expert without tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(CFG)
        self.aux = nn.Linear(CFG.vocab_size, 1)

    def forward(self, idx, targets, use_aux: bool):
        logits, loss = self.gpt(idx, targets)
        return loss + 0.01 * self.aux(logits.float()).square().mean() if use_aux else loss


def _aux_loop(info, graphed: bool, every: int):
    torch.manual_seed(0)
    model = _WithAux().to(info.device)
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (*model.gpt.blocks, model.aux):
        fsdp_graph.fully_shard(module, mp_policy=policy)
    fsdp_graph.fully_shard(model, mp_policy=policy)
    opt = _adamw(model, info.device)
    opt_step = fsdp_graph.graph_optimizer_step(model, opt, num_warmup_iters=WARMUP) if graphed else opt.step
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            loss = model(*_batch(i, info), use_aux=i % every == 2 % every)
            loss.backward()
            opt_step()
            opt.zero_grad()
            losses.append(loss.detach())
    if graphed:
        # every=2: used from step 0, so the capture (step 2) has it; the steps without it after the
        # capture step eagerly. every=3: first used at step 2, the capture call, whose optimizer then
        # makes the head's state: that capture is thrown away and the step eager; step 3 captures
        # without the head, and the steps with it (5, 8, 11) step eagerly.
        counts = {2: (WARMUP, 5, 5), 3: (WARMUP + 1, 6, 3)}[every]
        assert (opt_step.eager_steps, opt_step.replays, opt_step.eager_after_capture) == counts
        fallbacks = [w for w in caught if "steps eagerly, as optimizer.step() would" in str(w.message)]
        assert len(fallbacks) == 1
    return torch.stack(losses), fsdp_graph.full_state_dict(model)


def _unused_head_matches_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    for every in (2, 3):
        _compare(f"a head used every {every} steps", _aux_loop(info, True, every), _aux_loop(info, False, every))


def test_steps_whose_gradients_differ_from_the_capture_step_eagerly_and_stay_bitwise():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_unused_head_matches_eager, _ranks())


def _refusals(info) -> None:
    model = _build(info, oversized_block=False)
    loss_fn = lambda idx, targets: model(idx, targets)[1]  # noqa: E731
    config = GraphConfig(strategy="layer", optimizer_graph=True, num_warmup_iters=WARMUP)
    with pytest.raises(ValueError, match="optimizer_graph=True.*no optimizer was given. Pass the optimizer"):
        fsdp_graph.make_train_step(loss_fn, model, None, config=config, example_batch=_batch(0, info))
    with pytest.raises(ValueError, match="graph_optimizer_step: AdamW param group 0 is not capturable.*capturable=Tr"):
        fsdp_graph.graph_optimizer_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    stray = nn.Parameter(torch.zeros(3, device=info.device))
    with pytest.raises(ValueError, match=r"\(shape \(3,\)\) is not a parameter of this model.*from model.parameters"):
        fsdp_graph.graph_optimizer_step(model, torch.optim.AdamW([*model.parameters(), stray], capturable=True))
    blocks_only = GPT(CFG).to(info.device)
    for block in blocks_only.blocks:
        fsdp_graph.fully_shard(block)
    with pytest.raises(ValueError, match=r"belongs to no FSDP unit.*fully_shard\(model\) on the root"):
        fsdp_graph.graph_optimizer_step(blocks_only, _adamw(blocks_only, info.device))

    opt = _adamw(model, info.device)
    opt_step = fsdp_graph.graph_optimizer_step(model, opt, num_warmup_iters=1)
    for i in range(2):  # one eager step, then the capture
        loss_fn(*_batch(i, info)).backward()
        opt_step()
        opt.zero_grad()
    assert opt_step.replays == 1
    loss_fn(*_batch(2, info)).backward()
    opt.param_groups[0]["betas"] = (0.8, 0.999)
    with pytest.raises(RuntimeError, match=r"'betas' changed from \(0.9, 0.999\) to \(0.8, 0.999\)"):
        opt_step()
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    handle = opt.register_step_pre_hook(lambda o, args, kwargs: ((), {"closure": None}))
    with pytest.raises(RuntimeError, match="pre-hook returned new arguments.*Return None from the hook"):
        opt_step()
    handle.remove()
    handle = opt.register_step_pre_hook(lambda o, args, kwargs: (args, kwargs))  # changes nothing: accepted
    opt_step()
    handle.remove()
    assert opt_step.replays == 2
    opt.param_groups[0]["params"].append(nn.Parameter(torch.zeros(3, device=info.device)))
    with pytest.raises(RuntimeError, match="param group 0's list of parameters changed"):
        opt_step()
    opt.param_groups[0]["params"].pop()
    clipped = GPT(CFG).to(info.device)  # clipping reads every parameter of the model, sharded or not
    for block in clipped.blocks:
        fsdp_graph.fully_shard(block)
    block_params = [p for block in clipped.blocks for p in block.parameters()]
    with pytest.raises(ValueError, match=r"max_grad_norm clips parameter .*belongs to no FSDP unit.*=None"):
        fsdp_graph.graph_optimizer_step(clipped, torch.optim.AdamW(block_params, capturable=True), max_grad_norm=1.0)

    # The whole step gets the same checks: a hyperparameter it would have kept silently is refused.
    whole = _build(info, oversized_block=False)
    whole_opt = _adamw(whole, info.device)
    step = fsdp_graph.make_train_step(lambda idx, targets: whole(idx, targets)[1], whole, whole_opt,
                                      config=GraphConfig(strategy="full_iteration", num_warmup_iters=1),
                                      example_batch=_batch(0, info))
    for i in range(2):
        step(*_batch(i, info))
    whole_opt.param_groups[0]["weight_decay"] = 0.0
    with pytest.raises(RuntimeError, match="make_train_step: param group 0's 'weight_decay' changed from 0.01 to 0.0"):
        step(*_batch(2, info))
    # ... and a parameter whose first gradient comes in the captured step (its optimizer state would be made
    # inside the graph, and reset at every replay) is refused.
    torch.manual_seed(0)
    aux_model = _WithAux().to(info.device)
    for module in (*aux_model.gpt.blocks, aux_model.aux, aux_model):
        fsdp_graph.fully_shard(module)
    calls = []
    step = fsdp_graph.make_train_step(
        lambda idx, targets: aux_model(idx, targets, use_aux=calls.append(1) or len(calls) > 1), aux_model,
        _adamw(aux_model, info.device), config=GraphConfig(strategy="full_iteration", num_warmup_iters=1),
        example_batch=_batch(0, info))
    step(*_batch(0, info))
    with pytest.raises(RuntimeError, match="got their first gradient in the captured step.*Raise GraphConfig"):
        step(*_batch(1, info))


def test_optimizer_graph_refusals_name_the_fix():
    run_ranks(_refusals, 1)
