"""Ranks agreeing that they all make the same call, before any collective of it runs.

A collective that some rank never joins hangs until the process group's timeout and then fails
somewhere else (or pairs with an unrelated collective of the other ranks: gloo aborts, a load
silently stops half way). ``agree(what, ranks)`` runs first: each rank writes ``what`` into the
default group's store under a per-call sequence number and waits for every other rank's entry.
Ranks calling different things fail at once, naming both; a rank that never arrives makes the
others fail after the timeout, naming it. It costs a store round trip, so it guards rare calls
(state dicts, checkpoints, recovery after a failed step), never the per-layer hot path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

_PREFIX = "fsdp_graph/agree"
_sequence: dict[tuple, int] = {}  # (channel, ranks) -> number of agreements this process made


class AgreementError(RuntimeError):
    """Not every rank made the same call: the collective it guards did not start."""


def _default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def agree(what: str, ranks: Sequence[int] | None = None, *, channel: str = "calls",
          timeout: float | None = None) -> None:
    """Return once every rank of ``ranks`` (default: all) called ``agree`` with the same ``what``
    on ``channel``; raise ``AgreementError`` naming the ranks that called something else, or that
    did not call within ``timeout`` seconds (default: the store's timeout, the process group's)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    ranks = tuple(range(dist.get_world_size())) if ranks is None else tuple(sorted(ranks))
    if len(ranks) <= 1:
        return
    me = dist.get_rank()
    key = (channel, ranks)
    seq = _sequence.get(key, 0)
    _sequence[key] = seq + 1
    group_id = "-".join(map(str, ranks)) if len(ranks) < 64 else f"{len(ranks)}x{hash(ranks)}"
    base = f"{_PREFIX}/{channel}/{group_id}/{seq}"
    keys = [f"{base}/{r}" for r in ranks]
    store = _default_store()
    store.set(f"{base}/{me}", what)
    wait = store.timeout if timeout is None else timedelta(seconds=timeout)
    start = time.monotonic()
    try:
        store.wait(keys, wait)
    except RuntimeError:  # DistStoreError on a timeout
        missing = [r for r in ranks if not store.check([f"{base}/{r}"])]
        # Withdraw: a rank arriving late must wait for this one again, not agree with a call it gave up
        # on; and this rank's next call is this same agreement (the counters stay in step).
        store.delete_key(f"{base}/{me}")
        _sequence[key] = seq
        raise AgreementError(
            f"rank {me}: {what} is a collective call, and rank(s) {missing} did not make it within "
            f"{time.monotonic() - start:.0f} s (of ranks {list(ranks)}). Every rank must make it, at the same point: "
            "look for a call made on one rank only (under `if rank == 0`), a rank that skipped or failed a step, "
            "or a rank that died."
        ) from None
    values = {r: v.decode() for r, v in zip(ranks, store.multi_get(keys))}  # one round trip
    others = {r: v for r, v in values.items() if v != what}
    if others:
        listed = "; ".join(f"rank {r}: {v}" for r, v in sorted(others.items()))
        raise AgreementError(
            f"rank {me} called {what}, but at the same point {listed}. Every rank must make the same "
            "collective calls in the same order."
        )
    if seq > 0:  # every rank has passed the previous agreement: its entry is no longer read
        store.delete_key(f"{_PREFIX}/{channel}/{group_id}/{seq - 1}/{me}")
