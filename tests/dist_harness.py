"""Run a test function on N ranks, the way torchrun would, from inside pytest.

Each rank is a fresh process (forkserver: torch is imported once, no CUDA state is inherited)
with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, and calls
``fsdp_graph.init_distributed(backend)`` itself. The backend is NCCL when there are enough
GPUs, gloo otherwise (or what FSDP_GRAPH_TEST_BACKEND says). A rank's exception fails the test
with that rank's traceback. A rank still running after the time limit is killed, and the test
fails with where every hung rank waited: its Python stacks and its last collectives
(``collective_record.py``: which collective, of which unit and step, whether it returned).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

TIMEOUT_S = float(os.environ.get("FSDP_GRAPH_TEST_TIMEOUT", "240"))
_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "fsdp_graph"])  # DTensor imports dynamo


def backend_for(world_size: int) -> str:
    forced = os.environ.get("FSDP_GRAPH_TEST_BACKEND")
    if forced:
        return forced
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, backend: str, error_file: str, timeout: float,
               group_timeout: float | None, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
    )
    torch.set_num_threads(1)
    import faulthandler

    import torch.distributed as dist

    dump_after = max(timeout - min(15.0, timeout / 4), 1.0)
    stacks = open(error_file + ".stacks", "w")  # a hung rank leaves its Python stacks here
    faulthandler.dump_traceback_later(dump_after, file=stacks)

    import fsdp_graph

    from collective_record import record_collectives

    record_collectives(error_file + ".collectives", dump_after)  # ... and its last collectives here

    code = 0
    try:
        info = fsdp_graph.init_distributed(backend, timeout=group_timeout)
        fn(info, *args)
        if dist.is_initialized():
            dist.barrier()
    except BaseException:
        Path(error_file).write_text(traceback.format_exc())
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Skip interpreter shutdown: with gloo, a worker thread can abort the process while Python
    # finalises (pytorch/pytorch#190489), failing a rank whose test passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(fn: Callable, world_size: int, *args, backend: str | None = None, timeout: float | None = None,
              group_timeout: float | None = None) -> None:
    """Run ``fn(info, *args)`` on ``world_size`` ranks; ``fn`` must be a module-level function.
    ``timeout``: seconds before a rank still running counts as hung (FSDP_GRAPH_TEST_TIMEOUT, 240).
    ``group_timeout``: the process group's (``init_distributed(timeout=)``; torch's default if None)."""
    backend = backend or backend_for(world_size)
    timeout = TIMEOUT_S if timeout is None else timeout
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        errors = [os.path.join(tmp, f"rank{r}.err") for r in range(world_size)]
        procs = [
            _ctx.Process(target=_rank_main, args=(fn, r, world_size, port, backend, errors[r], timeout, group_timeout,
                                                    args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        reports = [f"--- rank {r} ---\n{Path(e).read_text()}" for r, e in enumerate(errors) if os.path.exists(e)]
        if hung:
            reports += [_hang_report(r, errors[r]) for r in hung]
        if reports or hung:
            detail = "\n".join(reports)
            if hung:
                detail = f"ranks {hung} did not finish within {timeout:.0f}s\n{detail}"
            raise AssertionError(f"{fn.__name__} failed on {backend} x{world_size}:\n{detail}")
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise AssertionError(f"{fn.__name__}: rank exit codes {codes} on {backend} x{world_size}")


def _hang_report(rank: int, error_file: str) -> str:
    parts = [f"--- rank {rank} hung ---"]
    for suffix, title in ((".collectives", "last collectives (oldest first)"), (".stacks", "Python stacks")):
        path = error_file + suffix
        text = Path(path).read_text().strip() if os.path.exists(path) else ""
        parts.append(f"{title}:\n{text or '(not written: the rank did not reach the dump time)'}")
    return "\n".join(parts)
