"""GPU, one device: graph capture and replay of plain modules (skipped without CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICE = "cuda"


class MLP(nn.Module):
    def __init__(self, d: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc, self.proj, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Gated(nn.Module):
    """Keyword arguments: a tensor, a frozen float and an optional tensor."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, *, gate, scale: float = 1.0, bias=None):
        y = self.lin(x) * torch.sigmoid(gate) * scale
        return {"y": y if bias is None else y + bias, "norm": y.detach().norm()}


def _pair(factory, seed=0):
    torch.manual_seed(seed)
    module = factory().to(DEVICE)
    return module, copy.deepcopy(module)


def test_graphed_plain_modules_match_eager_bitwise_over_training_steps():
    mlp, mlp_ref = _pair(MLP)
    gated, gated_ref = _pair(Gated)
    x0 = torch.randn(8, 64, device=DEVICE, requires_grad=True)
    kwargs = {"gate": torch.randn(8, 64, device=DEVICE, requires_grad=True), "scale": 0.5}
    graphed_mlp, graphed_gated = fsdp_graph.make_graphed_callables(
        [mlp, gated], [(x0,), (x0,)], sample_kwargs=[None, kwargs]
    )
    params = [*mlp.parameters(), *gated.parameters()]
    ref_params = [*mlp_ref.parameters(), *gated_ref.parameters()]
    opt, ref_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref_params, lr=0.1)
    for step in range(4):
        x = torch.randn(8, 64, device=DEVICE, requires_grad=True)
        gate = torch.randn(8, 64, device=DEVICE, requires_grad=True)
        x_ref, gate_ref = x.detach().clone().requires_grad_(), gate.detach().clone().requires_grad_()
        out = graphed_gated(graphed_mlp(x), gate=gate, scale=0.5)
        ref = gated_ref(mlp_ref(x_ref), gate=gate_ref, scale=0.5)
        assert torch.equal(out["y"], ref["y"]) and torch.equal(out["norm"], ref["norm"])
        out["y"].square().sum().backward()
        ref["y"].square().sum().backward()
        assert torch.equal(x.grad, x_ref.grad) and torch.equal(gate.grad, gate_ref.grad)
        for p, q in zip(params, ref_params):
            assert torch.equal(p.grad, q.grad)
        for o in (opt, ref_opt):
            o.step()  # parameters change in place: the graphs read the new values
            o.zero_grad(set_to_none=step % 2 == 0)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        y = self.lin(x)
        return y, y  # one tensor, two outputs: each gets its own gradient


