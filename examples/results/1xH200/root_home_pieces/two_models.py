"""Diagnose: two GPTs graphed in one call, backwards B then A; which parameters' step-0 gradients differ from eager."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
import torch

import fsdp_graph
from fsdp_graph.fsdp.registry import units_in

from dist_harness import run_ranks
from test_graph_parity_gpu import CFG, _batch, _build


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def run(info, graphed, order="BA", late=True, collective=None, dtype=torch.float32, steps=4):
    models = [_build(info, oversized_block=False, wide_root=True) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    if graphed:
        blocks = [b for m in models for b in m.blocks]
        sample = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device, dtype=dtype, requires_grad=True)
        fsdp_graph.graph_modules(blocks, [(sample,)] * len(blocks), collective_graphs=collective)
    losses, grads0 = [], None
    for i in range(steps):
        idx, targets = _batch(i, info)
        la = models[0](idx, targets)[1]
        lb = models[1](idx, (targets + 1) % CFG.vocab_size)[1]
        for which in order:
            (la if which == "A" else lb).backward()
        if i == 0:
            grads0 = [{n: _local(p.grad).clone() for n, p in m.named_parameters() if p.grad is not None}
                      for m in models]
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(torch.stack([la.detach(), lb.detach()]))
    homes = [units_in(m)[0].grads.sharded.home is not None for m in models]
    return torch.stack(losses), grads0, homes


def main(info):
    torch.use_deterministic_algorithms(True)
    for order in ("BA",):
        e_losses, e_grads, _ = run(info, False, order)
        for kw in ({}, {"collective": False}, {"dtype": torch.bfloat16}):
            losses, grads, homes = run(info, True, order, **kw)
            bad = []
            for m, (g, eg) in enumerate(zip(grads, e_grads)):
                for n in eg:
                    if n not in g:
                        bad.append(f"{'AB'[m]}:{n}:missing")
                    elif not torch.equal(g[n], eg[n]):
                        bad.append(f"{'AB'[m]}:{n}:{(g[n].float() - eg[n].float()).abs().max().item():.3g}")
            same = [torch.equal(losses[:, k], e_losses[:, k]) for k in range(2)]
            print(f"order {order} {kw} homes {homes}: losses equal A,B {same}; "
                  f"step-0 grads differing {len(bad)}: {bad[:12]}", flush=True)


if __name__ == "__main__":
    run_ranks(main, 1, timeout=400)
