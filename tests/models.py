"""Small models for the tests: uneven sizes (padding), a tied embedding, a frozen parameter,
a buffer used in forward, and blocks that can be sharded as units."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_graph
from fsdp_graph.fsdp.capture_interface import units_in


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has an exactly-zero gradient: Adam would amplify noise
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.out(F.gelu(self.fc(x)))


class TinyLM(nn.Module):
    """Embedding (tied to the head), blocks, final norm; odd sizes so shards need padding."""

    def __init__(self, vocab: int = 37, d: int = 10, n_blocks: int = 3, hidden: int = 23, seq: int = 8,
                 big_block: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.register_buffer("pos", torch.randn(seq, d) * 0.1)  # replicated, used in forward
        self.blocks = nn.ModuleList(
            Block(d, hidden * (4 if i == big_block else 1)) for i in range(n_blocks)
        )
        self.blocks[min(1, n_blocks - 1)].ln.weight.requires_grad_(False)  # frozen, inside a unit
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class EagerCollectiveBodies:
    """Stands in for a unit's collective graphs on CPU (``unit.replay_collectives(...)``): the bodies
    run eagerly, but the unit keeps its gradients at fixed addresses, as for real graphs."""

    def run(self, name, key, body) -> None:
        body()

    def spawn(self, name):
        return type(self)()  # (the root's use exchange: bodies, and records, of its own)

    def forget(self) -> None:
        pass


class RecordingCollectiveBodies(EagerCollectiveBodies):
    """The bodies run eagerly, as a graph's first run does; which ran, under which key, is kept
    (``runs``: (name, key) in order)."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, tuple]] = []

    def run(self, name, key, body) -> None:
        self.runs.append((name, key))
        body()


def shard_beside_reference(model: nn.Module, inner=(), **kwargs) -> nn.Module:
    """The replicated reference (a deep copy, taken first), then ``fully_shard`` on each module of
    ``inner`` and on ``model`` itself, with ``kwargs``."""
    ref = copy.deepcopy(model)
    for module in inner:
        fsdp_graph.fully_shard(module, **kwargs)
    fsdp_graph.fully_shard(model, **kwargs)
    return ref


def assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    """Every parameter's (full) gradient equals the reference's, to float rounding."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def not_capturing(monkeypatch=None) -> None:
    """A CPU build of torch cannot answer whether a stream is capturing (the engine asks before it
    runs a collective body through its graphs): it is told no, through ``monkeypatch`` where given
    (else in this rank's own process)."""
    if monkeypatch is not None:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    elif not torch.cuda.is_available():
        torch.cuda.is_current_stream_capturing = lambda: False


def on_fixed_buffers(model: nn.Module, monkeypatch=None) -> None:
    """Every unit's reduce run as its collective graphs would run it (``EagerCollectiveBodies``):
    gradients at fixed addresses, on CPU (``not_capturing``)."""
    not_capturing(monkeypatch)
    for unit in units_in(model):
        unit.replay_collectives(EagerCollectiveBodies())


def lm_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build(device: torch.device, seed: int = 0, **kwargs) -> tuple[TinyLM, TinyLM]:
    """(model to shard, replicated reference copy), identical on every rank."""
    torch.manual_seed(seed)
    model = TinyLM(**kwargs).to(device)
    return model, copy.deepcopy(model)


def shard(model: TinyLM, **kwargs) -> TinyLM:
    for block in model.blocks:
        fsdp_graph.fully_shard(block, **kwargs)
    return fsdp_graph.fully_shard(model, **kwargs)


def global_batch(step: int, world_size: int, device: torch.device, per_rank: int = 2, seq: int = 8,
                 vocab: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, vocab, (per_rank * world_size, seq), generator=g)
    targets = torch.randint(0, vocab, (per_rank * world_size, seq), generator=g)
    return idx.to(device), targets.to(device)


def local_part(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return tensor.chunk(world_size)[rank]


def local_loss(model: nn.Module, step: int, info) -> torch.Tensor:
    """This rank's loss on its slice of step ``step``'s global batch."""
    idx, targets = global_batch(step, info.world_size, info.device)
    return lm_loss(model, local_part(idx, info.rank, info.world_size), local_part(targets, info.rank, info.world_size))


def assert_full_state_matches(model: nn.Module, ref: nn.Module, rtol: float, atol: float) -> None:
    """The sharded model's full state dict equals the reference's state dict."""
    full = fsdp_graph.full_state_dict(model)
    expected = ref.state_dict()
    assert full.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


def sgd_pair(model: nn.Module, ref: nn.Module, lr: float = 0.1):
    return torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)


def train_beside_reference(model: nn.Module, ref: nn.Module, steps: int = 2, optimizers=None) -> None:
    """Single process: train both on the same batches; losses and final weights must agree."""
    opt, ref_opt = optimizers or sgd_pair(model, ref)
    cpu = torch.device("cpu")
    for step in range(steps):
        idx, targets = global_batch(step, 1, cpu)
        loss, ref_loss = lm_loss(model, idx, targets), lm_loss(ref, idx, targets)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
        loss.backward()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_full_state_matches(model, ref, rtol=1e-6, atol=1e-7)
