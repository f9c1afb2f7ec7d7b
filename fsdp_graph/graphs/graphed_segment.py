"""A segment at replay: k consecutive FSDP blocks, their FSDP steps inside one forward and one backward graph.

Installed as each block's ``forward`` by ``graph_segments`` (``segment_graphs.py``), so the model
keeps calling its blocks one by one. The first block's call replays the forward graph (every
block of the segment, with their all-gathers) and returns its own output; each later block's call
checks that it gets the previous block's output and the first block's other arguments, and returns
its own. Anything else would be a block computed from another input than the one it was given: it
raises. One autograd function spans the segment; its backward replays the backward graph (the
blocks' backward with their unshards and reduce-scatters, each unit's summed shard parked in a
buffer shared by the segments) and then adds the parked shards into the masters' ``.grad`` as the
eager reduce does (``UnitGradients.accumulate_parked``: ``zero_grad``, a replaced ``.grad``, the
divide factor and post-accumulate-grad hooks behave as eagerly).

The graphs depend on no Python state outside them (``docs/segment_graphs.md``). What the replay
does around them, and why:

* the caller's stream first waits on FSDP's side streams: eager collectives of other units use the
  same staging and slots, and the graph's own side-stream branches wait only on the caller's stream;
* afterwards the slots the graph wrote are marked as its units' (``claim_slots``), so a unit that
  believed its data was still in one gathers again;
* before the backward: ``no_sync`` is refused (the graph reduces at every backward);
* chained segments (``chained_buffers.py``): a segment whose first input is read where the
  previous segment wrote its output refuses another tensor there (a copy would overwrite that
  output), and the previous segment refuses a forward while this one's backward is pending.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..fsdp.capture_interface import FSDPUnit, ShardState, in_backward, run_as_forward
from .backward_probe import CONSUMERS, engine_runs, probe_input, returnable
from .chained_buffers import forward_refused, overwrite_refused
from .frozen_arguments import changed_since_capture, same
from .graphed_callable import CaptureGroup, autocast_state, describe_signature, recompute_refused, start_backward
from .replay_stream import launch, whole_target

NO_SYNC_FIX = "graph these blocks with segment_size=1 (GraphConfig(strategy='layer')), whose reduce runs eagerly"


class GraphedSegment:
    """One segment's graphs, static tensors and replay (see the module docstring)."""

    def __init__(self, name: str, modules: list[nn.Module], units: list[FSDPUnit], group: CaptureGroup) -> None:
        self.name = name
        self.modules = modules
        self.units = units
        self.group = group
        self.index = len(group.members)
        group.members.append(self)
        self.eager: list[Callable] = [m.forward for m in modules]  # the blocks' own forwards
        self.streams = units[0]._streams
        self.device = units[0].device
        self.replays = 0  # forward replays so far
        self.replay_default = None  # a ReplayTarget (replay_stream= given when graphing)
        # Set by the capture (``segment_graphs.py``):
        self.fwd_graph = self.bwd_graph = None
        self.input_spec = None
        self.input_leaves: list = []  # static tensors and frozen non-tensors of the first block's call
        self.input_names: list[str] = []
        self.signature = ""
        self.static_outputs: list[torch.Tensor] = []
        self.static_grad_outputs: list[torch.Tensor] = []  # [the last block's output gradient]
        self.static_grad_inputs: list = []  # per input tensor: its gradient, or None
        self.training = True
        self.autocast = (False, None)
        self.trainable: list[list[bool]] = []  # per unit, per parameter: requires_grad at capture
        self.parked: list[torch.Tensor] = []  # per unit: where its reduce leaves its summed shard
        self.claims_forward: list[tuple] = []  # (slot buffers, unit) the forward graph leaves in each slot
        self.claims_backward: list[tuple] = []
        # Per call:
        self._pending: weakref.ref | None = None  # the autograd node of a forward awaiting its backward
        self._outputs: tuple | None = None  # this forward's outputs, until the last block has had its own
        self._rest: tuple | None = None  # the first block's arguments after the first
        self._output_versions: list[int] = []
        self._complete = False  # every block of this forward's segment was called (its backward covers them all)
        self._grad_zero = False  # the static gradient of the last output is known to hold zeros
        # Chained boundaries (set by the capture): the segment whose last output this one's first input
        # aliases, and the one whose first input aliases this one's last output (and whose backward writes
        # the gradient this one's backward reads).
        self.chain_source: GraphedSegment | None = None
        self.chained_reader: GraphedSegment | None = None

    def finish_capture(self) -> None:
        self._tensor_positions = [i for i, x in enumerate(self.input_leaves) if isinstance(x, torch.Tensor)]
        self.static_inputs = [self.input_leaves[i] for i in self._tensor_positions]
        self._constants = [(i, x) for i, x in enumerate(self.input_leaves) if not isinstance(x, torch.Tensor)]

    # -- the blocks' calls -------------------------------------------------------------------
    def call(self, position: int, args: tuple, kwargs: dict):
        module = self.modules[position]
        if not torch.is_grad_enabled() or module.training != self.training:
            self._outputs = self._rest = None
            return run_as_forward(module, self.eager[position], args, kwargs)  # (evaluation: its steps by hand)
        if position == 0:
            return self._forward(args, kwargs)
        outputs = self._outputs
        if (outputs is None or not args or args[0] is not outputs[position - 1]
                or args[0]._version != self._output_versions[position - 1]):
            raise RuntimeError(
                f"{self._block(position)} was called with another input than the output of the block before it in "
                f"its segment ({self.name}), or with that output changed in place, while the segment's graph "
                "computed it from that output as it was. The blocks of a segment must run one after the other, "
                "each on the previous one's output (x = block(x)). Change the code between them, or graph these "
                "blocks with a smaller segment_size (1: each block on its own)."
            )
        rest_args, rest_kwargs = self._rest
        if len(args) - 1 != len(rest_args) or kwargs.keys() != rest_kwargs.keys() or not all(
            a is b or (not isinstance(a, torch.Tensor) and same(a, b))
            for a, b in zip((*args[1:], *kwargs.values()), (*rest_args, *(rest_kwargs[k] for k in kwargs)))
        ):
            raise RuntimeError(
                f"{self._block(position)} was called with other arguments (besides its input) than the first block "
                f"of its segment ({self.name}); the segment's graph gave every block the first block's. Pass the "
                "same objects to every block, or graph these blocks with segment_size=1."
            )
        output = outputs[position]
        if position == len(self.modules) - 1:
            self._outputs = self._rest = None  # (held until every block has had its output)
            self._complete = True
        return output

    def _block(self, position: int) -> str:
        return f"block {position} ({type(self.modules[position]).__name__}) of segment {self.name}"

    def _forward(self, args: tuple, kwargs: dict) -> torch.Tensor:
        if in_backward():
            raise RuntimeError(recompute_refused(f"segment {self.name}"))
        if autocast_state() != self.autocast:
            raise RuntimeError(
                f"segment {self.name}: autocast is {autocast_state()} but was {self.autocast} at capture; the graph "
                "replays the kernels chosen then. Call it under the same autocast setting."
            )
        self._outputs = self._rest = None  # (a forward that stopped early: its outputs no longer held here)
        tensors = self._live_inputs(args, kwargs)
        self._check_trainable()
        if self.chain_source is not None or self.chained_reader is not None:
            self._check_chain(tensors[0])
        if self._pending is not None and self._pending() is not None:
            raise RuntimeError(
                f"segment {self.name}: forward called again while the previous forward's backward is still pending; "
                "its activations live in the graph's memory and would be overwritten. Run backward first, or drop "
                "every reference to the previous output's autograd graph."
            )
        target = whole_target(self.replay_default, f"segment {self.name}", self.device)
        self.group.homes.vacate(f"segment {self.name}")  # (the forward may write any home)
        outputs = _SegmentReplay.apply(self, target, *tensors, probe_input(torch.is_grad_enabled()))
        self._outputs = outputs
        self._rest = (args[1:], kwargs)
        self._complete = len(self.modules) == 1
        return outputs[0]

    def _live_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        flat, spec = tree_flatten((args, kwargs))
        if spec != self.input_spec:
            raise ValueError(
                f"segment {self.name}: called with {describe_signature(args, kwargs)}, but it was captured with "
                f"{self.signature}. A graph replays one call signature: pass the same arguments as the sample."
            )
        for i, frozen in self._constants:
            if not same(flat[i], frozen):
                raise ValueError(changed_since_capture(f"segment {self.name}", self.input_names[i], flat[i], frozen))
        tensors = [flat[i] for i in self._tensor_positions]
        for i, (live, static) in enumerate(zip(tensors, self.static_inputs)):
            if isinstance(live, torch.Tensor) and live.requires_grad != static.requires_grad:
                raise ValueError(
                    f"segment {self.name}: input {self.input_names[self._tensor_positions[i]]} has requires_grad="
                    f"{live.requires_grad}, but was captured with requires_grad={static.requires_grad}: the graph "
                    "computes the gradients the sample called for. Call it as sampled (x.requires_grad_() on a "
                    "hidden state from frozen embeddings), or graph the blocks again with such a sample."
                )
            if not (isinstance(live, torch.Tensor) and live.shape == static.shape and live.dtype == static.dtype
                    and live.device == static.device):
                got = (f"shape {tuple(live.shape)}, {live.dtype}, requires_grad={live.requires_grad}"
                       if isinstance(live, torch.Tensor) else type(live).__name__)
                raise ValueError(
                    f"segment {self.name}: input {self.input_names[self._tensor_positions[i]]} is {got}, but the "
                    f"graph was captured with shape {tuple(static.shape)}, {static.dtype}, requires_grad="
                    f"{static.requires_grad}. A CUDA graph replays fixed shapes: pad the input to the captured "
                    "shape, or leave these blocks eager."
                )
        return tensors

    def _check_chain(self, hidden: torch.Tensor) -> None:
        """The first input, where chained, must be the previous segment's output in place (no copy over
        it); this forward must not overwrite the output the next segment reads while its backward is
        pending."""
        reader = self.chained_reader
        if reader is not None and reader.backward_pending():
            raise RuntimeError(forward_refused(f"segment {self.name}", f"segment {reader.name}"))
        static = self.static_inputs[0]
        if self.chain_source is not None and (hidden.data_ptr() != static.data_ptr()
                                              or hidden.stride() != static.stride()):
            raise RuntimeError(overwrite_refused(f"segment {self.name}", self.input_names[0],
                                                 f"segment {self.chain_source.name}"))

    def _check_trainable(self) -> None:
        for unit, flags in zip(self.units, self.trainable):
            if any(p.master.requires_grad is not flag for p, flag in zip(unit.params, flags)):
                raise RuntimeError(
                    f"segment {self.name}: which parameters of FSDP unit {unit.name} require a gradient changed "
                    "since the capture, which fixed the gradients the graph computes and reduces. Freeze or "
                    "unfreeze parameters before graphing: build the model and the step again after the change."
                )

    # -- around the replays ----------------------------------------------------------------
    def claim_slots(self, claims: list[tuple]) -> None:
        """The graph wrote these slots: whoever believed its data was there gathers again."""
        for buffers, unit in claims:
            owner = buffers.param_owner
            if owner is not unit.param_group:
                if owner is not None:
                    if owner.state is ShardState.UNSHARDED:
                        raise RuntimeError(
                            f"segment {self.name}: FSDP unit {owner.name} holds its parameters unsharded (module."
                            "unshard()) in a slot the segment's graph has just written. Call its reshard() before "
                            "running the segment's blocks."
                        )
                    owner.evict()
                buffers.param_owner = unit.param_group

    def backward_pending(self) -> bool:
        return self._pending is not None and self._pending() is not None

    def refuse_no_sync(self) -> None:
        for unit in self.units:
            if not unit.requires_gradient_sync or unit.grads.accumulation_pending:
                raise RuntimeError(
                    f"segment {self.name}: FSDP unit {unit.name} accumulates without synchronising (no_sync or "
                    "set_requires_gradient_sync(False)), but the segment's backward graph reduce-scatters at every "
                    f"backward. For gradient accumulation, {NO_SYNC_FIX}."
                )

    def accumulate_parked(self) -> None:
        """After the backward replay, on the stream the replay joined: each unit's parked shard into
        its masters' ``.grad``, last unit first as eager reduces them (post-accumulate-grad hooks run in
        that order); the next segment's replay waits on this stream before it writes the buffer."""
        for unit, parked in zip(reversed(self.units), reversed(self.parked)):
            unit.grads.accumulate_parked(parked)

    def copy_grad_outputs(self, grads: tuple) -> None:
        """The last block's output gradient into the static buffer the backward graph reads. The graph
        takes no gradient for the other blocks' outputs (each feeds the next block inside the graph):
        one that got a gradient from outside the segment is refused, not dropped."""
        inner = [i for i, grad in enumerate(grads[:-1]) if grad is not None]
        if inner:
            raise RuntimeError(
                f"segment {self.name}: the output of {self._block(inner[0])} got a gradient from outside the "
                "segment (a loss or other code that reads it besides the next block), but the segment's backward "
                "graph takes a gradient only for its last block's output. Choose segment_size so that this block "
                "ends a segment, or graph these blocks with graph_modules."
            )
        grad, static = grads[-1], self.static_grad_outputs[0]
        if grad is None:
            if not self._grad_zero:
                static.zero_()
                self._grad_zero = self.chained_reader is None  # (chained: the reader's backward writes it)
        elif grad.data_ptr() != static.data_ptr():
            static.copy_(grad)
            self._grad_zero = False


