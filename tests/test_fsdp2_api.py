"""FSDP2's API by the same names: one training script, switched between torch.distributed.fsdp and
fsdp_graph by its import alone, gives the same losses and clipping norms; FSDP2's options that
have no counterpart here are refused with the fix named."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_graph

from dist_harness import run_ranks
from models import TinyLM, global_batch, local_part

STEPS = 5
MAX_NORM = 0.02  # small enough that every step clips


def init_weights(model: TinyLM) -> None:
    """The model's own initialisation, run after to_empty on the sharded (DTensor) parameters."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    with torch.no_grad():
        model.pos.copy_(torch.linspace(-0.1, 0.1, model.pos.numel()).view_as(model.pos))


def fsdp2_script(info, library: str) -> tuple[list, list, dict]:
    """An FSDP2 user's script; ``library`` is the module it imports fully_shard from. Meta-device
    construction, fully_shard, to_empty, the model's own init, torch's clip_grad_norm_, AdamW."""
    from torch.distributed.device_mesh import init_device_mesh

    lib = importlib.import_module(library)
    fully_shard, MixedPrecisionPolicy = lib.fully_shard, lib.MixedPrecisionPolicy

    import torch.distributed as dist

    # gloo is the CPU backend (on a GPU machine with fewer GPUs than ranks, FSDP2's full_tensor of
    # CUDA tensors over gloo crashes): NCCL on CUDA, gloo on CPU.
    device = info.device if dist.get_backend() == "nccl" else torch.device("cpu")
    info = type("Info", (), {"device": device, "world_size": info.world_size, "rank": info.rank})
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyLM(n_blocks=4)
    fully_shard([model.blocks[0], model.blocks[1]], mesh=mesh, mp_policy=policy)  # a list of modules
    for block in model.blocks[2:]:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    model.to_empty(device=info.device)
    init_weights(model)
    initial = {name: p.full_tensor() for name, p in model.named_parameters()}
    for module in model.modules():
        if isinstance(module, lib.FSDPModule):
            module.set_gradient_divide_factor(2.0 * info.world_size)  # half the mean gradient
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (FSDP2's default)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1], model.blocks[2]])  # explicit prefetch
    model.blocks[3].set_modules_to_backward_prefetch([model.blocks[2], model.blocks[1]])
    losses, norms = [], []
    for step in range(STEPS):
        model.set_is_last_backward(True)
        idx, targets = global_batch(step, info.world_size, info.device)
        idx, targets = local_part(idx, info.rank, info.world_size), local_part(targets, info.rank, info.world_size)
        for micro in range(2):  # gradient accumulation: sync and reshard only after the last one
            last = micro == 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            logits = model(idx.chunk(2)[micro])
            loss = F.cross_entropy(logits.flatten(0, 1), targets.chunk(2)[micro].flatten()) / 2
            loss.backward()
            losses.append(loss.detach().clone())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor()
        opt.step()
        opt.zero_grad()
        norms.append(norm.detach().clone())
    return losses, norms, initial


def _switched_by_import(info) -> None:
    theirs = fsdp2_script(info, "torch.distributed.fsdp")
    ours = fsdp2_script(info, "fsdp_graph")
    assert ours[2].keys() == theirs[2].keys()
    for name in ours[2]:
        assert torch.equal(ours[2][name], theirs[2][name]), f"initial {name} differs from FSDP2's"
    for name, a, b in (("loss", ours[0], theirs[0]), ("clip norm", ours[1], theirs[1])):
        for step, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {name}: {m}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_fsdp2_script_switched_by_its_import_trains_the_same(world_size):
    run_ranks(_switched_by_import, world_size)


def test_torchs_mixed_precision_policy_is_accepted_with_output_dtype():
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    layer = nn.Linear(4, 4)
    fsdp_graph.fully_shard(layer, mp_policy=TorchPolicy(output_dtype=torch.float64))
    assert layer.fsdp_unit.config.mp_policy == fsdp_graph.MixedPrecisionPolicy(output_dtype=torch.float64)
    x = torch.randn(2, 4, requires_grad=True)
    out = layer(x)
    assert out.dtype == torch.float64
    out.sum().backward()  # the pre-backward hook sits before the cast, as in FSDP2
    assert layer.weight.grad is not None and x.grad is not None
    assert fsdp_graph.MixedPrecision is fsdp_graph.MixedPrecisionPolicy


def test_ignored_params_stay_unsharded_and_unmanaged_also_by_the_parent():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
    kept = model[0][1].weight
    fsdp_graph.fully_shard(model[0], ignored_params={kept})
    fsdp_graph.fully_shard(model)  # the parent does not take it either (FSDP2's behaviour)
    assert model[0][1].weight is kept and kept.shape == (4, 4)
    assert [p.name for p in model[0].fsdp_unit.params] == ["0.weight", "0.bias", "1.bias"]
    assert [p.name for p in model.fsdp_unit.params] == ["1.weight", "1.bias"]
    model(torch.randn(2, 4)).sum().backward()
    assert kept.grad is not None and kept.grad.shape == (4, 4)


def test_after_unshard_state_dicts_and_clipping_refuse_until_reshard():
    """unshard() leaves the unsharded parameters (and their gradients' views) in the module:
    clipping, loading or gathering there would act on the gathered copy, not the masters."""
    torch.manual_seed(0)
    model = _WithMethod()
    fsdp_graph.fully_shard(model)
    model(torch.randn(2, 6)).sum().backward()
    state = fsdp_graph.full_state_dict(model)
    model.unshard()
    for call in (lambda: fsdp_graph.clip_grad_norm_(model, 1.0), lambda: fsdp_graph.full_state_dict(model),
                 lambda: fsdp_graph.load_full_state_dict(model, state)):
        with pytest.raises(fsdp_graph.TransitionError, match=r"unshard\(\) left .*call module.reshard\(\) first"):
            call()
    model.reshard()
    fsdp_graph.load_full_state_dict(model, state)
    assert fsdp_graph.clip_grad_norm_(model, 1.0) > 0


def test_gradient_divide_factor_is_validated_and_survives_a_rebuild():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied across the two units: the parent rebuilds model[0]'s
    fsdp_graph.fully_shard(model[0])
    fsdp_graph.fully_shard(model[1])
    model[0].set_gradient_divide_factor(4.0)
    with pytest.raises(ValueError, match="factor must be a number > 0"):
        model[0].set_gradient_divide_factor(0)
    fsdp_graph.fully_shard(model)
    assert model[0].fsdp_unit.grads.divide_factor == 4.0


def test_fsdp2_options_without_a_counterpart_are_refused_with_the_fix():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    with pytest.raises(ValueError, match=r"reshard_after_forward=2.*True.*False"):
        fsdp_graph.fully_shard(nn.Linear(2, 2), reshard_after_forward=2)
    with pytest.raises(ValueError, match=r"CPUOffloadPolicy.*Drop offload_policy"):
        fsdp_graph.fully_shard(nn.Linear(2, 2), offload_policy=CPUOffloadPolicy())
    fsdp_graph.fully_shard(nn.Linear(2, 2), offload_policy=OffloadPolicy())  # no offload: fine
    with pytest.raises(ValueError, match="shard_placement_fn is not supported.*Drop shard_placement_fn"):
        fsdp_graph.fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda p: None)
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"modules 0 and 1 of the list share a parameter.*common ancestor"):
        fsdp_graph.fully_shard([nn.Sequential(shared), nn.Sequential(shared)])
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
        fsdp_graph.fully_shard(nn.Linear(2, 2), mp_policy={"param_dtype": torch.bfloat16})


