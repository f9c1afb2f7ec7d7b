"""Side-stream replay: how much of a graphed module's tail the caller's eager work hides (one GPU).

    python examples/side_stream_overlap.py --config small medium --out /tmp/side_stream

The GPT's attention modules are graphed (``GraphConfig(strategy="layer", modules=CausalSelfAttention)``);
each block's MLP runs eagerly after them, on the caller's stream. The *tail* is the stated piece of
work: after its output, each attention module runs a probe of that output (a matmul into a 4 × wider
buffer, reduced to one statistic, as a monitoring probe would), which nothing in the step reads.

  no_tail          attention graphs without the probe: the time the step needs
  tail_in_line     with the probe, replayed on the caller's stream: the MLP waits for the probe
  tail_after_join  with the probe, replayed on a side stream that the caller's stream joins at a
                   JoinEvent recorded after the output (replay_on(stream, join_event=...)): the
                   eager MLP runs while the probe finishes

hidden = (tail_in_line - tail_after_join) / (tail_in_line - no_tail): the share of the probe's time
the MLP hides. A profiler trace of tail_after_join gives the time during which kernels of the
replay stream and of the caller's stream ran at once. Losses must be bitwise equal in all three
(deterministic algorithms): the probe feeds nothing back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import fsdp_graph  # noqa: E402
from fsdp_graph import GraphConfig  # noqa: E402

from gpt import CONFIGS, GPT, CausalSelfAttention  # noqa: E402

SYSTEMS = ("no_tail", "tail_in_line", "tail_after_join")


class ProbedAttention(CausalSelfAttention):
    """Attention whose forward, after its output, probes it (the tail; see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.join.record()
        with torch.no_grad():
            self.probe_reading.copy_((out @ self.probe).float().square().mean())
        return out


def _build(config: str, tail: bool, join: fsdp_graph.JoinEvent) -> GPT:
    torch.manual_seed(0)
    cfg = CONFIGS[config]
    model = GPT(cfg)
    if tail:
        for block in model.blocks:
            block.attn.__class__ = ProbedAttention
            block.attn.join = join
            probe = (torch.randn(cfg.d_model, 4 * cfg.d_model) / cfg.d_model ** 0.5).to(torch.bfloat16)
            block.attn.register_buffer("probe", probe, persistent=False)  # (in the compute dtype)
            block.attn.register_buffer("probe_reading", torch.zeros(()), persistent=False)
    model.cuda()
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fsdp_graph.fully_shard(block, mp_policy=policy)
    return fsdp_graph.fully_shard(model, mp_policy=policy)


def _batch(config: str, step: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = CONFIGS[config]
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=g)
    return idx.cuda(), ((idx * 7 + 3) % cfg.vocab_size).cuda()


def run(config: str, system: str, steps: int, warmup: int, micro_batch: int, trace: str | None) -> dict:
    join = fsdp_graph.JoinEvent()
    model = _build(config, system != "no_tail", join)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device="cuda"), fused=True, capturable=True)
    step = fsdp_graph.make_train_step(
        lambda idx, targets: model(idx, targets)[1], model, opt,
        config=GraphConfig(strategy="layer", modules=CausalSelfAttention), example_batch=_batch(config, 0, micro_batch))
    stream = torch.cuda.Stream() if system == "tail_after_join" else None
    losses, times = [], []
    for i in range(steps):
        batch = _batch(config, i, micro_batch)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with fsdp_graph.replay_on(stream, join_event=join if stream is not None else None):
            losses.append(step(*batch))
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    result = {"config": config, "system": system, "step_ms": statistics.median(times),
              "losses": torch.stack(losses).tolist()}
    if trace and stream is not None:
        result["concurrent_ms_per_step"] = _concurrent_kernel_time(step, model, config, micro_batch, stream, join,
                                                                   trace)
    return result


def _concurrent_kernel_time(step, model, config, micro_batch, stream, join, trace: str) -> float:
    """Profile three steps; the time per step during which a kernel of ``stream`` and one of another
    stream ran at once (from the trace's kernel intervals)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1000)  # a marker: the trace names streams by its own numbers
        for i in range(3):
            with fsdp_graph.replay_on(stream, join_event=join):
                step(*_batch(config, 100 + i, micro_batch))
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    marker = min((e for e in events if "spin" in e["name"].lower() or "sleep" in e["name"].lower()),
                 key=lambda e: e["ts"])
    replay = marker["args"].get("stream")
    events = [e for e in events if e is not marker]
    ours = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["args"].get("stream") == replay]
    others = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["args"].get("stream") != replay)
    merged: list[list[float]] = []  # the other streams' busy intervals, merged
    for a, b in others:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in ours for c, d in merged)
    return overlap / 1e3 / 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", nargs="+", default=["small"], choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps (graph warm-up and capture among them)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--out", default=None, help="folder for results.json and the traces")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("side_stream_overlap.py needs a CUDA device: it measures CUDA graph replays")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (before cuBLAS starts)
    torch.use_deterministic_algorithms(True)
    fsdp_graph.init_distributed()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    results = []
    for config in args.config:
        rows = {}
        for system in SYSTEMS:
            trace = os.path.join(args.out, f"trace-{config}-{system}.json") if args.out else None
            rows[system] = run(config, system, args.steps, args.warmup, args.micro_batch, trace)
            torch.cuda.empty_cache()
        base, inline, joined = (rows[s]["step_ms"] for s in SYSTEMS)
        same = all(rows[s]["losses"] == rows["no_tail"]["losses"] for s in SYSTEMS)
        hidden = (inline - joined) / (inline - base) if inline > base else float("nan")
        print(f"{config}: no_tail {base:.2f} ms, tail_in_line {inline:.2f} ms, tail_after_join {joined:.2f} ms; "
              f"hidden {hidden:.0%} of the tail; kernels of both streams at once "
              f"{rows['tail_after_join'].get('concurrent_ms_per_step', float('nan')):.2f} ms per step; "
              f"losses bitwise equal: {same}", flush=True)
        results.append({"config": config, "rows": rows, "hidden": hidden, "losses_equal": same})
    if args.out:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
