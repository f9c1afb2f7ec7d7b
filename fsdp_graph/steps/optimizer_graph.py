"""The optimizer step, and the gradient clipping before it, as CUDA graphs of their own.

Outside a whole-step graph the optimizer step is eager Python over every master: fused AdamW's
``_init_group`` and the swap to local shards cost about 1 ms of host time per step on the small
preset (one H100's host), a fifth of a segment-graphed step's. Its kernels read only tensors that
can stay at fixed addresses (the masters, the optimizer state, the learning rates as device
tensors, the sharded gradients pinned or at their home in the layer graphs' pool), so it is
captured once and replayed:

    opt_step = fsdp_graph.graph_optimizer_step(model, optimizer, max_grad_norm=1.0)
    for batch in loader:
        loss_fn(*batch).backward()
        norm = opt_step()              # clip + optimizer.step(); eager for the first calls
        optimizer.zero_grad()

(``GraphConfig(strategy="layer", optimizer_graph=True)`` does this inside ``make_train_step``.)

* The graphs read every ``.grad`` at a fixed address: building it pins each unit's sharded
  gradients (the ``.grad`` each reduce sets is the same tensor at the same address every step),
  except where per-layer or segment graphs gave them a home in their pool, which is at fixed
  addresses already (``fsdp/grad_homes.py``): there the optimizer graph costs no gradient memory.
  Build it after the module graphs, which take the homes.
* The first ``num_warmup_iters`` calls step eagerly (the step body, not its hooks, under the
  host-sync check from the second call on); the next one captures and replays. A capture in which
  the optimizer made state (a parameter's first gradient: Adam makes its moments then) is thrown
  away, that step runs eagerly, and the next call captures again: made inside the graph, the
  state's zero-fill would be replayed at every step.
* Clipping and the step are two graphs: ``optimizer.step()`` runs its step hooks (the optimizer's
  and the global ones, this package's own among them) in Python between the two, so the replay
  runs them there too, and they are off inside the capture.
* Before every replay: which parameters have a gradient, and where, is compared with the capture
  (again after a user's pre-hook ran). When it differs (no rank used a parameter this step, a
  ``.grad`` was replaced, homed gradients moved out of their home because a ``.grad`` was still
  set at a graphed forward) the step runs eagerly, as ``optimizer.step()`` would, with a warning
  the first time: correct, only slower; steps whose gradients are back in place replay again. A
  change the graph would ignore (groups, state, hyperparameters) is refused
  (``captured_optimizer.py``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain

import torch
import torch.nn as nn
from torch.optim import optimizer as torch_optimizer

from ..fsdp.capture_interface import local_tensor, master_owner, require_fixed_addresses, root_contexts, units_in
from ..fsdp.clip_grad import clip_grad_norm_
from ..graphs.capture_streams import capture_stream
from ..graphs.host_sync import no_host_sync
from ..graphs.replay_stream import replay_target, replay_whole, whole_target
from ..graphs.whole_graph import capture_whole
from .captured_optimizer import CapturedOptimizer
from .graph_config import check_capturable_optimizer, trainable_outside_units

WHAT = "graph_optimizer_step"


class GraphedOptimizerStep:
    """``clip_grad_norm_`` (optional) and ``optimizer.step()``, replayed as CUDA graphs after a
    warm-up (see the module docstring); built by ``graph_optimizer_step``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None,
                 num_warmup_iters: int = 3, replay_stream: torch.cuda.Stream | None = None) -> None:
        refuse_ungraphable_step(model, optimizer, num_warmup_iters, max_grad_norm)
        self.model, self.optimizer, self.max_grad_norm = model, optimizer, max_grad_norm
        units = units_in(model)
        for unit in units:
            if unit.grads.sharded.home is None:  # (a home in the graphs' pool is at fixed addresses already)
                unit.grads.pin_sharded()  # the graph reads the gradients at fixed addresses
        self.device = units[0].device
        self.params = _read_params(model, optimizer, max_grad_norm is not None)
        self.captured_optimizer = CapturedOptimizer(
            optimizer, self.device, WHAT, "build it again (graph_optimizer_step, or make_train_step)")
        self.num_warmup_iters = num_warmup_iters
        self.replay_default = replay_target(replay_stream, None, WHAT)
        self.stream = capture_stream(self.device, self)  # (one no live graph set of ours shares)
        self.graphs: list | None = None  # [clip graph (with max_grad_norm), step graph]
        self._norm: torch.Tensor | None = None  # the clip graph's output: the total norm
        self._captured: CapturedGradients | None = None  # the ``.grad`` the graphs read, and where
        self.eager_steps = 0
        self.replays = 0
        self.eager_after_capture = 0  # steps whose gradients were not the captured ones
        self._warned = False

    def __call__(self) -> torch.Tensor | None:
        """One step; returns the gradient norm before clipping (None without ``max_grad_norm``)."""
        self.captured_optimizer.check()
        graphed = self.graphs is not None or self.eager_steps >= self.num_warmup_iters
        if graphed:
            target = whole_target(self.replay_default, WHAT, self.device)
            if self.graphs is None:
                graphed = self._capture()
            elif not self._same_gradients():
                graphed = False
        clip_graph, step_graph = self.graphs if graphed else (None, None)
        norm = None
        if clip_graph is not None:  # (graphed: ``self.graphs`` is set)
            replay_whole(clip_graph, target)
            norm = self._norm.clone()
        elif self.max_grad_norm is not None:
            norm = clip_grad_norm_(self.model, self.max_grad_norm)
        if _run_pre_hooks(self.optimizer) and graphed:  # a hook of the user's may have changed what the step reads
            self.captured_optimizer.check()
            graphed = self._same_gradients()
        if graphed:
            replay_whole(step_graph, target)
            self.replays += 1
        else:
            warm_up = self.graphs is None
            with _step_hooks_off(self.optimizer), no_host_sync("the optimizer step", enabled=warm_up and
                                                               self.eager_steps > 0):
                self.optimizer.step()
            if warm_up:
                self.eager_steps += 1
            else:
                self.eager_after_capture += 1
        _run_post_hooks(self.optimizer)
        return norm

    def _capture(self) -> bool:
        """Record the clipping and the step (hooks off); the caller replays them: this call's step. False
        (nothing kept) if the step made optimizer state, which the caller then makes eagerly."""
        captured = CapturedGradients([p.grad for p in self.params])  # (what the graphs will read)
        self.captured_optimizer.refuse_tensor_hyperparameters()
        contexts = root_contexts(self.model)
        pool = torch.cuda.graph_pool_handle()  # the two graphs replay one after the other: one pool
        clip = norm = None
        if self.max_grad_norm is not None:
            clip, norm = capture_whole(WHAT, lambda: clip_grad_norm_(self.model, self.max_grad_norm),
                                       contexts, self.stream, pool=pool)
        keys = self.captured_optimizer.state_keys()
        try:
            with _step_hooks_off(self.optimizer):
                step, _ = capture_whole(WHAT, self.optimizer.step, contexts, self.stream, pool=pool)
        finally:
            made = self.captured_optimizer.drop_state_made_since(keys)
        if made:  # (a parameter's first gradient: ``CapturedOptimizer.drop_state_made_since``)
            return False
        self.captured_optimizer.freeze()
        self.graphs, self._norm, self._captured = [clip, step], norm, captured
        return True

    def _same_gradients(self) -> bool:
        which = self._captured.differs([p.grad for p in self.params])
        if which is None:
            return True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{WHAT}: this step's gradients are not where the graph was captured reading them ({which}: a "
                "parameter no rank used this step, a .grad replaced, or, under per-layer and segment graphs, "
                "gradients moved out of their home in the graphs' pool because a .grad was still set when a "
                "graphed forward ran, a forward between the backward and this step: step first), so it steps "
                "eagerly, as optimizer.step() would; correct, but without the graph's speed. Steps whose "
                "gradients are back where the capture read them replay again. (Warned once.)",
                stacklevel=3,
            )
        return False


