"""Find host synchronisations in code that is about to be captured, before the capture.

A CUDA graph cannot contain a host sync: ``.item()``, ``.tolist()``, ``print`` of a CUDA
tensor, a data-dependent shape (``nonzero``, boolean-mask indexing, ``unique``) or an explicit
``synchronize``. Inside a capture they fail with an opaque CUDA error (or invalidate the
capture). Warm-up passes therefore run under ``torch.cuda.set_sync_debug_mode("error")``, which
makes PyTorch raise at the offending operation, and the error is turned into one that names the
fix. (PyTorch's check covers its own CUDA operations, not ``torch.distributed``: collectives
never sync anyway.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class HostSyncError(RuntimeError):
    """Code meant for a CUDA graph synchronises with the host."""


def host_sync_message(where: str) -> str:
    return (
        f"{where} synchronises with the host (.item(), .tolist(), .cpu(), printing a CUDA tensor, "
        "a data-dependent shape such as nonzero() / boolean-mask indexing / unique(), or "
        "torch.cuda.synchronize()), which a CUDA graph cannot contain. Keep values on the device "
        "(return the loss tensor and call .item() after the step; use torch.where instead of "
        "masking), or leave that code outside the graph: strategy='layer' graphs only the modules "
        "you select, strategy='none' runs eagerly."
    )


@contextmanager
def no_host_sync(where: str, enabled: bool = True) -> Iterator[None]:
    """Raise ``HostSyncError`` naming ``where`` if the body synchronises with the host."""
    if not enabled or not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as err:
        if "synchronizing" in str(err) and not isinstance(err, HostSyncError):
            raise HostSyncError(host_sync_message(where)) from err
        raise
    finally:
        torch.cuda.set_sync_debug_mode(previous)
