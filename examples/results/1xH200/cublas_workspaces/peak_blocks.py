"""(Run from the repository root, PYTHONPATH=$PWD.)
At each system's memory peak (memory_breakdown's method): every block alive outside the graph
pools, >= 1 MiB, with its allocation stack and the trace index it was allocated at (against the
trace's length: which step). Usage: torchrun ... .probe/peak_blocks.py CONFIG SYSTEM..."""
import gc
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
import memory_breakdown as M  # noqa: E402
import torch  # noqa: E402

import fsdp_graph  # noqa: E402

import benchmark as B  # noqa: E402


def frames_of(event, n=7):
    out = []
    for f in event.get("frames", [])[:60]:
        fn = f["filename"]
        if "/torch/" in fn and out:
            continue
        out.append(f"{fn.rsplit('/', 1)[-1]}:{f['line']} {f['name']}")
        if len(out) >= n:
            break
    return " < ".join(out) or "(no python frame)"


def main():
    config, systems = sys.argv[1], sys.argv[2:]
    B.set_allocator(None)
    info = fsdp_graph.init_distributed()
    env = B.Env(info.rank, info.world_size, info.device)
    bench = B.bench_config(config)
    warmup = 5
    batches = B.make_batches(bench, env, warmup + 4)
    for system in systems:
        marks = []

        def run():
            step, _ = B.BUILDERS[system](bench, env, batches, warmup)
            first = warmup if system in B.WHOLE_GRAPH_SYSTEMS else 0
            for i in range(first, warmup + 3):
                torch.cuda.synchronize()
                marks.append(torch.cuda.memory_allocated())
                step(*batches[i])
            return step.bench_model, step.bench_optimizer

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        model, opt = run()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        pools = M._graph_pool_segments(snap)
        by_storage = M._storage_categories(model, opt)
        at, at_pool = M._peaks(trace, pools)
        tl = M._replayed(trace, pools, at)
        site = M._site(trace[at].get("frames", []))
        print(f"\n##### {config} {system}: peak {tl.total / 2**30:.4f} GiB at trace {at}/{len(trace)}, "
              f"pool {tl.pool_size / 2**30:.4f}, outside {tl.outside_bytes / 2**30:.4f}; site {site}")
        print("  peak stack:", frames_of(trace[at], 12))
        index = {id(e): i for i, e in enumerate(trace)}
        rows = sorted(tl.outside.items(), key=lambda kv: -kv[1]["size"])
        small = 0
        for addr, ev in rows:
            if ev["size"] < 2**20:
                small += ev["size"]
                continue
            cat = by_storage.get(addr) or M._by_frames(ev.get("frames", []))
            print(f"  {ev['size'] / 2**20:8.2f} MiB @{index.get(id(ev))} [{cat[:28]}] {frames_of(ev)}")
        print(f"  (+ {small / 2**20:.2f} MiB in blocks < 1 MiB)")
        if pools:
            pc = M._pool_contents(M._replayed(trace, pools, at_pool))
            print("  pool at fullest:", {k: round(v, 4) for k, v in pc["kinds"].items()}, round(pc["pool_gib"], 4))
        del model, opt, trace, snap, tl
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