class CapturedGradients:
    """Where the captured step read each ``.grad`` (None, or its local tensor's address, shape, strides
    and dtype), compared before each replay: the graphs read that memory, whatever tensor object
    points at it now (a home's gradients back in their home after a move come under new objects).
    The objects are held weakly, only to compare addresses alone while they stay the same (their
    shapes could change only by resizing a ``.grad`` in place): a gradient home counts who holds its
    views (``fsdp/grad_homes.py``), and a strong reference here would count as a user's, moving the
    values out of the home at every forward."""

    def __init__(self, grads: list) -> None:
        self._layouts = [None if g is None else _layout(g) for g in grads]
        self._addresses = [None if layout is None else layout[0] for layout in self._layouts]
        self._refs = [None if g is None else weakref.ref(g) for g in grads]

    def differs(self, grads: list) -> str | None:
        """None where the step would read each gradient where the capture did; else what differs."""
        same_objects = all(g is (None if ref is None else ref()) for g, ref in zip(grads, self._refs))
        if same_objects and _addresses(grads) == self._addresses:
            return None
        for i, (g, layout) in enumerate(zip(grads, self._layouts)):
            if (g is None) != (layout is None):
                return f"parameter {i}'s .grad is {'None' if g is None else 'a tensor'}, " \
                       f"{'None' if layout is None else 'a tensor'} at the capture"
            if g is not None and _layout(g) != layout:
                return f"parameter {i}'s .grad is not where the capture read it (its memory moved)"
        self._refs = [None if g is None else weakref.ref(g) for g in grads]  # (the same places: new objects)
        return None


