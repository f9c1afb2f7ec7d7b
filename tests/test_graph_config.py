"""GraphConfig validation (every refusal names its fix) and the eager training step.

CPU: the checks ``validate_graph_config`` makes before any work, the optimizer checks of a
whole-step graph, and ``make_train_step`` with ``strategy="none"``: gradient accumulation over
stacked micro-batches plus clipping, on 2 ranks, against a replicated single-process reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_graph
from fsdp_graph import GraphConfig
from fsdp_graph.fsdp.registry import units_in
from fsdp_graph.steps.graph_config import check_capturable_optimizer, validate_graph_config

from dist_harness import run_ranks
from models import TinyLM, assert_full_state_matches, build, global_batch, lm_loss, local_part, shard
from test_graphed_callable import emulated


def test_config_values_are_normalised_or_refused_with_the_choices():
    model = shard(TinyLM())
    assert validate_graph_config(GraphConfig(strategy="None", forward_only="NONE"), model) == GraphConfig()
    with pytest.raises(
        ValueError, match=r"GraphConfig.strategy is 'layers'; choose one of 'none', 'layer', 'full_iteration'"
    ):
        validate_graph_config(GraphConfig(strategy="layers"), model)
    with pytest.raises(ValueError, match=r"forward_only is 'whole'; choose one of 'none', 'layer', 'model'"):
        validate_graph_config(GraphConfig(forward_only="whole"), model)
    with pytest.raises(ValueError, match="num_warmup_iters must be an int >= 1"):
        validate_graph_config(GraphConfig(num_warmup_iters=0), model)
    with pytest.raises(TypeError, match="expected a fsdp_graph.GraphConfig"):
        validate_graph_config({"strategy": "layer"}, model)
    with pytest.raises(TypeError, match="collective_graphs must be True, False or None, got 'off'"):
        validate_graph_config(GraphConfig(strategy="layer", collective_graphs="off"), model)
    with pytest.raises(TypeError, match="graph_modules: collective_graphs must be True, False or None, got 0"):
        fsdp_graph.graph_modules(list(model.children())[:1], [()], collective_graphs=0)


def test_a_module_selection_with_full_iteration_or_without_layer_graphs_is_refused():
    model = shard(TinyLM())
    with pytest.raises(ValueError, match=r"strategy='full_iteration' captures the whole step. Drop modules="):
        validate_graph_config(GraphConfig(strategy="full_iteration", modules=nn.Linear), model)
    with pytest.raises(ValueError, match="modules= is only used by strategy='layer' or forward_only='layer'"):
        validate_graph_config(GraphConfig(modules=nn.Linear), model)


def test_graphs_without_persistent_buffers_are_refused():
    model = shard(TinyLM(), double_buffer=False)
    for config in (
        GraphConfig(strategy="full_iteration"), GraphConfig(forward_only="model"), GraphConfig(strategy="layer")
    ):
        with pytest.raises(
            ValueError, match=r"double_buffer=False.*Pass double_buffer=True and persist_buffer_on_alloc_fail=True"
        ):
            validate_graph_config(config, model)


def test_whole_step_graphs_need_a_sharded_root_and_no_graphed_layers():
    plain = TinyLM()
    with pytest.raises(ValueError, match="call fsdp_graph.fully_shard on its blocks and its root first"):
        validate_graph_config(GraphConfig(strategy="full_iteration"), plain)
    blocks_only = TinyLM()
    for block in blocks_only.blocks:
        fsdp_graph.fully_shard(block)
    with pytest.raises(
        ValueError, match=r"parameter 'emb.weight' belongs to no FSDP unit.*fully_shard\(model\) on the root"
    ):
        validate_graph_config(GraphConfig(strategy="full_iteration"), blocks_only)
    model = shard(TinyLM())
    model.ln_f.forward, _ = emulated(model.ln_f, (torch.randn(2, 8, 10, requires_grad=True),))
    with pytest.raises(ValueError, match="module 'ln_f' is already graphed with graph_modules"):
        validate_graph_config(GraphConfig(strategy="full_iteration"), model)


def test_layer_selection_of_nothing_and_graphs_on_cpu_are_refused():
    model = shard(TinyLM())
    with pytest.raises(ValueError, match="selects no module of the model"):
        validate_graph_config(GraphConfig(strategy="layer", modules=nn.Conv1d), model)
    if not torch.cuda.is_available():
        for config in (
            GraphConfig(strategy="layer"), GraphConfig(strategy="full_iteration"), GraphConfig(forward_only="model")
        ):
            with pytest.raises(RuntimeError, match=r"needs CUDA.*Use GraphConfig\(\)"):
                validate_graph_config(config, model)
        with pytest.raises(RuntimeError, match="needs CUDA"):
            fsdp_graph.make_train_step(lambda i, t: lm_loss(model, i, t), model, config=GraphConfig(strategy="layer"))


def test_whole_step_optimizer_must_be_capturable():
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"AdamW param group 0 is not capturable.*capturable=True"):
        check_capturable_optimizer(torch.optim.AdamW(params))
    with pytest.raises(ValueError, match=r"SGD param group 0 needs fused=True.*\.item\(\)"):
        check_capturable_optimizer(torch.optim.SGD(params, lr=0.1))
    check_capturable_optimizer(torch.optim.AdamW(params, capturable=True))
    check_capturable_optimizer(None)


def test_train_step_refuses_unstacked_micro_batches_and_a_non_scalar_loss():
    model = shard(TinyLM())
    idx, targets = global_batch(0, 1, torch.device("cpu"))
    step = fsdp_graph.make_train_step(lambda i, t: lm_loss(model, i, t), model, grad_accum_steps=3)
    with pytest.raises(
        ValueError, match=r"argument 0 has shape \(2, 8\); each argument must stack the 3 micro-batches"
    ):
        step(idx, targets)
    bad = fsdp_graph.make_train_step(lambda i, t: model(i), model)
    with pytest.raises(TypeError, match="loss_fn must return the scalar loss"):
        bad(idx, targets)
    with pytest.raises(ValueError, match="grad_accum_steps must be an int >= 1"):
        fsdp_graph.make_train_step(lambda i, t: lm_loss(model, i, t), model, grad_accum_steps=0)


def _accumulating_step_matches_reference(info) -> None:
    model, ref = build(info.device)
    shard(model)
    accum, max_norm = 2, 0.5
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = fsdp_graph.make_train_step(lambda i, t: lm_loss(model, i, t), model, opt,
                                      grad_accum_steps=accum, max_grad_norm=max_norm)
    for s in range(3):
        micro = [global_batch(s * accum + k, info.world_size, info.device) for k in range(accum)]
        mine = [(local_part(i, info.rank, info.world_size), local_part(t, info.rank, info.world_size))
                for i, t in micro]
        loss = step(torch.stack([i for i, _ in mine]), torch.stack([t for _, t in mine]))
        # Reference: the same mean gradient, over every rank's part of every micro-batch.
        ref_loss = sum(lm_loss(ref, i, t) for i, t in micro) / accum
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / info.world_size, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        assert all(p.grad is None for p in model.parameters()), "the step ends with zero_grad"
    assert all(u.requires_gradient_sync for u in units_in(model)), "sync flags are restored after the step"
    assert_full_state_matches(model, ref, rtol=1e-5, atol=1e-6)


def test_eager_step_with_accumulation_and_clipping_matches_replicated_reference():
    run_ranks(_accumulating_step_matches_reference, 2)


def test_eval_step_runs_in_eval_mode_without_gradients_and_restores_the_mode():
    model = shard(TinyLM())
    model.blocks[0].train(False)  # a mixed mode must come back exactly
    seen = []
    model.blocks[1].register_forward_hook(lambda m, a, o: seen.append((m.training, torch.is_grad_enabled())))
    evaluate = fsdp_graph.make_eval_step(model)
    idx, _ = global_batch(0, 1, torch.device("cpu"))
    logits = evaluate(idx)
    assert seen == [(False, False)] and not logits.requires_grad
    assert model.training and not model.blocks[0].training and model.blocks[1].training


def test_step_without_optimizer_leaves_this_steps_gradient_and_a_failed_step_leaves_none():
    model = shard(TinyLM())
    idx, targets = global_batch(0, 1, torch.device("cpu"))
    step = fsdp_graph.make_train_step(lambda i, t: lm_loss(model, i, t), model)
    step(idx, targets)
    first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    step(idx, targets)  # same batch: the same gradient, not twice it (a graph replay overwrites too)
    second = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(first) == len(second) > 0 and all(torch.equal(a, b) for a, b in zip(first, second))

    calls = []

    def failing(i, t):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("data error in micro-batch 2")
        return lm_loss(model, i, t)

    accumulate = fsdp_graph.make_train_step(failing, model, grad_accum_steps=2)
    with pytest.raises(RuntimeError, match="micro-batch 2"):
        accumulate(torch.stack([idx, idx]), torch.stack([targets, targets]))
    assert all(p.grad is None for p in model.parameters())
    assert not any(u.grads.accumulation_pending for u in units_in(model)), "no partial sum may leak into the next step"
    assert all(u.requires_gradient_sync for u in units_in(model))


def test_static_inputs_take_tensors_in_the_captured_layout_only():
    from fsdp_graph.graphs.static_inputs import StaticInputs

    with pytest.raises(TypeError, match=r"argument 1 is a int.*functools.partial or a lambda"):
        StaticInputs("make_train_step", (torch.zeros(2), 3), torch.device("cpu"))
    inputs = StaticInputs("make_train_step", (torch.zeros(2, 4),), torch.device("cpu"))
    with pytest.raises(TypeError, match="called with 2 argument"):
        inputs.copy_in((torch.zeros(2, 4), torch.zeros(2, 4)))
    with pytest.raises(
        ValueError, match=r"argument 0 is shape \(2, 5\).*captured with shape \(2, 4\).*pad every batch"
    ):
        inputs.copy_in((torch.zeros(2, 5),))
    inputs.copy_in((torch.ones(2, 4),))
    assert torch.equal(inputs.tensors[0], torch.ones(2, 4))


def test_sample_recording_refuses_a_module_the_example_forward_never_runs():
    from fsdp_graph.graphs.module_graphs import record_sample_args

    model = TinyLM()
    idx, _ = global_batch(0, 1, torch.device("cpu"))
    unused = nn.Linear(2, 2)
    samples = record_sample_args([model.blocks[0]], lambda: model(idx))
    assert samples[0][0][0].shape == (2, 8, 10) and samples[0][0][0].grad_fn is None
    with pytest.raises(ValueError, match="did not run in the example forward"):
        record_sample_args([model.blocks[0], unused], lambda: model(idx))
    assert not model.blocks[0]._forward_pre_hooks, "recording hooks are removed"
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        fsdp_graph.make_train_step("loss", model)


def test_a_module_takes_one_graph_of_each_kind():
    lin = nn.Linear(3, 3)
    training, _ = emulated(lin, (torch.randn(2, 3, requires_grad=True),))
    forward_only, _ = emulated(lin, (torch.randn(2, 3),))
    forward_only.captured.grad_enabled, forward_only.eager = False, training  # the chain graph_modules builds
    lin.forward = forward_only
    for kind in (False, True):
        with pytest.raises(ValueError, match="capture each module once per kind"):
            fsdp_graph.graph_modules([lin], [(torch.randn(2, 3),)], forward_only=kind)
