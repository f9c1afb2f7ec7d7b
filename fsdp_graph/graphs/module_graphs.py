"""``graph_modules``: graph chosen modules of a model in place, FSDP-sharded or not.

For every module, in this order:

1. Checks, before any capture: the module is not inside another selected module and contains
   no FSDP unit (a unit's collectives would be captured); every FSDP parameter it reads belongs
   to one unit, idle, sharded with ``double_buffer=True`` and
   ``persist_buffer_on_alloc_fail=True`` (otherwise the unsharded parameters move between
   iterations and the graph would read stale addresses). Then: CUDA is available.
2. Its hooks come off and become capture-time hooks (``reroute.py``), FSDP's sentinel wrappers
   replaced by their handlers. A module *inside* a unit (a block's attention, say) has no FSDP
   hooks of its own, so it gets the enclosing unit's four steps as capture-time hooks: its
   parameters are unsharded around its capture exactly as around its eager call.
3. Capture (``capture.py``) inside each FSDP root's ``outside_training_step``: afterwards
   every unit is idle and gradients and recorded order are as before.
4. The hooks go back (also when capture fails) and ``module.forward`` becomes the graphed
   callable, so ``module(x)`` runs the restored hooks eagerly around the replay. Hooks on its
   submodules can no longer be added (they would never run).
5. With ``collective_graphs`` (on unless a call chose False), the enclosing units' unshard and reduce bodies are
   replayed as small graphs on their side streams too (``fsdp/collective_graphs.py``): the hooks
   between the graphed layers then cost one replay each instead of four to six launches. So do
   the reduce-scatters of a root that reduces in pieces (``replayable_roots``), each with its write
   into the root's sharded gradients, homed in the graphs' pool after the backward capture of its
   model's first graphed module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ..fsdp.capture_interface import (
    FSDPUnit,
    TrainingState,
    enclosing_unit,
    master_owner,
    pin_addresses,
    post_backward_handler,
    post_forward_reshard,
    pre_backward_handler,
    pre_forward_unshard,
    replay_collectives,
    replayable_roots,
    require_fixed_addresses,
    root_contexts,
    units_in,
)
from .activation_offload import refuse_offloaded
from .capture import argument_names, capture_callables, default_targets, require_cuda, static_copy
from .chained_buffers import LinkRecorder, Links, SampleCalls
from .frozen_arguments import new_object_each_call, same
from .graphed_callable import GraphedCallable
from .reroute import ModuleHooks, hooks_taken_off, seal_submodule_hooks
from .segment_graphs import SEGMENT_MARK, refuse_segmented

Selection = type | tuple | Callable[[str, nn.Module], bool]


def select_modules(model: nn.Module, selection: Selection) -> list[nn.Module]:
    """The modules of ``model`` (``named_modules`` order) chosen by a class, a tuple of classes,
    or a predicate ``(qualified_name, module) -> bool``: the list to pass to ``graph_modules``."""
    if isinstance(selection, type) or (
        isinstance(selection, tuple) and selection and all(isinstance(t, type) for t in selection)
    ):
        return [m for m in model.modules() if isinstance(m, selection)]
    if callable(selection):
        return [m for name, m in model.named_modules() if selection(name, m)]
    raise TypeError(
        f"selection must be a module class, a tuple of classes or a predicate (name, module) -> bool, not {selection!r}"
    )


def _describe(module: nn.Module, index: int) -> str:
    unit = enclosing_unit(module)
    if unit is not None and unit.module is module:
        return f"module {index} (FSDP unit {unit.name})"
    if unit is not None:
        return f"module {index} ({type(module).__name__} inside FSDP unit {unit.name})"
    return f"module {index} ({type(module).__name__})"


def _unit_to_unshard(module: nn.Module, name: str) -> FSDPUnit | None:
    """The FSDP unit whose parameters ``module`` reads (None for a plain module); refuses what
    a graph cannot replay correctly."""
    inner = [u for u in units_in(module) if u.module is not module]
    if inner:
        raise ValueError(
            f"graph_modules: {name} contains FSDP unit {inner[0].name}, whose unshard and reduce-scatter would "
            "be captured into the graph. Graph that inner unit (or modules inside it) instead."
        )
    owners = {id(u): u for u in (master_owner(p) for p in module.parameters()) if u is not None}
    if not owners:
        return None
    enclosing = enclosing_unit(module)
    foreign = [u for u in owners.values() if u is not enclosing]
    if foreign:
        raise ValueError(
            f"graph_modules: {name} reads parameters of FSDP unit {foreign[0].name}, an enclosing unit (a "
            "parameter tied across units), which is not unsharded around this module's capture. Graph a "
            "module that does not use it, or untie the parameter."
        )
    require_fixed_addresses(enclosing, f"graph_modules: {name}")
    if enclosing.state is not TrainingState.IDLE:
        raise ValueError(
            f"graph_modules: FSDP unit {enclosing.name} is in {enclosing.state.value}; graph modules between "
            "training steps (after optimizer.step(), not inside forward or backward)."
        )
    return enclosing


def graph_kinds(module: nn.Module) -> set[bool]:
    """The kinds of graph installed on ``module`` (True: training, False: forward-only), following
    the fallback chain from the installed graph to the other kind's (a block of a segment graph:
    training)."""
    kinds, runner = {True} if SEGMENT_MARK in module.__dict__ else set(), module.__dict__.get("forward")
    while isinstance(runner, GraphedCallable):
        kinds.add(runner.captured.grad_enabled)
        runner = runner.eager
    return kinds


def _check_selection(modules: list[nn.Module], names: list[str], forward_only: bool) -> None:
    for i, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise TypeError(f"graph_modules expects nn.Module objects; item {i} is a {type(module).__name__}")
        for sub in module.modules():
            kinds = graph_kinds(sub)
            if (not forward_only) in kinds or (kinds and sub is not module):
                kind = "forward-only" if forward_only else "training"
                raise ValueError(
                    f"graph_modules: {names[i]} is already graphed, or contains a graphed module, and a {kind} graph "
                    "was asked for: capture each module once per kind (one training graph, one forward-only graph)"
                )
        for j, other in enumerate(modules):
            if j != i and any(sub is other for sub in module.modules()):
                raise ValueError(
                    f"graph_modules: {names[j]} is inside {names[i]}, and both are selected. Graph one of them: "
                    "the outer one's graph would already contain the inner one."
                )


def _with_unit_steps(hooks: dict[str, dict], unit: FSDPUnit) -> dict[str, dict]:
    """A module inside ``unit``: the unit's unshard/reshard and backward handlers run around
    its capture, outermost (as they do around its eager call)."""
    unit_module = unit.module
    return {
        "pre_forward": {"fsdp_unshard": lambda m, a, k: pre_forward_unshard(unit_module, a, k), **hooks["pre_forward"]},
        "forward": {**hooks["forward"], "fsdp_reshard": lambda m, a, o: post_forward_reshard(unit_module, a, o)},
        "pre_backward": {"fsdp_pre_backward": lambda m: pre_backward_handler(unit_module), **hooks["pre_backward"]},
        "backward": {**hooks["backward"], "fsdp_post_backward": lambda m: post_backward_handler(unit_module)},
    }


def _capture_time_hooks(taken: ModuleHooks, unit: FSDPUnit | None, kwargs: dict) -> dict[str, dict]:
    hooks = taken.capture_time_hooks()
    taken.set_call_kwargs(kwargs)
    if unit is not None and unit.module is not taken.module:
        hooks = _with_unit_steps(hooks, unit)
    return hooks


@contextmanager
def eval_mode(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """``module.eval()`` for the body; afterwards every submodule's mode is as before."""
    modes = [(m, m.training) for m in module.modules()]
    if enabled:
        module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


