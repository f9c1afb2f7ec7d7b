"""``graph_segments``: k consecutive FSDP blocks per forward graph and per backward graph, their FSDP steps inside.

For models whose per-layer graphs are host-bound (small blocks): the host's work per block
(hooks, collective replays, events) falls by about k, while the model's code between segments
still runs eagerly. Design and measurements: ``docs/segment_graphs.md``.

For every segment (``segment_size`` consecutive modules of ``modules``, in execution order):

1. Checks, before any capture: each module is an FSDP unit of its own (``fully_shard(block)``),
   with no unit inside it, at fixed addresses, idle, with no hooks but FSDP's, not graphed yet;
   every unit under one root; a capturable device.
2. One parking buffer for every segment: a unit's reduce inside a segment's graph leaves its
   summed shard there, and the replay adds it into ``.grad`` afterwards, in Python as eagerly, so
   the sharded gradients follow ``zero_grad`` as FSDP2's do instead of staying pinned.
3. Warm-up, on the capture stream, with the units' hooks live and no prefetch leaving the segment:
   ``num_warmup_iters`` eager passes, every segment's forward in order, then every backward in
   reverse. The first one also finds parameters that get no gradient (refused: the graph would
   give them zeros where eager gives None).
4. Capture, as the whole step captures (``whole_graph.py``): the hooks run during the capture, so
   the all-gathers and reduce-scatters are recorded on FSDP's side streams, which join the capture
   stream at the end of each graph. Forwards in order, backwards in reverse, into one memory pool.
   Where ``chained_inputs`` says a segment's first block received the previous block's output
   itself, the segment reads it where the previous segment's graph writes it, and the previous
   segment reads its output gradient where this one's backward writes its input's
   (``chained_buffers.py``): no static copy of either.
5. Install: the units' hooks come off their modules for good, each module's ``forward`` becomes
   its place in the segment (``graphed_segment.py``), and nothing outside a segment prefetches
   its units any more. The root's steps stay eager between the segments, but a root that reduces
   in pieces replays each piece's reduce-scatter as a collective graph (``replayable_roots``;
   ``collective_graphs=False`` keeps them eager), with its write into the root's sharded gradients,
   homed in the segments' pool after the backward capture of its first segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack, contextmanager

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..fsdp.capture_interface import (
    FSDPUnit,
    TrainingState,
    enclosing_unit,
    master_owner,
    pin_addresses,
    replay_collectives,
    replayable_roots,
    require_fixed_addresses,
    root_contexts,
    unit_hooks,
    units_in,
    unused_on_every_rank,
)
from .activation_offload import refuse_offloaded
from .capture import argument_names, backward_on_this_thread, require_cuda, static_copy
from .capture_streams import capture_stream
from .chained_buffers import Links, alias_if_fits
from .frozen_arguments import same
from .gradient_homes import home_gradients, roots_homed_after
from .graphed_callable import CaptureGroup, GraphedCallable, autocast_state, describe_signature
from .graphed_segment import GraphedSegment
from .host_sync import no_host_sync
from .replay_stream import replay_target
from .reroute import seal_submodule_hooks
from .whole_graph import capture_whole

SEGMENT_MARK = "_fsdp_graph_segment"  # on a block of a segment: its GraphedSegment
_ALIGN = 256  # bytes: each unit's parked shard starts aligned, as the allocator's blocks do
_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def in_segment(module: nn.Module) -> bool:
    return SEGMENT_MARK in module.__dict__


def refuse_segmented(modules: Sequence[nn.Module], names: Sequence[str], what: str) -> None:
    for module, name in zip(modules, names):
        unit = enclosing_unit(module)
        if any(in_segment(sub) for sub in module.modules()) or (unit is not None and unit.segmented):
            raise ValueError(
                f"{what}: {name} is, contains or is inside a block of a segment graph (graph_segments), whose FSDP "
                "steps run inside the segment's graphs. Graph it with one kind of graph only: evaluate these blocks "
                "eagerly (they run their FSDP steps by hand with gradients off) or graph the whole forward "
                "(GraphConfig(forward_only='model'))."
            )


class _SegmentRunner:
    """A block's ``forward`` once it belongs to a segment: its place in the segment."""

    __slots__ = ("segment", "position")

    def __init__(self, segment: GraphedSegment, position: int) -> None:
        self.segment, self.position = segment, position

    def __call__(self, *args, **kwargs):
        return self.segment.call(self.position, args, kwargs)


