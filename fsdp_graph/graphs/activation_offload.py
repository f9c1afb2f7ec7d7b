"""Activation offload: the saved activations of chosen modules wait in pinned host memory between
their forward and their backward.

For memory-bound training. Around each chosen module's forward, ``saved_tensors_hooks`` sends
every tensor autograd saves (a CUDA tensor of at least ``min_bytes``, not a parameter; a view
goes as its base, once for all its views) to pinned host memory, on an offload stream that
waits for the compute stream first, so the copy overlaps the rest of the forward. The device
tensor is given back to the allocator at once, marked with ``record_stream``: its memory is
reused only after the copy has read it.

The way back is prefetched one module ahead: when a gradient reaches a chosen module's outputs
(its backward is about to start) its own tensors and those of the chosen module that ran before
it in the forward are copied back on a fetch stream, so the second copy overlaps this module's
backward. ``unpack`` makes the compute stream wait for the copy; a tensor no prefetch reached (a
module whose outputs need no gradient) is fetched when autograd asks for it.

Restored tensors keep the saved tensors' sizes and strides, so the backward runs the same kernels
and is bitwise equal to the one without offload. A saved tensor modified in place after it was
saved (which autograd refuses at backward) is refused here too, where it is still alive.

Eager modules only, for now: a training graph of an offloaded module is refused
(``refuse_offloaded``); offload under graphs is designed in ``docs/side_stream_and_offload.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

OFFLOAD_MARK = "_fsdp_graph_activation_offload"  # on an offloaded module: its ActivationOffload


class _Saved:
    """One offloaded tensor: its host copy, and its device copy once fetched. Held only by the
    saved variables of autograd's graph, so both copies go when the backward has used them."""

    __slots__ = ("call", "size", "stride", "dtype", "version", "alive", "host", "offloaded", "device_tensor",
                 "fetched", "__weakref__")

    def __init__(self, call: _Call, tensor: torch.Tensor) -> None:
        self.call = call
        self.size, self.stride, self.dtype = tensor.size(), tensor.stride(), tensor.dtype
        self.version = tensor._version
        self.alive = weakref.ref(tensor)  # to refuse an in-place change made after it was saved
        self.host = torch.empty_strided(self.size, self.stride, dtype=self.dtype, pin_memory=True)
        self.offloaded: torch.cuda.Event | None = None
        self.device_tensor: torch.Tensor | None = None
        self.fetched: torch.cuda.Event | None = None


class _Call:
    """One forward call of a chosen module: what it saved (weakly), and the chosen call before it."""

    __slots__ = ("module_name", "saved", "by_id", "previous", "__weakref__")

    def __init__(self, module_name: str, previous: _Call | None) -> None:
        self.module_name = module_name
        self.saved: list[weakref.ref] = []
        self.by_id: dict[int, weakref.ref] = {}  # id(tensor) -> its _Saved: a tensor saved twice goes once
        self.previous = weakref.ref(previous) if previous is not None else None

    def alive(self) -> list[_Saved]:
        return [s for s in (ref() for ref in self.saved) if s is not None]


