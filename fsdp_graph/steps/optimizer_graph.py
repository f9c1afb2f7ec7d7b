"""The optimizer step, and the gradient clipping before it, as CUDA graphs of their own.

Outside a whole-step graph the optimizer step is eager Python over every master: fused AdamW's
``_init_group`` and DTensor unwrapping cost about 2 ms per step on the small preset, a third of
a segment-graphed step. Its kernels read only tensors that can stay at fixed addresses (the
masters, the optimizer state, the learning rates as device tensors, the sharded gradients once
pinned), so it is captured once and replayed:

    opt_step = fsdp_graph.graph_optimizer_step(model, optimizer, max_grad_norm=1.0)
    for batch in loader:
        loss_fn(*batch).backward()
        opt_step()                     # clip + optimizer.step(); eager for the first calls
        optimizer.zero_grad()

(``GraphConfig(strategy="layer", optimizer_graph=True)`` does this inside ``make_train_step``.)

* Building it pins every unit's sharded gradients, so the ``.grad`` each reduce sets is the same
  tensor at the same address every step.
* The first ``num_warmup_iters`` calls step eagerly (the optimizer state comes into being; from
  the second call on under the host-sync check); the next one captures and replays.
* Clipping and the step are two graphs: ``optimizer.step()`` runs its step hooks (the optimizer's
  and the global ones, this package's own among them) in Python between the two, so the replay
  runs them there too, and they are off inside the capture.
* Before every replay: which parameters have a gradient, and where, is compared with the capture.
  When it differs (no rank used a parameter this step, a ``.grad`` was replaced) the step runs
  eagerly, as ``optimizer.step()`` would, with a warning the first time: correct, only slower.
  A change the graph would ignore (groups, state, hyperparameters) is refused
  (``captured_optimizer.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain

import torch
import torch.nn as nn
from torch.optim import optimizer as torch_optimizer

from ..fsdp.capture_interface import local_tensor, master_owner, require_fixed_addresses, root_contexts, units_in
from ..fsdp.clip_grad import clip_grad_norm_
from ..graphs.host_sync import no_host_sync
from ..graphs.replay_stream import replay_target, replay_whole, whole_target
from ..graphs.whole_graph import capture_whole
from .captured_optimizer import CapturedOptimizer
from .graph_config import check_capturable_optimizer

WHAT = "graph_optimizer_step"


class GraphedOptimizerStep:
    """``clip_grad_norm_`` (optional) and ``optimizer.step()``, replayed as CUDA graphs after a
    warm-up (see the module docstring); built by ``graph_optimizer_step``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None,
                 num_warmup_iters: int = 3, replay_stream: torch.cuda.Stream | None = None) -> None:
        _check(model, optimizer, num_warmup_iters)
        self.model, self.optimizer, self.max_grad_norm = model, optimizer, max_grad_norm
        self.units = units_in(model)
        for unit in self.units:
            unit.grads.pin_sharded()  # the graph reads the gradients at fixed addresses
        self.device = self.units[0].device
        self.params = _read_params(model, optimizer)
        self.captured_optimizer = CapturedOptimizer(optimizer, self.device, WHAT)
        self.num_warmup_iters = num_warmup_iters
        self.replay_default = replay_target(replay_stream, None, WHAT)
        self.stream = torch.cuda.Stream(self.device)
        self.graphs: list | None = None  # [clip graph (with max_grad_norm), step graph]
        self._grads: list = []  # each parameter's ``.grad`` at the capture
        self._addresses: list[int] = []
        self.eager_steps = 0
        self.replays = 0
        self.eager_after_capture = 0  # steps whose gradients were not the captured ones
        self._warned = False

    def __call__(self) -> None:
        self.captured_optimizer.check()
        if self.graphs is None and self.eager_steps < self.num_warmup_iters:
            with no_host_sync("the optimizer step", enabled=self.eager_steps > 0):
                self._eager()
            self.eager_steps += 1
            return
        target = whole_target(self.replay_default, WHAT, self.device)
        if self.graphs is None:
            self._capture()
        elif not self._same_gradients():
            self._eager()
            self.eager_after_capture += 1
            return
        clip, step = self.graphs
        if clip is not None:
            replay_whole(clip, target)
        _run_pre_hooks(self.optimizer)
        replay_whole(step, target)
        _run_post_hooks(self.optimizer)
        self.replays += 1

    def _eager(self) -> None:
        if self.max_grad_norm is not None:
            clip_grad_norm_(self.model, self.max_grad_norm)
        self.optimizer.step()

    def _capture(self) -> None:
        """Record the clipping and the step (hooks off); the caller replays them: this call's step."""
        self._grads = [p.grad for p in self.params]
        self._addresses = _addresses(self._grads)
        self.captured_optimizer.freeze()
        contexts = root_contexts(self.model)
        pool = torch.cuda.graph_pool_handle()  # the two graphs replay one after the other: one pool
        clip = None
        if self.max_grad_norm is not None:
            clip, _ = capture_whole(WHAT, lambda: clip_grad_norm_(self.model, self.max_grad_norm), contexts,
                                    self.stream, pool=pool)
        with _step_hooks_off(self.optimizer):
            step, _ = capture_whole(WHAT, self.optimizer.step, contexts, self.stream, pool=pool)
        self.graphs = [clip, step]

    def _same_gradients(self) -> bool:
        grads = [p.grad for p in self.params]
        if all(map(_is, grads, self._grads)) and _addresses(grads) == self._addresses:
            return True
        if not self._warned:
            self._warned = True
            changed = next(i for i, (g, c) in enumerate(zip(grads, self._grads)) if g is not c) \
                if not all(map(_is, grads, self._grads)) else None
            which = "a .grad's memory moved" if changed is None else (
                f"parameter {changed}'s .grad is {'None' if grads[changed] is None else 'another tensor'}, "
                f"{'None' if self._grads[changed] is None else 'a tensor'} at the capture")
            warnings.warn(
                f"{WHAT}: this step's gradients are not the ones the graph was captured with ({which}: a "
                "parameter no rank used this step, or a .grad replaced), so it steps eagerly, as "
                "optimizer.step() would; correct, but without the graph's speed. Steps whose gradients match "
                "the capture replay again. (Warned once.)",
                stacklevel=3,
            )
        return False


