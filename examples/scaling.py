"""How each system's step time, throughput, memory and ratios move as the world grows: one table and
one chart from benchmark runs at several world sizes (issue #16).

    for n in 2 4 8; do
        torchrun --standalone --nproc-per-node $n examples/benchmark.py --config small medium large --out bench/ws$n
    done
    python examples/scaling.py bench/ws2/results-gpt.json bench/ws4/results-gpt.json bench/ws8/results-gpt.json \\
        --out bench/

Writes scaling-MODEL.md (per config: each system's step time, tokens/s per GPU, MFU, peak memory
per GPU and its ratios to FSDP2, one column group per world size) and scaling-MODEL.png (each
ratio against the world size; needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

RATIOS = (("x_fsdp2_eager", "× fsdp2_eager"), ("x_fsdp2_full_graph", "× fsdp2_full_graph"))


def load(paths: list[str]) -> list[dict]:
    """The records of every file: one model, and one record per (config, system, world size)."""
    records, seen = [], {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for r in data if isinstance(data, list) else data["records"]:
            key = (r["config"], r["system"], r["world_size"])
            if key in seen:
                raise ValueError(f"{path} and {seen[key]} both hold {key}: pass one run per world size")
            seen[key] = path
            records.append(r)
    models = {r.get("model", "gpt") for r in records}
    if len(models) != 1:
        raise ValueError(f"the files hold runs of several models ({sorted(models)}): pass one model's files")
    return records


def _cell(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def table(records: list[dict]) -> list[str]:
    sizes = sorted({r["world_size"] for r in records})
    model = records[0].get("model", "gpt")
    lines = [f"Model: {model}; world sizes {', '.join(map(str, sizes))} "
             f"({', '.join(sorted({r['device'] for r in records}))})", ""]
    by_config = defaultdict(list)
    for r in records:
        by_config[r["config"]].append(r)
    head = ["step ms", "tokens/s per GPU", "MFU", "peak GiB per GPU", *(label for _, label in RATIOS)]
    for config, rows in by_config.items():
        lines += [f"### {config}", "", "| system | world size | " + " | ".join(head) + " |",
                  "|---|---|" + "---|" * len(head)]
        for system in dict.fromkeys(r["system"] for r in rows):
            for r in sorted((r for r in rows if r["system"] == system), key=lambda r: r["world_size"]):
                if not r.get("step_ms_median"):
                    continue  # skipped (a graph system on CPU)
                cells = [_cell(r["step_ms_median"], ".2f"), _cell(r["tokens_per_s"] / r["world_size"], ",.0f"),
                         _cell(None if r.get("mfu") is None else 100 * r["mfu"], ".1f"),
                         _cell(r.get("peak_mem_gib"), ".2f"), *(_cell(r.get(key), ".2f") for key, _ in RATIOS)]
                lines.append(f"| {system} | {r['world_size']} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot(records: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return False
    configs = list(dict.fromkeys(r["config"] for r in records))
    fig, axes = plt.subplots(len(RATIOS), len(configs), figsize=(5 * len(configs), 3.5 * len(RATIOS)),
                             squeeze=False)
    for col, config in enumerate(configs):
        rows = [r for r in records if r["config"] == config and r.get("step_ms_median")]
        for row, (key, label) in enumerate(RATIOS):
            ax = axes[row][col]
            for system in dict.fromkeys(r["system"] for r in rows):
                points = sorted((r["world_size"], r[key]) for r in rows if r["system"] == system and r.get(key))
                if points:
                    ax.plot(*zip(*points), marker="o", label=system)
            ax.set_title(f"{config}: step time {label}", fontsize=9)
            ax.set_xlabel("world size (GPUs)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results-MODEL.json of benchmark runs, one per world size")
    p.add_argument("--out", default=".", help="folder for scaling-MODEL.md and scaling-MODEL.png")
    args = p.parse_args(argv)
    try:
        records = load(args.results)
    except ValueError as err:
        raise SystemExit(f"scaling.py: {err}") from None
    model = records[0].get("model", "gpt")
    os.makedirs(args.out, exist_ok=True)
    md = os.path.join(args.out, f"scaling-{model}.md")
    with open(md, "w") as f:
        f.write("\n".join(table(records)))
    print(f"wrote {md}")
    if plot(records, os.path.join(args.out, f"scaling-{model}.png")):
        print(f"wrote {os.path.join(args.out, f'scaling-{model}.png')}")


if __name__ == "__main__":
    main()
