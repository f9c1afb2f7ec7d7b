"""Parameters that got no gradient end a backward with ``.grad = None``, as in PyTorch, DDP and FSDP2.

A unit reduces all of its parameters in one reduce-scatter, each rank sending zeros for those it
gave no gradient. A parameter that no rank gave one (an unused head, an MoE expert without
tokens, a skipped layer) would therefore come out with ``.grad = zeros``, and weight decay or
momentum would move it where the reference leaves it alone. So each unit records which
parameters got a gradient since its last reduce (``GradientUse``), and at the end of the backward
the ranks exchange one flag per parameter (``settle_unused``): a parameter no rank used gets
``.grad = None`` on every rank. Design and cost: ``docs/unused_parameters.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from .collective_graphs import CollectiveGraphCaptureError, can_replay
from .collectives import all_reduce, collective_failed
from .sharded_grads import run_post_accumulate_hooks


class GradientUse:
    """One unit's record: which trainable parameters got a gradient since its last reduce, and
    which ones that reduce left waiting for the ranks' decision."""

    def __init__(self) -> None:
        self.used: set[int] = set()  # parameter indices that got a gradient since the last reduce
        self.pending: list[int] | None = None  # a reduce ran: its candidates (None: no reduce to settle)
        self.unused: frozenset[int] = frozenset()  # the last decision: no rank gave these a gradient
        self.decided_from: tuple[int, ...] | None = None  # the candidates that decision was made for

    def note(self, indices: Iterable[int]) -> None:
        self.used.update(indices)

    def take_candidates(self, trainable: Sequence[int], current: Sequence) -> list[int]:
        """At a reduce: the trainable parameters no backward since the last reduce gave a gradient,
        whose master had no ``.grad`` before it (``current``). Starts the next period."""
        used, self.used = self.used, set()
        self.pending = [i for i, grad in zip(trainable, current) if grad is None and i not in used]
        return self.pending

    def forget_pending(self) -> None:
        """After a step that failed on every rank: no reduce of it waits for a decision. What earlier
        ``no_sync`` backwards used stays, as their sum does (``UnitGradients.clear`` drops both)."""
        self.pending = None

    def snapshot(self) -> tuple:
        return set(self.used), self.pending, self.unused, self.decided_from

    def restore(self, snapshot: tuple) -> None:
        used, self.pending, self.unused, self.decided_from = snapshot
        self.used = set(used)


class ExchangeGraphs:
    """The root's use exchange replayed (``_exchange_replayed``): collective graphs spawned in a
    replaying unit's pool, and one persistent int32 buffer per data-parallel group, sized for every
    parameter of the root's units in that group, so that its address (the graph's key) is the same
    whichever of them reduced, on every step and every rank's schedule alike."""

    def __init__(self, graphs) -> None:
        self.graphs = graphs
        self._flags: dict[tuple, torch.Tensor] = {}

    def flags(self, key: tuple, capacity: int, device: torch.device, streams) -> torch.Tensor:
        flags = self._flags.get(key)
        if flags is None or flags.numel() < capacity:
            flags = self._flags[key] = torch.ones(capacity, dtype=torch.int32, device=device)
            streams.shared_with_side_streams(flags)  # (a graph on the reduce stream reads and writes it)
        return flags


def settle_unused(units: Sequence, streams=None, exchange: ExchangeGraphs | None = None) -> None:
    """At the end of a backward: decide, for every unit (``UnitGradients``) whose reduce ran, which
    of its candidates no rank gave a gradient, and apply it (``_settle``). One int32
    all-reduce per data-parallel group; only a rank with candidates reads the sums back. Inside a
    CUDA graph capture (a whole-step graph) the last eager decision is reused. With ``exchange``
    (the root's, where its units' steps replay as collective graphs: the layer strategies) the
    all-reduce replays too, on the reduce stream of ``streams`` (``_exchange_replayed``)."""
    pending = [u for u in units if u.use.pending is not None]
    if not pending:
        return
    capturing = _capturing(pending[0].device)
    by_group: dict[tuple, list] = {}
    for unit in pending:
        by_group.setdefault(_groups(unit), []).append(unit)
    for (group, replicate), members in by_group.items():
        if group is None and replicate is None:  # one process: what it did not use, nobody did
            for unit in members:
                _settle(unit, set(unit.use.pending))
        elif capturing:
            for unit in members:
                _reuse_decision(unit)
        else:
            _exchange(members, group, replicate, _replayer(units, members, group, replicate, streams, exchange))


def unused_on_every_rank(units: Sequence) -> list[set[int]]:
    """For every unit (``UnitGradients``) whose reduce ran: its candidates (``use.pending``) that no
    rank gave a gradient, found as ``settle_unused`` finds them but without applying anything (a
    graph about to be captured asks whether it would have to give such parameters zeros)."""
    result = [set(u.use.pending or ()) for u in units]
    by_group: dict[tuple, list[int]] = {}
    for index, unit in enumerate(units):
        by_group.setdefault(_groups(unit), []).append(index)
    for (group, replicate), members in by_group.items():
        if group is None and replicate is None:
            continue
        flags = [0 if i in result[m] else 1 for m in members for i in units[m].trainable]
        used = torch.tensor(flags, dtype=torch.int32, device=units[members[0]].device)
        with _engine_sync(used.device):
            all_reduce(used, group)
            all_reduce(used, replicate)
            counts = used.tolist()
        position = 0
        for m in members:
            for i in units[m].trainable:
                if counts[position]:
                    result[m].discard(i)
                position += 1
    return result


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _several(group):
    """The group, or None where it has one rank (nothing to exchange: a single-GPU torchrun job)."""
    return None if group is None or dist.get_world_size(group) == 1 else group