def _unit_of_block(module: nn.Module, name: str) -> FSDPUnit:
    """The module's own FSDP unit, or an error naming the fix."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"graph_segments expects nn.Module objects; {name} is a {type(module).__name__}")
    unit = enclosing_unit(module)
    if unit is None or unit.module is not module:
        raise ValueError(
            f"graph_segments: {name} ({type(module).__name__}) is not an FSDP unit of its own. A segment captures "
            "its blocks' FSDP steps, so each block must be one: call fsdp_graph.fully_shard(block) on every block "
            "(then on the root), or use graph_modules for modules inside a unit."
        )
    inner = [u for u in units_in(module) if u is not unit]
    if inner:
        raise ValueError(f"graph_segments: {name} contains FSDP unit {inner[0].name}; segment the inner blocks instead")
    require_fixed_addresses(unit, f"graph_segments: {name}")
    if unit.state is not TrainingState.IDLE:
        raise ValueError(
            f"graph_segments: FSDP unit {unit.name} is in {unit.state.value}; graph between training steps."
        )
    if not unit.requires_gradient_sync or unit.grads.accumulation_pending:
        raise ValueError(
            f"graph_segments: FSDP unit {unit.name} accumulates gradients without synchronising (no_sync or "
            "set_requires_gradient_sync(False)); the capture would record no reduce-scatter. Graph after a "
            "synchronised backward, outside no_sync."
        )
    if not unit.reshard_after_backward:
        raise ValueError(
            f"graph_segments: FSDP unit {unit.name} keeps its parameters gathered after backward "
            "(set_reshard_after_backward(False)), which a segment graph does not replay. Leave it at True."
        )
    if any(isinstance(sub.__dict__.get("forward"), (GraphedCallable, _SegmentRunner)) for sub in module.modules()):
        raise ValueError(f"graph_segments: {name} is, or contains, a graphed module; graph each block once, one way")
    foreign = [n for n, p in module.named_parameters() if master_owner(p) is not unit]
    if foreign:
        raise ValueError(
            f"graph_segments: {name} reads parameter '{foreign[0]}', which its FSDP unit {unit.name} does not own "
            "(tied to another unit, or not sharded): the segment would compute with it without gathering it, and "
            "its gradient would be lost. Untie it, or graph this block with graph_modules."
        )
    foreign = [f"{attr}: {getattr(fn, '__name__', fn)!r}" for attr in ("_forward_pre_hooks", "_forward_hooks")
               for fn in getattr(module, attr).values() if fn not in unit_hooks]
    foreign += [attr for attr in ("_backward_pre_hooks", "_backward_hooks") if getattr(module, attr)]
    if foreign:
        raise ValueError(
            f"graph_segments: {name} has hooks of its own ({', '.join(foreign)}). A segment replays its blocks' "
            "kernels, not their Python, so they would run only at capture. Remove them, or graph this block "
            "with graph_modules, which runs a graphed module's hooks eagerly."
        )
    return unit


def graph_segments(
    modules: Sequence[nn.Module],
    sample_args: Sequence[tuple],
    *,
    segment_size: int,
    sample_kwargs: Sequence[dict | None] | None = None,
    num_warmup_iters: int = 3,
    pool=None,
    replay_stream: torch.cuda.Stream | None = None,
    chained_inputs: Links | None = None,
    collective_graphs: bool | None = None,
) -> list[GraphedSegment]:
    """Graph ``modules`` (FSDP blocks, in the order the model calls them, e.g. ``list(model.blocks)``)
    ``segment_size`` at a time, each segment as one forward and one backward graph with its FSDP
    steps inside; install them in place. Call between training steps, after ``fully_shard`` on
    every block and the root. ``sample_args`` / ``sample_kwargs``: one per module, as for
    ``graph_modules`` (only each segment's first is used: the blocks after it get the previous
    block's output and the first block's other arguments). Returns the segments, in order.

    The model's code stays as it is (``x = block(x)``); the blocks of a segment must run one after
    another, each on the previous one's output. Segments replay on the current stream, or on
    ``replay_stream`` (``replay_on`` overrides it per call), joined at their end.

    ``chained_inputs``: ``record_sample_args(modules, run).links``, as for ``graph_modules``. Where
    a segment's first block received the previous block's output itself, the two segments share
    that buffer and its gradient's (``chained_buffers.py``), and a call passing another tensor there
    is refused; ``make_train_step`` passes them unless ``GraphConfig(chain_static_buffers=False)``.

    ``collective_graphs``: the root's steps stay eager between the segments; a root that reduces in
    pieces through the shared staging replays each piece's reduce-scatter as a small graph, as
    ``graph_modules(collective_graphs=)`` does (False: eagerly, timed by NCCL's watchdog; None:
    as an earlier call chose for the root, else on).
    """
    if not isinstance(segment_size, int) or isinstance(segment_size, bool) or segment_size < 1:
        raise ValueError(f"graph_segments: segment_size must be an int >= 1, got {segment_size!r}")
    if collective_graphs is not None and not isinstance(collective_graphs, bool):
        raise TypeError(f"graph_segments: collective_graphs must be True, False or None, got {collective_graphs!r}")
    if not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(f"graph_segments: num_warmup_iters must be an int >= 1, got {num_warmup_iters!r}")
    modules = list(modules)
    if not modules:
        raise ValueError("graph_segments: no modules given")
    sample_args = list(sample_args)
    kwargs_list = [None] * len(modules) if sample_kwargs is None else list(sample_kwargs)
    if len(sample_args) != len(modules) or len(kwargs_list) != len(modules):
        raise ValueError(
            f"graph_segments: {len(modules)} modules, {len(sample_args)} sample_args and {len(kwargs_list)} "
            "sample_kwargs; pass one of each per module"
        )
    if chained_inputs is not None and len(chained_inputs) != len(modules):
        raise ValueError(
            "graph_segments: chained_inputs needs one list of pairs per module (record_sample_args(...).links); "
            f"got {len(chained_inputs)} for {len(modules)} modules."
        )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("graph_segments: a module appears twice; list each block once, in execution order")
    names = [f"module {i}" for i in range(len(modules))]
    refuse_offloaded(modules, names, graphs_own_offload=False)
    units = [_unit_of_block(m, name) for m, name in zip(modules, names)]
    contexts = list({id(c): c for u in units for c in root_contexts(u.module)}.values())
    if len(contexts) != 1:
        raise ValueError("graph_segments: the modules belong to different FSDP roots; graph each model's blocks "
                         "in a call of its own")
    ranges = [(start, min(start + segment_size, len(modules))) for start in range(0, len(modules), segment_size)]
    segment_names = [f"modules {start}..{end - 1}" if end - start > 1 else f"module {start}" for start, end in ranges]
    for (start, end), name in zip(ranges, segment_names):
        first = (tuple(sample_args[start]), dict(kwargs_list[start] or {}))
        for i in range(start + 1, end):
            _same_call(name, first, (tuple(sample_args[i]), dict(kwargs_list[i] or {})), i - start)
    require_cuda("graph_segments")
    on_cpu = [u.name for u in units if u.device.type != "cuda"]
    if on_cpu:
        raise ValueError(f"graph_segments: FSDP unit {on_cpu[0]} is on the CPU; CUDA graphs need the model on a GPU")
    default = replay_target(replay_stream, None, "graph_segments")
    group = CaptureGroup()
    segments = []
    for (start, end), name in zip(ranges, segment_names):
        segment = GraphedSegment(name, modules[start:end], units[start:end], group)
        segment.replay_default = default
        _set_sample(segment, tuple(sample_args[start]), dict(kwargs_list[start] or {}))
        segments.append(segment)
    chained = [bool(start) and chained_inputs is not None and (0, 0) in chained_inputs[start] for start, _ in ranges]
    try:
        _capture(segments, chained, contexts, num_warmup_iters, pool)
    except BaseException:
        group.homes.drop()
        raise
    for segment in segments:
        _install(segment)
    replay_collectives(replayable_roots(contexts), collective_graphs)  # (the root's steps stay outside them)
    return segments


def _set_sample(segment: GraphedSegment, args: tuple, kwargs: dict) -> None:
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
        raise ValueError(
            f"graph_segments: segment {segment.name}'s sample must pass the hidden state as the first positional "
            "argument, a tensor that requires grad: the segment's backward hands its gradient back, and each later "
            "block receives the previous block's output there. Record the sample from a real forward (make_train_step "
            "does), call x.requires_grad_() on a hidden state from frozen embeddings, or use graph_modules."
        )
    leaves, spec = tree_flatten((args, kwargs))
    for name, x in zip(argument_names(args, kwargs), leaves):
        if isinstance(x, torch.Tensor) and x.device.type != "cuda":
            raise ValueError(
                f"graph_segments: segment {segment.name}'s sample {name} is on {x.device}; pass CUDA tensors"
            )
    segment.input_spec, segment.input_leaves = spec, [static_copy(x) for x in leaves]
    segment.input_names, segment.signature = argument_names(args, kwargs), describe_signature(args, kwargs)
    segment.training = segment.modules[0].training
    segment.autocast = autocast_state()


def _same_call(segment: str, first: tuple, later: tuple, position: int) -> None:
    """A later block of a segment is called like the first (the graph gives it the first one's arguments
    besides its input): the same structure, tensors of the same shape and dtype, equal constants."""
    (first_args, first_kwargs), (args, kwargs) = first, later
    flat_first, spec_first = tree_flatten((first_args[1:], first_kwargs))
    flat, spec = tree_flatten((tuple(args)[1:], kwargs))
    alike = spec == spec_first and len(args) == len(first_args) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        else not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and same(a, b)
        for a, b in zip(flat, flat_first))
    if alike and args and isinstance(args[0], torch.Tensor) and isinstance(first_args[0], torch.Tensor):
        alike = (args[0].shape, args[0].dtype) == (first_args[0].shape, first_args[0].dtype)
    if not alike:
        raise ValueError(
            f"graph_segments: block {position} of segment {segment} is called with other arguments than the "
            "segment's first block (its samples differ), but a segment gives every block the first block's "
            "arguments besides the hidden state. Segment only blocks that are called alike (one kind of layer), "
            "e.g. modules=<the decoder layer class>, or graph them with graph_modules."
        )


def _sample_call(segment: GraphedSegment) -> tuple[tuple, dict]:
    return tree_unflatten(segment.input_leaves, segment.input_spec)


def _run_forward(segment: GraphedSegment) -> list[torch.Tensor]:
    """The segment's blocks, eagerly with their hooks (in a capture: recorded), from the static inputs."""
    _evict(segment)
    args, kwargs = _sample_call(segment)
    outputs, x = [], args[0]
    for position, module in enumerate(segment.modules):
        x = module(x, *args[1:], **kwargs)
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"graph_segments: block {position} of segment {segment.name} returned a {type(x).__name__}; a "
                "segment chains blocks that return one tensor (the next block's input). Graph these blocks with "
                "graph_modules instead."
            )
        outputs.append(x)
    segment.streams.wait_for_all()  # FSDP's side streams join (in a capture: the capture stream)
    return outputs


