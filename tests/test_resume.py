"""Checkpoints a user saves with ``fsdp_graph.Checkpointer`` and resumes from in fresh processes:
the resumed run is bitwise the uninterrupted one (model, AdamW, LR scheduler, RNG, data position),
at another world size it trains on to fp32 rounding, and only the newest ``keep_last`` stay.

The script is a user's: TinyLM with dropout (so the RNG matters), sharded block by block, AdamW,
a LambdaLR warm-up, a data source whose position is its state, ``Checkpointer.save`` every
``EVERY`` steps, ``Checkpointer.load`` at start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import fsdp_graph
import fsdp_graph.checkpoint.directory

from dist_harness import run_ranks
from models import TinyLM, global_batch, local_part, shard

pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine: CI runs it; the GPU suite need not

CPU = torch.device("cpu")
STEPS, EVERY, KILLED_AT = 8, 2, 5  # the interrupted run dies after step 5 (last checkpoint: step 4)


class DropoutLM(TinyLM):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = F.dropout(self.emb(idx) + self.pos[: idx.shape[1]], p=0.2, training=self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class RandomWindows:
    """Each rank's own stream of batches: its position is its generator's state."""

    def __init__(self, rank: int) -> None:
        self.gen = torch.Generator().manual_seed(100 + rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 37, (2, 9), generator=self.gen)
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["generator"])


def build(info, seed: int = 0):
    torch.manual_seed(seed)
    model = DropoutLM(n_blocks=2)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    torch.manual_seed(1234 + info.rank)  # the dropout stream differs per rank, as in real runs
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, x, y) -> torch.Tensor:
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return loss.detach()


def full_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in model.named_parameters()}


def _run(info, root: str, name: str, stop_after: int | None) -> None:
    """Train to STEPS (or die after ``stop_after``), resuming from ``root/name`` if it holds a checkpoint."""
    model, optimizer, scheduler = build(info, seed=0 if stop_after is not None or name == "plain" else 7)
    data = RandomWindows(info.rank)
    ckpt = fsdp_graph.Checkpointer(os.path.join(root, name), keep_last=2)
    start = ckpt.load(model, optimizer, scheduler=scheduler, data=data) or 0
    losses = {}
    for step in range(start, STEPS):
        losses[step] = train_step(model, optimizer, scheduler, *data.next())
        if (step + 1) % EVERY == 0:
            ckpt.save(step + 1, model, optimizer, scheduler=scheduler, data=data)
        if step + 1 == stop_after:
            return  # killed: nothing after this step is kept
    torch.save({"losses": losses, "weights": full_weights(model)}, os.path.join(root, f"{name}.rank{info.rank}.pt"))


def test_a_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path):
    root = str(tmp_path)
    run_ranks(_run, 2, root, "plain", None, backend="gloo")          # uninterrupted, saving as it goes
    run_ranks(_run, 2, root, "resumed", KILLED_AT, backend="gloo")   # dies after step 5
    kept = sorted(os.listdir(tmp_path / "resumed"))
    assert kept == ["step_00000002", "step_00000004"], kept             # keep_last=2, nothing left over
    run_ranks(_run, 2, root, "resumed", None, backend="gloo")         # fresh processes: resumes at step 4
    assert sorted(os.listdir(tmp_path / "resumed")) == ["step_00000006", "step_00000008"]
    for rank in range(2):
        plain = torch.load(tmp_path / f"plain.rank{rank}.pt")
        resumed = torch.load(tmp_path / f"resumed.rank{rank}.pt")
        assert sorted(resumed["losses"]) == list(range(4, STEPS))
        for step, loss in resumed["losses"].items():
            assert torch.equal(loss, plain["losses"][step]), f"rank {rank} step {step}"
        for name, value in plain["weights"].items():
            assert torch.equal(resumed["weights"][name], value), f"rank {rank}: {name} differs"


# -- another world size ---------------------------------------------------------------------------
GLOBAL_ROWS = 6  # one global batch per step, split evenly over 2 or 3 ranks


def _global_run(info, root: str, name: str, stop_after: int | None) -> None:
    """Without dropout, on the rows of one global batch per step: the same run at any world size."""
    torch.manual_seed(0)
    model = TinyLM(n_blocks=2)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    ckpt = fsdp_graph.Checkpointer(os.path.join(root, name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = ckpt.load(model, optimizer, scheduler=scheduler) or 0
    resharded = [w for w in caught if "RNG states and data position are not" in str(w.message)]
    assert bool(resharded) == (start > 0 and info.world_size != 2), [str(w.message) for w in caught]
    losses = {}
    for step in range(start, STEPS):
        idx, targets = global_batch(step, GLOBAL_ROWS, CPU, per_rank=1)
        x, y = local_part(idx, info.rank, info.world_size), local_part(targets, info.rank, info.world_size)
        loss = train_step(model, optimizer, scheduler, x, y)
        torch.distributed.all_reduce(loss)
        losses[step] = loss / info.world_size
        if (step + 1) % EVERY == 0:
            ckpt.save(step + 1, model, optimizer, scheduler=scheduler)
        if step + 1 == stop_after:
            return
    weights = full_weights(model)  # a collective: every rank
    if info.rank == 0:
        torch.save({"losses": losses, "weights": weights}, os.path.join(root, f"{name}.x{info.world_size}.pt"))


def test_a_checkpoint_resumes_at_another_world_size(tmp_path):
    root = str(tmp_path)
    run_ranks(_global_run, 2, root, "plain", None, backend="gloo")
    run_ranks(_global_run, 2, root, "moved", KILLED_AT, backend="gloo")
    run_ranks(_global_run, 3, root, "moved", None, backend="gloo")  # resumes at step 4 on 3 ranks
    plain, moved = torch.load(tmp_path / "plain.x2.pt"), torch.load(tmp_path / "moved.x3.pt")
    assert sorted(moved["losses"]) == list(range(4, STEPS))
    torch.testing.assert_close(torch.stack([moved["losses"][s] for s in range(4, STEPS)]),
                               torch.stack([plain["losses"][s] for s in range(4, STEPS)]), rtol=1e-5, atol=1e-6)
    for name, value in plain["weights"].items():
        torch.testing.assert_close(moved["weights"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# -- a kill during a save ------------------------------------------------------------------------
KILL_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "kill_during_save.py")


def _killed_while_saving(root, phase: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, KILL_SCRIPT, str(root), phase], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, f"the script was not killed at {phase}:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("phase, survivor", [("after_data", 2), ("rank_state", 2), ("before_publish", 2),
                                             ("while_pruning", 4)])
def test_a_kill_at_any_point_of_a_save_leaves_a_complete_checkpoint(tmp_path, phase, survivor):
    """Killed mid-save, the directory holds the previous checkpoint (or the new one, if it was
    already published), complete and loadable with the values it was saved with; the next save
    sweeps what the killed one left."""
    _killed_while_saving(tmp_path, phase)
    ckpt = fsdp_graph.Checkpointer(tmp_path / "ckpt", keep_last=1)
    leftovers = [e for e in os.listdir(tmp_path / "ckpt") if e.startswith((".tmp-", ".trash-"))]
    assert leftovers, "the kill left nothing behind: it did not happen mid-save"
    assert ckpt.latest()[0] == survivor
    torch.manual_seed(5)  # other initial values: the load must set them
    model = shard(TinyLM(n_blocks=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert ckpt.load(model, optimizer) == survivor
    want = torch.load(tmp_path / f"expected_{survivor}.pt")
    for key, value in want["model"].items():
        assert torch.equal(model.state_dict()[key], value), f"{key} differs from step {survivor}'s"
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p, value in zip(trainable, want["exp_avg"], strict=True):
        assert torch.equal(optimizer.state[p]["exp_avg"], value)
    ckpt.save(survivor + 1, model, optimizer)
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"step_{survivor + 1:08d}"]


# -- a directory another run wrote into, and data states of any kind -----------------------------------
class NumpyPosition:
    """A data source whose position holds numpy values (as many loaders' do)."""

    def __init__(self) -> None:
        import numpy as np

        self.epoch, self.rng = np.int64(0), np.random.default_rng(0)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.rng.bit_generator.state = state["rng"]


def test_a_save_into_a_directory_holding_later_steps_is_refused_and_numpy_data_states_round_trip(tmp_path):
    pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = shard(TinyLM(n_blocks=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = NumpyPosition()
    data.epoch += 3
    data.rng.random(5)
    ckpt = fsdp_graph.Checkpointer(tmp_path, keep_last=2)
    ckpt.save(6, model, optimizer, data=data)
    with pytest.raises(ValueError, match=r"already holds checkpoints of later steps \[6\], from another run.*"
                                         r"Resume with load\(\) first, or use a fresh directory"):
        ckpt.save(2, model, optimizer, data=data)  # a new run started over in the same directory
    assert [step for step, _ in fsdp_graph.checkpoint.directory.complete_checkpoints(tmp_path)] == [6]
    fresh = NumpyPosition()
    assert ckpt.load(model, optimizer, data=fresh) == 6
    assert fresh.epoch == 3 and fresh.rng.random() == data.rng.random()


# -- the errors a user can meet ---------------------------------------------------------------------
def test_checkpointer_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="keep_last must be an int >= 1 or None"):
        fsdp_graph.Checkpointer(tmp_path, keep_last=0)
    torch.manual_seed(0)
    model = shard(TinyLM(n_blocks=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt = fsdp_graph.Checkpointer(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"step must be an int >= 0 \(completed steps\)"):
        ckpt.save(-1, model)
    ckpt.save(1, model)  # model only: no optimizer, scheduler or data
    with pytest.raises(ValueError, match="saved without an optimizer; load it with optimizer=None"):
        ckpt.load(model, optimizer)
    with pytest.raises(ValueError, match="saved without a scheduler; load it with scheduler=None"):
        ckpt.load(model, scheduler=scheduler)
    with pytest.raises(ValueError, match="holds no data position .* load without data="):
        ckpt.load(model, data=RandomWindows(0))
    other = shard(TinyLM(n_blocks=1))  # another architecture: blocks.1 has no place in it
    with pytest.raises(ValueError, match=r"entries the model/optimizer being loaded has no place for .*blocks\.1"):
        ckpt.load(other)
    assert ckpt.load(model) == 1


def test_verify_on_a_meta_device_model_is_refused_with_the_fix():
    with torch.device("meta"):
        model = TinyLM(n_blocks=1)
    with pytest.raises(ValueError, match=r"on the meta device.*Pass verify=False for a meta-device model"):
        fsdp_graph.fully_shard(model.blocks[0], verify=True)
