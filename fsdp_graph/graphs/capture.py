"""``make_graphed_callables``: warm up, then capture each callable's forward and backward graph.

The procedure, for N callables sharing one memory pool:

1. ``pre_warmup_hook()``; ``num_warmup_iters`` eager passes on a side stream (cuBLAS handles,
   autotuning and lazy state must exist before capture); ``post_warmup_hook()``.
2. Capture, on the same side stream: forward graphs in call order, then backward graphs in
   reverse order (``torch.autograd.grad`` on the captured forward's outputs), so the pool's
   allocations follow the order in which they will be replayed.

A pass (warm-up or capture) calls each callable's *capture-time hooks* around its forward and
backward, always outside the capture context: ``pre_forward(module, args, kwargs)`` may return
new ``(args, kwargs)``, ``forward(module, args, outputs)`` may return new outputs (seen by the
next forward hook only), ``pre_backward(module)``, ``backward(module)``. This is where FSDP's
unshard and reshard run, so a graph never contains communication or Python.

TransformerEngine's ``make_graphed_callables`` takes the same hooks under its own names, each
``hook(module)`` returning None; that form is accepted too, in the same dict or alone:

    ``forward_pre_hooks`` -> ``pre_forward``     ``forward_hooks`` -> ``forward``
    ``backward_pre_hooks`` -> ``pre_backward``   ``backward_hooks`` -> ``backward``

They run where ours of the same kind run, in the order the dict lists them. One that returns a
value is an error (TE's contract; ours may replace arguments or outputs).

The static inputs are copies of the arguments *after* the pre-forward hooks: at replay the same
hooks run eagerly (``module(...)``) before the graphed forward sees its arguments.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from ..fsdp.capture_interface import master_owner, pin_addresses
from .activation_offload import OFFLOAD_MARK, HostPlan
from .capture_streams import capture_stream
from .chained_buffers import alias_if_fits, chained_sources
from .gradient_homes import home_gradients, roots_homed_after
from .graphed_callable import CapturedCall, CaptureGroup, GraphedCallable, autocast_state, describe_signature
from .host_sync import no_host_sync
from .replay_stream import check_target, recording_joins, replay_target

HOOK_KEYS = ("pre_forward", "forward", "pre_backward", "backward")
TE_HOOK_KEYS = {"forward_pre_hooks": "pre_forward", "forward_hooks": "forward",
                "backward_pre_hooks": "pre_backward", "backward_hooks": "backward"}  # TransformerEngine's names
MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA device: CUDA graphs do not exist on CPU (torch.cuda.is_available() is "
            "False). Train eagerly instead: fully_shard works on CPU without graphs."
        )


def normalize_capture_time_hooks(hooks, count: int) -> list[dict[str, dict]]:
    """One ``{key: {id: fn}}`` per callable, every key present; unknown keys are an error."""
    if hooks is None:
        return [{key: {} for key in HOOK_KEYS} for _ in range(count)]
    hooks = list(hooks)
    if len(hooks) != count:
        raise ValueError(
            f"capture_time_hooks has {len(hooks)} entries for {count} callables; pass one (or None) per callable"
        )
    normalized = []
    for i, entry in enumerate(hooks):
        entry = entry or {}
        if not isinstance(entry, dict):
            raise TypeError(f"capture_time_hooks[{i}] must be a dict like {{'pre_forward': {{id: fn}}}} or None")
        unknown = sorted(set(entry) - set(HOOK_KEYS) - set(TE_HOOK_KEYS))
        if unknown:
            raise ValueError(
                f"capture_time_hooks[{i}]: unknown key(s) {unknown}; the keys are {list(HOOK_KEYS)} (or "
                f"TransformerEngine's {list(TE_HOOK_KEYS)})"
            )
        merged: dict[str, dict] = {key: {} for key in HOOK_KEYS}
        for key, fns in entry.items():
            if not isinstance(fns, dict) or not all(callable(fn) for fn in fns.values()):
                raise TypeError(f"capture_time_hooks[{i}]['{key}'] must be a dict of hook id -> callable")
            if key in TE_HOOK_KEYS:
                merged[TE_HOOK_KEYS[key]].update(
                    ((key, hook_id), _te_style(fn, f"capture_time_hooks[{i}]['{key}'][{hook_id!r}]"))
                    for hook_id, fn in fns.items())
            else:
                merged[key].update(fns)
        normalized.append(merged)
    return normalized


def _te_style(fn: Callable, where: str) -> Callable:
    """A TransformerEngine-style hook, ``fn(module)`` returning None, called as ours of its kind is."""

    def hook(module, *_):
        if fn(module) is not None:
            raise TypeError(
                f"{where} returned a value, but a hook under TransformerEngine's names is called as hook(module) "
                "and must return None. To replace the arguments or the outputs, register it under 'pre_forward' "
                "(module, args, kwargs) -> (args, kwargs) or 'forward' (module, args, outputs) -> outputs instead."
            )

    return hook


def static_copy(x):
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().clone().requires_grad_(x.requires_grad)


def argument_names(args: tuple, kwargs: dict) -> list[str]:
    """'args[0]', "kwargs['mask']", ... for every leaf of (args, kwargs)."""
    names = []
    for path, _ in tree_flatten_with_path((args, kwargs))[0]:
        text = keystr(path)  # "[0][1]" or "[1]['mask']..."
        names.append(("args" if text.startswith("[0]") else "kwargs") + text[3:])
    return names


class CaptureTarget:
    """One callable being captured: its sample, its capture-time hooks, and what capture made."""

    def __init__(self, fn: Callable, name: str, args: tuple, kwargs: dict, hooks: dict[str, dict]) -> None:
        self.fn = fn
        self.module = fn if isinstance(fn, nn.Module) else None
        self.name = name
        self.sample = (tuple(args), dict(kwargs))
        self.hooks = hooks
        self.fwd_graph = self.bwd_graph = None
        self.offload = getattr(self.module, OFFLOAD_MARK, None)  # its ActivationOffload, if offloaded
        self.plan: HostPlan | None = None  # the group's host buffers, when some module is offloaded

    # -- capture-time hooks ----------------------------------------------------------------
    def run_pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for fn in self.hooks["pre_forward"].values():
            result = fn(self.fn, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise TypeError(
                        f"a capture-time pre_forward hook of {self.name} must return None or (args, kwargs)"
                    )
                args, kwargs = result
        return tuple(args), dict(kwargs)

    def run_forward(self, args: tuple, outputs):
        for fn in self.hooks["forward"].values():
            result = fn(self.fn, args, outputs)
            if result is not None:
                outputs = result
        return outputs

    def run_backward_hooks(self, key: str) -> None:
        for fn in self.hooks[key].values():
            fn(self.fn)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters()) if self.module is not None else []

    def parameter_places(self) -> list[tuple[dict, str, str, nn.Parameter]]:
        """Where each parameter the forward reads is held, and which object is there now."""
        if self.module is None:
            return []
        return [
            (sub._parameters, attr, f"{prefix}.{attr}" if prefix else attr, p)
            for prefix, sub in self.module.named_modules(remove_duplicate=False)
            for attr, p in sub._parameters.items()
            if p is not None
        ]


@dataclass
class ForwardPass:
    spec: Any
    leaves: list
    args: tuple
    kwargs: dict
    outputs: Any
    params: list[nn.Parameter]  # what the forward read: stand-ins sharing the parameters' memory
    param_places: list
    real_params: list[nn.Parameter]  # the module's parameters, which autograd sees at replay
    joins: dict  # the JoinEvents the forward recorded (captured: each with its CUDA event)
    offload_call: Any = None  # an offloaded module's call (activation_offload._Call): what it saved
    chained: list = field(default_factory=list)  # input tensor indices that alias the previous module's outputs


def _capturing(graph, pool, stream):
    if graph is None:
        return nullcontext()
    return torch.cuda.graph(graph, pool=pool, stream=stream)


def forward_pass(call: CaptureTarget, graph=None, pool=None, stream=None,
                 chained: dict[int, torch.Tensor] | None = None) -> ForwardPass:
    """``chained``: input tensor index -> the previous module's captured output to read it from
    (``chained_buffers.py``), where the capture sees the same structure, shape and dtype."""
    args, kwargs = tree_map(static_copy, call.sample)
    before_hooks = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    args, kwargs = call.run_pre_forward(args, kwargs)
    flat, spec = tree_flatten((args, kwargs))
    if chained and (spec != tree_flatten(call.sample)[1]
                    or sum(isinstance(x, torch.Tensor) for x in flat) != len(before_hooks)):
        chained = None  # (a hook changed the call's structure: the recorded positions do not apply)
    leaves, aliased, position = [], [], 0
    for x in flat:
        alias = alias_if_fits(x, before_hooks[position], chained.get(position)) \
            if chained and isinstance(x, torch.Tensor) else None
        if alias is not None:
            aliased.append(position)
        leaves.append(static_copy(x) if alias is None else alias)
        position += isinstance(x, torch.Tensor)
    args, kwargs = tree_unflatten(leaves, spec)
    # After the pre-forward hooks: FSDP has swapped its persistent unsharded parameters in.
    params, places = call.parameters(), call.parameter_places()
    # Capture differentiates stand-ins that share the parameters' memory (the graph reads the
    # same addresses), not the parameters: their AccumulateGrad nodes may be alive from eager
    # steps, bound to another stream (a sync that breaks capture), and their tensor hooks must
    # run once, at replay, not inside the graph.
    stand_ins = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in params}
    for holder, attr, _, p in places:
        holder[attr] = stand_ins[id(p)]
    try:
        with recording_joins() as joins, _capturing(graph, pool, stream), _offloaded(call, leaves, graph) as saved:
            outputs = call.fn(*args, **kwargs)
    finally:
        for holder, attr, _, p in places:
            holder[attr] = p
    call.run_forward(args, outputs)
    return ForwardPass(spec, leaves, args, kwargs, outputs, [stand_ins[id(p)] for p in params], places, params, joins,
                       saved, aliased)


def _offloaded(call: CaptureTarget, leaves: list, graph):
    """An offloaded module's forward: its saved tensors go to the group's host buffers (not its
    static inputs, which stay where they are); under capture the copies are recorded."""
    if call.plan is None:  # (not offloaded, or a forward-only graph: nothing is saved)
        return nullcontext()
    keep = frozenset(x.untyped_storage().data_ptr() for x in leaves if isinstance(x, torch.Tensor))
    return call.offload.graph_forward(call.name, call.plan, graph is not None, keep)


def _tensors(fwd: ForwardPass) -> tuple[list, list]:
    """Output tensors; input tensors then parameters (the stand-ins the capture differentiates)."""
    outputs = [o for o in tree_flatten(fwd.outputs)[0] if isinstance(o, torch.Tensor)]
    return outputs, [x for x in fwd.leaves if isinstance(x, torch.Tensor)] + list(fwd.params)


def _differentiable(fwd: ForwardPass) -> tuple[list, list]:
    """Positions (in ``_tensors``) of the outputs and inputs that take part in backward: an
    output returned twice gets a gradient buffer per position."""
    outputs, inputs = _tensors(fwd)
    return [i for i, o in enumerate(outputs) if o.requires_grad], [i for i, x in enumerate(inputs) if x.requires_grad]


def backward_pass(call: CaptureTarget, fwd: ForwardPass, graph=None, pool=None, stream=None,
                  chained: dict[int, torch.Tensor] | None = None):
    """Returns (grad_outputs, grads) for the differentiable outputs and inputs, or None.
    ``chained``: output tensor index -> the next module's static input gradient to read its
    gradient from (``chained_buffers.py``)."""
    call.run_backward_hooks("pre_backward")
    out_positions, in_positions = _differentiable(fwd)
    outputs, inputs = _tensors(fwd)
    result = None
    if out_positions and in_positions:
        chained = chained or {}
        grad_outputs = [  # static: allocated outside the capture, or the next module's input gradient
            chained[i] if i in chained else torch.zeros_like(outputs[i]) for i in out_positions]
        fetching = nullcontext() if fwd.offload_call is None else call.offload.graph_backward(
            fwd.offload_call, graph is not None)  # (its saved tensors back; the previous module's prefetched)
        with _capturing(graph, pool, stream), fetching:
            grads = torch.autograd.grad(
                [outputs[i] for i in out_positions], [inputs[i] for i in in_positions], grad_outputs, allow_unused=True
            )
        result = (grad_outputs, grads)
    call.run_backward_hooks("backward")
    return result


def captured_call(call: CaptureTarget, fwd: ForwardPass, backward, grad_enabled: bool) -> CapturedCall:
    out_leaves, out_spec = tree_flatten(fwd.outputs)
    outputs, inputs = _tensors(fwd)
    static_grad_outputs, static_grad_inputs = [None] * len(outputs), [None] * len(inputs)
    if backward is not None:
        out_positions, in_positions = _differentiable(fwd)
        for i, g in zip(out_positions, backward[0]):
            static_grad_outputs[i] = g
        for i, g in zip(in_positions, backward[1]):
            static_grad_inputs[i] = g
    return CapturedCall(
        name=call.name,
        input_spec=fwd.spec,
        input_leaves=fwd.leaves,
        input_names=argument_names(fwd.args, fwd.kwargs),
        signature=describe_signature(fwd.args, fwd.kwargs),
        positional_tensors_only=not fwd.kwargs and all(isinstance(x, torch.Tensor) for x in fwd.args),
        output_spec=out_spec,
        # Detached: the capture's autograd graph (and the AccumulateGrad nodes it made on the
        # side stream) must not outlive the capture, or replays would sync with that stream.
        output_leaves=[o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves],
        params=fwd.real_params,
        param_places=fwd.param_places,
        fwd_graph=call.fwd_graph,
        bwd_graph=call.bwd_graph if backward is not None else None,
        static_grad_outputs=static_grad_outputs,
        static_grad_inputs=static_grad_inputs,
        autocast=autocast_state(),
        training=call.module.training if call.module is not None else None,
        grad_enabled=grad_enabled,
        join_events=fwd.joins,
    )


@contextmanager
def backward_on_this_thread():
    """Warm-ups and captures run their backward on the calling thread, not on autograd's device
    thread: cuBLAS keeps a workspace (32 MiB on Hopper) per (thread, stream) for the process's life
    and a graph keeps the one it captured with, so a capture stream whose forward and backward ran
    on two threads would hold two. Same kernels and streams either way."""
    with torch.autograd.set_multithreading_enabled(False):
        yield


@contextmanager
def gc_paused():
    """A collection during capture can free tensors into the wrong pool: none runs meanwhile."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _hook_problems(module: nn.Module) -> list[str]:
    """Hooks a capture would bake in: on submodules (their Python would never run again) and
    global module hooks. A tensor hook on a parameter would run inside the captured backward
    and again when the gradient is accumulated at replay."""
    problems = [
        f"'{name}' has {attr}" for name, sub in module.named_modules() if sub is not module
        for attr in MODULE_HOOK_DICTS if getattr(sub, attr)
    ]
    from torch.nn.modules import module as module_mod

    problems += [f"global {attr}" for attr in ("_global_forward_pre_hooks", "_global_forward_hooks",
                                               "_global_backward_pre_hooks", "_global_backward_hooks")
                 if getattr(module_mod, attr, None)]
    problems += [f"parameter '{name}' has a tensor hook (register_hook)" for name, p in module.named_parameters()
                 if getattr(p, "_backward_hooks", None)]
    return problems