@contextmanager
def _capturable_forward(module: nn.Module, forward_only: bool) -> Iterator[None]:
    """During capture: the class's own forward (not a graph installed earlier), in eval mode for
    a forward-only graph; afterwards both are as before."""
    installed = module.__dict__.pop("forward", None)
    try:
        with eval_mode(module, enabled=forward_only):
            yield
    finally:
        if installed is not None:
            module.forward = installed


def record_sample_args(modules: list[nn.Module], run: Callable[[], object]) -> SampleCalls:
    """The arguments each module receives during ``run()`` (its first call), as detached copies
    that keep ``requires_grad``: samples for ``graph_modules`` that match the real calls. Their
    ``links`` say which inputs were the previous module's output itself, in both calls: the
    ``chained_inputs`` of ``graph_modules`` (``chained_buffers.py``).

    ``run`` is called twice, and a non-tensor argument that differs between the two calls (an
    object built anew on every call, such as HF's KV cache) is refused here, before any capture:
    the graph would freeze it and no later call could replay (``frozen_arguments.py``)."""
    (first, first_links), (second, second_links) = _first_calls(modules, run), _first_calls(modules, run)
    missing = [_describe(m, i) for i, (m, s) in enumerate(zip(modules, first)) if s is None]
    if missing:
        raise ValueError(
            f"{missing[0]} was selected for a graph but did not run in the example forward; select modules "
            "the model runs on every step (or graph it with graph_modules and your own sample arguments)."
        )
    for i, (module, a, b) in enumerate(zip(modules, first, second)):
        _refuse_new_objects(f"graphing {_describe(module, i)}", a, b)
    samples = SampleCalls(first)
    samples.links = [[pair for pair in a if pair in b] for a, b in zip(first_links, second_links)]
    return samples


