"""One GPU: test_unused_params_gpu's bitwise check with the use exchange forced on for a group of one
rank, so the read-back path (flags copied in, the all-reduce replayed alone, sums read back) runs with
a real NCCL all-reduce; its replay-count assertion runs too (info claims two ranks only for it)."""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
import test_unused_params_gpu as T  # noqa: E402

from dist_harness import run_ranks  # noqa: E402


def forced(info, optimizer_in_step):
    import functools

    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_graph
    import fsdp_graph.fsdp.unused_params as U
    U._several = lambda group: group  # (a group of one rank exchanges too)
    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("replicate", "shard"))  # (real groups of one rank)
    fsdp_graph.fully_shard = functools.partial(fsdp_graph.fully_shard, mesh=mesh)
    real_batch = T._batch
    T._batch = lambda i, _info: real_batch(i, info)  # (the real one-rank batch)
    claimed = dataclasses.replace(info, world_size=2)  # (only so _train asserts the exchange's replays)
    T._graphs_match_eager(claimed, optimizer_in_step)


if __name__ == "__main__":
    for opt_in in (True, False):
        try:
            run_ranks(forced, 1, opt_in, timeout=300)
            print("PASS optimizer_in_step", opt_in, flush=True)
        except AssertionError as e:
            print("FAIL optimizer_in_step", opt_in, str(e)[-2000:], flush=True)