def _dense(tensor: torch.Tensor) -> bool:
    """Its elements fill a block of memory without gaps or overlaps (a permutation of a contiguous
    tensor): a copy with the same strides restores it exactly."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _is_parameter(tensor: torch.Tensor) -> bool:
    """Parameters (FSDP's unsharded ones included) and their views stay: they are not activations."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class ActivationOffload:
    """Installed by ``offload_activations``; ``remove()`` takes the hooks off again."""

    def __init__(self, modules: Sequence[nn.Module], names: Sequence[str], min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self._offload_stream: torch.cuda.Stream | None = None
        self._fetch_stream: torch.cuda.Stream | None = None
        self._open: list[tuple[nn.Module, _Call, torch.autograd.graph.saved_tensors_hooks]] = []
        self._last: weakref.ref | None = None  # the latest chosen call of the forward
        self._handles = []
        self.modules = list(modules)
        for module, name in zip(self.modules, names):
            self._handles.append(module.register_forward_pre_hook(self._opener(name)))
            self._handles.append(module.register_forward_hook(self._close, always_call=True))
            setattr(module, OFFLOAD_MARK, self)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module in self.modules:
            if getattr(module, OFFLOAD_MARK, None) is self:
                delattr(module, OFFLOAD_MARK)
        self._handles = []

    # -- forward ------------------------------------------------------------------------
    def _opener(self, name: str):
        def open_call(module: nn.Module, args) -> None:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return  # nothing is saved (no_grad), or a recompute inside backward uses it at once
            last = self._last() if self._last is not None else None
            call = _Call(name, last)
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(call, t), self._unpack)
            hooks.__enter__()
            self._open.append((module, call, hooks))

        return open_call

    def _close(self, module: nn.Module, args, output) -> None:
        if not self._open or self._open[-1][0] is not module:
            return  # its pre-hook opened nothing
        _, call, hooks = self._open.pop()
        hooks.__exit__(None, None, None)
        if not call.saved:
            return
        self._last = weakref.ref(call)
        if output is None:
            return  # (the forward raised)
        for tensor in tree_leaves(output):
            if not (isinstance(tensor, torch.Tensor) and tensor.requires_grad):
                continue
            tensor.register_hook(_BackwardStarts(self, call))

    def _pack(self, call: _Call, tensor: torch.Tensor):
        """A saved tensor goes to host memory whole, or as a view of its base (q, k and v split from
        one projection: the base goes once)."""
        base = tensor if tensor._base is None else tensor._base
        if (not base.is_cuda or base.numel() * base.element_size() < self.min_bytes or _is_parameter(base)
                or not _dense(base)):
            return tensor
        known = call.by_id.get(id(base))  # (an id is reused once its tensor is gone: checked below)
        saved = known() if known is not None else None
        if saved is None or saved.alive() is not base or saved.version != base._version:
            saved = self._offload(call, base)
        if tensor is base:
            return saved
        return _View(saved, tensor.size(), tensor.stride(), tensor.storage_offset() - base.storage_offset())

    def _offload(self, call: _Call, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(call, tensor)
        stream = self._streams(tensor.device)[0]
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            saved.host.copy_(tensor, non_blocking=True)
            saved.offloaded = stream.record_event()
        tensor.record_stream(stream)  # its memory is reused once the copy has read it
        call.saved.append(weakref.ref(saved))
        call.by_id[id(tensor)] = call.saved[-1]
        return saved

    def _streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._offload_stream is None:
            self._offload_stream = torch.cuda.Stream(device)
            self._fetch_stream = torch.cuda.Stream(device)
        return self._offload_stream, self._fetch_stream

    # -- backward -------------------------------------------------------------------------
    def backward_starts(self, call: _Call) -> None:
        """A gradient reached the call's outputs: fetch its tensors, and prefetch the previous call's.
        The forward is over: the next chosen call starts a new chain."""
        self._last = None
        self.fetch(call.alive())
        previous = call.previous() if call.previous is not None else None
        if previous is not None:
            self.fetch(previous.alive())

    def fetch(self, saved: list[_Saved]) -> None:
        """Copy these offloaded tensors back on the fetch stream (those not there already)."""
        todo = [s for s in saved if s.device_tensor is None]
        if not todo:
            return
        stream = self._fetch_stream
        with torch.cuda.stream(stream):
            for s in todo:
                stream.wait_event(s.offloaded)
                device = torch.empty_strided(s.size, s.stride, dtype=s.dtype, device=stream.device)
                device.copy_(s.host, non_blocking=True)
                s.device_tensor = device
            fetched = stream.record_event()
        for s in todo:
            s.fetched = fetched

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        saved = packed.saved if isinstance(packed, _View) else packed
        alive = saved.alive()
        if alive is not None and alive._version != saved.version:
            raise RuntimeError(
                f"activation offload ({saved.call.module_name}): a tensor its forward saved for backward was "
                "modified in place afterwards (autograd would refuse it too: 'one of the variables needed for "
                "gradient computation has been modified by an inplace operation'). Use the out-of-place "
                "operation (x = x + y instead of x += y), or leave this module out of the offload selection."
            )
        if saved.device_tensor is None:
            self.fetch([saved, *saved.call.alive()])  # no prefetch reached this call (its outputs got no gradient)
        tensor = saved.device_tensor
        current = torch.cuda.current_stream(tensor.device)
        current.wait_event(saved.fetched)
        tensor.record_stream(current)  # (allocated on the fetch stream, read on this one)
        if isinstance(packed, _View):
            return tensor.as_strided(packed.size, packed.stride, packed.offset)
        return tensor


class _View(NamedTuple):
    """A saved view of an offloaded base: restored as the same view of the restored base."""

    saved: _Saved
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _BackwardStarts:
    """A tensor hook on a chosen module's output (weakly holding the offload: no cycle through C++)."""

    __slots__ = ("offload", "call")

    def __init__(self, offload: ActivationOffload, call: _Call) -> None:
        self.offload, self.call = weakref.ref(offload), call

    def __call__(self, grad: torch.Tensor) -> None:
        offload = self.offload()
        if offload is not None:
            offload.backward_starts(self.call)


def offload_activations(modules: Sequence[nn.Module], *, min_bytes: int = 1 << 20) -> ActivationOffload:
    """Keep the saved activations of ``modules`` (e.g. ``select_modules(model, Block)``) in pinned
    host memory between their forward and backward, prefetched back one module ahead (see the
    module docstring). Eager modules; a training graph of one of them is refused. Returns a handle
    whose ``remove()`` switches it off."""
    modules = list(modules)
    if not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"offload_activations: min_bytes must be an int >= 0, got {min_bytes!r}")
    for i, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise TypeError(f"offload_activations expects nn.Module objects; item {i} is a {type(module).__name__}")
        if getattr(module, OFFLOAD_MARK, None) is not None:
            raise ValueError(
                f"offload_activations: module {i} ({type(module).__name__}) is offloaded already; call remove() "
                "on the earlier handle first"
            )
    if not torch.cuda.is_available():
        raise RuntimeError(
            "offload_activations needs a CUDA device: it moves saved activations from GPU memory to pinned "
            "host memory (torch.cuda.is_available() is False). On CPU there is nothing to offload: drop it."
        )
    return ActivationOffload(modules, [f"module {i} ({type(m).__name__})" for i, m in enumerate(modules)], min_bytes)


def refuse_offloaded(modules: Sequence[nn.Module], names: Sequence[str]) -> None:
    """A training graph of an offloaded module would capture the copies and the host allocations
    (not built yet): refused, naming the fix."""
    for module, name in zip(modules, names):
        if any(getattr(sub, OFFLOAD_MARK, None) is not None for sub in module.modules()):
            raise ValueError(
                f"{name}: a module in the training graph offloads its activations (offload_activations), and "
                "offload under training graphs is not built yet. Graph it without offload (remove() on the handle "
                "offload_activations returned), or keep the offloaded modules eager (strategy='layer' with "
                "modules= leaving them out, or strategy='none')."
            )
