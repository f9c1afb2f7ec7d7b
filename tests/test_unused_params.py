"""Parameters that get no gradient in a backward end it with ``.grad = None`` on every rank, as in a
replicated reference and FSDP2, so AdamW's weight decay and momentum leave them alone; a parameter
used on some ranks only gets the averaged gradient. Checked against a replicated single-process
reference (every step: which ``.grad`` are None, their values, the weights after AdamW), on both
gradient paths, under ``no_sync``, with optimizer-in-backward hooks, and against FSDP2 itself."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_graph
from fsdp_graph.fsdp.collective_graphs import CollectiveGraphCaptureError
from fsdp_graph.fsdp.registry import root_contexts, units_in
from fsdp_graph.fsdp.unused_params import ExchangeGraphs

from dist_harness import run_ranks
from models import RecordingCollectiveBodies, not_capturing, on_fixed_buffers

# expert1's use per step and rank (two ranks): both, rank 0 only, none, rank 1 only.
pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine: CI runs it; the GPU suite need not
SCHEDULE = [(True, True), (True, False), (False, False), (False, True)]
# Under no_sync, per step and rank, per micro-batch.
MICRO_SCHEDULE = [((True, False), (False, False)), ((False, False), (False, False)), ((False, True), (True, True))]


class PassesInput(torch.autograd.Function):
    """Identity on ``x`` that takes a parameter and returns None as its gradient, as a graphed
    module's backward does for a parameter it does not use (autograd still runs that parameter's
    accumulation step and its post-accumulate-grad hooks, with no gradient)."""

    @staticmethod
    def forward(ctx, x, weight):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Routed(nn.Module):
    """Two experts, the second one run only when asked (a router that sent it no tokens); a pooler
    that no loss uses (its weight passed to a function that gives it no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.expert0 = nn.Linear(6, 6)
        self.expert1 = nn.Linear(6, 6)
        self.pooler = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_expert1: bool) -> torch.Tensor:
        h = PassesInput.apply(torch.tanh(self.inp(x)), self.pooler.weight)
        out = self.expert0(h)
        return out + self.expert1(h) if use_expert1 else out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.block = Routed()
        self.last = nn.Linear(6, 6)
        self.unused_head = nn.Linear(6, 3)  # in the root unit, whose inputs need no gradient

    def forward(self, x: torch.Tensor, use_expert1: bool) -> torch.Tensor:
        return self.last(self.block(self.first(x), use_expert1))


def _batch(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(100 * step + 10 * rank + micro))


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _build(path: str) -> tuple[Model, Model]:
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model.block)
    fsdp_graph.fully_shard(model)
    if path == "fixed_buffer":  # the reduce as collective graphs would run it: gradients at fixed addresses
        on_fixed_buffers(model)
    return model, ref


def _check_grads(model: nn.Module, ref: nn.Module, where: str) -> list[str]:
    """Same ``.grad`` None-ness and values as the reference; the names of the parameters with one."""
    ref_params = dict(ref.named_parameters())
    with_grad = []
    for name, param in model.named_parameters():
        expected = ref_params[name].grad
        if expected is None:
            assert param.grad is None, f"{where}: {name} got no gradient in the reference, but has .grad here"
            continue
        assert param.grad is not None, f"{where}: {name} has a gradient in the reference, but .grad is None here"
        torch.testing.assert_close(_full(param.grad), expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{where} {name}: {m}")
        with_grad.append(name)
    return with_grad


def _adamw(model: nn.Module, ref: nn.Module) -> tuple:
    """AdamW with weight decay: a zero gradient would still move a parameter (None leaves it)."""
    return tuple(torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) for m in (model, ref))


def _step(optimizers: tuple) -> None:
    for o in optimizers:
        o.step()
        o.zero_grad()


def _check_weights(model: nn.Module, ref: nn.Module) -> None:
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param.detach()), ref_params[name].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"final {name}: {m}")


def _train(info, path: str, hooks: bool) -> None:
    """Each rank its own batch and routing; the reference runs every rank's batch and routing."""
    model, ref = _build(path)
    world = info.world_size
    optimizers = _adamw(model, ref)
    called: list[str] = []
    ref_called: list[str] = []
    if hooks:  # optimizer-in-backward style hooks: each runs once, with the gradient, where there is one
        def record(calls: list, name: str):  # (autograd also runs them with .grad None: see PassesInput)
            return lambda param: calls.append(name) if param.grad is not None else None

        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            p.register_post_accumulate_grad_hook(record(called, name))
            q.register_post_accumulate_grad_hook(record(ref_called, name))
    for step, use in enumerate(SCHEDULE):
        model(_batch(step, info.rank), use[info.rank]).pow(2).mean().backward()
        sum(ref(_batch(step, r), use[r]).pow(2).mean() for r in range(world)).div(world).backward()
        with_grad = _check_grads(model, ref, f"rank {info.rank} step {step}")
        assert ("block.pooler.weight" in with_grad) is False and ("unused_head.weight" in with_grad) is False
        assert ("block.expert1.weight" in with_grad) == any(use)
        if hooks:
            assert sorted(called) == sorted(ref_called), f"step {step}: hooks ran for {called}, not {ref_called}"
            called.clear()
            ref_called.clear()
        _step(optimizers)
    _check_weights(model, ref)