def _check_arguments(modules: list, sample_args, sample_kwargs, num_warmup_iters: int) -> tuple[list, list]:
    if not modules:
        raise ValueError("make_graphed_callables: no callables given")
    for i, fn in enumerate(modules):
        if not callable(fn):
            raise TypeError(f"modules[{i}] is a {type(fn).__name__}, not a module or callable")
        if isinstance(fn, nn.Module):
            if isinstance(fn.__dict__.get("forward"), GraphedCallable):
                raise ValueError(f"modules[{i}] ({type(fn).__name__}) is already graphed; capture each module once")
            hooked = [name for name in MODULE_HOOK_DICTS if getattr(fn, name)]
            if hooked:
                raise ValueError(
                    f"modules[{i}] ({type(fn).__name__}) has hooks registered ({', '.join(hooked)}); capturing "
                    "would bake them into the graph. Use fsdp_graph.graph_modules, which moves them to "
                    "capture-time hooks, or remove them and pass them as capture_time_hooks."
                )
            problems = _hook_problems(fn)
            if problems:
                raise ValueError(
                    f"modules[{i}] ({type(fn).__name__}): {'; '.join(problems)}. A graph replays kernels, not Python: "
                    "such hooks would run at capture only, or twice per replay. Remove them before capture, "
                    "register them on the graphed module itself (graph_modules runs those eagerly), or use "
                    "register_post_accumulate_grad_hook on parameters."
                )
    if len({id(fn) for fn in modules}) != len(modules):
        raise ValueError("make_graphed_callables: a callable appears twice; capture each one once")
    sample_args = list(sample_args)
    if len(sample_args) != len(modules):
        raise ValueError(
            f"sample_args has {len(sample_args)} entries for {len(modules)} callables; pass one tuple per callable"
        )
    for i, args in enumerate(sample_args):
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"sample_args[{i}] must be a tuple of positional arguments, e.g. (x,), not {type(args).__name__}"
            )
    sample_kwargs = [None] * len(modules) if sample_kwargs is None else list(sample_kwargs)
    if len(sample_kwargs) != len(modules):
        raise ValueError(
            f"sample_kwargs has {len(sample_kwargs)} entries for {len(modules)} callables; "
            "pass one dict (or None) per callable"
        )
    if not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(
            f"num_warmup_iters must be an int >= 1, got {num_warmup_iters!r}: lazy CUDA state (cuBLAS "
            "handles, autotuning) must exist before capture"
        )
    return sample_args, [dict(k or {}) for k in sample_kwargs]


