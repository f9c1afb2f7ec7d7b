"""Checkpoints through torch's own API: ``torch.distributed.checkpoint`` (DCP) and its state-dict
functions see fsdp_graph's parameters as they see FSDP2's (``Shard(0)`` DTensors with FSDP2's
chunk rule), so a checkpoint moves between the two libraries and between world sizes, optimizer
state included, and training resumes where it stopped.

Every script here is a user's script: ``fully_shard`` imported from ``torch.distributed.fsdp``
(FSDP2) or from ``fsdp_graph``, AdamW, ``get_state_dict`` / ``set_state_dict``, ``dcp.save`` /
``dcp.load``. The batch of each step is one global batch of ``GLOBAL_ROWS`` rows split evenly
over the ranks, so the mean of the ranks' losses is the loss of the same global batch at every
world size.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

import fsdp_graph

from dist_harness import run_ranks
from models import TinyLM, global_batch, lm_loss, local_part

pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine: CI runs it; the GPU suite need not

LIBRARIES = {"fsdp2": "torch.distributed.fsdp", "fsdp_graph": "fsdp_graph"}
SAVED_AT = 3  # steps trained before the checkpoint
STEPS = 6  # the uninterrupted run; a resumed run trains steps SAVED_AT .. STEPS - 1
GLOBAL_ROWS = 24  # rows of a step's global batch: split evenly over 1, 2, 3, 4, 6 or 8 ranks
WRITER_WORLD_SIZE = 2
# Checkpoints are device-independent: these run on CPU with gloo everywhere (on a GPU machine, 3
# ranks over 2 GPUs would put CUDA tensors on gloo, which FSDP2's own collectives do not survive).
CPU = torch.device("cpu")
# Losses of the same global batch from runs that differ only in how the batch, the gradient sums
# and the optimizer state are split over ranks (or libraries): equal up to fp32 rounding.
RTOL, ATOL = 1e-5, 1e-6


# -- the user's script ---------------------------------------------------------------------------
def build(info, library: str, seed: int):
    """TinyLM (tied embedding/head, a frozen LayerNorm weight, a buffer) sharded by ``library``'s
    fully_shard (each block, then the root), and its AdamW."""
    fully_shard = importlib.import_module(LIBRARIES[library]).fully_shard
    if dist.is_initialized():  # a CPU mesh: FSDP2's default mesh is CUDA's wherever there is a GPU
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = functools.partial(fully_shard, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    torch.manual_seed(seed)
    model = TinyLM(n_blocks=2).to(CPU)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optimizer


def batch(step: int, info) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch (the same global batch at any world size)."""
    idx, targets = global_batch(step, GLOBAL_ROWS, CPU, per_rank=1)
    return local_part(idx, info.rank, info.world_size), local_part(targets, info.rank, info.world_size)


def mean_over_ranks(value: torch.Tensor, info) -> torch.Tensor:
    value = value.detach().clone()
    if info.world_size > 1:
        dist.all_reduce(value)
        value /= info.world_size
    return value


def train(model, optimizer, steps: range, info) -> torch.Tensor:
    """Train on ``steps``; the loss of each step's global batch (the mean of the ranks' losses)."""
    losses = []
    for step in steps:
        loss = lm_loss(model, *batch(step, info))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss, info))
    return torch.stack(losses)


