"""``GraphConfig``: how a model's steps use CUDA graphs, validated in one place.

Independent settings (after Megatron's split):

* ``strategy``, for training: ``"none"`` (eager), ``"layer"`` (the selected modules are graphed,
  FSDP's unshard/reshard and everything else run between them: ``graph_modules``; with
  ``collective_graphs`` (on unless False; None keeps an earlier step's choice), the units' unshard
  and reduce bodies are replayed as small graphs of their own on the side streams; with segments,
  whose blocks' FSDP steps are inside their graphs, it covers the root's: each piece's
  reduce-scatter of a root that reduces in pieces) or
  ``"full_iteration"`` (forward, loss, backward, the FSDP collectives and optionally the
  optimizer step as one graph: ``graph_train_step``);
* ``modules``, which modules ``"layer"`` graphs: a module class, a tuple of classes, a predicate
  ``(name, module) -> bool`` or a list of modules; None means every leaf FSDP unit (the blocks);
* ``segment_size``, for ``"layer"``: k > 1 graphs k consecutive blocks (FSDP units) per graph
  with their FSDP steps inside (``graph_segments``), for blocks too small to hide the host's
  work per layer; 1 (the default) graphs each module on its own;
* ``chain_static_buffers``, for ``"layer"``: where the example forward passes a graphed block's
  output straight to the next one (the next segment's first block, with ``segment_size``), the two
  graphs share one static buffer, and so do their gradients (``chained_buffers.py``); a call that
  passes the next block another tensor is refused (a copy would overwrite the previous output).
  True by default; False for a model whose code between the blocks changes from call to call;
* ``optimizer_graph``, for ``"layer"``: the clipping and the optimizer step replayed as CUDA graphs
  of their own (``graph_optimizer_step``); ``"full_iteration"`` has them inside its graph already;
* ``offload_activations``, for training under any strategy: the modules whose saved activations
  wait in pinned host memory between forward and backward (``offload_activations``), chosen as
  ``modules`` are; graphed modules record the copies in their graphs (per-layer graphs and the
  whole step; not segments);
* ``forward_only``, for evaluation: ``"none"``, ``"layer"`` (the same modules, forward-only
  graphs, unshard outside) or ``"model"`` (the whole forward with its unshards in one graph).

``validate_graph_config(config, model)`` normalises the config and refuses, before any work,
every combination that cannot work, with the fix in the message: graphs without persistent
buffers, ``modules`` with ``full_iteration``, graphs on CPU, a whole-step graph over parameters
no FSDP unit manages or over modules already graphed, a non-capturable optimizer. Two problems
only the running code reveals are caught as early as they can be, with messages that also name
the fix: host syncs (found by the warm-up, before any capture: ``host_sync.py``) and inputs
whose shape varies (checked at every call: ``static_inputs.py``, ``graphed_callable.py``).

``make_train_step`` and ``make_eval_step`` (``make_step.py``) turn a config into a step, so a
training script switches between eager, layer and full-iteration graphs by the config alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..fsdp.capture_interface import enclosing_unit, leaf_units, master_owner, require_fixed_addresses, units_in
from ..graphs.module_graphs import Selection, graph_kinds, select_modules

STRATEGIES = ("none", "layer", "full_iteration")
FORWARD_ONLY = ("none", "layer", "model")


@dataclass(frozen=True)
class GraphConfig:
    strategy: str = "none"
    modules: Selection | Sequence[nn.Module] | None = None
    forward_only: str = "none"
    num_warmup_iters: int = 3  # eager passes before capture (>= 2 also proves the code free of host syncs)
    collective_graphs: bool | None = None  # "layer": the units' unshard/reduce replayed as graphs too (None:
    # as an earlier step chose for them, else True; with segments, the root's reduce-scatters in pieces)
    replay_stream: torch.cuda.Stream | None = None  # every graph the step makes replays there (replay_on overrides)
    segment_size: int = 1  # "layer": k > 1 graphs k consecutive blocks per graph, their FSDP steps inside
    optimizer_graph: bool = False  # "layer": clipping and the optimizer step replayed as graphs of their own
    offload_activations: Selection | Sequence[nn.Module] | None = None  # these modules' saved activations
    # wait in pinned host memory between forward and backward (graphed or eager; CUDA only)
    offload_min_bytes: int = 1 << 20  # smaller saved tensors stay on the device
    chain_static_buffers: bool = True  # "layer": a block reads its input where the previous block wrote it,
    # and its output gradient where the next block's backward wrote it (chained_buffers.py); False for a model
    # whose code between the graphed blocks changes from call to call


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
    if config.collective_graphs is not None and not isinstance(config.collective_graphs, bool):
        raise TypeError(f"GraphConfig.collective_graphs must be True, False or None, got {config.collective_graphs!r}")
    if config.replay_stream is not None and not isinstance(config.replay_stream, torch.cuda.Stream):
        raise TypeError(
            f"GraphConfig.replay_stream must be a torch.cuda.Stream or None, not {type(config.replay_stream).__name__}"
        )
    size = config.segment_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"GraphConfig.segment_size must be an int >= 1, got {size!r}")
    if size > 1 and strategy != "layer":
        raise ValueError(
            f"GraphConfig: segment_size={size} groups the blocks of strategy='layer' into segment graphs, but the "
            f"strategy is {strategy!r}. Use strategy='layer', or drop segment_size."
        )
    if size > 1 and forward_only == "layer":
        raise ValueError(
            f"GraphConfig: segment_size={size} with forward_only='layer': a segment's blocks run their FSDP steps "
            "inside its training graphs, so they cannot also get forward-only graphs of their own. Use "
            "forward_only='model' (the whole forward as one graph) or 'none' (the blocks evaluate eagerly)."
        )
    if not isinstance(config.chain_static_buffers, bool):
        raise TypeError(f"GraphConfig.chain_static_buffers must be True or False, got {config.chain_static_buffers!r}")
    if not isinstance(config.optimizer_graph, bool):
        raise TypeError(f"GraphConfig.optimizer_graph must be True or False, got {config.optimizer_graph!r}")
    if config.optimizer_graph and strategy != "layer":
        raise ValueError(
            f"GraphConfig: optimizer_graph=True graphs the optimizer step of strategy='layer', but the strategy is "
            f"{strategy!r}" + (" (whose graph has the optimizer step inside already). Drop optimizer_graph."
                               if strategy == "full_iteration" else
                               ", which runs eagerly. Use strategy='layer', or drop optimizer_graph.")
        )
    if config.offload_activations is not None:
        _check_offload(config, model)
    if not isinstance(config.num_warmup_iters, int) or config.num_warmup_iters < 1:
        raise ValueError(f"GraphConfig.num_warmup_iters must be an int >= 1, got {config.num_warmup_iters!r}")
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
    if strategy == "full_iteration":
        _require_capture_path(model, "strategy='full_iteration'")
    if forward_only == "model":
        _require_capture_path(model, "forward_only='model'")
    if "layer" in (strategy, forward_only):
        for module in selected_modules(model, config):
            unit = enclosing_unit(module)
            if unit is not None:
                require_fixed_addresses(unit, f"a graphed {type(module).__name__}")
            _require_capture_path(module, f"a graphed {type(module).__name__}")
    if not torch.cuda.is_available() or any(u.device.type != "cuda" for u in units_in(model)):
        raise RuntimeError(
            f"GraphConfig(strategy={strategy!r}, forward_only={forward_only!r}) needs CUDA: CUDA graphs do not exist "
            "on CPU. Use GraphConfig() (strategy='none', forward_only='none') to run eagerly there."
        )
    return config


# Set by fsdp_graph.hf.take_capture_path on every HF model it makes take HF's capture path.
CAPTURE_PATH_MARK = "_fsdp_graph_takes_capture_path"


def is_hf_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (checked by name: transformers is not imported here)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)


def _require_capture_path(root: nn.Module, what: str) -> None:
    """HF models branch on capture (``hf/capture_path.py``): a graph that contains their forward
    must run on the capture path in eager steps as well, or eager and graphed steps differ."""
    for name, module in root.named_modules():
        if is_hf_model(module) and not getattr(module, CAPTURE_PATH_MARK, False):
            where = f"'{name}' ({type(module).__name__})" if name else type(module).__name__
            raise ValueError(
                f"{what} would capture the forward of HF model {where}, whose masking code takes another path "
                "under CUDA graph capture than in eager steps (eager and graphed losses would differ, and its "
                "eager host syncs refuse the warm-up). Call fsdp_graph.hf.take_capture_path(model) once before "
                "building the step (fsdp_graph.hf.shard_model does it), or graph only the decoder layers "
                "(strategy='layer')."
            )


def selected_modules(model: nn.Module, config: GraphConfig, field: str = "modules") -> list[nn.Module]:
    """The modules a layer strategy graphs (every leaf FSDP unit when ``modules`` is None), or with
    ``field="offload_activations"`` the modules whose activations are offloaded."""
    selection = getattr(config, field)
    if selection is None:
        chosen = [u.module for u in leaf_units(model)]
    elif isinstance(selection, (list, tuple)) and all(isinstance(m, nn.Module) for m in selection):
        chosen = list(selection)
    else:
        chosen = select_modules(model, selection)
    if not chosen:
        raise ValueError(
            f"GraphConfig: {field}={selection!r} selects no module of the model. Pass a module class (e.g. your "
            "Block), a predicate (name, module) -> bool, or a list"
            + ("; with modules=None, fully_shard each block first." if field == "modules" else ".")
        )
    return chosen


def _check_offload(config: GraphConfig, model: nn.Module) -> None:
    """Offload where it can work: training (any strategy but segments), on CUDA, on modules of the model."""
    size = config.offload_min_bytes
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"GraphConfig.offload_min_bytes must be an int >= 0, got {size!r}")
    if config.segment_size > 1:
        raise ValueError(
            f"GraphConfig: offload_activations with segment_size={config.segment_size}: segments of several blocks "
            "do not record activation offload. Use segment_size=1 (per-layer graphs) or strategy='full_iteration'."
        )
    chosen = selected_modules(model, config, "offload_activations")
    inside = {id(m) for m in model.modules()}
    if any(id(m) not in inside for m in chosen):
        raise ValueError("GraphConfig: offload_activations lists a module that is not part of the model")
    if config.strategy == "layer":
        offloaded = {id(m) for m in chosen}
        for module in selected_modules(model, config):
            inner = [sub for sub in module.modules() if sub is not module and id(sub) in offloaded]
            if inner:
                raise ValueError(
                    f"GraphConfig: offload_activations selects a {type(inner[0]).__name__} inside a graphed "
                    f"{type(module).__name__}; a per-layer graph records the offload of the graphed module itself "
                    "only. Offload the graphed modules (the same selection as modules=), or graph the offloaded ones."
                )


def _check_whole(model: nn.Module, what: str, training: bool) -> None:
    """A graph of the whole model: every unit at fixed addresses, no graphs inside it, and (for
    training) every trainable parameter managed by a unit."""
    units = units_in(model)
    if not units:
        raise ValueError(f"{what} graphs an FSDP model: call fsdp_graph.fully_shard on its blocks and its root first")
    for unit in units:
        require_fixed_addresses(unit, what)
    for name, sub in model.named_modules():
        # A whole training graph replays layers' training graphs (forward-only ones fall back to
        # eager with gradients on); a whole evaluation graph would replay forward-only ones.
        if training in graph_kinds(sub):
            raise ValueError(
                f"{what}: module '{name}' is already graphed with graph_modules; its replay cannot run inside "
                "another capture. Build the model without graph_modules (the whole graph contains the layers)."
            )
    if training:
        stray = trainable_outside_units(model)
        if stray:
            raise ValueError(
                f"{what}: parameter '{stray[0]}' belongs to no FSDP unit, so no persistent buffer holds its "
                "gradient between replays. Call fsdp_graph.fully_shard(model) on the root as well."
            )


def trainable_outside_units(model: nn.Module) -> list[str]:
    """Names of the trainable parameters no FSDP unit manages: autograd makes their ``.grad`` anew
    each step, so no graph can read it at a fixed address."""
    return [n for n, p in model.named_parameters() if p.requires_grad and master_owner(p) is None]


def check_capturable_optimizer(optimizer: torch.optim.Optimizer | None, what: str = "make_train_step",
                               eager_fix: str = "pass optimizer=None and step it outside the graph") -> None:
    """An optimizer step inside a graph must not sync with the host and must read its learning
    rate from a device tensor."""
    if optimizer is None:
        return
    name = type(optimizer).__name__
    for i, group in enumerate(optimizer.param_groups):
        if "capturable" in optimizer.defaults and not group.get("capturable"):
            raise ValueError(
                f"{what}: {name} param group {i} is not capturable; its step keeps state on the "
                f"host. Create it with capturable=True (e.g. torch.optim.{name}(params, lr=..., "
                f"capturable=True), fused=True as well for speed), or {eager_fix}."
            )
        if "capturable" not in optimizer.defaults and "fused" in optimizer.defaults and not group.get("fused"):
            raise ValueError(
                f"{what}: {name} param group {i} needs fused=True: its default path reads a tensor "
                f"learning rate with .item() (a host sync). Create it with fused=True, or {eager_fix}."
            )