@pytest.mark.parametrize("path", ["autograd_tensors", "fixed_buffer"])
def test_a_parameter_no_rank_used_has_no_gradient_and_is_not_decayed(path):
    run_ranks(_train, 2, path, False, backend="gloo")


def test_post_accumulate_hooks_run_only_for_parameters_some_rank_used():
    run_ranks(_train, 2, "autograd_tensors", True, backend="gloo")


def _train_no_sync(info, path: str) -> None:
    """Two micro-batches per step, the first under no_sync: a parameter used in any micro-batch
    of any rank has a gradient."""
    model, ref = _build(path)
    world = info.world_size
    optimizers = _adamw(model, ref)
    for step, per_rank in enumerate(MICRO_SCHEDULE):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            model(_batch(step, info.rank, micro), per_rank[info.rank][micro]).pow(2).mean().div(2).backward()
        sum(ref(_batch(step, r, k), per_rank[r][k]).pow(2).mean() for r in range(world) for k in range(2)).div(
            2 * world).backward()
        with_grad = _check_grads(model, ref, f"rank {info.rank} step {step}")
        assert ("block.expert1.weight" in with_grad) == any(any(m) for m in per_rank)
        _step(optimizers)
    _check_weights(model, ref)


@pytest.mark.parametrize("path", ["autograd_tensors", "fixed_buffer"])
def test_under_no_sync_a_parameter_used_in_any_micro_batch_has_a_gradient(path):
    run_ranks(_train_no_sync, 2, path, backend="gloo")


def _retried_after_a_failed_step(info) -> None:
    """A no_sync micro-batch, then a forward that raises on every rank (caught) and is retried: the
    first micro-batch's sum survives the recovery, and so does the record that expert1 got a
    gradient in it (it is used on rank 0 only, and not in the retried micro-batch)."""
    model, ref = _build("autograd_tensors")
    use = (True, False)
    model.set_requires_gradient_sync(False)
    model(_batch(0, info.rank, 0), use[info.rank]).pow(2).mean().div(2).backward()
    model.set_requires_gradient_sync(True)
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 5), False)  # a wrong shape: the first layer raises, on every rank
    model(_batch(0, info.rank, 1), False).pow(2).mean().div(2).backward()
    world = info.world_size
    sum(ref(_batch(0, r, 0), use[r]).pow(2).mean() for r in range(world)).div(2 * world).backward()
    sum(ref(_batch(0, r, 1), False).pow(2).mean() for r in range(world)).div(2 * world).backward()
    assert "block.expert1.weight" in _check_grads(model, ref, f"rank {info.rank}")


def test_a_no_sync_micro_batch_keeps_its_use_record_through_a_failed_step():
    run_ranks(_retried_after_a_failed_step, 2, backend="gloo")


class Side(nn.Module):
    """Two tables; the second one looked up only where asked."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(11, 6)
        self.b = nn.Embedding(11, 6)

    def forward(self, idx, use_b: bool):
        return self.a(idx) + self.b(idx) if use_b else self.a(idx)


class TwoTokenUnits(nn.Module):
    """The root and a second unit both fed token ids (no input needs a gradient); same flat size,
    so reduce-scatters paired across the two units would not even fail."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.side = Side()
        self.head = nn.Linear(6, 11, bias=False)

    def forward(self, idx, use_b: bool):
        return self.head(torch.tanh(self.emb(idx)) + 0.5 * self.side(idx, use_b))