def _check_devices(calls: list[CaptureTarget]) -> None:
    for call in calls:
        leaves = tree_flatten(call.sample)[0]
        names = argument_names(*call.sample)
        for name, x in zip(names, leaves):
            if isinstance(x, torch.Tensor) and x.device.type != "cuda":
                raise ValueError(f"{call.name}: sample input {name} is on {x.device}; CUDA graphs need CUDA tensors")


def make_graphed_callables(
    modules: Sequence[Callable] | Callable,
    sample_args: Sequence[tuple],
    *,
    sample_kwargs: Sequence[dict | None] | None = None,
    num_warmup_iters: int = 3,
    capture_time_hooks: Sequence[dict | None] | None = None,
    pre_warmup_hook: Callable[[], None] | None = None,
    post_warmup_hook: Callable[[], None] | None = None,
    pool=None,
    replay_stream: torch.cuda.Stream | None = None,
    join_event=None,
) -> list[GraphedCallable] | GraphedCallable:
    """Capture each callable's forward and backward as CUDA graphs; return one replaying callable each.

    ``modules`` is a list of modules (without hooks of their own) or plain functions, with one
    tuple of sample positional arguments each in ``sample_args`` (a single callable and a single
    tuple also work, and return a single callable). Sample tensors are copied, so one sample may
    serve several callables; they fix the shapes, dtypes and ``requires_grad`` flags every
    replay must match. All graphs share ``pool`` (a fresh one if None) and must be replayed in
    capture order: forwards in list order, backwards in reverse. See the module docstring for
    ``capture_time_hooks``; ``pre_warmup_hook`` and ``post_warmup_hook`` run once around the
    warm-up. ``replay_stream`` / ``join_event`` (one ``JoinEvent``, or one per callable): where the
    graphs replay by default (``replay_stream.py``; ``replay_on`` overrides it per call).
    """
    single = not isinstance(modules, (list, tuple))
    if single:
        modules, sample_args = [modules], [sample_args]
        sample_kwargs = None if sample_kwargs is None else [sample_kwargs]
        capture_time_hooks = None if capture_time_hooks is None else [capture_time_hooks]
    modules = list(modules)
    names = [f"modules[{i}] ({type(fn).__name__})" for i, fn in enumerate(modules)]
    graphed = capture_callables(
        modules, names, sample_args, sample_kwargs, num_warmup_iters, capture_time_hooks,
        pre_warmup_hook, post_warmup_hook, pool,
        eager=[fn.forward if isinstance(fn, nn.Module) else None for fn in modules],
        replay_stream=replay_stream, join_event=join_event,
    )
    return graphed[0] if single else graphed