def save(model, optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load(model, optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_values(model) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded tensor gathered (``full_tensor()``)."""
    return {key: value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
            for key, value in model.state_dict().items()}


def check_tied(model) -> None:
    assert model.head.weight is model.emb.weight, "the tied embedding/head came apart"


# -- the checkpoints the tests resume from --------------------------------------------------------
def _write_checkpoints(info, root: str) -> None:
    """At WRITER_WORLD_SIZE ranks, for each library: an uninterrupted run of STEPS steps (its losses
    are what a resumed run must reproduce), and a separate run of SAVED_AT steps saved with DCP.
    fsdp_graph's also saves plain ``model.state_dict()`` and (rank 0) its gathered values."""
    for library in LIBRARIES:
        model, optimizer = build(info, library, seed=0)
        uninterrupted = train(model, optimizer, range(STEPS), info)

        model, optimizer = build(info, library, seed=0)
        before = train(model, optimizer, range(SAVED_AT), info)
        assert torch.equal(before, uninterrupted[:SAVED_AT])
        save(model, optimizer, os.path.join(root, library))
        if library == "fsdp_graph":
            dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, "plain"))
            values = full_values(model)
        if info.rank == 0:
            torch.save(uninterrupted, os.path.join(root, f"{library}_losses.pt"))
            if library == "fsdp_graph":
                torch.save(values, os.path.join(root, "plain_values.pt"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("checkpoints")
    run_ranks(_write_checkpoints, WRITER_WORLD_SIZE, str(root), backend="gloo")
    return str(root)


# -- resuming ------------------------------------------------------------------------------------
def _resume(info, root: str, writer: str, reader: str) -> None:
    """``reader`` builds the model fresh (another seed: the checkpoint must be what sets it), loads
    ``writer``'s step-SAVED_AT checkpoint, and trains the remaining steps: the losses are those of
    ``writer``'s uninterrupted run at WRITER_WORLD_SIZE ranks."""
    expected = torch.load(os.path.join(root, f"{writer}_losses.pt"))
    model, optimizer = build(info, reader, seed=1)
    fresh_loss = mean_over_ranks(lm_loss(model, *batch(SAVED_AT, info)), info)
    assert not torch.allclose(fresh_loss, expected[SAVED_AT], rtol=1e-3), "the fresh model already matches"

    load(model, optimizer, os.path.join(root, writer))
    check_tied(model)
    if info.world_size == 1:  # no process group: fsdp_graph's parameters are plain, full-shape
        assert not any(isinstance(p, DTensor) for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in optimizer.state} == {id(p) for p in trainable}
    for p in trainable:  # AdamW's state, sharded as the parameter is
        state = optimizer.state[p]
        assert float(state["step"]) == SAVED_AT
        for name in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[name], DTensor) == isinstance(p, DTensor) and state[name].shape == p.shape
            if isinstance(p, DTensor):
                assert state[name].placements == p.placements
                assert state[name].to_local().shape == p.to_local().shape

    resumed = train(model, optimizer, range(SAVED_AT, STEPS), info)
    check_tied(model)
    torch.testing.assert_close(resumed, expected[SAVED_AT:], rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{writer} -> {reader} x{info.world_size}, steps {SAVED_AT}..: {m}")


def _resume_each(info, root: str, pairs: list[tuple[str, str]]) -> None:
    for writer, reader in pairs:
        _resume(info, root, writer, reader)


def test_a_dcp_checkpoint_moves_between_fsdp2_and_fsdp_graph(checkpoints):
    """Same world size, both directions (one launch: each rank pays torch's lazy imports once)."""
    run_ranks(_resume_each, WRITER_WORLD_SIZE, checkpoints, [("fsdp2", "fsdp_graph"), ("fsdp_graph", "fsdp2")],
              backend="gloo")


def test_a_dcp_checkpoint_reshards_to_more_ranks(checkpoints):
    """2 ranks -> 3: fsdp_graph's checkpoint and FSDP2's, both into fsdp_graph."""
    run_ranks(_resume_each, 3, checkpoints, [("fsdp_graph", "fsdp_graph"), ("fsdp2", "fsdp_graph")], backend="gloo")


# DCP says so when it runs without a process group (its documented single-process mode).
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_a_dcp_checkpoint_reshards_to_one_process_without_a_process_group(checkpoints, monkeypatch):
    """2 ranks -> a plain ``python script.py`` (this process): no process group, so fsdp_graph's
    parameters are plain full-shape tensors and DCP runs in its single-process mode."""
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not dist.is_initialized()
    info = fsdp_graph.init_distributed()
    assert info.world_size == 1 and not dist.is_initialized()
    _resume(info, checkpoints, "fsdp_graph", "fsdp_graph")


def _load_plain_state_dict(info, root: str) -> None:
    """What torch's DCP docs show: load in place into the model's own state dict, then load that."""
    model, _ = build(info, "fsdp_graph", seed=1)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(root, "plain"))
    model.load_state_dict(state)
    check_tied(model)
    expected = torch.load(os.path.join(root, "plain_values.pt"))
    loaded = full_values(model)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), f"{key} differs from the saved run's"
    # The forward computes with them: the saved run's next loss (it did not train on this batch).
    losses = torch.load(os.path.join(root, "fsdp_graph_losses.pt"))
    torch.testing.assert_close(mean_over_ranks(lm_loss(model, *batch(SAVED_AT, info)), info), losses[SAVED_AT],
                               rtol=RTOL, atol=ATOL)


def test_a_plain_module_state_dict_saved_with_dcp_loads_at_another_world_size(checkpoints):
    run_ranks(_load_plain_state_dict, 3, checkpoints, backend="gloo")


