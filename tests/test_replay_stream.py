"""CPU: replay on a caller's stream (``graphs/replay_stream.py``): the argument checks, and the
order of stream operations around a replay, with streams and events emulated by objects that log
what is asked of them. The graphs are the emulated ones of ``test_graphed_callable.py``; the GPU
test (``test_replay_stream_gpu.py``) runs the real thing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.fsdp import collectives
from fsdp_graph.fsdp.collectives import CommStreams
from fsdp_graph.graphs.replay_stream import JoinEvent, ReplayTarget, replay_on, replay_whole, whole_target

from test_graphed_callable import Scaled, emulated

pytestmark = pytest.mark.cpu_only

LOG: list[str] = []


class FakeStream:
    device = torch.device("cuda", 0)

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: FakeStream) -> None:
        LOG.append(f"{self.name} waits {other.name}")

    def wait_event(self, event: FakeEvent) -> None:
        LOG.append(f"{self.name} waits {event.name}")

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    made = 0

    def __init__(self, name: str | None = None) -> None:
        FakeEvent.made += 1
        self.name = name or f"event{FakeEvent.made}"

    def record(self, stream: FakeStream) -> None:
        LOG.append(f"{self.name} recorded on {stream.name}")


class Streams:
    """``torch.cuda``'s current stream, stream switches and events, emulated."""

    def __init__(self, monkeypatch) -> None:
        self.main = self.current = FakeStream("main")
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent())
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)  # (what replay_on accepts)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: setattr(self, "current", stream))
        monkeypatch.setattr(collectives, "_replay_tails", {})
        LOG.clear()


def _logging_replays(graphs, streams: Streams) -> None:
    """Each emulated replay notes the stream it ran on."""
    for which, graph in (("forward", graphs.captured.fwd_graph), ("backward", graphs.captured.bwd_graph)):
        def replay(which=which):
            LOG.append(f"{which} replay on {streams.current.name}")
            graphs.run(which)

        graph.replay = replay


def _side_streams() -> CommStreams:
    """A CommStreams with emulated side streams (its constructor makes real CUDA streams)."""
    comm = CommStreams.__new__(CommStreams)
    comm.cuda, comm.device, comm._pending = True, torch.device("cuda", 0), set()
    comm.all_gather, comm.reduce = FakeStream("all_gather"), FakeStream("reduce")
    return comm


def test_a_join_event_without_a_dedicated_stream_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="join_event was given without a replay stream.*pass a dedicated stream"):
        with replay_on(None, join_event=JoinEvent()):
            pass
    with pytest.raises(ValueError, match="graphing module 0 .*join_event was given without a replay stream"):
        fsdp_graph.graph_modules([nn.Linear(2, 2)], [(torch.randn(1, 2),)], join_event=JoinEvent())


def test_a_plain_event_or_a_non_stream_is_refused():
    with pytest.raises(TypeError, match="join_event must be a fsdp_graph.JoinEvent, not object.*self.join.record"):
        with replay_on(None, join_event=object()):
            pass
    with pytest.raises(TypeError, match="replay stream must be a torch.cuda.Stream, not str"):
        with replay_on("side"):
            pass
    with pytest.raises(TypeError, match="GraphConfig.replay_stream must be a torch.cuda.Stream"):
        fsdp_graph.make_train_step(lambda: None, nn.Linear(2, 2), config=fsdp_graph.GraphConfig(replay_stream=1))
    with pytest.raises(ValueError, match="join_event has 2 entries for 1 modules; pass one per module, or one"):
        fsdp_graph.graph_modules([nn.Linear(2, 2)], [(torch.randn(1, 2),)], join_event=[None, None])


def test_forward_and_backward_replay_on_the_given_stream_and_join_it_at_the_end(monkeypatch):
    module, reference = Scaled(), Scaled()
    reference.load_state_dict(module.state_dict())
    graphed, graphs = emulated(module, (torch.randn(2, 3, requires_grad=True),))
    streams = Streams(monkeypatch)
    _logging_replays(graphs, streams)
    side = FakeStream("side")
    x = torch.randn(2, 3, requires_grad=True)
    with replay_on(side):
        out = graphed(x)
    assert LOG == ["side waits main", "forward replay on side", "main waits side"]
    LOG.clear()
    out.square().sum().backward()  # outside the ``with``: the forward's stream replays its backward
    assert LOG == ["side waits main", "backward replay on side", "main waits side"]
    reference(x.detach()).square().sum().backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    LOG.clear()
    graphed(x).sum().backward()  # no replay_on and no default: the current stream, no stream operation
    assert LOG == ["forward replay on main", "backward replay on main"]