def _two_token_units(info) -> None:
    """side.b used on rank 0 only: rank 0 finished the side unit as soon as its last parameter
    accumulated, mid-backward, rank 1 only at the end, after the root, so the ranks paired the
    root's reduce-scatter with the side unit's (silently mixed gradients). Both now finish at the
    end of the backward, in the same order on every rank."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = TwoTokenUnits()
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model.side)
    fsdp_graph.fully_shard(model)
    use = (True, False)

    def loss(m, r):
        g = torch.Generator().manual_seed(r)
        idx, targets = torch.randint(0, 11, (2, 4), generator=g), torch.randint(0, 11, (2, 4), generator=g)
        return F.cross_entropy(m(idx, use[r]).flatten(0, 1), targets.flatten())

    loss(model, info.rank).backward()
    sum(loss(ref, r) for r in range(info.world_size)).div(info.world_size).backward()
    assert "side.b.weight" in _check_grads(model, ref, f"rank {info.rank}")


def test_units_fed_token_ids_reduce_in_the_same_order_on_every_rank():
    run_ranks(_two_token_units, 2, backend="gloo")


def _hsdp(info) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fsdp_graph.fully_shard(model.block, mesh=mesh)
    fsdp_graph.fully_shard(model, mesh=mesh)
    uses = [True, False, False, False]  # expert1 used on rank 0 only: another replica and shard
    model(_batch(0, info.rank), uses[info.rank]).pow(2).mean().backward()
    sum(ref(_batch(0, r), uses[r]).pow(2).mean() for r in range(4)).div(4).backward()
    with_grad = _check_grads(model, ref, f"rank {info.rank}")
    assert "block.expert1.weight" in with_grad and "block.pooler.weight" not in with_grad


def test_hsdp_decides_over_every_data_parallel_rank():
    run_ranks(_hsdp, 4, backend="gloo")


def test_one_process_without_a_group_leaves_unused_parameters_without_gradient():
    model, ref = _build("autograd_tensors")
    optimizers = _adamw(model, ref)
    for step, use in enumerate((True, False, True)):
        for m in (model, ref):
            m(_batch(step, 0), use).pow(2).mean().backward()
        _check_grads(model, ref, f"step {step}")
        _step(optimizers)
    _check_weights(model, ref)


def test_a_gradient_from_an_earlier_backward_is_kept_when_the_next_one_does_not_use_the_parameter():
    """Two backwards before one optimizer step: the second one not reaching expert1 leaves the
    first one's gradient, as autograd does."""
    model, ref = _build("autograd_tensors")
    for use in (True, False):
        for m in (model, ref):
            m(_batch(0, 0), use).pow(2).mean().backward()
    assert _check_grads(model, ref, "after two backwards").count("block.expert1.weight") == 1


