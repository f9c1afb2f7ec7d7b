"""Run exit_job.py as many two-rank jobs, several at once, and report how every rank exited.

Each rank is a process forked from this interpreter after torch and fsdp_graph are imported (a
fresh ``python`` spends ~4 CPU-seconds importing them: 200 of those take minutes on 2 cores). A
rank runs the job and leaves by raising SystemExit, the way any script ends: atexit handlers,
interpreter finalisation, C++ static destructors, exit(). Its status is what the shell would see
(-6: aborted). ``gc.freeze()`` before forking keeps finalisation from touching (copying) every
inherited object: it is what makes a rank exit in ~0.3 s instead of ~1 s.

``--starve-gloo`` forces the unlucky schedule that a loaded machine hits by chance: each rank is
pinned to one CPU and gloo's worker threads get SCHED_IDLE, so they run only while the rank's
main thread waits. A worker that completes a collective wakes the main thread, which preempts it
before it has destroyed the collective's work item; it gets to that (and needs the GIL for it)
only when the main thread next blocks, which can be during finalisation. Without the fix, 10-35%
of runs abort that way. ``--no-exit-hook`` undoes init_distributed's atexit registration: the
behaviour before the fix, to see the test fail.

    python tests/scripts/many_exits.py --runs 100 --jobs 4 --starve-gloo
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exit_job  # noqa: E402  (puts the repo root on sys.path too)

import fsdp_graph  # noqa: E402

LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Rank(NamedTuple):
    job: int
    rank: int
    end: str
    log: str
    started: float


def _ports() -> Iterator[int]:
    """Free ports below the kernel's ephemeral range, each once: a port the kernel hands out (bind
    to port 0, or any outgoing connection) could be taken again before rank 0 binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    low = max(1024, ephemeral_low - 12000)
    for port in range(random.randrange(low, low + 2000), ephemeral_low):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        yield port


def _starve_gloo_workers(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if "gloo" in name:
            os.sched_setaffinity(int(tid), {cpu})
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


def _rank(rank: int, port: int, end: str, log: str, starve: bool, exit_hook: bool) -> None:
    """Runs in the forked child and never returns: its SystemExit unwinds to the top (no frame of
    this script holds a ``with`` or ``finally`` around the fork) and the interpreter finalises."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    code = 0
    try:
        fsdp_graph.init_distributed()  # before the job's own call: the gloo threads exist now
        if not exit_hook:
            atexit.unregister(fsdp_graph.shutdown)
        if starve:
            allowed = sorted(os.sched_getaffinity(0))
            _starve_gloo_workers(allowed[rank % len(allowed)])
        exit_job.main(end)
    except BaseException as err:  # any failure is this rank's result
        print(f"rank {rank} failed: {err!r}", flush=True)
        code = 3
    sys.exit(code)


def _start_job(index: int, end: str, port: int, tmp: str, args: argparse.Namespace) -> dict[int, Rank]:
    """Fork one job's two ranks: {pid: its Rank}."""
    ranks = {}
    for rank in range(2):
        log = os.path.join(tmp, f"job{index}_rank{rank}.log")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _rank(rank, port, end, log, args.starve_gloo, not args.no_exit_hook)
        ranks[pid] = Rank(index, rank, end, log, time.monotonic())
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=4, help="jobs running at once")
    parser.add_argument("--ends", default=",".join(exit_job.ENDS), help="how the jobs end, in turn")
    parser.add_argument("--starve-gloo", action="store_true")
    parser.add_argument("--no-exit-hook", action="store_true")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a rank counts as hung")
    args = parser.parse_args()
    ends = args.ends.split(",")

    torch.set_num_threads(1)
    for name in [*LAUNCH_ENV, *(k for k in os.environ if k.startswith("TORCHELASTIC_"))]:
        os.environ.pop(name, None)  # the ranks are launched here, not by whatever launched this script
    exit_job.main("none")  # world size 1, no group: imports and caches warm before forking
    gc.freeze()

    tmp = tempfile.mkdtemp(prefix="many_exits_")
    ports = _ports()
    start, results, running, started = time.monotonic(), [], {}, 0
    while started < args.runs or running:
        while started < args.runs and len({r.job for r in running.values()}) < args.jobs:
            running.update(_start_job(started, ends[started % len(ends)], next(ports), tmp, args))
            started += 1
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for hung, r in running.items():
                if time.monotonic() - r.started > args.timeout:
                    os.kill(hung, signal.SIGKILL)  # reaped next: exit code -9
            time.sleep(0.005)
            continue
        r = running.pop(pid)
        with open(r.log) as f:
            out = f.read()
        code = os.waitstatus_to_exitcode(status)
        results.append({"job": r.job, "rank": r.rank, "end": r.end, "code": code,
                        "aborted": "terminate called" in out, "log": out[-2000:]})
    shutil.rmtree(tmp)

    failed = [r for r in results if r["code"] != 0 or r["aborted"]]
    for r in failed:
        print(f"--- job {r['job']} rank {r['rank']} (end={r['end']}): exit code {r['code']}\n{r['log']}")
    summary = {"runs": args.runs, "ranks": len(results), "failed_ranks": len(failed),
               "failed_runs": len({r["job"] for r in failed}), "aborted_ranks": sum(r["aborted"] for r in results),
               "failed_runs_by_end": {e: len({r["job"] for r in failed if r["end"] == e}) for e in ends},
               "seconds": round(time.monotonic() - start, 1)}
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
