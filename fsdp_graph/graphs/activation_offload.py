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

Under CUDA graphs (per-layer graphs and the whole step; ``docs/side_stream_and_offload.md``) the
same hooks run in the warm-up passes and in the capture, which records the copies:

* a graph writes fixed host addresses, so each graph owns a ``HostPlan``: one pinned buffer per
  offloaded tensor, in pass order, allocated by the first warm-up pass and only taken by the
  capture (which refuses a tensor the warm-up did not save);
* under capture, ``record_stream`` would keep the allocator from reusing a block before the
  capture ends, so the device tensor is instead held until the compute stream waited for its copy
  (``_release``), then dropped, and its pool memory is reused at once;
* the way back forks the fetch stream from the capture stream into memory of the graph's pool;
  every stream forked in a capture is joined before it ends (``_join``).

Segments of several blocks (``graph_segments``) refuse offloaded blocks (``refuse_offloaded``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

OFFLOAD_MARK = "_fsdp_graph_activation_offload"  # on an offloaded module: its ActivationOffload


class OffloadCaptureError(RuntimeError):
    """An offloaded module's capture cannot record its copies (raised inside the capture)."""


class HostPlan:
    """The pinned host buffers one graph's copies write (one group of layer graphs, or one whole
    step): one per offloaded tensor, in the order a pass saves them. Warm-up passes allocate what
    is missing; the capture only takes, so a replay always writes memory that lives as long as
    the plan (held by the graphs)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.buffers: list[torch.Tensor] = []
        self.cursor = 0

    def start_pass(self) -> None:
        self.cursor = 0

    def take(self, like: torch.Tensor, capturing: bool) -> torch.Tensor:
        i, self.cursor = self.cursor, self.cursor + 1
        if i < len(self.buffers):
            buffer = self.buffers[i]
            if buffer.size() == like.size() and buffer.stride() == like.stride() and buffer.dtype == like.dtype:
                return buffer
        if capturing:
            raise OffloadCaptureError(
                f"{self.what}: activation offload: the captured pass saved tensor #{i} ({tuple(like.shape)}, "
                f"{like.dtype}) for backward, but the warm-up passes saved "
                f"{'a different one there' if i < len(self.buffers) else f'only {len(self.buffers)}'}. A graph "
                "needs the same saved tensors in every pass: give every warm-up pass the shapes of the graphed "
                "steps, or leave the module whose saves change out of the offload selection."
            )
        buffer = torch.empty_strided(like.size(), like.stride(), dtype=like.dtype, pin_memory=True)
        self.buffers[i:i + 1] = [buffer]
        return buffer


class _Saved:
    """One offloaded tensor: its host copy, and its device copy once fetched. Held only by the
    saved variables of autograd's graph, so both copies go when the backward has used them."""

    __slots__ = ("call", "size", "stride", "dtype", "version", "alive", "host", "offloaded", "device_tensor",
                 "fetched", "fetched_in", "pending", "__weakref__")

    def __init__(self, call: _Call, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self.call = call
        self.size, self.stride, self.dtype = tensor.size(), tensor.stride(), tensor.dtype
        self.version = tensor._version
        self.alive = weakref.ref(tensor)  # to refuse an in-place change made after it was saved
        self.host = host
        self.offloaded: torch.cuda.Event | None = None
        self.device_tensor: torch.Tensor | None = None
        self.fetched: torch.cuda.Event | None = None
        self.fetched_in: object | None = None  # the capture that fetched it (None: eager)
        self.pending: torch.Tensor | None = None  # under capture: the device tensor, until its copy is waited for


class _Call:
    """One forward call of a chosen module: what it saved (weakly), the chosen call before it, and
    under graphs the plan its host buffers come from."""

    __slots__ = ("module_name", "saved", "by_id", "previous", "plan", "keep", "fetched_by", "__weakref__")

    def __init__(self, module_name: str, previous: _Call | None, plan: HostPlan | None = None,
                 keep: frozenset[int] = frozenset()) -> None:
        self.module_name = module_name
        self.saved: list[weakref.ref] = []
        self.by_id: dict[int, weakref.ref] = {}  # id(tensor) -> its _Saved: a tensor saved twice goes once
        self.previous = weakref.ref(previous) if previous is not None else None
        self.plan = plan
        self.keep = keep  # storages left in place (a layer graph's static inputs: persistent anyway)
        self.fetched_by: _Call | None = None  # under capture: the call whose backward fetched this one's tensors

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


class _OffloadStreams:
    """The offload and fetch streams, and what a capture that records copies on them must track:
    the streams it forked (joined before it ends), offloaded tensors whose copy the compute stream
    has not waited for (``_release`` frees them), fetched ones likewise."""

    def __init__(self) -> None:
        self._offload_stream: torch.cuda.Stream | None = None
        self._fetch_stream: torch.cuda.Stream | None = None
        self._capture: object | None = None  # a token while a capture records the copies, else None
        self._forked: list[torch.cuda.Stream] = []  # streams forked in that capture, joined before it ends
        self._pending: list[_Saved] = []  # under capture: offloaded tensors whose copy is not waited for yet
        self._fetching: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []  # under capture: fetched tensors
        # held until the compute stream waited for their copy (else a prefetch nobody reads could be freed early)

    def _streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._offload_stream is None:
            self._offload_stream = torch.cuda.Stream(device)
            self._fetch_stream = torch.cuda.Stream(device)
        return self._offload_stream, self._fetch_stream

    @contextmanager
    def _capturing(self, capturing: bool) -> Iterator[None]:
        """While a capture records the copies: a token for it; on a normal exit, every stream it
        forked joins the capture stream (a capture must end joined)."""
        if not capturing:
            yield
            return
        self._capture = object()
        try:
            yield
            self._join()
        except BaseException:
            with suppress(Exception):
                self._join()  # (so the capture can end, and the error that broke it is the one raised)
            raise
        finally:
            self._capture, self._forked, self._pending, self._fetching = None, [], [], []

    def _fork(self, stream: torch.cuda.Stream) -> None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        if self._capture is not None and stream not in self._forked:
            self._forked.append(stream)

    def _release(self, but: _Call | None = None) -> None:
        """Under capture: the compute stream waits for the copies of the pending tensors (except
        ``but``'s), whose memory then goes back to the pool. The offload stream copies in order,
        so the last copy's event covers the earlier ones."""
        done = [s for s in self._pending if s.call is not but]
        if not done:
            return
        torch.cuda.current_stream(done[-1].pending.device).wait_event(done[-1].offloaded)
        for s in done:
            s.pending = None
        self._pending = [s for s in self._pending if s.call is but]

    def _join(self) -> None:
        self._release()
        for stream in self._forked:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self._forked = []


class ActivationOffload(_OffloadStreams):
    """Installed by ``offload_activations``; ``remove()`` takes the hooks off again."""

    def __init__(self, modules: Sequence[nn.Module], names: Sequence[str], min_bytes: int) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self._open: list[tuple[nn.Module, _Call, torch.autograd.graph.saved_tensors_hooks]] = []
        self._last: weakref.ref | None = None  # the latest chosen call of the forward
        self._after_graph = False  # a graph replayed since that call (prefetching across it would hold memory long)
        self._plan: HostPlan | None = None  # set around a whole step's warm-up and capture (``planned``)
        self.recorded = False  # a whole step's capture recorded the copies (remove() is refused)
        self.owned: set[int] = set()  # ids of modules whose graphs record their offload: the hooks step aside
        self._handles = []
        self.modules = list(modules)
        self._names = list(names)
        for module, name in zip(self.modules, names):
            self._handles.append(module.register_forward_pre_hook(self._opener(name)))
            self._handles.append(module.register_forward_hook(self._close, always_call=True))
            setattr(module, OFFLOAD_MARK, self)

    def remove(self) -> None:
        owned = [name for module, name in zip(self.modules, self._names) if id(module) in self.owned or self.recorded]
        if owned:
            raise RuntimeError(
                f"offload_activations: {owned[0]} is graphed with its offload captured: its graphs copy its "
                "activations at every replay, and remove() cannot take the copies out of them. Build the model "
                "and its graphs again without offload."
            )
        for handle in self._handles:
            handle.remove()
        for module in self.modules:
            if getattr(module, OFFLOAD_MARK, None) is self:
                delattr(module, OFFLOAD_MARK)
        self._handles = []

    # -- forward ------------------------------------------------------------------------
    def _opener(self, name: str):
        def open_call(module: nn.Module, args) -> None:
            if id(module) in self.owned:
                self._after_graph = True  # its graph copies; the next eager call prefetches no call before it
                return
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return  # nothing is saved (no_grad), or a recompute inside backward uses it at once
            call = self._new_call(name, self._plan, linked=not self._after_graph)
            self._after_graph = False
            hooks = self._hooks(call)
            hooks.__enter__()
            self._open.append((module, call, hooks))

        return open_call

    def _close(self, module: nn.Module, args, output) -> None:
        if not self._open or self._open[-1][0] is not module:
            return  # its pre-hook opened nothing
        _, call, hooks = self._open.pop()
        hooks.__exit__(None, None, None)
        if self._capture is not None:
            self._release(but=call)  # the copies of the calls before it overlapped it; their memory is free now
        if not call.saved:
            return
        self._last = weakref.ref(call)
        if output is None:
            return  # (the forward raised)
        for tensor in tree_leaves(output):
            if not (isinstance(tensor, torch.Tensor) and tensor.requires_grad):
                continue
            tensor.register_hook(_BackwardStarts(self, call))

    def _new_call(self, name: str, plan: HostPlan | None, keep: frozenset[int] = frozenset(),
                  linked: bool = True) -> _Call:
        return _Call(name, self._last() if self._last is not None and linked else None, plan, keep)

    def _hooks(self, call: _Call) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(call, t), self._unpack)

    @contextmanager
    def graph_forward(self, name: str, plan: HostPlan, capturing: bool, keep: frozenset[int]) -> Iterator[_Call]:
        """One layer graph's forward pass (warm-up or capture): its saved tensors offloaded from
        ``plan``'s buffers; under capture the graph ends when its copies have."""
        call = self._new_call(name, plan, keep)
        with self._capturing(capturing), self._hooks(call):
            yield call
        if call.saved:
            self._last = weakref.ref(call)

    @contextmanager
    def graph_backward(self, call: _Call, capturing: bool) -> Iterator[None]:
        """One layer graph's backward pass: its tensors fetched (unless the backward before it did)
        and the previous call's prefetched, on the fetch stream, joined before the graph ends."""
        with self._capturing(capturing):
            self.backward_starts(call)
            yield

    @contextmanager
    def planned(self, plan: HostPlan, capturing: bool) -> Iterator[None]:
        """A whole step's warm-up or capture: the eager hooks take host buffers from ``plan``."""
        plan.start_pass()
        self._plan = plan
        try:
            with self._capturing(capturing):
                yield
            self.recorded = self.recorded or capturing
        finally:
            self._plan = None

    def _pack(self, call: _Call, tensor: torch.Tensor):
        """A saved tensor goes to host memory whole, or as a view of its base (q, k and v split from
        one projection: the base goes once)."""
        base = tensor if tensor._base is None else tensor._base
        # A scalar stays: an RNG seed or offset, which a capture keeps on the device and an eager pass on the host.
        if (not base.is_cuda or base.numel() <= 1 or base.numel() * base.element_size() < self.min_bytes
                or _is_parameter(base)
                or not _dense(base) or (call.keep and base.untyped_storage().data_ptr() in call.keep)):
            return tensor
        known = call.by_id.get(id(base))  # (an id is reused once its tensor is gone: checked below)
        saved = known() if known is not None else None
        if saved is None or saved.alive() is not base or saved.version != base._version:
            saved = self._offload(call, base)
        if tensor is base:
            return saved
        return _View(saved, tensor.size(), tensor.stride(), tensor.storage_offset() - base.storage_offset())

    def _offload(self, call: _Call, tensor: torch.Tensor) -> _Saved:
        capturing = self._capture is not None
        if (call.plan is None) if capturing else torch.cuda.is_current_stream_capturing():
            raise OffloadCaptureError(_unmanaged_capture(call.module_name))
        host = (call.plan.take(tensor, capturing) if call.plan is not None
                else torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, pin_memory=True))
        saved = _Saved(call, tensor, host)
        stream = self._streams(tensor.device)[0]
        self._fork(stream)
        with torch.cuda.stream(stream):
            saved.host.copy_(tensor, non_blocking=True)
            saved.offloaded = stream.record_event()
        if capturing:
            saved.pending = tensor  # held until the compute stream waited for the copy (``_release``)
            self._pending.append(saved)
        else:
            tensor.record_stream(stream)  # its memory is reused once the copy has read it
        call.saved.append(weakref.ref(saved))
        call.by_id[id(tensor)] = call.saved[-1]
        return saved

    # -- backward -------------------------------------------------------------------------
    def backward_starts(self, call: _Call) -> None:
        """A gradient reached the call's outputs: fetch its tensors, and prefetch the previous call's.
        The forward is over: the next chosen call starts a new chain."""
        self._last = None
        self.fetch(call.alive())
        previous = call.previous() if call.previous is not None else None
        if previous is not None and previous.plan is call.plan:  # (a graph may only fetch into its own pool)
            if self._capture is not None and any(s.device_tensor is None for s in previous.alive()):
                previous.fetched_by = call
            self.fetch(previous.alive())

    def fetch(self, saved: list[_Saved]) -> None:
        """Copy these offloaded tensors back on the fetch stream (those not there already)."""
        todo = [s for s in saved if s.device_tensor is None]
        if not todo:
            return
        stream = self._fetch_stream
        if self._capture is not None:
            # Under capture: after every pending copy (the compute stream waits for them), forked
            # from the capture stream, into pool memory of the compute stream.
            self._release()
            devices = [torch.empty_strided(s.size, s.stride, dtype=s.dtype, device=stream.device) for s in todo]
            self._fork(stream)
        with torch.cuda.stream(stream):
            for i, s in enumerate(todo):
                if self._capture is None:
                    stream.wait_event(s.offloaded)
                    device = torch.empty_strided(s.size, s.stride, dtype=s.dtype, device=stream.device)
                else:
                    device = devices[i]
                device.copy_(s.host, non_blocking=True)
                s.device_tensor = device
            fetched = stream.record_event()
        for s in todo:
            s.fetched, s.fetched_in = fetched, self._capture
        if self._capture is not None:
            self._fetching.append((fetched, [s.device_tensor for s in todo]))

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
        if saved.fetched_in is self._capture:  # (fetched by an earlier graph: that graph ended joined)
            current.wait_event(saved.fetched)
            self._fetching = [(e, ts) for e, ts in self._fetching if e is not saved.fetched]
        if self._capture is None:
            tensor.record_stream(current)  # (allocated on the fetch stream, read on this one)
        if isinstance(packed, _View):
            return tensor.as_strided(packed.size, packed.stride, packed.offset)
        return tensor