class _SegmentReplay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, segment: GraphedSegment, target, *args: torch.Tensor | None):
        *inputs, probe = args
        ctx.segment, ctx.target, ctx.probed = segment, target, probe is not None
        ctx.set_materialize_grads(False)
        # Eager collectives of other units share the staging and slots (this also waits on replays that
        # joined early, as ``begin_call`` does).
        segment.streams.wait_for_all()
        for live, static in zip(inputs, segment.static_inputs):
            if live.data_ptr() != static.data_ptr():
                static.copy_(live)
        launch(segment.fwd_graph, target)
        segment.claim_slots(segment.claims_forward)
        segment.replays += 1
        segment._pending = weakref.ref(ctx)
        segment._output_versions = [o._version for o in segment.static_outputs]
        return tuple(o.detach() for o in segment.static_outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        segment: GraphedSegment = ctx.segment
        if not (ctx.probed and engine_runs(ctx.next_functions[-1][0])):
            raise RuntimeError(
                f"segment {segment.name}: its backward runs under torch.autograd.grad or backward(inputs=...), "
                "which accumulate into none of its blocks' parameters (or only some), but the segment's backward "
                "graph reduce-scatters every block's gradients into the sharded gradients. Run loss.backward() "
                "through segments, or graph these blocks per layer (segment_size=1, or graph_modules), whose "
                "backward leaves the parameters alone there, as eager does."
            )
        start_backward(segment, ctx, f"segment {segment.name}")
        if not segment._complete:
            raise RuntimeError(
                f"segment {segment.name}: its forward stopped before its last block (a block skipped, called with "
                "gradients off or in the other mode), but its backward graph runs every block's backward and would "
                "give the skipped blocks' parameters zero gradients where eager leaves them None. Run every block "
                "of a segment, or graph blocks that may be skipped with segment_size=1."
            )
        segment.refuse_no_sync()
        segment.streams.wait_for_all()
        segment.copy_grad_outputs(grads)
        launch(segment.bwd_graph, ctx.target)
        segment.accumulate_parked()
        segment.claim_slots(segment.claims_backward)
        return (None, None, *returnable(segment.static_grad_inputs, ctx.next_functions, True), None)


CONSUMERS.add(_SegmentReplay._backward_cls)  # (copies the gradient it is given into its static buffer, keeps nothing)
