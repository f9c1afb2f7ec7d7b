"""torch's element-wise optimizers step the sharded (DTensor) parameters on their local shards:
bitwise the DTensor path's parameters and state, no DTensor dispatch in the step, and hooks,
state dicts and failures see DTensors as before."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dist_harness import run_ranks
from models import build, local_loss, shard

pytestmark = pytest.mark.cpu_only  # CPU and gloo on any machine: CI runs it; the GPU suite need not

CPU = torch.device("cpu")
OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


def _dtensor_path(optimizer):
    """The same optimizer as a subclass instance: the local-shard path leaves subclasses alone."""
    optimizer.__class__ = type(f"Sub{type(optimizer).__name__}", (type(optimizer),), {})
    return optimizer


class _DTensorOps(TorchDispatchMode):
    """Counts the ops that reach the dispatcher with a DTensor among their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs or {}))[0]):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert type(x) is type(y), (key, type(x), type(y))
        if isinstance(x, DTensor):
            assert x.placements == y.placements and x.shape == y.shape
            x, y = x._local_tensor, y._local_tensor
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        else:
            assert x == y, key


def _bitwise_against_the_dtensor_path(info, name: str) -> None:
    fast_model, _ = build(CPU)
    slow_model, _ = build(CPU)
    shard(fast_model)
    shard(slow_model)
    fast = OPTIMIZERS[name](list(fast_model.parameters()))
    slow = _dtensor_path(OPTIMIZERS[name](list(slow_model.parameters())))
    info = type("Info", (), {"device": CPU, "world_size": info.world_size, "rank": info.rank})
    for step in range(3):
        for model, optimizer in ((fast_model, fast), (slow_model, slow)):
            local_loss(model, step, info).backward()
            with _DTensorOps() as ops:
                optimizer.step()
            assert (ops.count == 0) == (optimizer is fast), (name, ops.count)
            optimizer.zero_grad()
    for (key, p), q in zip(fast_model.named_parameters(), slow_model.parameters()):
        assert isinstance(p, DTensor) and torch.equal(p._local_tensor, q._local_tensor), key
    fast_state, slow_state = fast.state_dict(), slow.state_dict()
    assert fast_state["state"].keys() == slow_state["state"].keys() and fast_state["state"]
    for index in fast_state["state"]:
        _same_state(fast_state["state"][index], slow_state["state"][index])
    assert fast.state and {id(k) for k in fast.state} <= {id(p) for p in fast_model.parameters()}  # by masters


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_element_wise_optimizers_step_local_shards_bitwise_like_dtensors(name):
    run_ranks(_bitwise_against_the_dtensor_path, 2, name, backend="gloo")


