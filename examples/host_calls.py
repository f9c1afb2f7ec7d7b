"""Deterministic host cost of the eager hot path: Python function calls per training step.

Wall-clock host times on shared machines vary by 2x between runs; the number of Python calls
the package makes per step does not. Counted with ``sys.setprofile`` on a tiny model (12 blocks,
world size 1, CPU), where the hooks, not the arithmetic, are the work:

    python examples/host_calls.py            # calls per step inside fsdp_graph, and in all
    python examples/host_calls.py --by-function

Compare two checkouts by running each one's copy (``PYTHONPATH=<checkout>``).
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
import torch.nn as nn

import fsdp_graph


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(self.ln(x))))


class _Model(nn.Module):
    def __init__(self, d: int = 16, n_blocks: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def count_calls(steps: int = 10) -> collections.Counter:
    """Calls per step: 'fsdp_graph', 'all', and one key per package function."""
    torch.manual_seed(0)
    model = _Model()
    for block in model.blocks:
        fsdp_graph.fully_shard(block)
    fsdp_graph.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 16, requires_grad=True)

    def step() -> None:
        model(x).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # lazy init and the recorded order are not the steady state
        step()
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg) -> None:
        if event == "call":
            counts["all"] += 1
            path = frame.f_code.co_filename.replace("\\", "/")
            if "/fsdp_graph/" in path:
                counts["fsdp_graph"] += 1
                counts[path.split("/fsdp_graph/")[-1] + ":" + frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
    return collections.Counter({k: v // steps for k, v in counts.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--by-function", action="store_true", help="also list the calls per package function")
    args = parser.parse_args()
    counts = count_calls()
    print(f"python calls per step: {counts['fsdp_graph']} in fsdp_graph, {counts['all']} in all")
    if args.by_function:
        for name, n in counts.most_common():
            if name not in ("all", "fsdp_graph"):
                print(f"{n:6d}  {name}")


if __name__ == "__main__":
    main()