def _against_fsdp2(info, source: str) -> list:
    """A pooler no rank uses, in a script written for FSDP2 (its import switched)."""
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = importlib.import_module(source).fully_shard
    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", (info.world_size,))  # (FSDP2 would pick CUDA where a GPU is present)
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    grads_none = []
    for step in range(3):
        model(_batch(step, info.rank), True).pow(2).mean().backward()
        grads_none.append([n for n, p in model.named_parameters() if p.grad is None])
        opt.step()
        opt.zero_grad()
    return grads_none, {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _switched(info) -> None:
    theirs = _against_fsdp2(info, "torch.distributed.fsdp")
    ours = _against_fsdp2(info, "fsdp_graph")
    assert ours[0] == theirs[0] and theirs[0][0], f"params without .grad: ours {ours[0]}, FSDP2's {theirs[0]}"
    for name, value in theirs[1].items():
        torch.testing.assert_close(ours[1][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert dist.get_world_size() == 2


def test_unused_parameters_match_fsdp2():
    run_ranks(_switched, 2, backend="gloo")


def _captured_steps(info) -> None:
    """A whole-step capture cannot read the ranks' flags back: it reuses the last eager decision
    (emulated here: the settlement is told it runs inside a capture), and refuses a step whose
    parameter use differs from it."""
    import fsdp_graph.fsdp.unused_params as unused_params

    model, ref = _build("autograd_tensors")
    use = (True, False)  # expert1 used on rank 0 only: a gradient everywhere; pooler and unused_head: none
    model(_batch(0, info.rank), use[info.rank]).pow(2).mean().backward()  # eager: decides by the exchange
    eager = [n for n, p in model.named_parameters() if p.grad is None]
    model.zero_grad()
    unused_params._capturing = lambda device: True
    model(_batch(1, info.rank), use[info.rank]).pow(2).mean().backward()  # "captured": no collective
    assert [n for n, p in model.named_parameters() if p.grad is None] == eager
    model.zero_grad()
    with pytest.raises(unused_params.ParameterUseChanged, match="must not change from step to step"):
        model(_batch(2, info.rank), not use[info.rank]).pow(2).mean().backward()


def test_a_captured_step_reuses_the_eager_decision_and_refuses_changed_use():
    run_ranks(_captured_steps, 2, backend="gloo")


class _Experts(nn.Module):
    """Every parameter used on every rank but expert1's, which each rank runs as the schedule says."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.expert0 = nn.Linear(6, 6)
        self.expert1 = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_expert1: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.expert0(h) + self.expert1(h) if use_expert1 else self.expert0(h)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.block = _Experts()

    def forward(self, x: torch.Tensor, use_expert1: bool, skip_block: bool = False) -> torch.Tensor:
        return self.first(x) if skip_block else self.block(self.first(x), use_expert1)


def _sharded_net() -> tuple[_Net, _Net]:
    """(the net sharded, block and root, and its single-process reference)."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model.block)
    fsdp_graph.fully_shard(model)
    return model, ref


def _exchange_replayed(info) -> None:
    model, ref = _sharded_net()
    not_capturing()
    bodies = [RecordingCollectiveBodies() for _ in units_in(model)]
    for unit, recording in zip(units_in(model), bodies):
        unit.replay_collectives(recording)
    optimizers = _adamw(model, ref)
    world = info.world_size
    keys = set()
    for step, use in enumerate(SCHEDULE + SCHEDULE + [(True, True)]):
        skip = step == 4  # (the block's unit not reached: only the root reduces, and exchanges)
        model(_batch(step, info.rank), use[info.rank], skip).pow(2).mean().backward()
        sum(ref(_batch(step, r), use[r], skip).pow(2).mean() for r in range(world)).div(world).backward()
        with_grad = _check_grads(model, ref, f"rank {info.rank} step {step}")
        assert ("block.expert1.weight" in with_grad) == (any(use) and not skip)
        exchange = root_contexts(model)[0]._exchange[1].graphs  # (the root's, spawned from a replaying unit's)
        assert not any(name.startswith("use_exchange") for recording in bodies for name, _ in recording.runs)
        runs, exchange.runs = exchange.runs, []
        # One exchange per step, one body whether this rank has candidates (expert1 unused here) or not,
        # at the group's one buffer: its address the same whichever units reduced (the size differs).
        assert [name for name, _ in runs] == ["use_exchange"], (step, runs)
        keys.add(runs[0][1])
        _step(optimizers)
    assert len({key[0] for key in keys}) == 1 and len(keys) == 2, keys
    _check_weights(model, ref)


def test_the_exchange_replays_as_a_collective_body_and_decides_as_eagerly():
    """Where the units' reduces replay as collective graphs, the end-of-backward exchange of which
    parameters got a gradient replays too: one body (the all-reduce) at the group's persistent
    buffer, filled with ones before it where this rank used every parameter, its flags copied in
    and the sums read back where not. The decisions (and so the gradients and weights) equal the
    single-process reference's, also in a step that does not reach the block."""
    run_ranks(_exchange_replayed, 2, backend="gloo")


class _CaptureFailsOnce(RecordingCollectiveBodies):
    """As ``CollectiveGraphs.run`` does when a capture fails: raises once without running the body."""

    def run(self, name, key, body) -> None:
        if not self.runs:
            self.runs.append((name, key))
            raise CollectiveGraphCaptureError("capturing its use_exchange as a CUDA graph failed: (test)")
        super().run(name, key, body)


def _exchange_capture_fails(info) -> None:
    model, ref = _sharded_net()
    on_fixed_buffers(model)
    ctx = root_contexts(model)[0]
    optimizers = _adamw(model, ref)
    world = info.world_size
    for step, use in enumerate(SCHEDULE):
        if step == 1 and info.rank == 0:  # (on one rank only: its peer's all-reduce must still pair)
            failing = _CaptureFailsOnce()
            ctx._exchange = (ctx._exchange[0], ExchangeGraphs(failing))
            with pytest.warns(UserWarning, match="ran eagerly instead"):
                model(_batch(step, info.rank), use[info.rank]).pow(2).mean().backward()
            assert len(failing.runs) == 1
        else:
            model(_batch(step, info.rank), use[info.rank]).pow(2).mean().backward()
        sum(ref(_batch(step, r), use[r]).pow(2).mean() for r in range(world)).div(world).backward()
        _check_grads(model, ref, f"rank {info.rank} step {step}")
        _step(optimizers)
    _check_weights(model, ref)


def test_an_exchange_whose_capture_fails_on_one_rank_runs_eagerly_there_and_decides_as_eagerly():
    """A failed capture of the exchange's graph skips its all-reduce on that rank (``CollectiveGraphs.run``
    raises without running the body): run eagerly instead, with a warning, it still pairs with its
    peers' (their replay would otherwise wait for ever, untimed by the watchdog)."""
    run_ranks(_exchange_capture_fails, 2, backend="gloo")