def graph_optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None,
                         num_warmup_iters: int = 3,
                         replay_stream: torch.cuda.Stream | None = None) -> GraphedOptimizerStep:
    """``opt_step()`` = ``clip_grad_norm_(model, max_grad_norm)`` (if given) + ``optimizer.step()``,
    replayed as CUDA graphs after ``num_warmup_iters`` eager calls; see the module docstring."""
    return GraphedOptimizerStep(model, optimizer, max_grad_norm=max_grad_norm, num_warmup_iters=num_warmup_iters,
                                replay_stream=replay_stream)


def _check(model: nn.Module, optimizer, num_warmup_iters) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{WHAT}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(num_warmup_iters, int) or isinstance(num_warmup_iters, bool) or num_warmup_iters < 1:
        raise ValueError(f"{WHAT}: num_warmup_iters must be an int >= 1 (the optimizer state comes into being in "
                         f"the first eager step), got {num_warmup_iters!r}")
    units = units_in(model)
    if not units:
        raise ValueError(f"{WHAT} graphs the step of an FSDP model: call fsdp_graph.fully_shard on its blocks and "
                         "its root first")
    if not torch.cuda.is_available() or any(u.device.type != "cuda" for u in units):
        raise RuntimeError(f"{WHAT} needs CUDA: CUDA graphs do not exist on CPU. Call optimizer.step() there.")
    for unit in units:
        require_fixed_addresses(unit, WHAT)
    check_capturable_optimizer(optimizer, WHAT)
    owned = {id(p) for p in model.parameters()}
    for i, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if param.requires_grad and (master_owner(param) is None or id(param) not in owned):
                where = "belongs to no FSDP unit" if id(param) in owned else "is not a parameter of this model"
                raise ValueError(
                    f"{WHAT}: a parameter of param group {i} (shape {tuple(param.shape)}) {where}: its .grad is a "
                    "new tensor every step, which a graph cannot read. Call fsdp_graph.fully_shard(model) on the "
                    "root as well (and build the optimizer from model.parameters()), or step it eagerly."
                )


def _read_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter whose ``.grad`` the graphs read: the optimizer's, and the model's (clipping)."""
    seen: dict[int, torch.Tensor] = {}
    for param in chain((p for g in optimizer.param_groups for p in g["params"]), model.parameters()):
        seen.setdefault(id(param), param)
    return list(seen.values())


def _is(a, b) -> bool:
    return a is b


def _addresses(grads: list) -> list[int]:
    return [0 if g is None else local_tensor(g).data_ptr() for g in grads]


def _pre_hooks(optimizer) -> Iterator:
    return chain(torch_optimizer._global_optimizer_pre_hooks.values(), optimizer._optimizer_step_pre_hooks.values())


def _run_pre_hooks(optimizer) -> None:
    """What ``optimizer.step()`` runs before its body (``Optimizer.profile_hook_step``), with no arguments."""
    for hook in list(_pre_hooks(optimizer)):
        if hook(optimizer, (), {}) is not None:
            raise RuntimeError(
                f"{WHAT}: an optimizer step pre-hook returned new arguments for step(), which a captured step "
                "cannot take. Return None from the hook, or step this optimizer eagerly."
            )


def _run_post_hooks(optimizer) -> None:
    for hook in list(chain(optimizer._optimizer_step_post_hooks.values(),
                           torch_optimizer._global_optimizer_post_hooks.values())):
        hook(optimizer, (), {})
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True  # (what the scheduler's wrapper of step() records)


@contextmanager
def _step_hooks_off(optimizer) -> Iterator[None]:
    """Inside the capture: the hooks run in Python around each replay instead (their GPU work would
    otherwise run twice, once recorded and once from Python)."""
    tables = [torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks,
              optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks]
    saved = [list(t.items()) for t in tables]
    for table in tables:
        table.clear()
    try:
        yield
    finally:
        for table, entries in zip(tables, saved):
            table.update(entries)