def test_a_forward_joins_at_its_join_event_and_the_side_streams_wait_for_the_rest(monkeypatch):
    graphed, graphs = emulated(Scaled(), (torch.randn(2, 3, requires_grad=True),))
    join = JoinEvent()
    graphed.captured.join_events = {join: FakeEvent("join")}  # what the capture records
    streams = Streams(monkeypatch)
    _logging_replays(graphs, streams)
    side, comm = FakeStream("side"), _side_streams()
    graphed.replay_default = ReplayTarget(side, join)  # as graph_modules(replay_stream=, join_event=) sets
    out = graphed(torch.randn(2, 3, requires_grad=True))
    tail = LOG[-1].split()[0]
    assert LOG == ["side waits main", "forward replay on side", "main waits join", f"{tail} recorded on side"]
    LOG.clear()
    with comm.enter(comm.all_gather):  # the next unshard, into a slot the rest of the replay may read
        pass
    assert LOG == ["all_gather waits main", f"all_gather waits {tail}"]
    LOG.clear()
    out.sum().backward()  # the next graph call starts with the caller's stream waiting for the rest
    assert LOG == [f"main waits {tail}", "side waits main", "backward replay on side", "main waits side"]
    LOG.clear()
    with comm.enter(comm.reduce):
        pass
    assert LOG == ["reduce waits main"]


def test_the_end_of_a_forward_or_backward_joins_every_tail(monkeypatch):
    Streams(monkeypatch)
    comm = _side_streams()
    collectives.note_replay_tail(FakeStream("side"), FakeEvent("tail"))
    comm.wait_for_all()
    assert LOG == ["main waits tail"]
    assert collectives._replay_tails == {}


def test_a_join_event_the_forward_never_recorded_is_refused_before_the_replay(monkeypatch):
    graphed, graphs = emulated(Scaled(), (torch.randn(2, 3, requires_grad=True),))
    Streams(monkeypatch)
    with pytest.raises(ValueError, match="join_event JoinEvent.* was not recorded by this module's forward"):
        with replay_on(FakeStream("side"), join_event=JoinEvent()):
            graphed(torch.randn(2, 3, requires_grad=True))
    assert graphs.replays["forward"] == 0 and LOG == []


def test_a_whole_step_graph_refuses_a_join_event_and_joins_at_its_end(monkeypatch):
    Streams(monkeypatch)

    class Graph:
        def replay(self):
            LOG.append("step replay")

    side = FakeStream("side")
    replay_whole(Graph(), whole_target(ReplayTarget(side), "make_train_step", side.device))
    assert LOG == ["side waits main", "step replay", "main waits side"]
    with pytest.raises(ValueError, match="make_train_step: a join_event was given for a whole-step"):
        with replay_on(side, join_event=JoinEvent()):
            whole_target(None, "make_train_step", side.device)
    wrong = r"the replay stream is on cuda:0, but the graph was captured on cuda:1\. "
    fix = r"Create the stream on the graph's device: torch.cuda.Stream\(device='cuda:1'\)"
    with pytest.raises(ValueError, match=wrong + fix):
        whole_target(ReplayTarget(side), "make_eval_step", torch.device("cuda", 1))


def test_replay_on_none_overrides_a_default_and_join_event_record_outside_a_capture_does_nothing(monkeypatch):
    graphed, graphs = emulated(Scaled(), (torch.randn(2, 3, requires_grad=True),))
    streams = Streams(monkeypatch)
    _logging_replays(graphs, streams)
    graphed.replay_default = ReplayTarget(FakeStream("side"))
    with replay_on(None):
        graphed(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert LOG == ["forward replay on main", "backward replay on main"]
    JoinEvent().record()  # eager code (warm-up, an eager run of the module): no event, no error


def test_the_next_graph_call_waits_for_the_rest_of_a_replay_that_joined_early(monkeypatch):
    """That rest may read its static inputs, which the next call of the same graph overwrites, and
    graphs share a memory pool whose blocks the capture passed from one graph to the next: the
    next call, on whatever stream, starts with the caller's stream waiting for it."""
    first, first_graphs = emulated(Scaled(), (torch.randn(2, 3, requires_grad=True),))
    second, second_graphs = emulated(Scaled(), (torch.randn(2, 3, requires_grad=True),))
    join = JoinEvent()
    first.captured.join_events = {join: FakeEvent("join")}
    streams = Streams(monkeypatch)
    _logging_replays(first_graphs, streams)
    _logging_replays(second_graphs, streams)
    x = torch.randn(2, 3)
    with torch.no_grad():
        with replay_on(FakeStream("side"), join_event=join):
            first(x)
        tail = LOG[-1].split()[0]
        LOG.clear()
        second(x)  # on the current stream, after the rest (before its static inputs are written)
        assert LOG == [f"main waits {tail}", "forward replay on main"]
        assert collectives._replay_tails == {}  # the caller's stream covers it now
        with replay_on(FakeStream("side"), join_event=join):
            first(x)
        tail = LOG[-1].split()[0]
        LOG.clear()
        with replay_on(FakeStream("other")):  # on another side stream
            second(x)
        assert LOG == [f"main waits {tail}", "other waits main", "forward replay on other", "main waits other"]
