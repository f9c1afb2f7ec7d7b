"""The three collectives FSDP needs, and the side streams they run on.

All of them read and write caller-owned tensors: no collective here allocates, which is what
lets the unshard/reduce paths keep fixed addresses (and run inside CUDA graphs). World size 1
without a process group takes a local path. On GPU, all-gathers run on one side stream and
reduce-scatters on another (``CommStreams``), joined to the compute stream through events.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older versions have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective of a unit failed: on gloo, most often a rank that never joined it (timeout)."""


def collective_failed(op: str, unit: str, error: BaseException) -> CollectiveError:
    """The error to raise when ``op`` of ``unit`` raised ``error``: which rank, which collective, why."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CollectiveError(
        f"rank {rank}: the {op} of FSDP unit {unit} failed: {str(error).strip().splitlines()[0][:300]}. If it timed "
        "out, another rank did not join it: a rank that skipped this unit (a data-dependent branch), called a "
        "collective on one rank only, raised in an earlier step, or died. fsdp_graph.init_distributed(timeout=...) "
        "bounds the wait. (On NCCL a collective runs asynchronously: its timeout is reported by NCCL's watchdog.)"
    )


def all_gather_inplace(flat: torch.Tensor, shard_numel: int, group: dist.ProcessGroup | None) -> None:
    """Gather every rank's shard into ``flat``; this rank's shard is already in place in ``flat``."""
    if group is None or flat.numel() == 0:
        return
    rank = dist.get_rank(group)
    local = flat.narrow(0, rank * shard_numel, shard_numel)
    _all_gather_single(flat, local, group=group)


def reduce_scatter_sum(out_shard: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out_shard`` = this rank's shard of the sum of ``flat`` over the group. ``out_shard`` may be
    that shard's place in ``flat`` (in place)."""
    if group is None:
        if out_shard.data_ptr() != flat.data_ptr():
            out_shard.copy_(flat)
        return
    if flat.numel() == 0:
        return
    _reduce_scatter_single(out_shard, flat, op=dist.ReduceOp.SUM, group=group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


class _OnStream:
    """``torch.cuda.stream(stream)`` for a stream of the current device, without that context's two
    lookups of the current device (each reads the environment through ``torch.cuda.is_available``):
    the hooks enter a side stream several times per unit and step (``docs/performance.md``)."""

    __slots__ = ("stream", "previous")

    def __init__(self, stream, previous) -> None:
        self.stream, self.previous = stream, previous  # previous: the current stream, looked up by the caller

    def __enter__(self) -> None:
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.previous)


# A forward graph replayed on a caller's stream that joined the caller's stream early (at a join
# event inside the graph, ``graphs/replay_stream.py``) may still read its unit's unsharded
# parameters, its static inputs and pool memory after the join: per device, its replay stream ->
# an event at the end of that replay. Side streams entered, and the caller's stream at the next
# graph call, wait on them. Empty unless join events are used.
_replay_tails: dict[int, dict] = {}


def note_replay_tail(stream, event) -> None:
    """A replay on ``stream`` ended at ``event`` after its caller's stream joined it early."""
    _replay_tails.setdefault(stream.device.index, {})[stream] = event


def wait_for_replay_tails(stream, retire: bool) -> None:
    """``stream`` (None: the current stream) waits for the rest of every replay on its device that
    joined early. ``retire``: ``stream`` is the caller's, which now covers them (side streams and
    replays wait on it)."""
    if not _replay_tails:
        return
    stream = torch.cuda.current_stream() if stream is None else stream
    device = stream.device.index
    tails = _replay_tails.get(device)
    if tails:
        for tail in tuple(tails.values()):
            stream.wait_event(tail)
    if retire:
        _replay_tails.pop(device, None)


class CommStreams:
    """Side streams for all-gathers and reduce-scatters (None on CPU, where all is synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # an indexed device keeps stream lookups off the slow path
            device = torch.device("cuda", torch.cuda.current_device())
        self.all_gather = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.reduce = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.device = device
        self._pending: set = set()  # side streams given work since the current stream last joined them

    def enter(self, stream):
        """Run on ``stream`` after everything already queued on the current stream."""
        if stream is None:
            return nullcontext()
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        if _replay_tails:
            wait_for_replay_tails(stream, retire=False)
        self._pending.add(stream)
        if torch.cuda.current_device() != self.device.index:
            return torch.cuda.stream(stream)  # it switches the device as well
        return _OnStream(stream, current)  # entered at once, by the caller's ``with``

    @staticmethod
    def record(stream):
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def shared_with_side_streams(self, *tensors: torch.Tensor) -> None:
        """Persistent ``tensors`` (allocated on the compute stream) that the side streams also read
        or write: when they are freed at last (the model dropped, perhaps after a step that failed
        midway), the allocator waits for the side streams' queued work before reusing the memory."""
        if self.cuda and not torch.cuda.is_current_stream_capturing():
            for tensor in tensors:
                tensor.record_stream(self.all_gather)
                tensor.record_stream(self.reduce)

    def synchronize(self) -> None:
        """Wait on the host for all work on the device: every stream is joined afterwards."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            _replay_tails.pop(self.device.index, None)  # (every replay on the device is done)
        self._pending.clear()

    def wait_for_all(self) -> None:
        """Compute stream waits for every collective: nothing in flight may race the optimizer
        (a prefetch that was never consumed still reads the master shard)."""
        # Only streams that were given work: inside a whole-step capture, waiting on a stream
        # that is not part of the capture would wait on an event recorded outside it.
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for stream in (self.all_gather, self.reduce):
                if stream in self._pending:
                    current.wait_stream(stream)
            self._pending.clear()
            wait_for_replay_tails(current, retire=True)  # (the end of a forward or backward)
