"""``CollectiveGraphs.run``'s life cycle, on CPU with a stand-in for ``torch.cuda.CUDAGraph`` (the
GPU parity tests, ``test_graph_parity_gpu.py``, replay the real graphs): a body runs eagerly at
its first call with a set of addresses, is captured at the second and replayed from then on; new
addresses start over; a capture that fails leaves that body eager for good, says which unit and
body and how to switch the replay off, and does not spoil the other units' captures. Which units
replay is a per-unit choice that an evaluation step with the default setting leaves alone."""

from __future__ import annotations

import pytest
import torch

from fsdp_graph.fsdp.capture_interface import replay_collectives, units_in
from fsdp_graph.fsdp.collective_graphs import CollectiveGraphCaptureError, CollectiveGraphs, GraphPool

from models import build, shard

_pools_capturing: set = set()  # as torch's allocator: pools with a capture under way


class _StandInGraph:
    """Records what a CUDA graph would: the body runs between capture_begin and capture_end. Like
    torch, a capture_end that fails (an invalidated capture) leaves its pool registered, and a
    capture into a registered pool is refused."""

    invalidate_next = False

    def __init__(self) -> None:
        self.replayed = 0

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:
        assert capture_error_mode == "thread_local"  # NCCL's watchdog thread may query events meanwhile
        if pool in _pools_capturing:
            raise RuntimeError(f"beginAllocateToPool: already recording to mempool_id {pool}")
        _pools_capturing.add(pool)
        self.pool = pool

    def capture_end(self) -> None:
        if _StandInGraph.invalidate_next:
            _StandInGraph.invalidate_next = False
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        _pools_capturing.discard(self.pool)

    def replay(self) -> None:
        self.replayed += 1


@pytest.fixture
def stand_in(monkeypatch):
    handles = iter(range(1, 1000))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda device, pool: _pools_capturing.remove(pool),
                        raising=False)  # as torch's allocator: raises (KeyError here) if not registered
    monkeypatch.setattr("fsdp_graph.fsdp.collective_graphs.hold", lambda holder: None)  # no real graphs to release
    _pools_capturing.clear()


@pytest.fixture
def graphs(stand_in):
    return CollectiveGraphs(GraphPool(), "blocks.3")


def test_a_body_runs_eagerly_then_is_captured_then_replays(graphs):
    runs = []
    body = lambda: runs.append(1)  # noqa: E731
    for _ in range(4):
        graphs.run("unshard", (10, 20), body)
    assert len(runs) == 2 and graphs.replays == {"unshard": 3}  # eager, capture (+ replay), replay, replay
    graphs.run("unshard", (10, 21), body)  # other addresses (a re-plan): eagerly again
    graphs.run("copy_in", (10, 20), body)  # another body: its own life cycle
    assert len(runs) == 4 and graphs.replays == {"unshard": 3}
    graphs.forget()
    graphs.run("unshard", (10, 20), body)
    assert len(runs) == 5 and graphs.replays == {"unshard": 3}


def test_a_capture_that_fails_raises_once_and_leaves_the_body_eager(graphs):
    calls = []

    def body():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("operation not permitted when stream is capturing")

    graphs.run("reduce_scatter", (1,), body)
    with pytest.raises(CollectiveGraphCaptureError, match=r"FSDP unit blocks.3: capturing its reduce_scatter as a "
                       r"CUDA graph failed: operation not permitted .*collective_graphs=False"):
        graphs.run("reduce_scatter", (1,), body)
    graphs.run("reduce_scatter", (1,), body)
    graphs.run("reduce_scatter", (1,), body)
    assert len(calls) == 4 and graphs.replays == {}


def test_an_invalidated_capture_leaves_the_other_units_captures_working(stand_in):
    pool = GraphPool()
    first, second = CollectiveGraphs(pool, "blocks.0"), CollectiveGraphs(pool, "blocks.1")
    body = lambda: None  # noqa: E731
    first.run("unshard", (1,), body)
    _StandInGraph.invalidate_next = True
    with pytest.raises(CollectiveGraphCaptureError, match="blocks.0: capturing its unshard"):
        first.run("unshard", (1,), body)
    assert not _pools_capturing  # the allocator no longer believes a capture is under way
    second.run("unshard", (2,), body)
    second.run("unshard", (2,), body)
    second.run("unshard", (2,), body)
    assert second.replays == {"unshard": 2} and first.replays == {}
    assert second._graphs[("unshard", (2,))].pool != (0, 1)  # a fresh pool: the failed capture's blocks stay


def test_a_collective_that_refuses_the_capture_names_the_capture_and_the_fix(graphs):
    """ProcessGroupNCCL's own refusal of a capture (an old NCCL) reaches us as a CollectiveError;
    under capture NCCL only enqueues, so it is about the capture: the message says so, names the
    switch, and keeps the collective's words."""
    from fsdp_graph.fsdp.collectives import CollectiveError

    calls = []

    def body():
        calls.append(1)
        if len(calls) == 2:
            raise CollectiveError("rank 1: the gradient reduce-scatter of FSDP unit blocks.3 failed: Capturing "
                                  "NCCL collectives is only allowed with NCCL >= 2.9.6")

    graphs.run("reduce_scatter", (1,), body)
    with pytest.raises(CollectiveGraphCaptureError, match="collective_graphs=False") as raised:
        graphs.run("reduce_scatter", (1,), body)
    assert "capturing its reduce_scatter" in str(raised.value) and "NCCL >= 2.9.6" in str(raised.value)
    assert isinstance(raised.value.__cause__, CollectiveError)
    assert not _pools_capturing
    graphs.run("reduce_scatter", (1,), body)  # eager from then on
    assert len(calls) == 3 and graphs.replays == {}


def test_an_earlier_choice_per_unit_is_kept_by_a_later_default(stand_in):
    model = shard(build(torch.device("cpu"))[0])
    units = [u for u in units_in(model) if u.module is not model]
    on = lambda: [u.param_group.collective_graphs is not None for u in units]  # noqa: E731
    replay_collectives(units, None)  # nobody chose: on
    assert all(on()) and all(u.grads.collective_graphs is u.param_group.collective_graphs for u in units)
    kept = [u.param_group.collective_graphs for u in units]
    replay_collectives(units, None)
    assert [u.param_group.collective_graphs for u in units] == kept  # graphs already made are kept
    replay_collectives(units[:1], False)  # training chose eager FSDP steps for one unit
    replay_collectives(units, None)  # an evaluation step with the default
    assert on() == [False] + [True] * (len(units) - 1)
    replay_collectives(units, True)
    assert all(on())