def _meshes(info) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(info.device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match="mesh= or process_group=, not both"):
        fsdp_graph.fully_shard(nn.Linear(2, 2).to(info.device), mesh=mesh["shard"],
                               process_group=mesh["shard"].get_group())
    cube = init_device_mesh(info.device.type, (1, 2, 2))
    with pytest.raises(ValueError, match="mesh has 3 dimensions.*2-D \\(replicate, shard\\)"):
        fsdp_graph.fully_shard(nn.Linear(2, 2).to(info.device), mesh=cube)
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.DeviceMesh"):
        fsdp_graph.fully_shard(nn.Linear(2, 2).to(info.device), mesh=mesh.get_group(0))


def test_meshes_of_more_than_two_dimensions_are_refused_with_the_fix():
    run_ranks(_meshes, 4)


class _WithMethod(nn.Module):
    """A model whose users call a method other than forward (as ``generate``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.proj(x)))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))

    def twice(self, x: torch.Tensor) -> torch.Tensor:
        """Calls the module itself, as a ``generate`` does."""
        return self(x) + self(2 * x)


def _module_methods(info) -> None:
    """unshard()/reshard() and register_fsdp_forward_method behave as FSDP2's do."""
    import torch.distributed.fsdp as fsdp2

    results = {}
    for lib in (fsdp2, fsdp_graph):
        torch.manual_seed(0)
        model = _WithMethod().to(info.device)
        full = {k: v.clone() for k, v in model.state_dict().items()}
        lib.fully_shard(model)
        model.unshard()  # the full parameters in the module, outside forward
        unsharded = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert {n: p.shape for n, p in unsharded.items()} == {k: v.shape for k, v in full.items()}
        assert all(torch.equal(unsharded[k], full[k]) for k in full), lib.__name__
        x = torch.randn(4, 6, device=info.device)
        y = model(x)  # uses them
        model.reshard()
        handle = model.unshard(async_op=True)
        handle.wait()
        model.reshard()
        lib.register_fsdp_forward_method(model, "features")
        feats = model.features(x)  # outside forward: the method unshards around itself
        feats.sum().backward()
        lib.register_fsdp_forward_method(model, "twice")
        model.twice(x).sum().backward()  # forwards nested inside a registered method
        grads = [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]
        results[lib.__name__] = (y.detach(), feats.detach(), [g.detach().clone() for g in grads])
    ours, theirs = results["fsdp_graph"], results["torch.distributed.fsdp"]
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])
    assert len(ours[2]) == len(theirs[2])
    for a, b in zip(ours[2], theirs[2]):
        torch.testing.assert_close(a, b)


