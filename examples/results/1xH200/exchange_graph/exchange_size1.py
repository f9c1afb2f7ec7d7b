"""One GPU: the parity test on a 1 x 1 HSDP mesh with the use exchange forced on for groups of one
rank (it skips them otherwise), so the exchange's graph is captured and replayed with a real NCCL
all-reduce; the parity test asserts its replays (collective graphs on) or its absence (off)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
from dist_harness import run_ranks  # noqa: E402
from test_graph_parity_gpu import _eager_and_graphed_agree  # noqa: E402


def forced(info, *case):
    import fsdp_graph.fsdp.unused_params as U
    U._several = lambda group: group  # (a group of one rank exchanges too)
    _eager_and_graphed_agree(info, *case)


if __name__ == "__main__":
    for case in [("blocks", False, 0, (1, 1), True, None), ("blocks", False, 0, (1, 1), False, None),
                 ("blocks", False, 0, (1, 1), True, "wide_root")]:
        try:
            run_ranks(forced, 1, *case, timeout=200)
            print("PASS", case, flush=True)
        except AssertionError as e:
            print("FAIL", case, str(e)[-1500:], flush=True)
