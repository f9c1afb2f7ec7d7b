"""One stream per device for every warm-up and capture this package runs.

cuBLAS keeps a workspace for each (thread's handle, stream) it has run a matmul on, for the life of
the process (32 MiB each on H100 and H200, ``torch._C._cuda_getCublasWorkspaceSize()``), and a
captured graph keeps using the one it captured with. A fresh stream per capture left two more behind
every time (the capturing thread's and autograd's): per-layer graphs, segments, a whole step, an
evaluation graph and every rebuild paid them again. Sharing one stream pays them once per process.
Captures run one at a time, so nothing else queues on it meanwhile.
"""

from __future__ import annotations

import torch

_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """The capture stream of ``device`` (None: the current device), made on first use."""
    index = torch.cuda._utils._get_device_index(device, optional=True)
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(index)
    return stream