def test_an_output_returned_twice_gets_both_gradients():
    twice, ref = _pair(Twice)
    graphed = fsdp_graph.make_graphed_callables(twice, (torch.randn(4, 64, device=DEVICE, requires_grad=True),))
    x = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    a, b = graphed(x)
    (a.square().sum() + 3 * b.sum()).backward()
    ra, rb = ref(x.detach())
    (ra.square().sum() + 3 * rb.sum()).backward()
    for p, q in zip(twice.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_two_micro_batches_accumulate_like_eager():
    mlp, ref = _pair(MLP)
    graphed = fsdp_graph.make_graphed_callables(mlp, (torch.randn(4, 64, device=DEVICE, requires_grad=True),))
    for _ in range(2):
        x = torch.randn(4, 64, device=DEVICE, requires_grad=True)
        graphed(x).sum().backward()
        ref(x.detach().requires_grad_()).sum().backward()
    for p, q in zip(mlp.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_autograd_grad_gradients_survive_later_replays():
    """torch.autograd.grad returns the input's and a parameter's gradients to the caller: kept over later
    replays, they stay what eager gives, and no parameter accumulates."""
    mlp, ref = _pair(MLP)
    graphed = fsdp_graph.make_graphed_callables(mlp, (torch.randn(4, 64, device=DEVICE, requires_grad=True),))
    xs = [torch.randn(4, 64, device=DEVICE, requires_grad=True) for _ in range(3)]
    got = [torch.autograd.grad(graphed(x).square().sum(), [x, mlp.fc.weight]) for x in xs]
    want = [torch.autograd.grad(ref(x).square().sum(), [x, ref.fc.weight]) for x in xs]
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
    assert all(p.grad is None for p in mlp.parameters())


@pytest.mark.parametrize("names", ["ours", "transformer_engine"])
def test_capture_time_hooks_run_in_order_around_warmup_and_capture_never_at_replay(names):
    log: list = []

    def hooks(tag):
        if names == "transformer_engine":  # TE's make_graphed_callables form: hook(module) -> None
            return {
                "forward_pre_hooks": {1: lambda m: log.append(f"pre_forward{tag}")},
                "forward_hooks": {2: lambda m: log.append(f"forward{tag}")},
                "backward_pre_hooks": {3: lambda m: log.append(f"pre_backward{tag}")},
                "backward_hooks": {4: lambda m: log.append(f"backward{tag}")},
            }
        return {
            "pre_forward": {1: lambda m, a, k: log.append(f"pre_forward{tag}")},
            "forward": {2: lambda m, a, o: log.append(f"forward{tag}")},
            "pre_backward": {3: lambda m: log.append(f"pre_backward{tag}")},
            "backward": {4: lambda m: log.append(f"backward{tag}")},
        }

    a, b = MLP().to(DEVICE), MLP().to(DEVICE)
    x = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    ga, gb = fsdp_graph.make_graphed_callables(
        [a, b], [(x,), (x,)], num_warmup_iters=2, capture_time_hooks=[hooks("A"), hooks("B")],
        pre_warmup_hook=lambda: log.append("pre_warmup"), post_warmup_hook=lambda: log.append("post_warmup"),
    )
    one_pass = [
        "pre_forwardA", "forwardA", "pre_forwardB", "forwardB",
        "pre_backwardB", "backwardB", "pre_backwardA", "backwardA",
    ]
    assert log == ["pre_warmup", *one_pass, *one_pass, "post_warmup", *one_pass]  # 2 warm-ups, then the capture
    log.clear()
    for _ in range(3):
        gb(ga(torch.randn(4, 64, device=DEVICE, requires_grad=True))).sum().backward()
    assert log == []


def test_capture_time_pre_forward_hook_can_replace_arguments():
    lin = nn.Linear(64, 64).to(DEVICE)
    to_half = {"pre_forward": {0: lambda m, a, k: ((a[0].half(),), k)}}
    lin.half()
    graphed = fsdp_graph.make_graphed_callables(
        lin, (torch.randn(4, 64, device=DEVICE),), capture_time_hooks=to_half
    )
    x = torch.randn(4, 64, device=DEVICE, dtype=torch.half)
    assert torch.equal(graphed(x), lin.forward(x))  # the static input is the hook's (half) result
    with pytest.raises(ValueError, match="expected shape \\(4, 64\\), torch.float16"):
        graphed(x.float())


def test_dropout_masks_change_between_replays():
    mlp = MLP(dropout=0.5).to(DEVICE)
    x = torch.randn(16, 64, device=DEVICE, requires_grad=True)
    graphed = fsdp_graph.make_graphed_callables(mlp, (x,))
    masks = []
    for _ in range(3):
        live = x.detach().clone().requires_grad_()
        out = graphed(live)
        out.sum().backward()
        mask = out != 0
        assert 0.3 < mask.float().mean().item() < 0.7
        masks.append(mask)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


def test_graph_modules_keeps_plain_hooks_eager_around_the_replay():
    calls = []
    mlp = MLP().to(DEVICE)
    mlp.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    mlp.register_forward_hook(lambda m, args, out: out * 2)
    ref = copy.deepcopy(mlp)
    (graphed,) = fsdp_graph.graph_modules([mlp], [(torch.randn(4, 64, device=DEVICE, requires_grad=True),)])
    assert calls == ["pre"] * 4  # 3 warm-ups and the capture
    calls.clear()
    x = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    out = mlp(x)  # through nn.Module.__call__: the hooks run eagerly, the forward replays
    assert calls == ["pre"] and mlp.forward is graphed
    assert torch.equal(out, ref(x))
    with pytest.raises(RuntimeError, match="would never run"):
        mlp.fc.register_forward_hook(lambda *a: None)


def test_sharding_a_graphed_module_is_refused():
    fsdp_graph.init_distributed()
    mlp = MLP().to(DEVICE)
    fsdp_graph.graph_modules([mlp], [(torch.randn(4, 64, device=DEVICE, requires_grad=True),)])
    with pytest.raises(ValueError, match="already graphed.*fully_shard on every unit and the root first"):
        fsdp_graph.fully_shard(mlp)


def test_sharding_a_module_captured_with_make_graphed_callables_is_refused():
    """The low-level capture pins what it captured too, installed as forward or not: its graphs
    read the parameters' current addresses, which fully_shard would replace."""
    fsdp_graph.init_distributed()
    model = nn.Sequential(MLP(), MLP()).to(DEVICE)
    sample = (torch.randn(4, 64, device=DEVICE, requires_grad=True),)
    model[0].forward = fsdp_graph.make_graphed_callables(model[0], sample)
    with pytest.raises(ValueError, match=r"'0' \(MLP\) is already graphed \(make_graphed_callables\)"):
        fsdp_graph.fully_shard(model)


def test_sample_inputs_must_be_on_the_gpu():
    with pytest.raises(ValueError, match=r"sample input args\[0\] is on cpu; CUDA graphs need CUDA tensors"):
        fsdp_graph.make_graphed_callables(MLP().to(DEVICE), (torch.randn(4, 64),))


def test_sharding_the_root_after_its_blocks_were_graphed_is_refused():
    from models import TinyLM

    fsdp_graph.init_distributed()
    model = TinyLM(n_blocks=2).to(DEVICE)
    for block in model.blocks:
        fsdp_graph.fully_shard(block)
    fsdp_graph.graph_modules([model.blocks[0]], [(torch.randn(2, 8, 10, device=DEVICE, requires_grad=True),)])
    with pytest.raises(ValueError, match=r"'blocks.0' \(FSDPBlock\) is already graphed.*then graph_modules"):
        fsdp_graph.fully_shard(model)
