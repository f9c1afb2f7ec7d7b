"""fsdp_graph: sharded (FSDP) training whose layers, or whole steps, run as CUDA graphs.

The public API (README.md has the full picture; docs/architecture.md the design):

- ``init_distributed()``: the process group from torchrun / accelerate / plain python.
- ``fully_shard(module, ...)``: FSDP2-style, bottom-up; persistent double-buffered parameters.
  ``MixedPrecisionPolicy`` (alias ``MixedPrecision``): compute, reduce and output dtypes.
  FSDP2's options (``mesh``, ``reshard_after_forward``, a list of modules, ...) by the same
  names (``fsdp/fsdp_options.py``). ``FSDPModule``: ``no_sync()``,
  ``set_requires_gradient_sync()`` on every sharded module.
- ``Checkpointer``: sharded checkpoints of the whole training state (DCP), atomic, exact resume.
- ``full_state_dict`` / ``load_full_state_dict``: unsharded checkpoints. ``clip_grad_norm_``:
  the global gradient norm.
- ``pre_backward_handler`` / ``post_backward_handler`` and the sentinel names: the protocol a
  graph wrapper detects.
- ``GraphConfig`` + ``make_train_step`` / ``make_eval_step``: eager, per-layer or whole-step
  graphs, chosen by configuration and validated up front. ``graph_optimizer_step``: the clipping
  and the optimizer step as graphs of their own, for a hand-written loop.
- ``graph_modules`` / ``select_modules``: graph chosen modules in place;
- ``graph_segments``: graph k consecutive FSDP blocks per graph, their FSDP steps inside;
  ``make_graphed_callables``: the low-level capture with capture-time hooks.
- ``offload_activations``: chosen modules' saved activations in pinned host memory between
  forward and backward (eager modules).
- ``replay_on`` / ``JoinEvent``: replay graphs on a stream the caller gives, so work on the
  caller's stream overlaps them (``replay_stream=`` when graphing sets the default).

- ``fsdp_graph.hf``: HF transformers models (``shard_model``, ``take_capture_path``; docs/hf.md).

Everything else stays importable from its module (``fsdp_graph.fsdp``: the sharding engine;
``fsdp_graph.graphs``: capture and replay; ``fsdp_graph.steps``: the steps).
"""

from . import hf  # fsdp_graph.hf.shard_model / take_capture_path; transformers is imported when they run
from .checkpoint.checkpointer import Checkpointer
from .fsdp.clip_grad import clip_grad_norm_
from .fsdp.distributed import DistInfo, init_distributed
from .fsdp.fully_shard import FSDPModule, fully_shard, register_fsdp_forward_method
from .fsdp.hooks import BACKWARD_PRE_SENTINEL, BACKWARD_SENTINEL, post_backward_handler, pre_backward_handler
from .fsdp.mixed_precision import MixedPrecision, MixedPrecisionPolicy
from .fsdp.shutdown import shutdown
from .fsdp.state_dict import full_state_dict, load_full_state_dict
from .fsdp.training_state import TransitionError
from .graphs.activation_offload import offload_activations
from .graphs.capture import make_graphed_callables
from .graphs.host_sync import HostSyncError
from .graphs.module_graphs import graph_modules, select_modules
from .graphs.replay_stream import JoinEvent, replay_on
from .graphs.segment_graphs import graph_segments
from .steps.graph_config import GraphConfig
from .steps.make_step import make_eval_step, make_train_step
from .steps.optimizer_graph import graph_optimizer_step

__all__ = [
    "BACKWARD_PRE_SENTINEL",
    "BACKWARD_SENTINEL",
    "Checkpointer",
    "DistInfo",
    "FSDPModule",
    "GraphConfig",
    "HostSyncError",
    "JoinEvent",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "TransitionError",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "graph_modules",
    "graph_optimizer_step",
    "graph_segments",
    "hf",
    "init_distributed",
    "load_full_state_dict",
    "make_eval_step",
    "make_graphed_callables",
    "offload_activations",
    "make_train_step",
    "post_backward_handler",
    "pre_backward_handler",
    "register_fsdp_forward_method",
    "replay_on",
    "select_modules",
    "shutdown",
]

__version__ = "0.1.0"
