"""One GPU: the parity test's cases on a 1 x 1 HSDP mesh, so the units hold real NCCL groups of one
rank and the root's piece graphs capture a real reduce-scatter and all-reduce with the write."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
from dist_harness import run_ranks
from test_graph_parity_gpu import _eager_and_graphed_agree

CASES = [
    ("blocks", False, 0, (1, 1), True, "wide_root"),
    ("blocks", False, 0, (1, 1), False, "wide_root"),
    ("blocks", False, 0, (1, 1), True, None),
    ("blocks", False, 0, (1, 1), True, "grads_kept"),
    ("blocks", True, 0, (1, 1), True, None),
]
if __name__ == "__main__":
    for case in CASES:
        try:
            run_ranks(_eager_and_graphed_agree, 1, *case, timeout=300)
            print("PASS", case, flush=True)
        except AssertionError as e:
            print("FAIL", case, str(e)[-1500:], flush=True)