def capture_callables(
    modules: list, names: list[str], sample_args, sample_kwargs, num_warmup_iters: int, capture_time_hooks,
    pre_warmup_hook, post_warmup_hook, pool, eager: list, forward_only: bool = False, *,
    replay_stream=None, join_event=None, links=None,
) -> list[GraphedCallable]:
    """``make_graphed_callables`` with names for error messages and each module's eager forward.
    ``forward_only``: capture forward graphs only, under ``torch.no_grad()`` (evaluation).
    ``links``: ``graph_modules``' ``chained_inputs`` (``chained_buffers.py``)."""
    sample_args, sample_kwargs = _check_arguments(modules, sample_args, sample_kwargs, num_warmup_iters)
    targets = default_targets(replay_stream, join_event, names)
    hooks = normalize_capture_time_hooks(capture_time_hooks, len(modules))
    calls = [
        CaptureTarget(fn, name, a, k, h)
        for fn, name, a, k, h in zip(modules, names, sample_args, sample_kwargs, hooks)
    ]
    require_cuda("make_graphed_callables")
    _check_devices(calls)
    where = f"graphed {', '.join(names) if len(names) <= 3 else names[0] + f' (and {len(names) - 1} more)'}"
    plan = _own_offload(calls, where, forward_only)
    try:
        return _capture(calls, num_warmup_iters, pre_warmup_hook, post_warmup_hook, pool, eager, forward_only,
                        targets, where, plan, links)
    except BaseException:
        for call in calls:
            if call.plan is not None:
                call.offload.owned.discard(id(call.module))
        raise