def _unmanaged_capture(module_name: str) -> str:
    return (
        f"activation offload ({module_name}): this forward is being captured into a CUDA graph that fsdp_graph "
        "did not set up for its offload (a capture of its own, or a module called inside another module's "
        "per-layer graph), so its copies would write host memory nobody keeps. Graph offloaded modules themselves "
        "with graph_modules or make_train_step (strategy 'layer' or 'full_iteration'), or remove() the offload "
        "before capturing."
    )


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
    module docstring). Install it before graphing: per-layer graphs (``graph_modules``) and the
    whole step (``make_train_step``) then record the copies; segments refuse offloaded blocks.
    Returns a handle whose ``remove()`` switches it off (refused once a graph recorded it)."""
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
        runner = module.__dict__.get("forward")
        if (getattr(getattr(runner, "captured", None), "grad_enabled", False)
                or "_fsdp_graph_segment" in module.__dict__):  # (segment_graphs.SEGMENT_MARK)
            raise ValueError(
                f"offload_activations: module {i} ({type(module).__name__}) has a training graph already, whose "
                "capture recorded no offload (its replay saves nothing the hooks could move). Offload before "
                "graphing: offload_activations first, then graph_modules, or GraphConfig(offload_activations=...)."
            )
    if not torch.cuda.is_available():
        raise RuntimeError(
            "offload_activations needs a CUDA device: it moves saved activations from GPU memory to pinned "
            "host memory (torch.cuda.is_available() is False). On CPU there is nothing to offload: drop it."
        )
    return ActivationOffload(modules, [f"module {i} ({type(m).__name__})" for i, m in enumerate(modules)], min_bytes)


def add_host_plans(model: nn.Module, plans: dict[int, tuple[ActivationOffload, HostPlan]], what: str) -> None:
    """A whole-step graph's plans: one per offload installed in ``model``, added as they appear."""
    for module in model.modules():
        offload = getattr(module, OFFLOAD_MARK, None)
        if offload is not None and id(offload) not in plans:
            plans[id(offload)] = (offload, HostPlan(what))


