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
"""

from .capture import make_graphed_callables
from .clip_grad import clip_grad_norm_
from .distributed import DistInfo, init_distributed
from .fully_shard import FSDPModule, fully_shard
from .module_graphs import graph_modules, select_modules
from .graphed_callable import GraphedCallable
from .hooks import (
    BACKWARD_PRE_SENTINEL,
    BACKWARD_SENTINEL,
    post_backward_handler,
    pre_backward_handler,
)
from .mixed_precision import MixedPrecision
from .state_dict import full_state_dict, load_full_state_dict
from .training_state import TrainingState, TransitionError
from .unit import FSDPUnit

__all__ = [
    "BACKWARD_PRE_SENTINEL",
    "BACKWARD_SENTINEL",
    "DistInfo",
    "FSDPModule",
    "FSDPUnit",
    "GraphedCallable",
    "MixedPrecision",
    "TrainingState",
    "TransitionError",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "graph_modules",
    "init_distributed",
    "load_full_state_dict",
    "make_graphed_callables",
    "post_backward_handler",
    "pre_backward_handler",
    "select_modules",
]

__version__ = "0.1.0"
