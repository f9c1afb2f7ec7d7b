"""Soak: many steps of each graph strategy, checked for what only shows over time.

    torchrun --standalone --nproc-per-node 2 examples/soak.py --config small --steps 1000
    torchrun --standalone --nproc-per-node 2 examples/soak.py --config tiny --steps 20 --strategies none   # CPU

Every strategy trains the same GPT (examples/gpt.py) from the same seed on the same batches, with
deterministic kernels and a fixed NCCL algorithm, capturable fused AdamW and clipping, through
``make_train_step``. Each step is timed between two device synchronisations. Checked, per
strategy: peak memory (``torch.cuda.max_memory_allocated``) does not grow after step
``--settle`` (default 20); no step after warm-up takes more than 3x the median (``--slow-factor``); every loss equals
the eager run's bit for bit. Each slow step is reported with whether a full Python garbage
collection ran in it; ``--gc-freeze`` (default) freezes the set-up objects once the step is built,
so full collections stay short. Prints a table; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

_EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _EXAMPLES_DIR)
sys.path.insert(1, os.path.dirname(_EXAMPLES_DIR))

import torch  # noqa: E402

import fsdp_graph  # noqa: E402

from benchmark import make_deterministic  # noqa: E402
from gpt import CONFIGS, GPT  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--settle", type=int, default=20, help="steps after which peak memory must stay flat")
    p.add_argument("--slow-factor", type=float, default=3.0, help="no step after warm-up may take longer than "
                   "this times the median")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="gc.freeze() once the step is built, so that Python's full collections do not scan the "
                        "long-lived set-up objects mid-run (torchtitan and Megatron manage the collector too)")
    p.add_argument("--strategies", nargs="+", default=["none", "layer", "full_iteration"],
                   choices=["none", "layer", "full_iteration"], help="'none' (eager) is the reference")
    return p.parse_args()


def batch(step: int, cfg, batch_size: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(strategy: str, args, info) -> dict:
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    model = GPT(cfg).to(info.device)
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fsdp_graph.fully_shard(block, mp_policy=policy)
    fsdp_graph.fully_shard(model, mp_policy=policy)
    cuda = info.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device=info.device) if cuda else 3e-4,
                                  fused=cuda or None, capturable=cuda)
    step = fsdp_graph.make_train_step(
        lambda x, y: model(x, y)[1], model, optimizer, config=fsdp_graph.GraphConfig(strategy=strategy),
        example_batch=batch(0, cfg, args.batch_size, info.rank, info.device), max_grad_norm=1.0)
    losses, times, peaks, live, full_gcs = [], [], [], [], []
    collections = [0]  # Python's full (generation 2) garbage collections so far

    def count_full_gc(phase: str, gc_info: dict) -> None:
        if phase == "start" and gc_info["generation"] == 2:
            collections[0] += 1

    gc.callbacks.append(count_full_gc)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    for i in range(args.steps):
        x, y = batch(i, cfg, args.batch_size, info.rank, info.device)
        sync(info.device)
        before = collections[0]
        start = time.perf_counter()
        loss = step(x, y)
        sync(info.device)
        times.append(time.perf_counter() - start)
        losses.append(loss.cpu())  # kept off the device: 1,000 losses there would look like growth
        full_gcs.append(collections[0] > before)
        peaks.append(torch.cuda.max_memory_allocated(info.device) if cuda else 0)
        live.append(torch.cuda.memory_allocated(info.device) if cuda else 0)
    gc.callbacks.remove(count_full_gc)
    gc.unfreeze()
    result = {"losses": torch.stack(losses), "times": times, "peaks": peaks, "live": live, "full_gcs": full_gcs}
    step = optimizer = model = None  # free them before the next strategy builds its own
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(info.device)
    return result


def main() -> int:
    args = parse_args()
    make_deterministic()
    info = fsdp_graph.init_distributed(timeout=600)
    if "none" not in args.strategies:
        args.strategies.insert(0, "none")
    results = {s: run(s, args, info) for s in args.strategies}
    eager = results["none"]["losses"]
    warmup = 5  # capture and the first replays
    failures, rows = [], []
    for strategy, r in results.items():
        timed = r["times"][warmup:] or r["times"]
        median = statistics.median(timed)
        slowest = max(timed)
        slow = [warmup + i for i, t in enumerate(timed) if t > args.slow_factor * median]
        slow_with_gc = [i for i in slow if r["full_gcs"][i]]
        settle = min(args.settle, len(r["peaks"]) - 1)
        settled = r["peaks"][settle]
        growth = r["peaks"][-1] - settled
        live_drift = max(r["live"][settle:]) - min(r["live"][settle:])
        differing = (r["losses"] != eager).nonzero()
        first_diff = int(differing[0]) if len(differing) else None
        rows.append(f"| {strategy} | {args.steps} | {1000 * median:.2f} | {1000 * slowest:.2f} | "
                    f"{slowest / median:.2f} | {len(slow)} ({len(slow_with_gc)}) | {settled / 2**30:.3f} | "
                    f"{growth / 2**20:+.2f} | {live_drift / 2**20:.2f} | {sum(r['full_gcs'])} | "
                    f"{'bitwise' if first_diff is None else f'differ from step {first_diff}'} |")
        if growth > 0:
            failures.append(f"{strategy}: peak memory grew by {growth} bytes after step {args.settle}")
        if slow:
            failures.append(f"{strategy}: steps {slow[:10]} took more than {args.slow_factor}x the median "
                            f"({len(slow_with_gc)} of them ran a full Python garbage collection)")
        if first_diff is not None:
            failures.append(f"{strategy}: losses differ from eager's from step {first_diff}")
    if info.rank == 0:
        print(f"soak: config {args.config}, world size {info.world_size}, {args.steps} steps, "
              f"device {info.device.type}, gc.freeze {'on' if args.gc_freeze else 'off'}")
        print(f"| strategy | steps | median ms | slowest ms | slowest / median | steps > {args.slow_factor:g}x median "
              "(with a full gc) | peak GiB at settle | peak growth after, MiB | live memory range after, MiB | "
              "full gcs | losses vs eager |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
        print("\n".join(failures) if failures else "soak: every check passed", flush=True)
    fsdp_graph.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