def _own_offload(calls: list[CaptureTarget], where: str, forward_only: bool) -> HostPlan | None:
    """Offloaded modules' training graphs record their offload, from one plan of host buffers per
    group; their offload hooks step aside from now on."""
    offloaded = [call for call in calls if call.offload is not None]
    if forward_only or not offloaded:
        return None
    plan = HostPlan(where)
    for call in offloaded:
        call.plan = plan
        call.offload.owned.add(id(call.module))
    return plan


def _capture(calls: list[CaptureTarget], num_warmup_iters: int, pre_warmup_hook, post_warmup_hook, pool,
             eager: list, forward_only: bool, targets: list, where: str, plan: HostPlan | None, links) -> list:
    group = CaptureGroup()
    homed = None if pool is not None or forward_only or plan is not None else _homing(calls)
    torch.cuda.synchronize()
    stream = group.capture_stream = capture_stream(None, group)  # (one no live graph set of ours shares)
    stream.wait_stream(torch.cuda.current_stream())
    with (gc_paused(), backward_on_this_thread(), torch.cuda.stream(stream),
          torch.no_grad() if forward_only else nullcontext()):
        if pre_warmup_hook is not None:
            pre_warmup_hook()
        for i in range(num_warmup_iters):
            with no_host_sync(where, enabled=i > 0):  # the first pass may initialise lazily
                if plan is not None:
                    plan.start_pass()
                passes = [forward_pass(call) for call in calls]
                for call, fwd in zip(reversed(calls), reversed(passes)):
                    if not forward_only:
                        backward_pass(call, fwd)
                del passes
        if post_warmup_hook is not None:
            post_warmup_hook()
        torch.cuda.synchronize()

        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        for call in calls:
            call.fwd_graph, call.bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        if plan is not None:
            plan.start_pass()
        try:
            passes, backwards = capture_pass(
                calls, links, forward_only, pool, stream,
                after_backward=None if homed is None else lambda i: home_gradients(homed.get(i, []), group, i,
                                                                                   pool, stream))
            for call, fwd, target in zip(calls, passes, targets):  # (refused before anything is pinned or installed)
                check_target(target, fwd.joins, f"graphed {call.name}", stream.device)
        except BaseException:
            group.homes.drop()
            raise
    torch.cuda.current_stream().wait_stream(stream)
    for call in calls:
        if call.module is not None:  # its graphs hold its parameters' addresses from now on
            pin_addresses(call.module, "make_graphed_callables")
    graphed = [
        GraphedCallable(captured_call(call, fwd, bwd, not forward_only), eager=e, module=call.module, group=group)
        for call, fwd, bwd, e in zip(calls, passes, backwards, eager)
    ]
    for runner, target in zip(graphed, targets):
        runner.replay_default, runner.device = target, stream.device
    link_chains(graphed, passes)
    if plan is not None:
        _link_prefetches(graphed, passes, plan)
    return graphed


