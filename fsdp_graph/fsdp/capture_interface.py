"""What the graph layer (``fsdp_graph.graphs``) and the steps may use of the engine, and nothing more.

The graph wrapper meets FSDP through the sentinel protocol (``hooks.py``) and this small surface:

* the unit's four steps, as the hook functions a module's hooks call
  (``pre_forward_unshard``, ``post_forward_reshard``, ``pre_backward_handler``,
  ``post_backward_handler``), and the sentinel attribute names;
* which unit a module is, encloses it, or owns a parameter (``units_in``, ``enclosing_unit``,
  ``leaf_units``, ``master_owner``, ``unsharded_owner``), and whether it is idle (``TrainingState``);
* per-layer graphs hand their parameters' gradients to the unit (``grads.from_graphs``: ``cover`` at
  graph construction, ``receive`` at each backward replay; ``graph_gradients.py``);
* whether a backward runs now (``in_backward``): graphs refuse to replay a forward inside one (an
  activation-checkpoint recompute would overwrite pool memory the backward still needs);
* the roots (``root_contexts``): ``outside_training_step()`` around unit steps that are no
  training step, ``forget_events()`` around a capture that records the steps themselves, and
  ``capture_failed()`` when such a capture failed midway;
* the persistence check (``require_fixed_addresses``): a graph may read a unit only if its
  unsharded parameters (and gradient buffer) never move;
* address pins (``pin_addresses``): a graph captured on a module pins it, so that re-sharding
  it later is refused instead of leaving the graph reading stale addresses;
* ``release_before_destroy``: a graph that captured collectives registers to be released before
  the default or an NCCL process group is destroyed (``communicator_graphs.py``);
* replays on a caller's stream that joined it early (``note_replay_tail``, ``wait_for_replay_tails``):
  the side streams, and the caller's stream at the next graph call, wait on those replays' ends;
* collective graphs (``replay_collectives``): the graph strategies replay the units' unshard and
  reduce bodies as small CUDA graphs on their side streams, and those of the roots no graph
  encloses (``replayable_roots``);
* for segment graphs (several units' steps captured, eager code around them): the unit hooks
  (``unit_hooks``) to take off, ``run_as_forward`` to run a unit's steps by hand, and per unit
  ``segmented`` (no prefetch from outside), ``param_group`` (its slot, ``evict``; its
  ``dtypes.reduce``), ``grads.parking`` (where a captured reduce leaves the summed shard) and
  ``grads.accumulate_parked`` (which adds it into ``.grad`` after the replay, as eagerly);
* gradient homes (``GradHomes``, ``grads.sharded.set_home``; ``grad_homes.py``): per-layer and
  segment graphs take each unit's sharded gradient buffer from their pool, and vacate the homes
  before every forward replay;
* ``local_tensor``: this rank's piece of a master or of its ``.grad`` (the address a graph reads);
* per unit, for the whole-step graphs: ``requires_gradient_sync``, ``grads.clear()``,
  ``grads.pin_sharded()``, ``grads.expose_sharded(unused)``, ``grads.use.unused`` (the parameters
  no rank gave a gradient, as decided at the capture).

Nothing here imports the graph layer: the engine does not know it exists.
"""

from __future__ import annotations

from .collective_graphs import CollectiveGraphs, GraphPool
from .collectives import note_replay_tail, wait_for_replay_tails
from .communicator_graphs import hold as release_before_destroy
from .grad_homes import GradHomes
from .hooks import (
    BACKWARD_PRE_SENTINEL,
    BACKWARD_SENTINEL,
    POST_BACKWARD_TRIGGER_NODE,
    cast_forward_inputs,
    cast_forward_outputs,
    install_post_backward,
    install_pre_backward,
    post_backward_handler,
    post_forward_reshard,
    pre_backward_handler,
    pre_forward_unshard,
    run_as_forward,
)
from .mesh import local_tensor
from .param_group import ShardState
from .registry import enclosing_unit, leaf_units, pin_addresses, root_contexts, units_in
from .root import RootContext, in_backward
from .sharded_param import master_owner, unsharded_owner
from .training_state import TrainingState
from .unit import FSDPUnit
from .unused_params import unused_on_every_rank

__all__ = [
    "BACKWARD_PRE_SENTINEL",
    "BACKWARD_SENTINEL",
    "POST_BACKWARD_TRIGGER_NODE",
    "FSDPUnit",
    "GradHomes",
    "RootContext",
    "ShardState",
    "TrainingState",
    "enclosing_unit",
    "in_backward",
    "leaf_units",
    "local_tensor",
    "master_owner",
    "note_replay_tail",
    "pin_addresses",
    "post_backward_handler",
    "post_forward_reshard",
    "pre_backward_handler",
    "pre_forward_unshard",
    "release_before_destroy",
    "replay_collectives",
    "replayable_roots",
    "require_fixed_addresses",
    "root_contexts",
    "run_as_forward",
    "unit_hooks",
    "units_in",
    "unsharded_owner",
    "unused_on_every_rank",
    "wait_for_replay_tails",
]

# Every hook fully_shard registers on a unit's module (``hooks.py``).
unit_hooks = frozenset({pre_forward_unshard, cast_forward_inputs, install_post_backward, post_forward_reshard,
                        install_pre_backward, cast_forward_outputs})


def require_fixed_addresses(unit: FSDPUnit, what: str) -> None:
    """Refuse a graph over ``unit`` unless its unsharded parameters (and gradient buffer) never move."""
    config = unit.config
    if not config.fixed_addresses:
        raise ValueError(
            f"{what} reads FSDP unit {unit.name}, sharded with double_buffer={config.double_buffer} and "
            f"persist_buffer_on_alloc_fail={config.persist_buffer_on_alloc_fail}: its unsharded parameters are "
            "re-allocated per unshard and move between iterations, but a CUDA graph replays fixed addresses. "
            "Pass double_buffer=True and persist_buffer_on_alloc_fail=True to fully_shard (the defaults)."
        )


def replayable_roots(contexts) -> list[FSDPUnit]:
    """The root units of ``contexts`` that reduce through the shared staging in pieces and have
    persistent buffers. Where no graph of the layer strategies encloses a root, its steps stay eager
    between them, and its reduce in pieces is the largest of them on the host; each piece's
    reduce-scatter touches only the staging, so it replays with no memory of its own (and its write
    with it, once the graphs give the root a home: ``graphs/gradient_homes.py``). (A root that
    fits the staging would need a persistent gradient buffer for its copy-in to replay: it stays
    eager. So does one sharded without persistent buffers: it was not made ready for graphs.)"""
    return [ctx.root for ctx in contexts
            if ctx.root.config.fixed_addresses and ctx.root.grads.reduce.pieces(ctx.root.param_group.scratch)]


def replay_collectives(units: list[FSDPUnit], enabled: bool | None) -> None:
    """Switch the replay of ``units``' unshard and reduce bodies as CUDA graphs on (True) or off
    (False); None keeps the choice an earlier call made for a unit, and switches on a unit no call
    has chosen for (so an evaluation step with the default leaves training's choice alone). A
    unit that replays already keeps its graphs; the new ones share one memory pool."""
    pool = GraphPool()
    for unit in units:
        if enabled is not None:
            unit.collective_graphs_chosen = enabled
        if unit.collective_graphs_chosen is False:
            unit.replay_collectives(None)
        elif unit.param_group.collective_graphs is None:
            unit.replay_collectives(CollectiveGraphs(pool, unit.name))