def _hooks_and_failures_see_dtensors(info) -> None:
    model, _ = build(CPU)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    info = type("Info", (), {"device": CPU, "world_size": info.world_size, "rank": info.rank})
    seen = []

    def look(opt, *_):
        seen.append(all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"]))
        seen.append(all(isinstance(v, DTensor) for s in opt.state.values() for v in s.values() if v.dim()))

    optimizer.register_step_pre_hook(look)
    optimizer.register_step_post_hook(look)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(2):
        local_loss(model, step, info).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert seen == [True] * 8, seen

    # A step that fails inside its body leaves the optimizer as it was: masters, DTensor state.
    local_loss(model, 2, info).backward()
    before = {k: v._local_tensor.clone() for k, v in optimizer.state[next(model.parameters())].items()
              if isinstance(v, DTensor)}
    optimizer.param_groups[0]["lr"] = "not a number"
    with pytest.raises(Exception):
        optimizer.step()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert params == list(model.parameters()) and all(isinstance(p, DTensor) for p in params)
    after = optimizer.state[next(model.parameters())]
    assert all(torch.equal(after[k]._local_tensor, v) for k, v in before.items()) and before


def test_hooks_schedulers_and_a_failed_step_see_dtensors():
    run_ranks(_hooks_and_failures_see_dtensors, 2, backend="gloo")


def _closures_subclasses_and_memory(info) -> None:
    import gc
    import weakref

    info = type("Info", (), {"device": CPU, "world_size": info.world_size, "rank": info.rank})
    # A subclass whose step calls super().step(): its hooks run once per step, as they do without
    # this package in a process that has built no AdamW yet (torch hooks a class's step at its
    # first instance; a spawned rank has built none).
    class Mine(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    subject = build(CPU)[0]
    shard(subject)
    calls = []
    mine = Mine(subject.parameters(), lr=1e-2)
    mine.register_step_post_hook(lambda *_: calls.append(1))
    for step in range(3):
        local_loss(subject, step, info).backward()
        mine.step()
        mine.zero_grad()
    assert len(calls) == 3, len(calls)

    # step(closure): the closure's backward must reach the parameters the step updates.
    models = [build(CPU)[0] for _ in range(2)]
    optimizers = []
    for model in models:
        shard(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _dtensor_path(optimizers[1])
    for step in range(3):
        for model, optimizer in zip(models, optimizers):
            def closure(model=model, optimizer=optimizer, step=step):
                optimizer.zero_grad()
                loss = local_loss(model, step, info)
                loss.backward()
                return loss

            optimizer.step(closure)
    changed = [not torch.equal(p.full_tensor(), q)
               for p, q in zip(models[0].parameters(), build(CPU)[0].parameters()) if p.requires_grad]
    assert sum(changed) > len(changed) // 2, "step(closure) did not update the parameters"
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor)

    # A step that fails while the masters are being swapped leaves every master in place.
    optimizer = torch.optim.AdamW(models[0].parameters(), lr=1e-2)
    params = [p for p in models[0].parameters() if p.requires_grad]
    local_loss(models[0], 0, info).backward()
    good = params[-1].grad
    params[-1].grad = DTensor.from_local(torch.zeros(good._local_tensor.numel() + 1), good.device_mesh,
                                         good.placements, run_check=False, shape=good.shape, stride=good.stride())
    with pytest.raises(RuntimeError):
        optimizer.step()
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(models[0].parameters())
    params[-1].grad = good
    before = [p._local_tensor.clone() for p in params]
    optimizer.step()
    assert all(not torch.equal(p._local_tensor, b) for p, b in zip(params, before) if p._local_tensor.numel())

    # A state dict taken before the first step is the one the step fills, as on the DTensor path.
    optimizer = torch.optim.AdamW(models[0].parameters(), lr=1e-2)
    first = next(p for p in models[0].parameters() if p.requires_grad)
    held = optimizer.state[first]
    local_loss(models[0], 0, info).backward()
    optimizer.step()
    assert optimizer.state[first] is held and isinstance(held["exp_avg"], DTensor)
    # A plain tensor as a master's state is refused as the DTensor path refuses it, not used.
    held["exp_avg"] = held["exp_avg"]._local_tensor.clone()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        optimizer.step()

    # Nothing of the optimizer outlives it (no reference cycle through our step).
    optimizer = torch.optim.AdamW(models[0].parameters(), lr=1e-2)
    local_loss(models[0], 0, info).backward()
    optimizer.step()
    state = weakref.ref(next(iter(optimizer.state.values()))["exp_avg"])
    gc.disable()
    try:
        del optimizer
        assert state() is None, "the optimizer's state outlived it"
    finally:
        gc.enable()


def test_closures_subclasses_and_the_optimizers_lifetime():
    run_ranks(_closures_subclasses_and_memory, 2, backend="gloo")


def _gradient_placed_otherwise(info, dtensor_path: bool) -> list:
    """A master's gradient replaced, after the checked one was freed, by a DTensor of other
    placements: the id of the freed gradient may be reused by the new one (tried for)."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Shard

    import fsdp_graph

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    fsdp_graph.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    if dtensor_path:
        _dtensor_path(optimizer)
    p = next(model.parameters())

    def grad(placements, value):
        return DTensor.from_local(torch.full(p._local_tensor.shape, value), p.device_mesh, placements,
                                  run_check=False, shape=p.shape, stride=p.stride())

    p.grad = grad(p.placements, 1.0)
    freed = id(p.grad)
    optimizer.step()
    p.grad = None
    gc.collect()
    template, kept = grad((Partial(), Shard(0)), 0.5), []  # each replica holds half: the gradient is 1.0
    for _ in range(1000):
        candidate = template.detach()
        if id(candidate) == freed:
            break
        kept.append(candidate)
    before = p._local_tensor.clone()
    p.grad = candidate
    optimizer.step()
    return (before - p._local_tensor).flatten().tolist()


def _same_update_as_the_dtensor_path(info) -> None:
    assert _gradient_placed_otherwise(info, False) == _gradient_placed_otherwise(info, True)


def test_a_gradient_placed_otherwise_takes_the_dtensor_path():
    run_ranks(_same_update_as_the_dtensor_path, 4, backend="gloo")


def _state_replaced_between_steps(info, add_group_first: bool) -> None:
    """The step mapping is built once and reused while the state is unchanged; a state loaded
    between steps (new tensors) is the one the next step uses, and the old one is freed at once,
    not kept alive by the reused mapping until the next step. ``add_group_first``: a param group
    added (a new plan) in between, which must not leave the mapping unguarded."""
    import gc
    import weakref

    info = type("Info", (), {"device": CPU, "world_size": info.world_size, "rank": info.rank})
    models = [build(CPU)[0] for _ in range(2)]
    for model in models:
        shard(model)
    fast = torch.optim.AdamW(models[0].parameters(), lr=1e-2)
    slow = _dtensor_path(torch.optim.AdamW(models[1].parameters(), lr=1e-2))
    pairs = ((models[0], fast), (models[1], slow))

    def train(steps):
        for step in steps:
            for model, optimizer in pairs:
                local_loss(model, step, info).backward()
                with _DTensorOps() as ops:
                    optimizer.step()
                assert (ops.count == 0) == (optimizer is fast), ops.count  # ours on local shards throughout
                optimizer.zero_grad()

    train(range(3))  # the first step creates the state; the next ones reuse the mapping
    if add_group_first:
        for _, optimizer in pairs:
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})  # no gradient: no state
        train(range(3, 4))
    master = next(p for p in models[0].parameters() if p.requires_grad)
    old_local = weakref.ref(fast.state[master]["exp_avg"]._local_tensor)
    gc.disable()  # freed by reference counting: no cycle may be what frees the old state
    try:
        for _, optimizer in pairs:
            saved = optimizer.state_dict()
            for state in saved["state"].values():
                state["exp_avg"] = state["exp_avg"] * 0.5  # new tensors, other values
            optimizer.load_state_dict(saved)
            del saved, state
        assert old_local() is None, "the old state's local tensor outlived the load"
    finally:
        gc.enable()
    train(range(4, 7))
    for (key, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor), key


@pytest.mark.parametrize("add_group_first", [False, True])
def test_a_state_loaded_between_steps_is_used_and_the_old_one_freed(add_group_first):
    run_ranks(_state_replaced_between_steps, 2, add_group_first, backend="gloo")