def _run_backward(segment: GraphedSegment, outputs: list[torch.Tensor]) -> list:
    _evict(segment)  # the backward gathers every unit itself, the last one too
    args, kwargs = _sample_call(segment)
    inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    for x in inputs:
        x.grad = None
    torch.autograd.backward(outputs[-1:], segment.static_grad_outputs)  # (only the last leaves the segment)
    stuck = [u.name for u in segment.units if u.state is not TrainingState.IDLE]
    if stuck:
        raise RuntimeError(
            f"graph_segments: FSDP unit {stuck[0]} of segment {segment.name} did not finish its backward (its "
            "inputs got no gradient). Graph blocks whose input is the previous block's output."
        )
    segment.streams.wait_for_all()
    return [x.grad if x.requires_grad else None for x in inputs]


def _evict(segment: GraphedSegment) -> None:
    """The units' data is not trusted to be in their slots: each pass gathers it itself."""
    for unit in segment.units:
        unit.param_group.evict()


@contextmanager
def _prefetch_inside(segments: list[GraphedSegment]):
    """During warm-up and capture each unit prefetches only its neighbour inside its segment."""
    saved = [(u, u.forward_prefetch, u.backward_prefetch) for s in segments for u in s.units]
    for segment in segments:
        units = segment.units
        for i, unit in enumerate(units):
            unit.forward_prefetch = units[i + 1:i + 2]
            unit.backward_prefetch = units[i - 1:i] if i else []
    try:
        yield
    finally:
        for unit, forward, backward in saved:
            unit.forward_prefetch, unit.backward_prefetch = forward, backward


