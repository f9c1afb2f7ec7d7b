"""fsdp_graph: sharded (FSDP) training whose layers can run as CUDA graphs.

Public API (see README.md for the full picture):

- ``init_distributed()``: process group from torchrun / accelerate / plain python.
- ``fully_shard(module, ...)``: FSDP2-style, bottom-up; persistent double-buffered parameters.
- ``MixedPrecision``: compute and reduce dtypes.
- ``full_state_dict`` / ``load_full_state_dict``: unsharded checkpoints.
- ``clip_grad_norm_``: global gradient-norm clipping.
- ``FSDPModule``: mixin of every sharded module (``no_sync()``, ``set_requires_gradient_sync()``).
- ``graph_modules(modules, sample_args, ...)``: graph chosen modules in place (FSDP units, modules
  inside them, plain modules); ``select_modules(model, Block)`` chooses them.
- ``make_graphed_callables(...)``: the low-level capture with capture-time hooks.
- ``graph_train_step(loss_fn, example_batch, model=..., optimizer=...)``: the whole training step
  (collectives, optimizer, gradient accumulation) as one CUDA graph.
- ``graph_forward(model, example_args)``: the whole evaluation forward as one graph;
  ``graph_modules(..., forward_only=True)``: per-layer evaluation graphs.
- ``GraphConfig`` + ``make_train_step`` / ``make_eval_step``: pick eager, layer or full-iteration
  graphs by configuration, validated up front (``validate_graph_config``).
"""

from .capture import make_graphed_callables
from .clip_grad import clip_grad_norm_
from .distributed import DistInfo, init_distributed
from .forward_graph import EvalStep, GraphedForward, graph_forward
from .graph_config import GraphConfig, make_eval_step, make_train_step, validate_graph_config
from .fully_shard import FSDPModule, fully_shard
from .module_graphs import graph_modules, select_modules
from .graphed_callable import GraphedCallable
from .host_sync import HostSyncError
from .hooks import (
    BACKWARD_PRE_SENTINEL,
    BACKWARD_SENTINEL,
    post_backward_handler,
    pre_backward_handler,
)
from .mixed_precision import MixedPrecision
from .state_dict import full_state_dict, load_full_state_dict
from .train_step import GraphedTrainStep, TrainStep, graph_train_step
from .training_state import TrainingState, TransitionError
from .unit import FSDPUnit

__all__ = [
    "BACKWARD_PRE_SENTINEL",
    "BACKWARD_SENTINEL",
    "DistInfo",
    "EvalStep",
    "FSDPModule",
    "FSDPUnit",
    "GraphConfig",
    "GraphedCallable",
    "GraphedForward",
    "GraphedTrainStep",
    "HostSyncError",
    "MixedPrecision",
    "TrainStep",
    "TrainingState",
    "TransitionError",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "graph_forward",
    "graph_modules",
    "graph_train_step",
    "init_distributed",
    "load_full_state_dict",
    "make_eval_step",
    "make_graphed_callables",
    "make_train_step",
    "post_backward_handler",
    "pre_backward_handler",
    "select_modules",
    "validate_graph_config",
]

__version__ = "0.1.0"
