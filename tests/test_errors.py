"""Every mistake a user can make at set-up gets an error that names the fix."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import fsdp_graph

from models import build, global_batch, lm_loss, shard

CPU = torch.device("cpu")


def test_child_after_root_is_refused():
    model, _ = build(CPU)
    fsdp_graph.fully_shard(model)
    with pytest.raises(ValueError, match=r"called after fully_shard on the enclosing module.*bottom-up"):
        fsdp_graph.fully_shard(model.blocks[0])


def test_sharding_twice_is_refused():
    model, _ = build(CPU)
    shard(model)
    with pytest.raises(ValueError, match="already sharded"):
        fsdp_graph.fully_shard(model.blocks[0])


def test_mixed_dtypes_need_a_param_dtype():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64))
    expected = r"mixed dtypes.*'0.weight' is torch.float32.*MixedPrecisionPolicy\(param_dtype="
    with pytest.raises(TypeError, match=expected):
        fsdp_graph.fully_shard(model)
    ok = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64))
    fsdp_graph.fully_shard(ok, mp_policy=fsdp_graph.MixedPrecision(param_dtype=torch.float32))
    assert ok(torch.randn(2, 4)).dtype == torch.float32


def test_integer_parameters_are_refused():
    module = nn.Linear(2, 2)
    module.steps = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match="'steps' has dtype torch.int64.*buffer"):
        fsdp_graph.fully_shard(module)


def test_world_size_above_one_without_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"no process group is initialised.*init_distributed"):
        fsdp_graph.fully_shard(nn.Linear(2, 2))


def test_replaced_parameter_is_detected_at_forward():
    model, _ = build(CPU)
    shard(model)
    model.blocks[0].fc.weight = nn.Parameter(torch.zeros(23, 10))
    idx, targets = global_batch(0, 1, CPU)
    with pytest.raises(RuntimeError, match=r"'fc.weight' was replaced after fully_shard.*load_full_state_dict"):
        lm_loss(model, idx, targets)


def test_reassigned_data_is_detected_at_forward():
    model, _ = build(CPU)
    shard(model)
    model.blocks[2].out.bias.data = torch.zeros_like(model.blocks[2].out.bias)
    idx, targets = global_batch(0, 1, CPU)
    with pytest.raises(RuntimeError, match="'out.bias' was replaced after fully_shard"):
        lm_loss(model, idx, targets)


def test_bad_arguments():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fsdp_graph.fully_shard(torch.zeros(2))
    with pytest.raises(TypeError, match="MixedPrecision"):
        fsdp_graph.fully_shard(nn.Linear(2, 2), mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(TypeError, match="floating torch.dtype"):
        fsdp_graph.MixedPrecision(param_dtype=torch.int32)


def test_state_dict_during_forward_is_refused():
    model, _ = build(CPU)
    shard(model)
    model.blocks[0].register_forward_hook(lambda m, a, o: fsdp_graph.full_state_dict(model))
    idx, targets = global_batch(0, 1, CPU)
    with pytest.raises(fsdp_graph.TransitionError, match="outside forward/backward"):
        lm_loss(model, idx, targets)


def test_model_state_dict_mid_step_or_after_unshard_is_refused():
    model, _ = build(CPU)
    shard(model)
    model.blocks[0].register_forward_hook(lambda m, a, o: model.state_dict())
    idx, targets = global_batch(0, 1, CPU)
    with pytest.raises(fsdp_graph.TransitionError, match="state_dict\\(\\) needs the unit idle"):
        lm_loss(model, idx, targets)
    model, _ = build(CPU)
    shard(model)
    model.blocks[1].unshard()
    with pytest.raises(fsdp_graph.TransitionError, match="call module.reshard\\(\\) first"):
        model.state_dict()
    model.blocks[1].reshard()
    assert model.state_dict().keys() == build(CPU)[1].state_dict().keys()


def test_scalar_parameter_is_refused_with_the_fix():
    module = nn.Linear(2, 2)
    module.scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(ValueError, match="'scale' is a 0-d.*reshape\\(1\\)"):
        fsdp_graph.fully_shard(module)


def test_dtype_change_of_a_sharded_model_is_refused():
    module = fsdp_graph.fully_shard(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="MixedPrecisionPolicy\\(param_dtype"):
        module.to(torch.float64)


def test_init_distributed_without_launcher_is_world_size_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    info = fsdp_graph.init_distributed()
    assert (info.rank, info.world_size, info.local_rank) == (0, 1, 0)
    assert info.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert not torch.distributed.is_initialized()
    assert fsdp_graph.init_distributed() == info  # idempotent


def test_init_distributed_names_the_launcher_when_rendezvous_is_missing(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT not set.*torchrun"):
        fsdp_graph.init_distributed()


class _Caller(nn.Linear):
    """A leaf unit whose forward may call another unit that is not its submodule."""

    callee = None

    def forward(self, x):
        x = super().forward(x)
        return self.callee(x) if self.callee is not None else x


@pytest.mark.parametrize("double_buffer", [True, False])
def test_units_needing_the_same_slot_at_once(double_buffer):
    model = nn.Sequential(_Caller(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    for layer in model:
        fsdp_graph.fully_shard(layer, double_buffer=double_buffer)
    fsdp_graph.fully_shard(model, double_buffer=double_buffer)
    model(torch.randn(2, 4)).sum().backward()  # first pass: slots alternate 0, 1, 0
    object.__setattr__(model[0], "callee", model[2])  # now the third runs inside the first
    if double_buffer:
        with pytest.raises(RuntimeError, match=r"share a double-buffer slot.*double_buffer=False"):
            model(torch.randn(2, 4))
    else:
        model(torch.randn(2, 4)).sum().backward()  # the fix the message names


def test_load_full_state_dict_mid_forward_is_refused_also_for_a_submodule():
    """Mid-forward a unit's modules hold its unsharded parameters: a load would write into the
    gathered copy and leave the masters unchanged, with no error. Refused, also when called on a
    module inside the unit (which has no unit of its own)."""
    model, _ = build(CPU)
    shard(model)
    idx, targets = global_batch(0, 1, CPU)
    zeros = {k: torch.zeros_like(v) for k, v in fsdp_graph.full_state_dict(model.blocks[1]).items()}
    before = fsdp_graph.full_state_dict(model.blocks[1])
    for target in (model.blocks[1], model.blocks[1].fc):
        fc_part = {k[len("fc."):]: v for k, v in zeros.items() if k.startswith("fc.")}
        part = zeros if target is model.blocks[1] else fc_part
        handle = model.blocks[1].register_forward_pre_hook(
            lambda m, a, target=target, part=part: fsdp_graph.load_full_state_dict(target, part))
        with pytest.raises(fsdp_graph.TransitionError, match=r"load_full_state_dict needs the unit idle.*forward"):
            lm_loss(model, idx, targets)
        handle.remove()
    after = fsdp_graph.full_state_dict(model.blocks[1])
    assert all(torch.equal(after[k], before[k]) for k in before), "nothing was loaded"


def test_full_state_dict_of_a_module_inside_a_unit_is_full():
    """A module inside a unit holds 1-D master pieces; its full state dict gathers them."""
    model, ref = build(CPU)
    shard(model)
    full = fsdp_graph.full_state_dict(model.blocks[0].fc)
    expected = ref.blocks[0].fc.state_dict()
    assert {k: tuple(v.shape) for k, v in full.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    for key, value in expected.items():
        assert torch.equal(full[key], value), key


def test_unit_steps_called_directly_before_lazy_init_name_the_entry_points():
    model, _ = build(CPU)
    shard(model)
    with pytest.raises(RuntimeError, match=r"steps run through its root.*pre_forward_unshard"):
        model.blocks[0].fsdp_unit.pre_forward()


def test_moving_a_tie_out_of_a_unit_mid_step_is_refused():
    """fully_shard on an ancestor rebuilds a unit that holds a tied parameter; that needs the unit
    idle (an exception in backward can leave it mid-step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied across the two units-to-be
    fsdp_graph.fully_shard(model[0])
    fsdp_graph.fully_shard(model[1])
    fsdp_graph.pre_backward_handler(model[0])  # as if a backward stopped half-way
    with pytest.raises(fsdp_graph.TransitionError, match=r"fully_shard\(Sequential\), which moves a tied parameter"):
        fsdp_graph.fully_shard(model)


def test_a_collective_one_rank_never_joins_fails_after_the_timeout(tmp_path):
    """init_distributed(timeout=...): the hang becomes an error within seconds."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "rank_skips_collective.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert "RAISED after" in out, out[-3000:]
    seconds = float(out.split("RAISED after ")[1].split("s:")[0])
    assert seconds < 30, out[-2000:]
    assert re.search(r"(?i)timed out|timing out|timeout", out.split("RAISED after ")[1].splitlines()[0]), out[-2000:]


def test_ranks_that_start_further_apart_than_the_collective_timeout_still_form_the_group():
    """init_distributed(timeout=2) with one rank 4 s late: the wait to arrive is not bounded by the
    collective timeout (it was, and failed on 2 H200s when one rank's CUDA start took 2 s longer)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "rank_starts_late.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "rank 0 SUM 2.0" in out and "rank 1 SUM 2.0" in out, out[-3000:]


def test_init_distributed_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        fsdp_graph.init_distributed(timeout=0)


def test_an_optimizer_built_before_fully_shard_is_refused_at_its_step():
    """It holds the parameters fully_shard replaced: they get no gradient, so it would silently
    stop training the model (FSDP2 does, silently)."""
    model, _ = build(CPU)
    early = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shard(model)
    idx, targets = global_batch(0, 1, CPU)
    lm_loss(model, idx, targets).backward()
    with pytest.raises(RuntimeError, match=r"AdamW holds \d+ parameter\(s\) that fully_shard replaced.*"
                                           r"Build the optimizer after fully_shard"):
        early.step()
    late = torch.optim.AdamW(model.parameters(), lr=1e-3)
    late.step()  # built after fully_shard: fine