def _homing(calls: list[CaptureTarget]) -> dict[int, list]:
    """After which backward capture each FSDP unit's sharded gradients take their home in the pool
    (``gradient_homes.py``): that of the first module in call order that reads its parameters, the last
    of them captured. The unit's reduce follows that module's backward, and the modules called before
    it replay their backwards later, from memory captured later, which the home then holds. (A module
    without the unit's parameters could be called before all of them: it does not count.) A root
    that reduces in pieces between the graphs: after that of the first module of its model
    (``roots_homed_after``)."""
    first: dict[int, tuple] = {}
    units_per_call: list[list] = []
    for i, call in enumerate(calls):
        owners = {id(u): u for u in map(master_owner, call.parameters()) if u is not None}
        units_per_call.append(list(owners.values()))
        if len(owners) == 1:
            unit = next(iter(owners.values()))
            first.setdefault(id(unit), (i, unit))
    homed: dict[int, list] = {}
    for i, unit in first.values():
        homed.setdefault(i, []).append(unit)
    for i, roots in roots_homed_after(units_per_call).items():
        homed.setdefault(i, []).extend(roots)
    return homed


def capture_pass(calls: list[CaptureTarget], links, forward_only: bool, pool=None, stream=None,
                 capturing: bool = True, after_backward=None) -> tuple[list[ForwardPass], list]:
    """Forwards in call order, then backwards in reverse, into ``calls``' graphs (emulated graphs in
    CPU tests: ``capturing=False``); inputs and output gradients chained as ``links`` say;
    ``after_backward(i)`` once module ``i``'s backward is captured and its hooks have run."""
    passes: list[ForwardPass] = []
    for i, call in enumerate(calls):
        chained = chained_sources(links[i], _tensors(passes[-1])[0]) if links and i else None
        passes.append(forward_pass(call, call.fwd_graph if capturing else None, pool, stream, chained))
    backwards: list = [None] * len(calls)
    for i in reversed(range(len(calls))):
        if not forward_only:
            chained = _gradients_of_chained(passes, backwards, links, i) if links else None
            backwards[i] = backward_pass(calls[i], passes[i], calls[i].bwd_graph if capturing else None, pool, stream,
                                         chained)
            if after_backward is not None:
                after_backward(i)
    return passes, backwards