def test_unshard_reshard_and_forward_methods_as_in_fsdp2():
    run_ranks(_module_methods, 2)


def test_register_fsdp_forward_method_names_a_missing_method_and_skips_plain_modules():
    plain = _WithMethod()
    fsdp_graph.register_fsdp_forward_method(plain, "features")  # not sharded: a no-op, as in FSDP2
    assert "features" not in plain.__dict__
    model = _WithMethod()
    fsdp_graph.fully_shard(model)
    with pytest.raises(ValueError, match="_WithMethod has no method 'generate' to register"):
        fsdp_graph.register_fsdp_forward_method(model, "generate")


def test_reshard_after_backward_false_skips_the_gather_after_an_unsynchronised_backward(monkeypatch):
    """FSDP2's set_reshard_after_backward(False) for accumulation: after a backward without
    gradient sync the next forward reuses the gathered parameters; a synchronised backward
    reshards, since the optimizer step follows it."""
    import fsdp_graph.fsdp.param_group as param_group

    from models import build, shard

    model, _ = build(torch.device("cpu"))
    shard(model, double_buffer=False)  # dynamic buffers: kept only because of the setting
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    original = param_group.all_gather_inplace
    monkeypatch.setattr(param_group, "all_gather_inplace", lambda *a: calls.append(1) or original(*a))
    info = type("Info", (), {"world_size": 1, "rank": 0, "device": torch.device("cpu")})
    from models import local_loss

    def gathers(step: int) -> int:
        calls.clear()
        local_loss(model, step, info).backward()
        return len(calls)

    units = 4
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)  # accumulation: what the setting is for
    assert gathers(0) == 2 * units  # dynamic: freed after forward, gathered again for backward
    assert gathers(1) == units  # the forward reuses what the last (unsynchronised) backward kept
    model.set_requires_gradient_sync(True)
    assert gathers(2) == units  # still kept; this synchronised backward reshards (a step follows)
    opt.step()
    assert gathers(3) == 2 * units
    with pytest.raises(TypeError, match="not a fully_shard-ed module"):
        model.set_modules_to_forward_prefetch([nn.Linear(2, 2)])


def test_deepcopy_of_a_sharded_model_is_refused_with_the_fix():
    import copy

    model = fsdp_graph.fully_shard(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="deepcopy.*before fully_shard.*get_model_state_dict"):
        copy.deepcopy(model)


def _kept_parameters_are_never_stale(info) -> None:
    """set_reshard_after_backward(False) left on through optimizer steps, with DTensor masters:
    every forward equals the unsharded reference's (a kept copy is never used after the masters
    changed), also when the optimizer steps after an unsynchronised backward."""
    from models import build, shard

    model, ref = build(info.device)
    shard(model)
    model.set_reshard_after_backward(False)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    idx, targets = global_batch(0, info.world_size, info.device)
    mine = idx[:2]  # the same batch on every rank: the averaged gradient is the reference's
    for step in range(4):
        sync = step != 2
        model.set_requires_gradient_sync(sync)
        out, expected = model(mine), ref(mine)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")
        scale = 1.0 if sync else 0.0  # step 2 adds nothing: the steps stay comparable
        (out.float().square().mean() * scale).backward()
        (expected.float().square().mean() * scale).backward()
        for o in (opt, ref_opt):
            o.step()  # step 2: after an unsynchronised backward, with step 1's gradients kept
            if step != 1:
                o.zero_grad()


