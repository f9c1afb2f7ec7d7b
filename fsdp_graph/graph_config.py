"""``GraphConfig``: how a model's steps use CUDA graphs, validated in one place.

Three independent settings (after Megatron's split):

* ``strategy``, for training: ``"none"`` (eager), ``"layer"`` (the selected modules are graphed,
  FSDP's unshard/reshard and everything else stay eager: ``graph_modules``) or
  ``"full_iteration"`` (forward, loss, backward, the FSDP collectives and optionally the
  optimizer step as one graph: ``graph_train_step``);
* ``modules``, which modules ``"layer"`` graphs: a module class, a tuple of classes, a predicate
  ``(name, module) -> bool`` or a list of modules; None means every leaf FSDP unit (the blocks);
* ``forward_only``, for evaluation: ``"none"``, ``"layer"`` (the same modules, forward-only
  graphs, unshard outside) or ``"model"`` (the whole forward with its unshards in one graph).

``validate_graph_config(config, model)`` normalises the config and refuses, before any work,
every combination that cannot work, with the fix in the message: graphs without persistent
buffers, ``modules`` with ``full_iteration``, graphs on CPU, a whole-step graph over parameters
no FSDP unit manages or over modules already graphed, a non-capturable optimizer. Two problems
only the running code reveals are caught as early as they can be, with messages that also name
the fix: host syncs (found by the warm-up, before any capture: ``host_sync.py``) and inputs
whose shape varies (checked at every call: ``static_inputs.py``, ``graphed_callable.py``).

``make_train_step`` and ``make_eval_step`` turn a config into a step, so a training script
switches between eager, layer and full-iteration graphs by the config alone.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.nn as nn

from .forward_graph import EvalStep, GraphedForward
from .fully_shard import _ENCLOSING_ATTR, units_in
from .module_graphs import Selection, eval_mode, graph_kinds, graph_modules, record_sample_args, select_modules
from .train_step import GraphedTrainStep, TrainStep
from .unit import FSDPUnit, master_owner
from .whole_graph import root_contexts

STRATEGIES = ("none", "layer", "full_iteration")
FORWARD_ONLY = ("none", "layer", "model")


@dataclass(frozen=True)
class GraphConfig:
    strategy: str = "none"
    modules: Selection | Sequence[nn.Module] | None = None
    forward_only: str = "none"
    warmup_steps: int = 3  # eager passes before capture (>= 2 also proves the code free of host syncs)


def _choice(value, choices: tuple, field: str) -> str:
    text = str(value).strip().lower().replace("-", "_")
    if text not in choices:
        raise ValueError(f"GraphConfig.{field} is {value!r}; choose one of {', '.join(map(repr, choices))}")
    return text


def validate_graph_config(config: GraphConfig | None, model: nn.Module) -> GraphConfig:
    """The normalised config, or an error naming the fix (see the module docstring)."""
    config = GraphConfig() if config is None else config
    if not isinstance(config, GraphConfig):
        raise TypeError(f"expected a fsdp_graph.GraphConfig, got {type(config).__name__}")
    strategy = _choice(config.strategy, STRATEGIES, "strategy")
    forward_only = _choice(config.forward_only, FORWARD_ONLY, "forward_only")
    config = replace(config, strategy=strategy, forward_only=forward_only)
    if not isinstance(config.warmup_steps, int) or config.warmup_steps < 1:
        raise ValueError(f"GraphConfig.warmup_steps must be an int >= 1, got {config.warmup_steps!r}")
    if config.modules is not None and strategy == "full_iteration":
        raise ValueError(
            "GraphConfig: modules= selects the layers of strategy='layer', but strategy='full_iteration' captures "
            "the whole step. Drop modules= (forward_only='layer' then graphs every leaf FSDP unit), or use "
            "strategy='layer' to graph only the selected modules."
        )
    if config.modules is not None and "layer" not in (strategy, forward_only):
        raise ValueError("GraphConfig: modules= is only used by strategy='layer' or forward_only='layer'; drop it")
    if strategy == forward_only == "none":
        return config
    if strategy == "full_iteration":
        _check_whole(model, "strategy='full_iteration'", training=True)
    if forward_only == "model":
        _check_whole(model, "forward_only='model'", training=False)
    if "layer" in (strategy, forward_only):
        for module in selected_modules(model, config):
            unit = module.__dict__.get(_ENCLOSING_ATTR)
            if unit is not None:
                _check_persistent(unit, f"a graphed {type(module).__name__}")
    if not torch.cuda.is_available() or any(u.device.type != "cuda" for u in units_in(model)):
        raise RuntimeError(
            f"GraphConfig(strategy={strategy!r}, forward_only={forward_only!r}) needs CUDA: CUDA graphs do not exist "
            "on CPU. Use GraphConfig() (strategy='none', forward_only='none') to run eagerly there."
        )
    return config


def selected_modules(model: nn.Module, config: GraphConfig) -> list[nn.Module]:
    """The modules a layer strategy graphs (every leaf FSDP unit when ``modules`` is None)."""
    if config.modules is None:
        units = units_in(model)
        parents = {id(u.parent) for u in units if u.parent is not None}
        chosen = [u.module for u in units if id(u) not in parents and u.parent is not None]
    elif isinstance(config.modules, (list, tuple)) and all(isinstance(m, nn.Module) for m in config.modules):
        chosen = list(config.modules)
    else:
        chosen = select_modules(model, config.modules)
    if not chosen:
        raise ValueError(
            f"GraphConfig: modules={config.modules!r} selects no module of the model. Pass a module class (e.g. your "
            "Block), a predicate (name, module) -> bool, or a list; with modules=None, fully_shard each block first."
        )
    return chosen


def _check_persistent(unit: FSDPUnit, what: str) -> None:
    config = unit.config
    if not (config.double_buffer and config.persist_buffer_on_alloc_fail):
        raise ValueError(
            f"{what} reads FSDP unit {unit.name}, sharded with double_buffer={config.double_buffer} and "
            f"persist_buffer_on_alloc_fail={config.persist_buffer_on_alloc_fail}: its unsharded parameters are "
            "re-allocated per unshard and move between iterations, but a CUDA graph replays fixed addresses. "
            "Pass double_buffer=True and persist_buffer_on_alloc_fail=True to fully_shard (the defaults)."
        )


def _check_whole(model: nn.Module, what: str, training: bool) -> None:
    """A graph of the whole model: every unit at fixed addresses, no graphs inside it, and (for
    training) every trainable parameter managed by a unit."""
    units = units_in(model)
    if not units:
        raise ValueError(f"{what} graphs an FSDP model: call fsdp_graph.fully_shard on its blocks and its root first")
    for unit in units:
        _check_persistent(unit, what)
    for name, sub in model.named_modules():
        # A whole training graph replays layers' training graphs (forward-only ones fall back to
        # eager with gradients on); a whole evaluation graph would replay forward-only ones.
        if training in graph_kinds(sub):
            raise ValueError(
                f"{what}: module '{name}' is already graphed with graph_modules; its replay cannot run inside "
                "another capture. Build the model without graph_modules (the whole graph contains the layers)."
            )
    if training:
        stray = [n for n, p in model.named_parameters() if p.requires_grad and master_owner(p) is None]
        if stray:
            raise ValueError(
                f"{what}: parameter '{stray[0]}' belongs to no FSDP unit, so no persistent buffer holds its "
                "gradient between replays. Call fsdp_graph.fully_shard(model) on the root as well."
            )


def check_capturable_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """An optimizer step inside a graph must not sync with the host and must read its learning
    rate from a device tensor."""
    if optimizer is None:
        return
    name = type(optimizer).__name__
    for i, group in enumerate(optimizer.param_groups):
        if "capturable" in optimizer.defaults and not group.get("capturable"):
            raise ValueError(
                f"graph_train_step: {name} param group {i} is not capturable; its step keeps state on the "
                f"host. Create it with capturable=True (e.g. torch.optim.{name}(params, lr=..., "
                "capturable=True), fused=True as well for speed), or pass optimizer=None and step it "
                "outside the graph."
            )
        if "capturable" not in optimizer.defaults and "fused" in optimizer.defaults and not group.get("fused"):
            raise ValueError(
                f"graph_train_step: {name} param group {i} needs fused=True: its default path reads a tensor "
                "learning rate with .item() (a host sync). Create it with fused=True, or pass optimizer=None "
                "and step it outside the graph."
            )


def check_full_iteration(model: nn.Module, optimizer, warmup_steps: int) -> None:
    validate_graph_config(GraphConfig(strategy="full_iteration", warmup_steps=warmup_steps), model)
    check_capturable_optimizer(optimizer)


def _require_example(example, what: str, config: GraphConfig):
    if example is None:
        raise ValueError(f"{what} with {config} needs an example batch: its shapes fix the graph's shapes")
    return tuple(example)


def make_train_step(
    loss_fn: Callable[..., torch.Tensor],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    config: GraphConfig | None = None,
    example_batch: tuple | None = None,
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
) -> TrainStep | GraphedTrainStep:
    """A training step ``step(*batch) -> loss`` for ``config.strategy`` (see ``train_step.py``)."""
    config = validate_graph_config(config, model)
    body = TrainStep(loss_fn, model, optimizer, grad_accum_steps=grad_accum_steps, max_grad_norm=max_grad_norm)
    if config.strategy == "none":
        return body
    example = _require_example(example_batch, "make_train_step", config)
    if config.strategy == "full_iteration":
        return GraphedTrainStep(body, example, warmup_steps=config.warmup_steps)
    modules = selected_modules(model, config)
    micro = body.micro_batches(example)[0]
    samples = _samples(model, modules, lambda: loss_fn(*micro))
    graph_modules(modules, [a for a, _ in samples], sample_kwargs=[k for _, k in samples],
                  num_warmup_iters=config.warmup_steps)
    return body


def make_eval_step(model: nn.Module, *, config: GraphConfig | None = None, example_args: tuple | None = None):
    """An evaluation step ``evaluate(*args) -> model outputs`` (eval mode, no gradients) for
    ``config.forward_only``."""
    config = validate_graph_config(config, model)
    if config.forward_only == "none":
        return EvalStep(model)
    example = _require_example(example_args, "make_eval_step", config)
    if config.forward_only == "model":
        return GraphedForward(model, example, warmup_iters=config.warmup_steps)
    modules = selected_modules(model, config)
    with eval_mode(model), torch.no_grad():
        samples = _samples(model, modules, lambda: model(*example))
    graph_modules(modules, [a for a, _ in samples], sample_kwargs=[k for _, k in samples],
                  num_warmup_iters=config.warmup_steps, forward_only=True)
    return EvalStep(model)


def _samples(model: nn.Module, modules: list[nn.Module], run: Callable[[], object]) -> list[tuple[tuple, dict]]:
    """Each module's arguments in one example forward, which is no training step."""
    with ExitStack() as stack:
        for ctx in root_contexts(model):
            stack.enter_context(ctx.outside_training_step())
        return record_sample_args(modules, run)