def link_chains(graphed: list[GraphedCallable], passes: list[ForwardPass]) -> None:
    for previous, runner, fwd in zip(graphed, graphed[1:], passes[1:]):
        if fwd.chained:
            runner.chain_to(previous, fwd.chained)


def _gradients_of_chained(passes: list[ForwardPass], backwards: list, links, i: int) -> dict[int, torch.Tensor]:
    """Output tensor index of module ``i`` -> the static gradient the next module's backward wrote
    for the input that aliases it (where there is one: that input needed a gradient)."""
    if i + 1 >= len(passes) or backwards[i + 1] is None:
        return {}
    following = passes[i + 1]
    _, in_positions = _differentiable(following)
    grads = dict(zip(in_positions, backwards[i + 1][1]))
    return {k: grads[j] for j, k in links[i + 1] if j in following.chained and grads.get(j) is not None}


def _link_prefetches(graphed: list[GraphedCallable], passes: list[ForwardPass], plan: HostPlan) -> None:
    """Which backward graph brings whose offloaded tensors back (the prefetch it recorded), so a
    replay out of that order is refused; the group keeps the host buffers as long as its graphs."""
    by_call = {id(fwd.offload_call): runner for fwd, runner in zip(passes, graphed) if fwd.offload_call is not None}
    for fwd, runner in zip(passes, graphed):
        fetcher = fwd.offload_call.fetched_by if fwd.offload_call is not None else None
        if fetcher is not None:
            runner.prefetched_by = by_call[id(fetcher)]
            runner.prefetched_by.prefetches = runner
    graphed[0].group.host_plan = plan


def default_targets(replay_stream, join_event, names: list[str]) -> list:
    """One checked ``ReplayTarget`` (or None) per callable, from ``replay_stream`` and ``join_event``
    (one ``JoinEvent`` for all callables, or a sequence with one per callable)."""
    events = join_event if isinstance(join_event, (list, tuple)) else [join_event] * len(names)
    if len(events) != len(names):
        raise ValueError(f"join_event has {len(events)} entries for {len(names)} modules; pass one per module, or one")
    return [replay_target(replay_stream, e, f"graphing {name}") for name, e in zip(names, events)]