def graph_optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None,
                         num_warmup_iters: int = 3,
                         replay_stream: torch.cuda.Stream | None = None) -> GraphedOptimizerStep:
    """``opt_step()`` = ``clip_grad_norm_(model, max_grad_norm)`` (if given) + ``optimizer.step()``,
    replayed as CUDA graphs after ``num_warmup_iters`` eager calls; see the module docstring."""
    return GraphedOptimizerStep(model, optimizer, max_grad_norm=max_grad_norm, num_warmup_iters=num_warmup_iters,
                                replay_stream=replay_stream)


def refuse_ungraphable_step(model: nn.Module, optimizer, num_warmup_iters, max_grad_norm) -> None:
    """What ``graph_optimizer_step`` cannot graph, refused with the fix (before anything is changed)."""
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
    check_capturable_optimizer(optimizer, WHAT, "step it eagerly (without graph_optimizer_step / optimizer_graph)")
    owned = {id(p) for p in model.parameters()}
    if max_grad_norm is not None:
        stray = trainable_outside_units(model)
        if stray:
            raise ValueError(
                f"{WHAT}: max_grad_norm clips parameter '{stray[0]}', which belongs to no FSDP unit: its .grad is a "
                "new tensor every step, which a graph cannot read. Call fsdp_graph.fully_shard(model) on the root "
                "as well, or clip outside (max_grad_norm=None and fsdp_graph.clip_grad_norm_ before the call)."
            )
    for i, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if param.requires_grad and (master_owner(param) is None or id(param) not in owned):
                where = "belongs to no FSDP unit" if id(param) in owned else "is not a parameter of this model"
                raise ValueError(
                    f"{WHAT}: a parameter of param group {i} (shape {tuple(param.shape)}) {where}: its .grad is a "
                    "new tensor every step, which a graph cannot read. Call fsdp_graph.fully_shard(model) on the "
                    "root as well (and build the optimizer from model.parameters()), or step it eagerly."
                )


def _read_params(model: nn.Module, optimizer: torch.optim.Optimizer, clipping: bool) -> list[torch.Tensor]:
    """Every parameter whose ``.grad`` the graphs read: the optimizer's, and with clipping the model's."""
    seen: dict[int, torch.Tensor] = {}
    read = chain((p for g in optimizer.param_groups for p in g["params"]), model.parameters() if clipping else ())
    for param in read:
        seen.setdefault(id(param), param)
    return list(seen.values())


def _addresses(grads: list) -> list[int | None]:
    return [None if g is None else local_tensor(g).data_ptr() for g in grads]  # (None: an empty one is at 0)


def _layout(grad: torch.Tensor) -> tuple:
    local = local_tensor(grad)
    return local.data_ptr(), tuple(local.shape), local.stride(), local.dtype


def _run_pre_hooks(optimizer) -> bool:
    """What ``optimizer.step()`` runs before its body (``Optimizer.profile_hook_step``); whether a hook
    other than this package's own ran (the caller then checks again what the step reads)."""
    foreign = False
    for hook in list(chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                           optimizer._optimizer_step_pre_hooks.values())):
        result = hook(optimizer, (optimizer,), {})
        if result is not None and not _same_arguments(result, optimizer):
            raise RuntimeError(
                f"{WHAT}: an optimizer step pre-hook returned new arguments for step() ({result!r}), which a "
                "captured step cannot take. Return None from the hook, or step this optimizer eagerly."
            )
        foreign = foreign or not getattr(hook, "__module__", "").startswith("fsdp_graph.")
    return foreign


def _same_arguments(result, optimizer) -> bool:
    """A pre-hook's ``(args, kwargs)`` that change nothing: ``step()`` called as before, no closure."""
    return (isinstance(result, tuple) and len(result) == 2 and tuple(result[0]) == (optimizer,)
            and isinstance(result[1], dict) and all(v is None for v in result[1].values()))


def _run_post_hooks(optimizer) -> None:
    for hook in list(chain(optimizer._optimizer_step_post_hooks.values(),
                           torch_optimizer._global_optimizer_post_hooks.values())):
        hook(optimizer, (optimizer,), {})
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
