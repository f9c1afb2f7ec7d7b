"""Make HF transformers run, eagerly too, the code path it runs under CUDA graph capture.

transformers asks ``is_tracing()`` (true under ``torch.compile``, export and CUDA stream capture)
before its data-dependent shortcuts: outside a capture it reads the batch on the host (is any
sequence packed? is the padding mask all ones?) and, if it may, skips the causal mask so that
SDPA runs its ``is_causal`` kernels; under capture it builds the mask from shapes alone. A graphed
step runs eagerly first (warm-up, and ``strategy='none'``) and is then captured, so the two paths
meet in one run: the warm-up's host syncs are refused although the capture would not make them,
and the graph replays other attention kernels than the eager steps ran (not bitwise).

The rule, for any library that branches on ``torch.cuda.is_current_stream_capturing()``: give it
the same answer in eager runs as under capture. Here that answer is "capturing": HF's static path,
which has no host sync, honours padding masks and packed ``position_ids``, and is the path HF
itself keeps correct for compile and export. Its cost: the causal mask is materialised, so SDPA
cannot use its flash kernel (measured in the benchmark, ``--model hf-llama``).

Mechanism: ``is_tracing`` looks at capture through one function,
``transformers.utils.import_utils.is_cuda_stream_capturing``. It is replaced, once, by one that
answers True while the ``forward`` of a model passed to ``take_capture_path`` is running in this
thread (its frame is on the Python stack, with that model as ``self``), and defers to torch
otherwise. Nothing is counted, so nothing can be left over: an exception, a KeyboardInterrupt, a
failed capture or a hook that raises cannot leave HF on the wrong path, and the model carries no
hooks (graphing a module that contains it works as before). HF models not passed to
``take_capture_path`` keep HF's own behaviour. ``make_train_step`` / ``make_eval_step`` refuse,
before any capture, a graph that would run an HF model without it (``steps/graph_config.py``).
"""

from __future__ import annotations

import inspect
import sys

import torch.nn as nn

from ..steps.graph_config import CAPTURE_PATH_MARK, is_hf_model

_forward_codes: set = set()  # the code of every marked model class's forward (unwrapped from HF's decorators)


def _in_marked_forward() -> bool:
    """Whether a marked model's forward is on this thread's Python stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _forward_codes and getattr(frame.f_locals.get("self"), CAPTURE_PATH_MARK, False):
            return True
        frame = frame.f_back
    return False


class _Probe:
    """A stand-in marked model: is_tracing() must say True inside its forward."""

    def forward(self, import_utils) -> bool:
        return import_utils.is_tracing()


setattr(_Probe, CAPTURE_PATH_MARK, True)


def _self_test(import_utils) -> bool:
    """transformers' is_tracing() follows the replaced probe inside a marked forward."""
    code = _Probe.forward.__code__
    added = code not in _forward_codes
    _forward_codes.add(code)
    try:
        return _Probe().forward(import_utils) is True
    finally:
        if added:
            _forward_codes.discard(code)


def _install() -> None:
    """Replace transformers' capture probe once, and check that ``is_tracing`` now follows it."""
    import transformers
    from transformers.utils import import_utils

    probe = getattr(import_utils, "is_cuda_stream_capturing", None)
    if probe is None or not hasattr(import_utils, "is_tracing"):
        raise RuntimeError(
            f"fsdp_graph.hf.take_capture_path: transformers {transformers.__version__} has no "
            "utils.import_utils.is_cuda_stream_capturing, through which it asks whether a CUDA graph capture is "
            "under way; install transformers>=5.17 (or graph only decoder layers: strategy='layer')."
        )
    if getattr(probe, "_fsdp_graph", False):
        return

    def is_cuda_stream_capturing() -> bool:
        return (bool(_forward_codes) and _in_marked_forward()) or probe()

    is_cuda_stream_capturing._fsdp_graph = True
    import_utils.is_cuda_stream_capturing = is_cuda_stream_capturing
    if not _self_test(import_utils):
        import_utils.is_cuda_stream_capturing = probe
        raise RuntimeError(
            f"fsdp_graph.hf.take_capture_path: transformers {transformers.__version__}'s is_tracing() does not "
            "consult is_cuda_stream_capturing, so its capture path cannot be chosen for eager runs; install "
            "transformers>=5.17 (or graph only decoder layers: strategy='layer')."
        )


def take_capture_path(model: nn.Module) -> nn.Module:
    """Make ``model`` (an HF ``PreTrainedModel``) run HF's capture path in every forward; returns it.

    Call it once, before building the step; ``fsdp_graph.hf.shard_model`` does. Eager, per-layer
    and whole-step runs then compute the same kernels, bitwise, and no warm-up is refused for a
    host sync that only HF's eager path makes.
    """
    hf_models = [m for m in model.modules() if is_hf_model(m)]
    if not hf_models:
        raise TypeError(
            f"fsdp_graph.hf.take_capture_path: {type(model).__name__} is not a transformers PreTrainedModel and "
            "contains none; it is for HF models (your own code can simply not branch on capture)."
        )
    _install()
    for module in hf_models:
        _forward_codes.add(inspect.unwrap(type(module).forward).__code__)
        setattr(module, CAPTURE_PATH_MARK, True)
    return model
