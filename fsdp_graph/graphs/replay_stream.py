"""Replay graphs on a stream the caller gives, joining back at the end or at a ``JoinEvent``.

    with fsdp_graph.replay_on(stream):                 # or graph_modules(..., replay_stream=stream)
        y = block(x)                                   # the replay runs on ``stream``
    other_work()                                       # main-stream work issued now overlaps it

A replay on a side stream first waits for the caller's stream (its inputs, and FSDP's all-gather
that the caller's stream already waited on), then the caller's stream waits for it again:

* without a join event, on the whole replay;
* with one, only up to the point where the module's forward recorded it (``self.join.record()``
  in ``forward``): work issued after the call overlaps the rest of the graph. That rest may only
  write what no caller-stream work reads before the next graph call, and may read the outputs
  only if the caller does not change them in place. FSDP's side streams wait on it before they
  write what it reads (``fsdp/collectives.py``'s replay tails), and the caller's stream waits on
  it at the next graph call, before that call writes its static inputs: the rest may still read
  its own, and graphs share a memory pool whose blocks the capture handed from one graph to the
  next on the assumption that they replay one after the other. So the rest overlaps the caller's
  work up to the next graph call.

A backward always joins the whole replay: autograd reads its gradients on the caller's stream
right after it. The stream chosen for a forward call also replays that call's backward.

``JoinEvent`` is a marker, not a CUDA event: each capture that sees ``record()`` gets its own
external CUDA event (``torch.cuda.Event(external=True)``), recorded inside that graph, so a wait
after a replay refers to exactly that replay. A join event the replayed graph never recorded would
wait on nothing (a silent race): it is refused. One ``JoinEvent`` may serve several modules.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..fsdp.capture_interface import note_replay_tail, wait_for_replay_tails


class JoinEvent:
    """A point in a graphed module's forward where the caller's stream may go on (see the module
    docstring). Create one per module (``self.join = fsdp_graph.JoinEvent()``), call
    ``self.join.record()`` in ``forward`` after the last write of every output, and pass it as
    ``join_event=``. Outside a graph capture ``record()`` does nothing."""

    def record(self) -> None:
        if not _open_captures or not torch.cuda.is_current_stream_capturing():
            return
        event = torch.cuda.Event(external=True)
        event.record(torch.cuda.current_stream())
        _open_captures[-1][self] = event  # a second record in one forward: the later point joins

    def __repr__(self) -> str:
        return f"JoinEvent(at 0x{id(self):x})"


_open_captures: list[dict] = []  # the join events recorded by each forward capture in progress


@contextmanager
def recording_joins() -> Iterator[dict]:
    """Around a forward capture: the ``JoinEvent``s it records, each with its CUDA event."""
    joins: dict = {}
    _open_captures.append(joins)
    try:
        yield joins
    finally:
        _open_captures.pop()


class ReplayTarget:
    """Where a graph replays: ``stream``, joined back at ``join_event`` (forward only) or at the end."""

    __slots__ = ("stream", "join_event")

    def __init__(self, stream, join_event: JoinEvent | None = None) -> None:
        self.stream, self.join_event = stream, join_event

    def replay(self, graph, joins: dict | None = None) -> None:
        """Replay ``graph`` on the stream (after ``begin_call``). ``joins``: the join events the
        graph's forward recorded (None for a backward or a whole step, which join at the end)."""
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        torch.cuda.set_stream(self.stream)  # (torch.cuda.stream() would look the device up twice more)
        try:
            graph.replay()
        finally:
            torch.cuda.set_stream(current)
        if joins is not None and self.join_event is not None:
            current.wait_event(joins[self.join_event])
            tail = torch.cuda.Event()
            tail.record(self.stream)
            note_replay_tail(self.stream, tail)
        else:
            current.wait_stream(self.stream)


def begin_call() -> None:
    """At every graph call, before its static inputs are written: the caller's stream waits for the
    rest of any replay that joined early. That rest may still read its static inputs, and pool
    memory the capture handed on to the graph replayed next (it assumed one replay after the
    other). Nothing on CPU, or when no join event is in use."""
    wait_for_replay_tails(None, retire=True)