@contextmanager
def offload_passes(plans: dict[int, tuple[ActivationOffload, HostPlan]], capturing: bool) -> Iterator[None]:
    """A whole step's warm-up (``capturing=False``) or capture: every offload takes its host buffers
    from its plan; under capture, its streams join the capture stream at the end."""
    with ExitStack() as stack:
        for offload, plan in plans.values():
            stack.enter_context(offload.planned(plan, capturing))
        yield


def refuse_offloaded(modules: Sequence[nn.Module], names: Sequence[str], *, graphs_own_offload: bool) -> None:
    """Offload inside a training graph, where it cannot work, refused naming the fix: in a segment
    of several blocks at all (``graphs_own_offload=False``), in a per-layer graph on a module
    inside the graphed one (its hooks would run once, at capture)."""
    for module, name in zip(modules, names):
        if not isinstance(module, nn.Module):
            continue  # (refused by the caller's own check)
        inner = [sub for sub in module.modules() if getattr(sub, OFFLOAD_MARK, None) is not None
                 and not (graphs_own_offload and sub is module)]
        if not inner:
            continue
        if graphs_own_offload:
            raise ValueError(
                f"{name}: a module inside it offloads its activations (offload_activations), but a per-layer graph "
                "records the offload of the graphed module itself only. Offload the graphed modules (the same "
                "selection as the graphs), or graph the offloaded modules themselves."
            )
        raise ValueError(
            f"{name}: a block of this segment offloads its activations (offload_activations), which segments of "
            "several blocks do not record. Use per-layer graphs (segment_size=1) or the whole step "
            "(strategy='full_iteration') with offload, or remove() the offload."
        )