@contextmanager
def _fresh_unsharded(units: list[FSDPUnit]):
    """During warm-up and capture the units compute with new unsharded parameter objects on the same
    memory (the graphs read the same addresses): the originals' AccumulateGrad nodes may be alive,
    bound to the stream of the eager steps (a loss the user still holds), and a capture that
    accumulates through them would have to wait on that stream, which breaks it."""
    saved = [(p, p.unsharded) for u in units for p in u.params if p.unsharded is not None]
    for param, original in saved:
        param.unsharded = nn.Parameter(original.detach(), requires_grad=original.requires_grad)
    try:
        yield
    finally:
        for param, original in saved:
            original.requires_grad_(param.unsharded.requires_grad)  # (a change followed during the warm-up)
            param.unsharded = original


def _park(segments: list[GraphedSegment]) -> None:
    """One buffer, as large as the largest segment's shards, and each segment's view of it per unit:
    where the unit's reduce leaves its summed shard (reduce dtype) until the replay accumulates it.
    Segments replay one after another, each accumulating before the next one's graph writes it."""
    def sizes(segment: GraphedSegment) -> list[tuple[int, torch.dtype, int]]:
        return [(u.grads.layout.shard_numel, u.param_group.dtypes.reduce,
                 -(-u.grads.layout.shard_numel * u.param_group.dtypes.reduce.itemsize // _ALIGN) * _ALIGN)
                for u in segment.units]

    with torch.inference_mode(False):
        buffer = torch.empty(max(sum(n for *_, n in sizes(s)) for s in segments), dtype=torch.uint8,
                             device=segments[0].device)
    for segment in segments:
        segment.parked, offset = [], 0
        for numel, dtype, nbytes in sizes(segment):
            segment.parked.append(buffer[offset:offset + numel * dtype.itemsize].view(dtype))
            offset += nbytes


@contextmanager
def _parking(units: list[FSDPUnit], parked: list[torch.Tensor]):
    for unit, buffer in zip(units, parked):
        unit.grads.parking = buffer
    try:
        yield
    finally:
        for unit in units:
            unit.grads.parking = None


def _capture(segments: list[GraphedSegment], chained: list[bool], contexts: list, num_warmup_iters: int,
             pool) -> None:
    _park(segments)
    units = [u for s in segments for u in s.units]
    with _parking(units, [b for s in segments for b in s.parked]):
        _warm_up_and_capture(segments, chained, units, contexts, num_warmup_iters, pool)


def _chain_input(segment: GraphedSegment, previous: GraphedSegment, output: torch.Tensor) -> None:
    """Before ``segment``'s forward capture: its first input becomes a leaf on ``previous``'s captured
    last output (its static copy is dropped), where the layouts agree."""
    alias = alias_if_fits(segment.input_leaves[0], segment.input_leaves[0], output)
    if alias is not None:
        segment.input_leaves[0] = alias
        segment.chain_source, previous.chained_reader = previous, segment


def _chain_gradient(segment: GraphedSegment, output: torch.Tensor) -> None:
    """Before ``segment``'s backward capture: it reads its last output's gradient where the reader's
    backward graph (captured already) writes its input's gradient."""
    reader = segment.chained_reader
    grad = None if reader is None else reader.static_grad_inputs[0]
    if grad is not None and (grad.shape, grad.dtype, grad.stride()) == (output.shape, output.dtype, output.stride()):
        segment.static_grad_outputs = [grad]


def _warm_up_and_capture(segments: list[GraphedSegment], chained: list[bool], units: list[FSDPUnit],
                         contexts: list, num_warmup_iters: int, pool) -> None:
    torch.cuda.synchronize()
    group = segments[0].group
    stream = group.capture_stream = capture_stream(segments[0].device, group)  # (one no live set of ours shares)
    where = f"graph_segments ({len(segments)} segments)"
    with ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx.outside_training_step())
            stack.enter_context(ctx.end_of_backward_deferred())
        stack.enter_context(_prefetch_inside(segments))
        stack.enter_context(_fresh_unsharded(units))
        stack.enter_context(torch.cuda.stream(stream))
        stack.enter_context(backward_on_this_thread())  # (one cuBLAS workspace for the capture stream)
        for segment in segments:
            segment.static_grad_outputs = None
        for i in range(num_warmup_iters):
            with no_host_sync(where, enabled=i > 0):
                passes = [_run_forward(s) for s in segments]
                for segment, outputs in zip(segments, passes):
                    if segment.static_grad_outputs is None:
                        segment.static_grad_outputs = [torch.zeros_like(outputs[-1])]
                if i == 0:
                    for unit in units:
                        unit.grads.clear()  # (so the reduce notes which parameters got no gradient)
                for segment, outputs in zip(reversed(segments), reversed(passes)):
                    _run_backward(segment, outputs)
                del passes
            if i == 0:
                _refuse_unused(units)
        own_pool = pool is None
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        captured = []
        for i, segment in enumerate(segments):
            if chained[i]:
                _chain_input(segment, segments[i - 1], captured[-1][-1])
            segment.fwd_graph, outputs = capture_whole(
                f"graph_segments: forward of segment {segment.name}", lambda s=segment: _run_forward(s), contexts,
                stream, pool)
            captured.append(outputs)
            segment.claims_forward = _claims(segment.units)
        roots = roots_homed_after([segment.units for segment in segments])  # (a root that reduces in pieces)
        for i, segment, outputs in zip(reversed(range(len(segments))), reversed(segments), reversed(captured)):
            _chain_gradient(segment, outputs[-1])
            segment.bwd_graph, segment.static_grad_inputs = capture_whole(
                f"graph_segments: backward of segment {segment.name}", lambda s=segment, o=outputs: _run_backward(s, o),
                contexts, stream, pool)
            if own_pool:  # (its activations freed: the units' gradients from that memory, gradient_homes.py)
                assert segment.group.members[i] is segment  # (the index a home's guard reads from)
                home_gradients(segment.units + roots.get(i, []), segment.group, i, pool, stream)
            segment.static_outputs = [o.detach() for o in outputs]
            segment.claims_backward = _claims(list(reversed(segment.units)))
        del captured
    torch.cuda.current_stream().wait_stream(stream)
    for segment in segments:
        segment.trainable = [[p.master.requires_grad for p in u.params] for u in segment.units]
        segment.finish_capture()


def _claims(units: list[FSDPUnit]) -> list[tuple]:
    """(slot, unit) for each slot, the last of ``units`` to use it."""
    last = {}
    for unit in units:
        buffers = unit.param_group.buffers  # (a dedicated buffer is its unit's anyway: a no-op claim)
        if buffers is not None:
            last[id(buffers)] = (buffers, unit)
    return list(last.values())


def _refuse_unused(units: list[FSDPUnit]) -> None:
    """After the first warm-up backward (every ``.grad`` None before it): a parameter that no rank gave a
    gradient would get zeros from the graph, where eager leaves ``.grad`` None. Every rank decides alike."""
    for unit, unused in zip(units, unused_on_every_rank([u.grads for u in units])):
        if unused:
            names = ", ".join(unit.params[i].name for i in sorted(unused))
            raise ValueError(
                f"graph_segments: parameter(s) {names} of FSDP unit {unit.name} got no gradient in the warm-up on "
                "any rank. A segment's backward graph reduces every parameter and would give them zeros, where "
                "eager training leaves .grad None. Graph these blocks with graph_modules (per layer), or leave the "
                "unused parameters out of the model."
            )


def _install(segment: GraphedSegment) -> None:
    for position, (module, unit) in enumerate(zip(segment.modules, segment.units)):
        for attr in _FORWARD_HOOK_DICTS:  # (only FSDP's, checked before the capture)
            getattr(module, attr).clear()
        unit.param_group.evict()
        unit.segmented = True
        module.__dict__[SEGMENT_MARK] = segment
        module.forward = _SegmentRunner(segment, position)
        pin_addresses(module, "graph_segments")
        seal_submodule_hooks(module, f"block {position} of segment {segment.name}")
