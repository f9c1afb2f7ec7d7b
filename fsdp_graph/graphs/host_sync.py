"""Find host synchronisations in code that is about to be captured, before the capture.

A CUDA graph cannot contain a host sync: ``.item()``, ``.tolist()``, ``print`` of a CUDA
tensor, a data-dependent shape (``nonzero``, boolean-mask indexing, ``unique``), a tensor used
as a Python ``bool`` (``if mask.all():``) or an explicit ``synchronize``. Inside a capture they
fail with an opaque CUDA error (or invalidate the capture). Warm-up passes therefore run under
``torch.cuda.set_sync_debug_mode("error")``, which makes PyTorch raise at the offending
operation, and the error is turned into one that names the fix and the line that synced: the
innermost frame of the traceback outside torch itself, so the user's or the library's own code
(``transformers/masking_utils.py:755``), not torch's printing or dispatch internals. (PyTorch's
check covers its own CUDA operations, not ``torch.distributed``: collectives never sync anyway.)
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class HostSyncError(RuntimeError):
    """Code meant for a CUDA graph synchronises with the host."""


def syncing_line(err: BaseException) -> str | None:
    """``file:line in function: source`` of the innermost frame outside torch that led to ``err``."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    if not frames:
        return None
    frame = frames[-1]
    source = f": {frame.line.strip()}" if frame.line else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}{source}"


def host_sync_message(where: str, line: str | None = None) -> str:
    at = f" at {line}" if line else ""
    return (
        f"{where} synchronises with the host{at}. A CUDA graph cannot contain that: .item(), .tolist(), "
        ".cpu(), a tensor used as a Python bool (if t.all():), printing a CUDA tensor, a data-dependent "
        "shape such as nonzero() / boolean-mask indexing / unique(), or torch.cuda.synchronize(). Keep "
        "values on the device (return the loss tensor and call .item() after the step; use torch.where "
        "instead of masking), or leave that code outside the graph: strategy='layer' graphs only the "
        "modules you select, strategy='none' runs eagerly."
        + (_HF_HINT if line and f"{os.sep}transformers{os.sep}" in line else "")
    )


_HF_HINT = (
    " This line is in transformers, which skips such reads under capture: make the model take that path in "
    "eager steps too, fsdp_graph.hf.take_capture_path(model) (fsdp_graph.hf.shard_model does it)."
)


@contextmanager
def no_host_sync(where: str, enabled: bool = True) -> Iterator[None]:
    """Raise ``HostSyncError`` naming ``where`` and the syncing line if the body synchronises with the host."""
    if not enabled or not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # torch warns, once per process, that the debug mode is a prototype
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as err:
        if "synchronizing" in str(err) and not isinstance(err, HostSyncError):
            raise HostSyncError(host_sync_message(where, syncing_line(err))) from err
        raise
    finally:
        torch.cuda.set_sync_debug_mode(previous)
