"""``CollectiveGraphs.run``'s life cycle, on CPU with a stand-in for ``torch.cuda.CUDAGraph`` (the
GPU parity tests, ``test_graph_parity_gpu.py``, replay the real graphs): a body runs eagerly at
its first call with a set of addresses, is captured at the second and replayed from then on; new
addresses start over; a capture that fails leaves that body eager for good."""

from __future__ import annotations

import pytest
import torch

from fsdp_graph.fsdp.collective_graphs import CollectiveGraphs


class _StandInGraph:
    """Records what a CUDA graph would: the body runs between capture_begin and capture_end."""

    def __init__(self) -> None:
        self.replayed = 0

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:
        assert capture_error_mode == "thread_local"  # NCCL's watchdog thread may query events meanwhile

    def capture_end(self) -> None:
        pass

    def replay(self) -> None:
        self.replayed += 1


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _StandInGraph)
    return CollectiveGraphs(pool=None)


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
    with pytest.raises(RuntimeError, match="not permitted"):
        graphs.run("reduce_scatter", (1,), body)
    graphs.run("reduce_scatter", (1,), body)
    graphs.run("reduce_scatter", (1,), body)
    assert len(calls) == 4 and graphs.replays == {}
