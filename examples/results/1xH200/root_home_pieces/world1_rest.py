"""One GPU: the 2-GPU-only bitwise tests of HF models and the whole step at one rank (a 1 x 1 HSDP mesh
for the whole step: real NCCL groups of one rank)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
import test_hf_models_gpu as H  # noqa: E402

import test_full_iteration_gpu as F  # noqa: E402
from dist_harness import run_ranks  # noqa: E402

if __name__ == "__main__":
    cases = [(H._every_strategy_bitwise, (arch,)) for arch in H.ARCHS]
    cases += [(F._full_iteration_matches_eager, args) for args in
              [(1, None, True, None), (2, 1.0, True, None), (1, 1.0, True, (1, 1))]]
    for fn, args in cases:
        try:
            run_ranks(fn, 1, *args, timeout=240)
            print("PASS", fn.__name__, args, flush=True)
        except AssertionError as e:
            print("FAIL", fn.__name__, args, str(e)[-1200:], flush=True)
