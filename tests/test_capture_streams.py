"""CPU: which pooled stream a capture gets, with torch's round-robin pool of 32 streams stood in.

The GPU test (``test_capture_streams_gpu.py``) runs the real captures; this one checks the rules on
a stand-in pool that hands out its streams round-robin as torch's does."""

from __future__ import annotations

import gc
import itertools
import warnings
from types import SimpleNamespace

import pytest
import torch

from fsdp_graph.graphs import capture_streams
from fsdp_graph.graphs.capture_streams import STREAMS_PER_POOL, capture_stream


class Holder:
    """A set of graphs; ``cycle`` makes it collectable only by the garbage collector, as a group of
    graphed callables is."""

    def __init__(self, cycle: bool = False) -> None:
        self.me = self if cycle else None


@pytest.fixture
def pool(monkeypatch):
    """``torch.cuda.Stream`` as a round-robin pool of 32 streams on device 0; no default capture stream."""
    handles = itertools.cycle(range(1000, 1000 + STREAMS_PER_POOL))
    device = SimpleNamespace(index=0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device_=None: SimpleNamespace(device=device,
                                                                                   cuda_stream=next(handles)))
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None, raising=False)
    monkeypatch.setattr(capture_streams, "_holders", {})


def test_a_live_holder_keeps_its_stream_while_more_holders_than_the_pool_come_and_go(pool):
    kept = Holder()
    stream = capture_stream(0, kept).cuda_stream
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fsdp_graph:")
        for _ in range(3 * STREAMS_PER_POOL):
            other = Holder()
            assert capture_stream(0, other).cuda_stream != stream
            del other


def test_holders_dropped_in_a_cycle_give_their_streams_back_at_the_collection_run_when_none_is_free(pool):
    kept = Holder()
    stream = capture_stream(0, kept).cuda_stream
    gc.disable()  # (as a long run between collections)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="fsdp_graph:")
            for _ in range(3 * STREAMS_PER_POOL):
                assert capture_stream(0, Holder(cycle=True)).cuda_stream != stream
    finally:
        gc.enable()


def test_more_live_holders_than_the_pool_has_streams_are_warned_about_at_the_callers_line(pool):
    live = [Holder() for _ in range(STREAMS_PER_POOL + 1)]
    streams = [capture_stream(0, holder).cuda_stream for holder in live[:-1]]
    assert len(set(streams)) == STREAMS_PER_POOL
    with pytest.warns(RuntimeWarning, match=r"Drop the steps and graphed modules you no longer use") as caught:
        capture_stream(0, live[-1])
    assert caught[0].filename == __file__  # (the user's line, not the package's)


def test_torchs_default_capture_stream_is_not_handed_out(pool, monkeypatch):
    default = torch.cuda.Stream()
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", default, raising=False)
    streams = {capture_stream(0, holder).cuda_stream for holder in [Holder() for _ in range(STREAMS_PER_POOL - 1)]}
    assert default.cuda_stream not in streams and len(streams) == STREAMS_PER_POOL - 1
