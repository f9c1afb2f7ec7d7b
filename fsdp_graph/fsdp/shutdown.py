"""Ending a distributed job without an abort at interpreter exit.

Why: gloo runs each collective as a work item on one of its worker threads ("pt_gloo_runloop"),
and the worker destroys that item a moment after the collective has completed, when the main
thread may already have moved on. Destroying it drops the Python objects the item holds (the
input tensors, whose Python objects the caller may have dropped already, and objects captured in
its thread-local-state snapshot), and that takes the GIL. If the main thread has started
finalising the interpreter by then, CPython ends the worker with ``pthread_exit``; the unwind
crosses a ``noexcept`` C++ destructor, and the process aborts with "terminate called without an
active exception" (pytorch/pytorch#190489). ``destroy_process_group`` alone does not help: the
workers live as long as anything (a sharded model, a mesh) still references the group, usually
until finalisation.

``shutdown()`` first lets those workers finish (the GIL released, bounded), then releases the CUDA
graphs that captured NCCL collectives (``communicator_graphs.py``: NCCL's destroy would wait for
them forever), then destroys the process group, all while the interpreter is fully alive.
``init_distributed`` registers it with ``atexit`` when it creates the group: atexit handlers run
before finalisation starts, so a script that just ends, or that calls
``torch.distributed.destroy_process_group()`` itself, exits cleanly too.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import warnings

import torch.distributed as dist

from .communicator_graphs import release_graphs

_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives gloo's worker threads
_TASKS = "/proc/self/task"
_IDLE_TIMEOUT_S = 2.0
_NO_PROC_WAIT_S = 0.05
_registered = False


def shutdown() -> None:
    """Destroy the default process group (and its subgroups) safely; idempotent.

    Waits (at most 2 s, the GIL released) until gloo's worker threads are idle, so none of them
    needs the GIL after the interpreter starts finalising, releases the CUDA graphs that captured
    collectives, then calls ``destroy_process_group``.
    Call it at the end of a script, or let the ``atexit`` hook that ``init_distributed``
    registers call it. It runs no collective: it is safe when another rank has failed.
    """
    wait_for_gloo_workers()
    release_graphs()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def register_shutdown_at_exit() -> None:
    """Run ``shutdown()`` at interpreter exit (once), before finalisation starts."""
    global _registered
    if not _registered:
        atexit.register(_shutdown_at_exit)
        _registered = True


def _shutdown_at_exit() -> None:
    """``shutdown()``, unless the script died of an exception on NCCL: its collectives may still be
    pending on a peer that failed, and tearing the communicators down could then wait for them;
    the process ends anyway (torchrun stops the other ranks)."""
    died = getattr(sys, "last_value", None) is not None
    if died and dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        return
    shutdown()


def wait_for_gloo_workers(timeout: float = _IDLE_TIMEOUT_S) -> bool:
    """Return once every gloo worker thread is idle (True), or after ``timeout`` s (False).

    Idle: asleep, and not woken once during a window of two GIL switch intervals in which this
    thread sleeps (so the GIL is free). A worker still destroying a finished work item is either
    running, or waiting for the GIL, and a thread waiting for the GIL wakes every switch interval
    (CPython's timed wait), so it shows as woken; an idle worker sleeps on its queue until the
    next collective. Linux shows threads in /proc; elsewhere this sleeps briefly instead.
    """
    before = _gloo_worker_states()
    if before is None:
        time.sleep(_NO_PROC_WAIT_S)  # no /proc: give the workers the GIL for a moment
        return True
    window = max(0.01, 2 * sys.getswitchinterval())
    deadline = time.monotonic() + timeout
    while before:
        time.sleep(window)  # releases the GIL: a worker waiting for it gets it now
        after = _gloo_worker_states() or {}
        if all(state[0] == "S" and before.get(tid) == state for tid, state in after.items()):
            return True
        if time.monotonic() > deadline:
            warnings.warn(f"fsdp_graph.shutdown: gloo's worker threads were still busy after {timeout:.0f} s; "
                          "the process may abort at exit. Is a collective still running (an async_op=True "
                          "collective never waited for, or one another rank never joined)?", stacklevel=3)
            return False
        before = after
    return True


def _gloo_worker_states() -> dict[int, tuple[str, str, str]] | None:
    """{thread id: (state, voluntary, involuntary context switches)} of gloo's worker threads;
    None where /proc is not available."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    states = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"{_TASKS}/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:  # the thread ended meanwhile
            continue
        states[int(tid)] = (fields["State"].split()[0], fields["voluntary_ctxt_switches"].strip(),
                            fields["nonvoluntary_ctxt_switches"].strip())
    return states