def replay_target(stream, join_event, where: str) -> ReplayTarget | None:
    """The checked target for ``stream`` and ``join_event`` (None: replay on the current stream)."""
    if join_event is not None and not isinstance(join_event, JoinEvent):
        raise TypeError(
            f"{where}: join_event must be a fsdp_graph.JoinEvent, not {type(join_event).__name__}. Create one "
            "(self.join = fsdp_graph.JoinEvent()), call self.join.record() in the module's forward where the "
            "caller may go on, and pass it: the package must know the graph recorded it (a CUDA event the "
            "graph never records would be waited on as already complete)."
        )
    if stream is None:
        if join_event is not None:
            raise ValueError(
                f"{where}: join_event was given without a replay stream. The current stream cannot go on at an "
                "event recorded on itself: pass a dedicated stream too (replay_on(torch.cuda.Stream(), "
                "join_event=...), or replay_stream= when graphing)."
            )
        return None
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"{where}: the replay stream must be a torch.cuda.Stream, not {type(stream).__name__}")
    return ReplayTarget(stream, join_event)


_chosen = threading.local()  # the replay_on stack of the calling thread


@contextmanager
def replay_on(stream: torch.cuda.Stream | None, join_event: JoinEvent | None = None) -> Iterator[None]:
    """Replay the graphs called in the body on ``stream`` (graphed modules, whole steps and
    whole evaluation forwards), the caller's stream joining at ``join_event`` (a forward that
    recorded it) or at the end of each replay. Overrides a default given when graphing; ``None``
    replays on the current stream."""
    target = replay_target(stream, join_event, "replay_on")
    stack = _chosen.__dict__.setdefault("stack", [])
    stack.append(target)
    try:
        yield
    finally:
        stack.pop()


def chosen_target(default: ReplayTarget | None) -> ReplayTarget | None:
    """The innermost ``replay_on`` of this thread, else ``default``."""
    stack = getattr(_chosen, "stack", None)
    return stack[-1] if stack else default


def check_target(target: ReplayTarget | None, joins: dict, name: str, device: torch.device | None) -> None:
    """Refuse a join event the graph's forward did not record, and a stream of another device."""
    if target is None:
        return
    if device is not None and _index(target.stream.device) != _index(device):
        raise ValueError(
            f"{name}: the replay stream is on {target.stream.device}, but the graph was captured on {device}. "
            f"Create the stream on the graph's device: torch.cuda.Stream(device={str(device)!r})."
        )
    if target.join_event is not None and target.join_event not in joins:
        raise ValueError(
            f"{name}: join_event {target.join_event!r} was not recorded by this module's forward during "
            "its capture, so a wait on it would wait on nothing. Call join_event.record() in the forward of the "
            "module it is given for (after the last write of every output), then graph it again; or give no "
            "join_event (the caller's stream then waits for the whole replay)."
        )


def whole_target(default: ReplayTarget | None, what: str, device: torch.device) -> ReplayTarget | None:
    """Where a whole-step or whole-forward graph replays: ``replay_on``, else ``default``; joined at
    its end, since its outputs (loss, gradients, weights) are all read after it."""
    target = chosen_target(default)
    if target is not None and target.join_event is not None:
        raise ValueError(
            f"{what}: a join_event was given for a whole-step (or whole-forward) graph, whose loss, gradients and "
            "weights are all read after it: it joins at its end. Pass replay_on(stream) without join_event."
        )
    check_target(target, {}, what, device)
    return target


def launch(graph, target: ReplayTarget | None, joins: dict | None = None) -> None:
    """Replay ``graph`` on the current stream (no target) or where ``target`` says (after ``begin_call``)."""
    if target is None:
        graph.replay()
    else:
        target.replay(graph, joins)


def replay_whole(graph, target: ReplayTarget | None) -> None:
    begin_call()
    launch(graph, target)


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index
