"""GPU, one device: a live graph set keeps its capture stream from every later capture of ours.

A graph's matmuls write the cuBLAS workspace of the stream it was captured on, and torch frees
that workspace when any graph captured on the stream is destroyed; ``torch.cuda.Stream()`` hands
out 32 pooled streams round-robin. A step that lives while more than 32 others are built and
dropped (an evaluation step built anew at every evaluation) would otherwise share its capture
stream with one of them (``fsdp_graph/graphs/capture_streams.py``).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.graphs.capture_streams import STREAMS_PER_POOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _graphed():
    module = nn.Linear(32, 32).cuda()
    x = torch.randn(4, 32, device="cuda", requires_grad=True)
    return fsdp_graph.make_graphed_callables(module, (x,), num_warmup_iters=1)


def test_a_live_graph_set_keeps_its_capture_stream_while_more_sets_than_torch_has_streams_come_and_go():
    gc.collect()
    kept = _graphed()
    stream = kept.group.capture_stream.cuda_stream
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fsdp_graph:")  # (no stream is short: one other set lives)
        for _ in range(2 * STREAMS_PER_POOL):  # torch's pool wraps around twice
            other = _graphed()
            assert other.group.capture_stream.cuda_stream != stream
            del other  # (freed at a later collection: a set's callables and its group reference each other)


def test_more_live_graph_sets_than_torch_has_streams_are_warned_about_naming_the_fix():
    gc.collect()
    live, ours = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while not ours and len(live) <= STREAMS_PER_POOL:
            live.append(_graphed())
            ours = [w for w in caught if str(w.message).startswith("fsdp_graph:")]
    assert ours, f"{len(live)} live graph sets, no warning"
    assert "Drop the steps and graphed modules you no longer use" in str(ours[0].message)
    assert ours[0].filename == __file__  # (the user's line)
    before = [g.group.capture_stream.cuda_stream for g in live[:-1]]
    assert len(set(before)) == len(before)  # (each set had a stream of its own until the pool ran out)
    del live
    gc.collect()