def _first_calls(modules: list[nn.Module], run: Callable[[], object]) -> tuple[list, Links]:
    samples: list = [None] * len(modules)
    links = LinkRecorder(len(modules))

    def recorder(i: int):
        def hook(module, args, kwargs):
            if samples[i] is None:
                samples[i] = tree_map(static_copy, (tuple(args), dict(kwargs)))  # no autograd graph kept
                links.note_input(i, args, kwargs)
        return hook

    handles = [m.register_forward_pre_hook(recorder(i), with_kwargs=True, prepend=True) for i, m in enumerate(modules)]
    handles += [m.register_forward_hook(links.output_hook(i), prepend=True) for i, m in enumerate(modules)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return samples, links.links


def _refuse_new_objects(where: str, first: tuple, second: tuple | None) -> None:
    flat_first, spec_first = tree_flatten(first)
    flat_second, spec_second = tree_flatten(second)
    if spec_first != spec_second:
        return  # a changing signature is refused at replay, with both signatures
    for name, a, b in zip(argument_names(*first), flat_first, flat_second):
        if not isinstance(a, torch.Tensor) and not same(a, b):
            raise ValueError(new_object_each_call(where, name, a, b))


def graph_modules(
    modules: Sequence[nn.Module],
    sample_args: Sequence[tuple],
    *,
    sample_kwargs: Sequence[dict | None] | None = None,
    num_warmup_iters: int = 3,
    pool=None,
    forward_only: bool = False,
    collective_graphs: bool | None = None,
    replay_stream: torch.cuda.Stream | None = None,
    join_event=None,
    chained_inputs: Links | None = None,
) -> list[GraphedCallable]:
    """Capture each module's forward and backward as CUDA graphs and install them in place.

    ``modules``: FSDP units, modules inside a unit (attention only, MLP only) or plain modules,
    e.g. ``select_modules(model, Block)``; ``sample_args``: one tuple of sample arguments per
    module (``[(x,)] * len(modules)`` is fine: samples are copied). Call it between training
    steps, after ``fully_shard`` on every unit and the root. Afterwards ``module(...)`` replays,
    with the module's hooks (FSDP's unshard/reshard among them) running eagerly around the
    graph. Returns the graphed callables, in order.

    ``forward_only=True`` captures evaluation graphs instead: the forward only, in eval mode
    under ``torch.no_grad()``, replayed when the module is in eval mode with gradients disabled
    (unshard still runs eagerly around it). A module may have one graph of each kind.

    ``collective_graphs``: replay the enclosing FSDP units' unshard (cast, all-gather, copy-out)
    and reduce (copy-in, zeroing, reduce-scatter) as CUDA graphs on their side streams, captured
    at their second run, and so does a wider root's reduce-scatter of each piece through the shared
    staging; False runs them eagerly (NCCL's watchdog then times them out). The setting is per
    unit: None (the default) keeps what an earlier call chose for a unit and is True for a unit no
    call has chosen for; True or False set it again.

    ``replay_stream`` / ``join_event``: replay the graphs on that stream by default, the caller's
    stream joining at the end of each replay or, for a forward, at ``join_event`` (a ``JoinEvent``
    the module's forward records, or one per module); ``replay_on`` overrides it per call
    (``replay_stream.py``).

    ``chained_inputs``: per module, pairs (index among its input tensors, index among the previous
    module's output tensors) that are the same tensor in the model's forward, as
    ``record_sample_args(...).links`` finds them: the two share one static buffer, and so do their
    gradients (``chained_buffers.py``). Training graphs only.
    """
    if chained_inputs is not None and (forward_only or len(chained_inputs) != len(modules)):
        raise ValueError(
            "graph_modules: chained_inputs needs one list of pairs per module (record_sample_args(...).links), and "
            f"training graphs; got {len(chained_inputs)} for {len(modules)} modules"
            + (" with forward_only=True. Drop chained_inputs." if forward_only else ".")
        )
    if collective_graphs is not None and not isinstance(collective_graphs, bool):
        raise TypeError(f"graph_modules: collective_graphs must be True, False or None, got {collective_graphs!r}")
    modules = list(modules)
    names = [_describe(m, i) for i, m in enumerate(modules)]
    _check_selection(modules, names, forward_only)
    refuse_segmented(modules, names, "graph_modules")
    default_targets(replay_stream, join_event, names)  # (checked before any capture; set by the capture)
    if not forward_only:
        refuse_offloaded(modules, names, graphs_own_offload=True)
    units = [_unit_to_unshard(m, name) for m, name in zip(modules, names)]
    require_cuda("graph_modules")
    kwargs_list = [None] * len(modules) if sample_kwargs is None else list(sample_kwargs)
    eager = [m.forward for m in modules]  # the other kind's graph, if one is installed, else forward
    roots = {id(ctx): ctx for u in units if u is not None for ctx in root_contexts(u.module)}
    with ExitStack() as stack:
        for ctx in roots.values():
            stack.enter_context(ctx.outside_training_step())
        for module in modules:
            stack.enter_context(_capturable_forward(module, forward_only))
        with hooks_taken_off(modules, names) as taken:
            capture_time_hooks = [
                _capture_time_hooks(t, u, dict(k or {})) for t, u, k in zip(taken, units, kwargs_list)
            ]
            graphed = capture_callables(
                modules, names, sample_args, sample_kwargs, num_warmup_iters, capture_time_hooks,
                None, None, pool, eager, forward_only, replay_stream=replay_stream, join_event=join_event,
                links=chained_inputs,
            )
    replayed = [u for u in units if u is not None] + replayable_roots(roots.values())
    replay_collectives(list({id(u): u for u in replayed}.values()), collective_graphs)
    for module, name, runner in zip(modules, names, graphed):
        pin_addresses(module, "graph_modules")
        module.forward = runner
        seal_submodule_hooks(module, name)
    return graphed
