"""Hook order, the sentinel protocol, and handlers driven by hand as a graph capture would."""

from __future__ import annotations

import pytest
import torch

import fsdp_graph
from fsdp_graph.fsdp.hooks import (
    cast_forward_inputs,
    install_post_backward,
    install_pre_backward,
    post_forward_reshard,
    pre_forward_unshard,
)
from fsdp_graph.fsdp.introspect import watch_steps
from fsdp_graph.fsdp.param_group import ShardState
from fsdp_graph.fsdp.registry import root_contexts, units_in
from fsdp_graph.fsdp.training_state import TrainingState

from dist_harness import run_ranks
from models import build, global_batch, lm_loss, local_loss, shard


def _hook_order(info) -> None:
    model, _ = build(info.device, n_blocks=2)
    shard(model)
    log: list = []

    def trace(step, unit):
        if step != "end_backward":  # the root's callback; it runs the root's post_backward, traced below
            log.append((unit.name.split(" ")[0], step))

    with watch_steps(before=trace):
        for step in range(2):  # the second iteration runs with prefetching
            log.clear()
            loss = local_loss(model, step, info)
            loss.backward()
            assert log == [
                ("<root>", "pre_forward"),
                ("blocks.0", "pre_forward"), ("blocks.0", "post_forward"),
                ("blocks.1", "pre_forward"), ("blocks.1", "post_forward"),
                ("<root>", "post_forward"),
                ("<root>", "pre_backward"),
                ("blocks.1", "pre_backward"), ("blocks.1", "post_backward"),
                ("blocks.0", "pre_backward"), ("blocks.0", "post_backward"),
                ("<root>", "post_backward"),  # the root's end-of-backward step: its inputs need no grad
            ], log
            assert all(u.state is TrainingState.IDLE for u in units_in(model))


def test_hooks_run_in_unit_order():
    run_ranks(_hook_order, 2)


def _prefetch(info) -> None:
    """From the second iteration on, the next unit's all-gather is enqueued before the current
    unit's compute is launched (so on GPU it overlaps that compute, on its own stream)."""
    model, _ = build(info.device, n_blocks=3)
    shard(model)
    block1 = model.blocks[1].fsdp_unit
    seen = []
    # appended, so it runs after FSDP's (prepended) hooks, right before blocks[0].forward
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(block1.shard_state is ShardState.PREFETCHED))
    for step in range(2):
        local_loss(model, step, info).backward()
    assert seen == [False, True], seen
    (ctx,) = root_contexts(model)
    assert [u.name.split(" ")[0] for u in ctx.order.backward] == ["<root>", "blocks.2", "blocks.1", "blocks.0"]
    if info.device.type == "cuda":
        current = torch.cuda.current_stream()
        assert ctx.streams.all_gather != current and ctx.streams.reduce != current


def test_next_unit_is_prefetched():
    run_ranks(_prefetch, 2)


def test_wrapper_hooks_carry_sentinels_naming_callable_handlers():
    model, _ = build(torch.device("cpu"))
    shard(model, mp_policy=fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16))
    block = model.blocks[0]
    pre = list(block._forward_pre_hooks.values())
    post = list(block._forward_hooks.values())
    assert pre == [pre_forward_unshard, cast_forward_inputs, install_post_backward]
    assert post == [post_forward_reshard, install_pre_backward]
    assert install_pre_backward._cuda_graph_backward_pre_handler is fsdp_graph.pre_backward_handler
    assert install_post_backward._cuda_graph_backward_handler is fsdp_graph.post_backward_handler
    plain = [
        h for h in pre + post
        if not hasattr(h, fsdp_graph.BACKWARD_PRE_SENTINEL) and not hasattr(h, fsdp_graph.BACKWARD_SENTINEL)
    ]
    assert plain == [pre_forward_unshard, cast_forward_inputs, post_forward_reshard]
    assert all(block._forward_pre_hooks_with_kwargs.get(i) for i in block._forward_pre_hooks)


def _drive_by_hand(info) -> None:
    """Run one block the way a graph wrapper captures it: plain hooks around the forward,
    wrapper hooks withheld, inner handlers called around the backward. Gradients must equal
    those of the ordinary, autograd-driven path."""
    auto, _ = build(info.device, n_blocks=1)
    manual, _ = build(info.device, n_blocks=1)
    for m in (auto, manual):
        fsdp_graph.fully_shard(m.blocks[0])
    torch.manual_seed(info.rank)
    x = torch.randn(2, 8, 10, device=info.device, requires_grad=True)
    grad_out = torch.randn(2, 8, 10, device=info.device)

    y = auto.blocks[0](x)
    y.backward(grad_out)

    block = manual.blocks[0]
    unit = block.fsdp_unit
    saved = {k: dict(v) for k, v in (("pre", block._forward_pre_hooks), ("post", block._forward_hooks))}
    block._forward_pre_hooks.clear()
    block._forward_hooks.clear()
    try:
        pre_forward_unshard(block, (x,), {})
        out = block(x)  # no hooks installed: the forward alone, as under capture
        post_forward_reshard(block, (x,), out)
        with pytest.raises(fsdp_graph.TransitionError, match="post_backward in state idle"):
            fsdp_graph.post_backward_handler(block)
        fsdp_graph.pre_backward_handler(block)
        torch.autograd.backward(out, grad_out)
        fsdp_graph.post_backward_handler(block)
    finally:
        block._forward_pre_hooks.update(saved["pre"])
        block._forward_hooks.update(saved["post"])
    assert unit.state is TrainingState.IDLE
    for (name, a), (_, m) in zip(auto.blocks[0].named_parameters(), block.named_parameters()):
        if a.grad is None:
            assert m.grad is None, name
        else:
            torch.testing.assert_close(m.grad, a.grad, rtol=0, atol=0, msg=lambda msg: f"{name}: {msg}")


def test_inner_handlers_work_when_called_by_hand():
    run_ranks(_drive_by_hand, 2)


def test_impossible_transitions_raise():
    model, _ = build(torch.device("cpu"), n_blocks=1)
    shard(model)
    block = model.blocks[0]
    with pytest.raises(fsdp_graph.TransitionError, match="cannot run post_forward in state idle"):
        post_forward_reshard(block, (), None)
    pre_forward_unshard(block, (), {})
    with pytest.raises(fsdp_graph.TransitionError, match="cannot run pre_forward in state forward"):
        pre_forward_unshard(block, (), {})
    with pytest.raises(fsdp_graph.TransitionError, match="cannot run pre_backward in state forward"):
        fsdp_graph.pre_backward_handler(block)
    post_forward_reshard(block, (), None)
    # a forward after an interrupted one starts clean: the root resets stuck units
    pre_forward_unshard(block, (), {})
    idx, targets = global_batch(0, 1, torch.device("cpu"))
    lm_loss(model, idx, targets).backward()
    assert block.fsdp_unit.state is TrainingState.IDLE
