"""The order units run in, recorded in the first forward and the first backward, for prefetching.

Later iterations prefetch the next unit in forward order and the previous one in backward
order. The recording is kept as it is across steps that are no training step (graph capture:
``snapshot`` / ``restore``).
"""

from __future__ import annotations

from typing import Generic, TypeVar

Unit = TypeVar("Unit")


class ExecutionOrder(Generic[Unit]):
    def __init__(self) -> None:
        self.forward: list[Unit] = []
        self.backward: list[Unit] = []
        self._next_forward: dict[Unit, Unit] | None = None  # set once the first pass is recorded
        self._next_backward: dict[Unit, Unit] | None = None

    def record_forward(self, unit: Unit) -> None:
        if self._next_forward is None and unit not in self.forward:
            self.forward.append(unit)

    def record_backward(self, unit: Unit) -> None:
        if self._next_backward is None and unit not in self.backward:
            self.backward.append(unit)

    def forward_done(self) -> None:
        if self._next_forward is None and self.forward:
            self._next_forward = dict(zip(self.forward, self.forward[1:]))

    def backward_done(self) -> None:
        if self._next_backward is None and self.backward:
            self._next_backward = dict(zip(self.backward, self.backward[1:]))

    def after_in_forward(self, unit: Unit) -> Unit | None:
        return self._next_forward.get(unit) if self._next_forward else None

    def after_in_backward(self, unit: Unit) -> Unit | None:
        return self._next_backward.get(unit) if self._next_backward else None

    def snapshot(self) -> tuple:
        return list(self.forward), list(self.backward), self._next_forward, self._next_backward

    def restore(self, snapshot: tuple) -> None:
        self.forward[:], self.backward[:], self._next_forward, self._next_backward = snapshot
