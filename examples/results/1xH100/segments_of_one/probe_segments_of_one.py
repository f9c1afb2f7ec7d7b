"""Probe (not committed): segment graphs of ONE block each (FSDP steps inside every block's graph),
measured as ours_segment_graphs when SEG_K is set (benchmark run with --segment-size 2 to take the
segments path, then the segment size replaced by SEG_K). Since 2026-11-24 (later session) the segments
are chained as make_train_step chains them (chain_static_buffers=True by default)."""
import os
import sys

sys.path.insert(0, "examples")
import fsdp_graph.steps.make_step as ms
from fsdp_graph.graphs.segment_graphs import graph_segments

K = int(os.environ.get("SEG_K", "0"))
original = ms._graph_layers


def patched(config, modules, samples):
    if K and config.segment_size > 1:
        graph_segments(modules, [a for a, _ in samples], sample_kwargs=[k for _, k in samples],
                       segment_size=K, num_warmup_iters=config.num_warmup_iters,
                       replay_stream=config.replay_stream,
                       chained_inputs=samples.links if config.chain_static_buffers else None)
    else:
        original(config, modules, samples)


ms._graph_layers = patched
import benchmark  # noqa: E402

benchmark.main()
