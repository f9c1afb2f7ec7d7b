"""State shared by all units under one root: streams, buffer placement, execution order.

Built lazily at the root's first forward, when every unit is known (FSDP2 does the same). The
first forward and the first backward record the order in which units run; later iterations
prefetch the next unit in that order (forward) or the previous one (backward).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Iterator

import torch

from .buffers import plan_placements
from .training_state import TrainingState

if TYPE_CHECKING:
    from .unit import FSDPUnit


class CommStreams:
    """Side streams for all-gathers and reduce-scatters (None on CPU, where all is synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.all_gather = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.reduce = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.device = device
        self._pending: set = set()  # side streams given work since the current stream last joined them

    def enter(self, stream):
        """Run on ``stream`` after everything already queued on the current stream."""
        if stream is None:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self._pending.add(stream)
        return torch.cuda.stream(stream)

    def record(self, stream):
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def synchronize(self) -> None:
        """Wait on the host for all work on the device: every stream is joined afterwards."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._pending.clear()

    def wait_for_all(self) -> None:
        """Compute stream waits for every collective: nothing in flight may race the optimizer
        (a prefetch that was never consumed still reads the master shard)."""
        # Only streams that were given work: inside a whole-step capture, waiting on a stream
        # that is not part of the capture would wait on an event recorded outside it.
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for stream in (self.all_gather, self.reduce):
                if stream in self._pending:
                    current.wait_stream(stream)
            self._pending.clear()


class RootContext:
    def __init__(self, root: FSDPUnit, units: list[FSDPUnit]) -> None:
        self.root = root
        self.units = units
        self.streams = CommStreams(root.device)
        for unit, (placement, pool) in plan_placements(units).items():
            unit.bind_root(self, placement, pool)
        self.forward_order: list[FSDPUnit] = []
        self.backward_order: list[FSDPUnit] = []
        self._next_forward: dict[FSDPUnit, FSDPUnit] | None = None  # set once the first pass is recorded
        self._next_backward: dict[FSDPUnit, FSDPUnit] | None = None
        self.end_of_backward_queued = False

    # -- iteration boundaries -------------------------------------------------------------
    def begin_forward(self) -> None:
        """Root pre-forward: a new iteration. Recover units left mid-step by an exception."""
        self.end_of_backward_queued = False
        for unit in self.units:
            unit.reset_if_stuck()
            unit.clear_prefetch()

    def end_forward(self) -> None:
        if self._next_forward is None and self.forward_order:
            self._next_forward = dict(zip(self.forward_order, self.forward_order[1:]))
        for unit in self.units:
            unit.clear_prefetch()
        self.streams.wait_for_all()

    def end_backward(self) -> None:
        """Run post-backward for units autograd did not reach (e.g. the root, whose inputs need
        no gradient), then make the current stream wait for every reduce-scatter."""
        self.end_of_backward_queued = False
        for unit in self.units:
            if unit.state is TrainingState.BACKWARD:
                unit.post_backward()
        if self._next_backward is None and self.backward_order:
            self._next_backward = dict(zip(self.backward_order, self.backward_order[1:]))
        self.streams.wait_for_all()

    @contextmanager
    def outside_training_step(self) -> Iterator[None]:
        """Unit steps run by graph warm-up and capture are no training step: afterwards every unit
        is idle with nothing prefetched, and the recorded execution order and all gradients are
        as before (also when capture fails)."""
        # Capture unshards only the graphed units, in list order: slots taken then would not
        # alternate in execution order. Take them in module order (a stack's forward order) first.
        for unit in self.units:
            unit.bind_slot()
        order = (list(self.forward_order), list(self.backward_order), self._next_forward, self._next_backward)
        grads = [unit.grad_state() for unit in self.units]
        try:
            yield
        finally:
            self.streams.wait_for_all()
            for unit, state in zip(self.units, grads):
                unit.reset_if_stuck()
                unit.clear_prefetch()
                unit.restore_grad_state(state)
            self.forward_order[:], self.backward_order[:] = order[0], order[1]
            self._next_forward, self._next_backward = order[2], order[3]
            self.end_of_backward_queued = False

    def forget_events(self) -> None:
        """Around a whole-step capture: see ``FSDPUnit.forget_events``. Synchronises the device."""
        self.streams.synchronize()
        for unit in self.units:
            unit.forget_events()

    # -- execution order for prefetching --------------------------------------------------
    def record_forward(self, unit: FSDPUnit) -> None:
        if self._next_forward is None and unit not in self.forward_order:
            self.forward_order.append(unit)

    def record_backward(self, unit: FSDPUnit) -> None:
        if self._next_backward is None and unit not in self.backward_order:
            self.backward_order.append(unit)

    def next_forward(self, unit: FSDPUnit) -> FSDPUnit | None:
        return self._next_forward.get(unit) if self._next_forward else None

    def next_backward(self, unit: FSDPUnit) -> FSDPUnit | None:
        return self._next_backward.get(unit) if self._next_backward else None