def _settle(unit, unused: set[int]) -> None:
    """The ranks' decision on the last reduce's candidates: ``unused`` got a gradient on no rank, so
    their ``.grad`` is None again; the others keep the reduced gradient, and their post-accumulate-
    grad hooks (deferred by the reduce) run now."""
    pending = unit.use.pending
    for i in unused:
        unit.params[i].master.grad = None
    run_post_accumulate_hooks([unit.params[i].master for i in pending if i not in unused])
    unit.use.pending, unit.use.unused, unit.use.decided_from = None, frozenset(unused), tuple(pending)


def _replayer(units: Sequence, members: list, group, replicate, streams, exchange: ExchangeGraphs | None):
    """``_exchange_replayed`` for ``members`` at their group's buffer (sized for all of ``units`` in
    that group), where the exchange replays; else None."""
    if exchange is None or streams is None or not can_replay(exchange.graphs):
        return None
    capacity = sum(len(u.params) for u in units if _groups(u) == (group, replicate))
    buffer = exchange.flags((id(group), id(replicate)), capacity, members[0].device, streams)
    return partial(_exchange_replayed, members, group=group, replicate=replicate, streams=streams,
                   exchange=exchange, buffer=buffer)


def _groups(unit) -> tuple:
    return _several(unit.group), _several(unit.replicate_group)


def _exchange(units: list, group, replicate, replayed=None) -> None:
    """``replayed(candidates)``: the exchange as a graph (``_exchange_replayed``); None: eagerly."""
    candidates = [set(u.use.pending) for u in units]
    device = units[0].device
    if replayed is not None:
        counts = replayed(candidates)
    else:
        with _engine_sync(device):  # (a rank with candidates copies its flags in and reads the sums back)
            if any(candidates):
                used = torch.tensor(_flags(units, candidates), dtype=torch.int32, device=device)
            else:
                used = torch.ones(sum(len(u.trainable) for u in units), dtype=torch.int32, device=device)
            _all_reduce(used, group, replicate, units[0].name)
            counts = used.tolist() if any(candidates) else None
    offset = 0
    for unit, cand in zip(units, candidates):
        _settle(unit, {i for pos, i in enumerate(unit.trainable, offset) if i in cand and counts[pos] == 0})
        offset += len(unit.trainable)


def _exchange_replayed(units: list, candidates: list[set], *, group, replicate, streams, exchange: ExchangeGraphs,
                       buffer: torch.Tensor) -> list | None:
    """The exchange as one collective graph, the all-reduce alone, at the group's persistent buffer,
    on the reduce stream (after the step's last reduce-scatter): the eager all-reduce's Python was
    200-450 µs of host time at the end of every backward on 2 × H200. Before the replay, a rank
    without candidates (every parameter used, the steady state) fills the buffer with ones and reads
    nothing back; a rank with candidates copies its flags in and reads the sums back (waiting on the
    host for a replayed collective, which NCCL's watchdog does not time). Every rank runs, captures
    and replays the same body under one key at the same step. A capture that fails on this rank
    runs the all-reduce eagerly instead (its peers' collective still pairs with it), with a warning."""
    size = sum(len(u.trainable) for u in units)
    flags, mine = buffer[:size], any(candidates)

    def body() -> None:
        _all_reduce(flags, group, replicate, units[0].name)

    with streams.enter(streams.reduce):
        if mine:
            with _engine_sync(flags.device):
                flags.copy_(torch.tensor(_flags(units, candidates), dtype=torch.int32))
        else:
            flags.fill_(1)
        try:
            exchange.graphs.run("use_exchange", (flags.data_ptr(), size, id(group), id(replicate)), body)
        except CollectiveGraphCaptureError as err:
            warnings.warn(f"{err} (The exchange of which parameters got a gradient ran eagerly instead.)",
                          stacklevel=2)
            body()
    if not mine:
        return None
    streams.wait(streams.record(streams.reduce))
    with _engine_sync(flags.device):
        return flags.tolist()


def _flags(units: list, candidates: list[set]) -> list[int]:
    return [0 if i in cand else 1 for u, cand in zip(units, candidates) for i in u.trainable]


def _all_reduce(used: torch.Tensor, group, replicate, unit: str) -> None:
    try:
        all_reduce(used, group)
        all_reduce(used, replicate)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as err:
        raise collective_failed("exchange of which parameters got a gradient", unit, err) from err


@contextmanager
def _engine_sync(device: torch.device) -> Iterator[None]:
    """Host syncs of the engine that a whole-step capture does not contain (it reuses the last
    decision): the warm-up's host-sync check (``set_sync_debug_mode``) is off for them."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class ParameterUseChanged(RuntimeError):
    """Which parameters get a gradient changed between the last eager step and a whole-step capture."""


def _reuse_decision(unit) -> None:
    pending = tuple(unit.use.pending)
    before = unit.use.decided_from or ()
    if pending != before:  # (also where this rank now gives every parameter a gradient, or gave all one before)
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ParameterUseChanged(
            f"rank {rank}: FSDP unit {unit.name}: the parameters that get no gradient changed between the last "
            f"eager step ({_names(unit, before)}) and the step recorded into the whole-step graph "
            f"({_names(unit, pending)}). A whole-step CUDA graph replays one step: which parameters get a gradient "
            "must not change from step to step. Use GraphConfig(strategy='layer') or 'none' for a model whose "
            "parameter use varies."
        )
    _settle(unit, set(unit.use.unused) & set(pending))


def _names(unit, indices) -> str:
    return ", ".join(unit.params[i].name for i in indices) or "none"
