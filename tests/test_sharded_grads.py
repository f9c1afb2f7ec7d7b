"""The masters' gradients follow ``zero_grad`` as FSDP2's do: ``set_to_none=True`` gives their memory
back before the next forward (where activations peak), the next backward takes it again, and a
gradient the user keeps is never changed under them."""

from __future__ import annotations

import weakref

import torch

from fsdp_graph.fsdp.introspect import sharded_grad_bytes, sharded_grad_bytes_held
from fsdp_graph.fsdp.mesh import local_tensor
from fsdp_graph.fsdp.registry import root_contexts, units_in

from dist_harness import run_ranks
from models import build, local_loss, shard


def _gradients_follow_zero_grad(info) -> None:
    model, _ = build(info.device)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = units_in(model)
    params = list(model.parameters())

    def backward(step):
        local_loss(model, step, info).backward()

    backward(0)
    assert all(sharded_grad_bytes_held(u) == sharded_grad_bytes(u) for u in units)
    trained = [p for p in params if p.requires_grad]
    grads = [weakref.ref(p.grad) for p in trained]  # (a strong reference would be a kept gradient)
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(sharded_grad_bytes_held(u) == sharded_grad_bytes(u) for u in units)  # until the next forward
    loss = local_loss(model, 1, info)
    assert all(sharded_grad_bytes_held(u) == 0 for u in units), "zero_grad(set_to_none=True) gave nothing back"
    loss.backward()
    assert all(sharded_grad_bytes_held(u) == sharded_grad_bytes(u) for u in units)
    assert all(p.grad is g() for p, g in zip(trained, grads))  # the same .grad objects: no new tensors per step
    opt.step()

    # set_to_none=False: the same memory, zeroed, then accumulated into.
    opt.zero_grad(set_to_none=False)
    loss = local_loss(model, 2, info)
    assert all(sharded_grad_bytes_held(u) == sharded_grad_bytes(u) for u in units)
    zeroed = [local_tensor(p.grad) for p in params if p.grad is not None]
    assert len(zeroed) > len(params) // 2 and not any(g.any() for g in zeroed)
    loss.backward()
    opt.step()

    # A gradient the user keeps past zero_grad stays theirs, with its values, as with FSDP2.
    kept = params[3].grad
    kept_values = local_tensor(kept).clone()
    opt.zero_grad(set_to_none=True)
    backward(3)
    assert params[3].grad is not kept
    assert torch.equal(local_tensor(kept), kept_values)
    assert not torch.equal(local_tensor(params[3].grad), kept_values)
    opt.step()

    # The same with zero_grad between the forward and the backward (nothing is given back at that
    # forward: the gradients were still set; the reduce finds the kept one and makes a new buffer).
    loss = local_loss(model, 4, info)
    kept = params[3].grad
    kept_values = local_tensor(kept).clone()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    assert params[3].grad is not kept
    assert torch.equal(local_tensor(kept), kept_values)
    del kept


def _warmup_brackets_leave_gradient_memory_as_it_was(info) -> None:
    """Graph warm-up and capture run unit steps inside ``outside_training_step``, which restores the
    gradients afterwards: a pinned buffer (captured in a whole-step graph) keeps its address, and
    memory the bracket took is given back at the next forward."""
    model, _ = build(info.device)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = units_in(model)
    (ctx,) = root_contexts(model)

    local_loss(model, 0, info).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    local_loss(model, 1, info)  # gives the memory back
    assert all(sharded_grad_bytes_held(u) == 0 for u in units)
    with ctx.outside_training_step():
        local_loss(model, 2, info).backward()  # takes it again
    assert all(p.grad is None for p in model.parameters())
    local_loss(model, 3, info)
    assert all(sharded_grad_bytes_held(u) == 0 for u in units), "memory taken inside the bracket stayed"

    for unit in units:
        unit.grads.pin_sharded()
    addresses = [unit.grads.sharded.flat.data_ptr() for unit in units]
    with ctx.outside_training_step():
        local_loss(model, 4, info).backward()
    assert [unit.grads.sharded.flat.data_ptr() for unit in units] == addresses, "a pinned buffer moved"
    local_loss(model, 5, info)
    assert all(sharded_grad_bytes_held(u) == sharded_grad_bytes(u) for u in units)  # pinned: kept


def test_gradients_follow_zero_grad_and_a_kept_gradient_stays_the_users():
    run_ranks(_gradients_follow_zero_grad, 2)


def test_warmup_brackets_keep_pinned_gradients_in_place_and_give_taken_memory_back():
    run_ranks(_warmup_brackets_leave_gradient_memory_as_it_was, 2)
