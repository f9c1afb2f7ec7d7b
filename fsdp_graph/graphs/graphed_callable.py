"""A captured callable at replay: live inputs into static inputs, replay, gradients back to autograd.

A CUDA graph replays fixed kernels on fixed addresses. Everything here exists so that a replay
either computes exactly what the eager call would have, or refuses loudly:

* live inputs are *copied* into the static inputs the graph reads (rebinding a name would
  leave the graph reading stale data), after a check of shape, dtype, device and
  ``requires_grad`` against what was captured; non-tensor arguments were frozen into the graph,
  so they must equal the captured ones;
* the module must still hold the very parameter objects (and addresses) the graph was captured
  with: FSDP's persistent unsharded parameters, or a plain module's own parameters;
* one backward per forward: the backward graph reads the activations the forward graph left
  in the shared pool, so a second forward before that backward (or a backward without its
  forward) would silently use the wrong activations. A forward whose autograd graph is gone
  (its outputs were dropped) no longer counts as pending;
* gradients go back to autograd as the static gradient tensors themselves where autograd hands them
  straight to a consumer that keeps nothing (another replay's backward, the AccumulateGrad of a leaf
  without hooks, which copies or adds since this object references them), and as copies everywhere
  else (``autograd.grad`` returns them to its caller; AccumulateGrad would adopt a view of one as
  ``.grad``): no ``.grad`` and no returned gradient ever aliases a buffer the next replay overwrites
  (``backward_probe.py``). A tensor hook on a graphed module's input or output (or a node hook
  between two graphs) may be shown a static buffer: one that keeps it must clone it.

The graphs only need a ``replay()`` method, which is what lets the checks run in CPU tests.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..fsdp.capture_interface import GradHomes, in_backward
from .backward_probe import CONSUMERS, engine_runs, probe_input, returnable
from .chained_buffers import forward_refused, overwrite_refused
from .frozen_arguments import changed_since_capture, same
from .gradient_handoff import hand_over, plan_handoffs
from .replay_stream import ReplayTarget, begin_call, check_target, chosen_target, launch


@dataclass
class CapturedCall:
    """What one capture produced (see ``capture.py``)."""

    name: str
    input_spec: TreeSpec  # of (args, kwargs), as the graphed forward received them
    input_leaves: list  # static input tensors and the frozen non-tensor values, flattened
    input_names: list[str]  # e.g. "args[0]", "kwargs['mask']", per leaf
    signature: str  # the call's structure, for error messages
    positional_tensors_only: bool  # every argument a tensor, no keywords: the fast path applies
    output_spec: TreeSpec
    output_leaves: list  # static output tensors and frozen non-tensor outputs
    params: list[nn.Parameter]  # the module's parameters the graphs read, unique, in order
    param_places: list[tuple[dict, str, str, nn.Parameter]]  # (module._parameters, attribute, name, object) at capture
    fwd_graph: Any  # has .replay()
    bwd_graph: Any | None  # None when nothing needed a gradient at capture
    static_grad_outputs: list  # per output tensor: its static gradient, None if not differentiable
    static_grad_inputs: list  # per input tensor then per parameter: static gradient or None
    training: bool | None  # the module's mode at capture (None for plain callables)
    autocast: tuple = (False, None)  # (enabled, dtype) at capture: kernels were chosen under it
    grad_enabled: bool = True  # False: a forward-only (evaluation) graph, captured under no_grad
    join_events: dict = field(default_factory=dict)  # JoinEvent -> the CUDA event its forward graph records


class CaptureGroup:
    """The callables captured together into one memory pool, in capture order.

    Backward graphs were captured in reverse order, each free to reuse memory that the
    activations of the backwards captured before it occupied. So a backward may only replay
    when no callable captured *after* it still awaits its own backward."""

    def __init__(self) -> None:
        self.members: list[GraphedCallable] = []
        self.capture_stream = None  # the stream its graphs were captured on (capture_streams.py)
        self.host_plan = None  # activation offload: the pinned buffers the graphs copy to and from
        # The member whose offloaded tensors the last prefetching backward brought back into the pool.
        # Any forward replay of the group may overwrite them, and clears it. A backward that prefetches
        # nothing leaves it: while the reader's backward is pending, check_backward_order lets only the
        # backwards of members captured between the reader and the prefetcher run (the prefetcher was
        # checked when it ran), and those were captured while the prefetched tensors were alive.
        self.prefetched_for: GraphedCallable | None = None
        self.homes = GradHomes()  # units' sharded gradients homed in the pool (gradient_homes.py)

    def pending_from(self, index: int):
        """The first member from ``index`` on (in capture order) whose forward replayed and whose
        backward has not yet: its saved activations are still to be read. None if there is none."""
        for member in self.members[index:]:
            if member.backward_pending():
                return member
        return None

    def check_backward_order(self, runner: GraphedCallable) -> None:
        later = self.pending_from(runner.index + 1)
        if later is not None:
            raise RuntimeError(
                f"graphed {runner.name}: its backward runs before the backward of {later.name}, which was "
                "captured after it into the same memory pool and whose saved activations it may overwrite. "
                "Capture modules in the order their forwards run (pass them to graph_modules in "
                "execution order), or capture them in separate calls."
            )


class GraphedCallable:
    """Callable returned by ``make_graphed_callables``; ``graph_modules`` installs it as the
    module's ``forward``. A module whose training mode differs from capture runs ``eager`` (the
    original forward, or the graphed callable of the other mode), as does a forward-only graph
    called with gradients enabled."""

    def __init__(self, captured: CapturedCall, eager: Callable | None = None, module: nn.Module | None = None,
                 group: CaptureGroup | None = None) -> None:
        c = captured
        self.group = group or CaptureGroup()
        self.index = len(self.group.members)
        self.group.members.append(self)
        self.replays = 0  # forward replays so far
        self.name = c.name
        self.captured = c
        self.eager = eager
        self.module = module
        self._tensor_positions = [i for i, x in enumerate(c.input_leaves) if isinstance(x, torch.Tensor)]
        self.static_inputs = [c.input_leaves[i] for i in self._tensor_positions]
        self._constants = [(i, x) for i, x in enumerate(c.input_leaves) if not isinstance(x, torch.Tensor)]
        self._n_tensors = len(self.static_inputs)
        self._output_tensor_positions = [i for i, x in enumerate(c.output_leaves) if isinstance(x, torch.Tensor)]
        self.static_outputs = [c.output_leaves[i] for i in self._output_tensor_positions]
        self._single_output = c.output_spec.is_leaf() and len(self.static_outputs) == 1
        self._non_differentiable = [i for i, g in enumerate(c.static_grad_outputs) if g is None]
        self.params = c.params
        self._param_checks = [
            (places, attr, qualified, param, param.data_ptr(), param.requires_grad)
            for places, attr, qualified, param in c.param_places
        ]
        self._has_backward = c.bwd_graph is not None
        self._any_trainable = any(p.requires_grad for p in self.params)  # (checked unchanged at every call)
        # Parameter gradients the backward hands to their FSDP units instead of autograd (gradient_handoff.py).
        self._handoffs = plan_handoffs(self.params, module, c.static_grad_inputs, self._n_tensors) \
            if self._has_backward else []
        self._pending: weakref.ref | None = None  # the autograd node of a forward awaiting its backward
        self._output_versions: list[int] = []
        self.replay_default: ReplayTarget | None = None  # replay_stream= / join_event= given when graphing
        self.device: torch.device | None = None  # where it was captured (None: emulated graphs, in tests)
        # Activation offload: the graph whose backward brings this one's saved tensors back (recorded
        # in its capture), and the one whose tensors this one's backward brings back.
        self.prefetched_by: GraphedCallable | None = None
        self.prefetches: GraphedCallable | None = None
        # Chained static buffers (chained_buffers.py): the inputs read where chain_source writes its outputs,
        # and the graph that reads this one's outputs in place.
        self.chain_source: GraphedCallable | None = None
        self.chained_inputs: frozenset[int] = frozenset()
        self.chained_reader: GraphedCallable | None = None

    def chain_to(self, source: GraphedCallable, positions: list[int]) -> None:
        self.chain_source, self.chained_inputs = source, frozenset(positions)
        source.chained_reader = self

    def _check_chain(self, inputs) -> None:
        """A chained input must be ``chain_source``'s output in place (then the replay copies nothing):
        a copy would overwrite that output, which anyone may still read (a detached alias leaves no
        trace). And this forward must not overwrite its output while the graph reading it in place
        still awaits its backward."""
        reader = self.chained_reader
        if reader is not None and reader.backward_pending():
            raise RuntimeError(forward_refused(self.name, reader.name))
        for i in self.chained_inputs:
            live, static = inputs[i], self.static_inputs[i]
            if live.data_ptr() != static.data_ptr() or live.stride() != static.stride():
                name = self.captured.input_names[self._tensor_positions[i]]
                raise RuntimeError(overwrite_refused(self.name, name, self.chain_source.name))

    # -- the call ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.eager is not None and (
            (self.module is not None and self.module.training != self.captured.training)  # dropout differs
            or (not self.captured.grad_enabled and torch.is_grad_enabled())  # no backward graph
        ):
            return self.eager(*args, **kwargs)
        if in_backward():
            raise RuntimeError(recompute_refused(f"graphed {self.name}"))
        if autocast_state() != self.captured.autocast:
            raise RuntimeError(
                f"graphed {self.name}: autocast is {autocast_state()} but was {self.captured.autocast} at capture; "
                "the graph replays the kernels (and dtypes) chosen then. Call it under the same autocast "
                "setting, or capture again."
            )
        inputs = self._live_inputs(args, kwargs)
        self._check_params()
        self._check_no_pending_backward()
        if self.chain_source is not None or self.chained_reader is not None:
            self._check_chain(inputs)
        target = chosen_target(self.replay_default)
        check_target(target, self.captured.join_events, f"graphed {self.name}", self.device)
        track = self._has_backward and torch.is_grad_enabled()
        self.group.homes.vacate(f"graphed {self.name}")  # (the forward may write any home: grad_homes.py)
        probe = probe_input(track and (self._any_trainable or any(x.requires_grad for x in inputs)))
        outputs = _Replay.apply(self, track, target, *inputs, *self.params, probe)
        if self._single_output:
            return outputs[0]
        leaves = list(self.captured.output_leaves)
        for i, out in zip(self._output_tensor_positions, outputs):
            leaves[i] = out
        return tree_unflatten(leaves, self.captured.output_spec)

    def _live_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if self.captured.positional_tensors_only and not kwargs and len(args) == self._n_tensors:
            tensors = args
        else:
            flat, spec = tree_flatten((args, kwargs))
            if spec != self.captured.input_spec:
                raise ValueError(
                    f"graphed {self.name}: called with {describe_signature(args, kwargs)}, but it was captured "
                    f"with {self.captured.signature}. A graph replays one call signature: pass the same "
                    "positional and keyword arguments as the sample."
                )
            for i, frozen in self._constants:
                if not same(flat[i], frozen):
                    raise ValueError(
                        changed_since_capture(f"graphed {self.name}", self.captured.input_names[i], flat[i], frozen)
                    )
            tensors = [flat[i] for i in self._tensor_positions]
        grad_matters = torch.is_grad_enabled()
        for i, (live, static) in enumerate(zip(tensors, self.static_inputs)):
            if not (
                isinstance(live, torch.Tensor)
                and live.shape == static.shape
                and live.dtype == static.dtype
                and live.device == static.device
                and (not grad_matters or live.requires_grad == static.requires_grad)
            ):
                raise ValueError(self._mismatch(self.captured.input_names[self._tensor_positions[i]], live, static))
        return tensors

    def _mismatch(self, name: str, live, static: torch.Tensor) -> str:
        def describe(t) -> str:
            if not isinstance(t, torch.Tensor):
                return f"{type(t).__name__} {t!r}"
            return f"shape {tuple(t.shape)}, {t.dtype}, {t.device}, requires_grad={t.requires_grad}"

        return (
            f"graphed {self.name}: input {name} does not match the captured sample: expected "
            f"{describe(static)}, got {describe(live)}. A CUDA graph replays fixed shapes: pad the input "
            "to the captured shape, capture once per shape, or leave this module eager."
        )

    def _check_params(self) -> None:
        for places, attr, name, param, ptr, requires_grad in self._param_checks:
            current = places.get(attr)
            if current is not param or current.data_ptr() != ptr or current.requires_grad != requires_grad:
                raise RuntimeError(
                    f"graphed {self.name}: parameter '{name}' is not the tensor the graph was captured with "
                    "(replaced, moved, or requires_grad changed). Call the module itself, module(...), so "
                    "FSDP's hooks swap the persistent unsharded parameters in; after changing parameters, "
                    "capture again."
                )

    def backward_pending(self) -> bool:
        return self._pending is not None and self._pending() is not None

    def _check_no_pending_backward(self) -> None:
        if self.backward_pending():
            raise RuntimeError(
                f"graphed {self.name}: forward called again while the previous forward's backward is still "
                "pending. Its activations live in the graph's static buffers and would be overwritten. Run "
                "backward first, or drop every reference to the previous output's autograd graph (detach "
                "tensors you keep for logging)."
            )

    def _start_backward(self, node) -> None:
        if self.prefetched_by is not None and self.group.prefetched_for is not self:
            raise RuntimeError(
                f"graphed {self.name}: its offloaded activations are brought back from host memory by the backward "
                f"graph of {self.prefetched_by.name} (the prefetch, one module ahead, was captured into that graph), "
                "which did not replay since the group's last forward replay (skipped, or run eagerly because its "
                "training mode differs from its capture), or a forward graph of the group or another prefetching "
                "backward replayed in between and may have overwritten them. Run the graphed modules' forwards and "
                "backwards in the order they were captured, or leave this module out of the offload selection."
            )
        start_backward(self, node, f"graphed {self.name}")


def start_backward(runner, node, what: str) -> None:
    """The checks before a backward replay of ``runner`` (a graphed callable or a segment): it is the
    backward of the last forward, whose outputs were not modified since, and no graph captured
    after it into the same pool awaits its own backward."""
    if runner._pending is None or runner._pending() is not node:
        raise RuntimeError(
            f"{what}: backward without a matching forward (backward run twice for one forward, e.g. "
            "retain_graph=True). A graphed forward supports exactly one backward."
        )
    if any(o._version != v for o, v in zip(runner.static_outputs, runner._output_versions)):
        raise RuntimeError(
            f"{what}: an output was modified in place after the forward; the backward graph may read it (as "
            "eager autograd would refuse). Clone the output before modifying it."
        )
    runner.group.check_backward_order(runner)
    runner._pending = None


def autocast_state() -> tuple:
    enabled = torch.is_autocast_enabled("cuda")
    return enabled, torch.get_autocast_dtype("cuda") if enabled else None


def recompute_refused(what: str) -> str:
    return (
        f"{what}: its forward ran inside a backward (activation checkpointing's recompute). A graph keeps its "
        "activations in its memory pool for the whole step, so checkpointing a graphed module saves no memory, and "
        "a forward replayed inside the backward would overwrite pool memory the backward still needs (other "
        "graphs' gradients, the sharded gradients' homes). Leave graphed modules out of activation checkpointing "
        "(HF: gradient_checkpointing_disable()), or graph only the modules you do not checkpoint."
    )


def describe_signature(args: tuple, kwargs: dict) -> str:
    return f"{len(args)} positional argument(s) and keyword arguments {sorted(kwargs)}"


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: GraphedCallable, track: bool, target: ReplayTarget | None, *args: torch.Tensor | None):
        *inputs, probe = args  # (the probe last: next_functions[i] stays the i-th input's edge)
        ctx.runner, ctx.target, ctx.probed = runner, target, probe is not None
        ctx.set_materialize_grads(False)
        begin_call()
        for live, static in zip(inputs, runner.static_inputs):  # (on the caller's stream, which owns them)
            if live.data_ptr() != static.data_ptr():  # (a chained input never: _check_chain)
                static.copy_(live)
        launch(runner.captured.fwd_graph, target, runner.captured.join_events)
        runner.replays += 1
        runner.group.prefetched_for = None
        if track:
            runner._pending = weakref.ref(ctx)
            runner._output_versions = [o._version for o in runner.static_outputs]
        outputs = tuple(o.detach() for o in runner.static_outputs)
        if runner._non_differentiable:
            ctx.mark_non_differentiable(*(outputs[i] for i in runner._non_differentiable))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        runner: GraphedCallable = ctx.runner
        runner._start_backward(ctx)
        begin_call()
        for grad, static in zip(grads, runner.captured.static_grad_outputs):
            if static is None:
                continue
            if grad is None:
                static.zero_()
            elif grad.data_ptr() != static.data_ptr():
                static.copy_(grad)
        launch(runner.captured.bwd_graph, ctx.target)  # joins at the end: autograd reads the gradients now
        if runner.prefetches is not None:  # (a backward captured between a prefetch and its reader keeps it)
            runner.group.prefetched_for = runner.prefetches
        edges = ctx.next_functions
        plain = ctx.probed and engine_runs(edges[-1][0])
        grads = runner.captured.static_grad_inputs
        if runner._handoffs:
            grads = hand_over(runner._handoffs, grads, edges, plain)
        return (None, None, None, *returnable(grads, edges, plain), None)


CONSUMERS.add(_Replay._backward_cls)  # (copies the gradient it is given into its static buffer, keeps nothing)