# -- full state dicts ----------------------------------------------------------------------------
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def assert_same_full(ours, theirs, where: str = "") -> None:
    """Two full state dicts (nested dicts / lists) hold the same keys, values and equal CPU tensors."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), f"{where}: keys {list(ours)} vs {list(theirs)}"
        for key in theirs:
            assert_same_full(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(theirs, (list, tuple)):
        # (torch's load path may turn a tuple such as AdamW's betas into a list)
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_full(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and not isinstance(ours, DTensor), f"{where}: {type(ours)}"
        assert ours.device.type == "cpu", f"{where}: on {ours.device}"
        assert torch.equal(ours, theirs), f"{where}: {ours} vs {theirs}"
    else:
        assert ours == theirs, f"{where}: {ours!r} vs {theirs!r}"


def _full_state_dicts(info) -> None:
    full, full_optim, params, trained = {}, {}, {}, {}
    for library in LIBRARIES:
        torch.manual_seed(0)
        reference = TinyLM(n_blocks=2).to(CPU)  # what build(seed=0) shards
        model, optimizer = build(info, library, seed=0)
        reference_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), f"{library} {name}: {p.placements}"
            assert p.device_mesh.size() == info.world_size
            assert torch.equal(p.full_tensor(), reference_params[name]), f"{library} {name}"
        train(model, optimizer, range(2), info)
        # Snapshots, as a file would hold them: with cpu_offload, a CPU tensor in the state dicts may
        # be the live one (AdamW's "step"), which the continued run below would go on incrementing.
        full[library] = copy.deepcopy(get_model_state_dict(model, options=FULL))
        full_optim[library] = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=FULL))
        params[library] = {name: p.full_tensor() for name, p in model.named_parameters()}
        trained[library] = model, optimizer
        check_tied(model)

    # The same run gives the same values as FSDP2 (bitwise: same chunks, same reductions, same ops).
    assert params["fsdp_graph"].keys() == params["fsdp2"].keys()
    for name, value in params["fsdp2"].items():
        assert torch.equal(params["fsdp_graph"][name], value), f"{name}.full_tensor() differs from FSDP2's"
    # cpu_offload: only rank 0 holds the full state dicts (as with FSDP2), on the CPU.
    if info.rank == 0:
        assert full["fsdp2"].keys() == reference.state_dict().keys()  # the tied weight under both names
        assert full_optim["fsdp2"]["state"]
    else:
        assert full["fsdp2"] == {} and full_optim["fsdp2"] == {}
    assert_same_full(full["fsdp_graph"], full["fsdp2"], "model")
    assert_same_full(full_optim["fsdp_graph"], full_optim["fsdp2"], "optim")

    # Resume from full state dicts that only rank 0 holds (the others pass empty dicts). Two calls:
    # set_state_dict(model, optimizer, ...) with an empty model dict takes the other ranks for
    # "optimizer only" and skips the model's broadcast that rank 0 starts (a hang, with FSDP2 too).
    model, optimizer = build(info, "fsdp_graph", seed=1)
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full["fsdp_graph"], options=from_rank0)
    set_optimizer_state_dict(model, optimizer, full_optim["fsdp_graph"], options=from_rank0)
    check_tied(model)
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), params["fsdp_graph"][name]), f"{name} was not loaded"
    assert_same_full(get_optimizer_state_dict(model, optimizer, options=FULL), full_optim["fsdp_graph"], "loaded optim")
    continued = train(*trained["fsdp_graph"], range(2, 4), info)
    assert torch.equal(train(model, optimizer, range(2, 4), info), continued)

    # From rank 0: another (unsharded) model's values.
    torch.manual_seed(7)
    source = TinyLM(n_blocks=2).to(CPU)
    model, _ = build(info, "fsdp_graph", seed=0)
    set_model_state_dict(model, source.state_dict() if info.rank == 0 else {}, options=from_rank0)
    check_tied(model)
    source_params = dict(source.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),)
        assert torch.equal(p.full_tensor(), source_params[name]), f"{name} was not loaded"
    assert torch.equal(model.pos, source.pos)
    # The forward computes with the loaded values (they reached the shards the all-gather reads).
    torch.testing.assert_close(lm_loss(model, *batch(0, info)), lm_loss(source, *batch(0, info)),
                               rtol=RTOL, atol=ATOL)


def test_full_state_dicts_match_fsdp2_and_load_from_rank_0():
    run_ranks(_full_state_dicts, 2, backend="gloo")
