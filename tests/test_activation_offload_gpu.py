"""GPU, one device: activation offload (``offload_activations``) on eager FSDP training.

The offloaded run must be bitwise equal to the plain one (losses and weights), must actually take
the saved activations off the device between forward and backward, and must refuse a saved tensor
modified in place after the forward (autograd's own check, lost under saved-tensor hooks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_graph

from models import TinyLM, lm_loss, shard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model(offload: bool, checkpoint: bool = False) -> tuple[TinyLM, object]:
    torch.manual_seed(0)
    model = TinyLM(vocab=101, d=64, n_blocks=4, hidden=192, seq=32).cuda()
    if checkpoint:  # activation checkpointing of the second block, inside its offloaded forward
        inner = model.blocks[1].forward
        model.blocks[1].forward = lambda x: torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard(model, mp_policy=policy)
    handle = fsdp_graph.offload_activations(list(model.blocks), min_bytes=0) if offload else None
    return model, handle


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 101, (4, 32), generator=g)
    return idx.cuda(), torch.roll(idx, -1, dims=1).cuda()


def _train(offload: bool, steps: int = 5, checkpoint: bool = False) -> tuple[list[torch.Tensor], dict]:
    model, _handle = _model(offload, checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = lm_loss(model, *_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    full = {n: p.detach() for n, p in model.named_parameters()}
    return losses, {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).clone() for n, p in full.items()}


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed_block"])
def test_offloaded_training_is_bitwise_equal_to_plain(checkpoint, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)  # flash attention's backward is otherwise nondeterministic
    try:
        _compare_offloaded_with_plain(checkpoint)
    finally:
        torch.use_deterministic_algorithms(False)


def _compare_offloaded_with_plain(checkpoint: bool) -> None:
    plain_losses, plain_weights = _train(False, checkpoint=checkpoint)
    losses, weights = _train(True, checkpoint=checkpoint)
    for step, (a, b) in enumerate(zip(losses, plain_losses)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} != {b.item()}"
    for name, w in weights.items():
        assert torch.equal(w, plain_weights[name]), name


def _allocated_after_forward(offload: bool) -> tuple[int, torch.Tensor]:
    model, handle = _model(offload)
    lm_loss(model, *_batch(0)).backward()  # (lazy init, optimizer-free warm-up)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = lm_loss(model, *_batch(1))
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # lets the allocator take back blocks whose copies have finished
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return held, handle


def test_the_saved_activations_leave_the_device_between_forward_and_backward():
    held_plain, _ = _allocated_after_forward(False)
    held_offloaded, _handle = _allocated_after_forward(True)
    # Four blocks hold most of the plain run's activations; the head's logits and loss remain.
    assert held_offloaded < 0.6 * held_plain, (held_offloaded, held_plain)


class _KeepsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return F.gelu(self.lin(x))  # the linear saves x, the GELU its input


def test_a_saved_tensor_changed_in_place_after_the_forward_is_refused():
    block = _KeepsInput().cuda()
    handle = fsdp_graph.offload_activations([block], min_bytes=0)
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    h = x * 2
    y = block(h)
    h.add_(1)  # autograd alone would refuse this at backward too
    with pytest.raises(RuntimeError, match=r"modified in place afterwards.*out-of-place"):
        y.sum().backward()
    handle.remove()


def test_a_second_backward_reads_the_same_restored_tensors_and_remove_takes_the_hooks_off():
    block = _KeepsInput().cuda()
    ref = _KeepsInput().cuda()
    ref.load_state_dict(block.state_dict())
    handle = fsdp_graph.offload_activations([block], min_bytes=0)
    x = torch.randn(32, 64, device="cuda")
    y, y_ref = block(x), ref(x)
    for _ in range(2):  # retain_graph: the restored tensors stay for the second backward
        y.pow(2).sum().backward(retain_graph=True)
        y_ref.pow(2).sum().backward(retain_graph=True)
    assert torch.equal(block.lin.weight.grad, ref.lin.weight.grad)
    handle.remove()
    assert not block._forward_pre_hooks and not block._forward_hooks
    fsdp_graph.offload_activations([block])  # (may be offloaded again once removed)