def test_kept_parameters_are_gathered_again_after_an_optimizer_step():
    run_ranks(_kept_parameters_are_never_stale, 2)


def _apply_keeps_masters_owned_and_refuses_everywhere(info) -> None:
    from fsdp_graph.fsdp.sharded_param import master_owner

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 1), nn.Sequential(nn.Linear(1, 3)))
    fsdp_graph.fully_shard(model[1])
    model[1].to_empty(device=info.device)  # a child materialised before its parent is sharded
    fsdp_graph.fully_shard(model)
    model.to_empty(device=info.device)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert all(master_owner(p) is not None for p in model.parameters())  # tags survive swap_tensors
    model(torch.randn(2, 4, device=info.device)).sum().backward()
    # Linear(4, 1).weight has one row: rank 1 holds none of it. Swapping it behind the unit's back
    # (to_empty on a plain submodule) must be refused on every rank, not only where rows live.
    model[0].to_empty(device=info.device)
    with pytest.raises(RuntimeError, match="'0.weight' was replaced after fully_shard"):
        model(torch.randn(2, 4, device=info.device))


def test_to_empty_keeps_ownership_and_a_swap_behind_the_units_back_is_refused_on_every_rank():
    run_ranks(_apply_keeps_masters_owned_and_refuses_everywhere, 2)


def test_a_unit_rebuilt_for_a_tied_parameter_keeps_its_settings_and_prefetch_lists():
    from models import build

    model, _ = build(torch.device("cpu"))
    for block in model.blocks:
        fsdp_graph.fully_shard(block)
    fsdp_graph.fully_shard(model.emb)  # holds the weight tied to the head: rebuilt by the root's call
    model.emb.set_reshard_after_backward(False)
    model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0], model.emb])
    fsdp_graph.fully_shard(model)
    assert model.emb.fsdp_unit.reshard_after_backward is False
    assert model.blocks[1].fsdp_unit.backward_prefetch == [model.blocks[0].fsdp_unit, model.emb.fsdp_unit]
    idx, targets = global_batch(0, 1, torch.device("cpu"))
    F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()


def _optimizer_in_backward(info) -> None:
    """register_post_accumulate_grad_hook on the sharded parameters (optimizer in backward) runs
    once per parameter and backward, with the reduced gradient, as in FSDP2: same weights."""
    import torch.distributed.fsdp as fsdp2

    from models import build

    weights = {}
    for lib in (fsdp2, fsdp_graph):
        model, _ = build(info.device)
        for block in model.blocks:
            lib.fully_shard(block)
        lib.fully_shard(model)
        calls = []
        optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters() if p.requires_grad}

        def step_now(param, optimizers=optimizers, calls=calls):
            calls.append(1)
            optimizers[param].step()
            optimizers[param].zero_grad()

        for p in optimizers:
            p.register_post_accumulate_grad_hook(step_now)
        for step in range(2):
            idx, targets = global_batch(step, info.world_size, info.device)
            logits = model(local_part(idx, info.rank, info.world_size))
            F.cross_entropy(logits.flatten(0, 1), local_part(targets, info.rank, info.world_size).flatten()).backward()
        assert len(calls) == 2 * len(optimizers), (lib.__name__, len(calls))
        weights[lib.__name__] = [p.full_tensor() for p in model.parameters()]
    for ours, theirs in zip(weights["fsdp_graph"], weights["torch.distributed.fsdp"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_post_accumulate_grad_hooks_run_as_in_fsdp2():
    run_ranks(_optimizer_in_backward, 2)


def test_tensor_parallel_parameters_are_refused_with_the_fix():
    run_ranks(_tp_refused, 2)


def _tp_refused(info) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    layer = nn.Linear(4, 4).to(info.device)
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [TShard(1)]))
    with pytest.raises(ValueError, match="'weight' is already a DTensor.*tensor parallel"):
        fsdp_graph.fully_shard(layer)
