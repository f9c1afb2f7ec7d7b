"""What all units under one root share: lazy init, the iteration boundaries, the end of backward.

``fully_shard`` makes one ``RootContext`` per tree of units (the outermost unit is the root).
At the first step (``lazy_init``), when every unit is known, as in FSDP2, it plans every unit's
buffer placement (``buffers.plan_placements``), creates the comm streams and the execution order,
and hands them to the units (``FSDPUnit.bind``). Hooks enter here (``pre_forward`` ...): the root's
forward starts an iteration, its end ends the forward pass, and the end-of-backward callback runs
post-backward for units autograd did not reach and joins the comm streams.

``outside_training_step`` brackets unit steps that are no training step (graph warm-up and
capture): afterwards every unit is idle, the recorded order and all gradients are as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .agreement import AgreementError, agree
from .buffers import plan_placements, plan_scratch
from .collectives import CommStreams
from .order import ExecutionOrder
from .stray_gradients import refuse_stray_gradients
from .training_state import TrainingState
from .unit import FSDPUnit
from .unused_params import ExchangeGraphs, settle_unused

# How long a rank whose step raised waits at its next forward for the other ranks to report the
# same failure. Ranks that failed the same step get there within the time their error handling
# takes; a rank that did not fail never does, so this bounds the wait before the clear error.
FAILED_STEP_WAIT_S = 60.0


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread right now."""
    return torch._C._current_graph_task_id() != -1


class RootContext:
    def __init__(self, root: FSDPUnit, units: list[FSDPUnit]) -> None:
        self.root = root
        self.units = units  # the root first, then every unit under it in module order
        self.streams: CommStreams | None = None
        self.order: ExecutionOrder[FSDPUnit] = ExecutionOrder()
        self._end_of_backward_queued = False
        self._failed_step: str | None = None  # what raised in the last step (note_failed_step)
        self._failed_steps = 0
        self._exchange: tuple | None = None  # (a unit's collective graphs, the use exchange's ExchangeGraphs)

    def lazy_init(self) -> None:
        """Plan placements and bind every unit (once; idempotent)."""
        if self.streams is not None:
            return
        streams = CommStreams(self.root.device)
        with_inner = {id(u.parent) for u in self.units if u.parent is not None}
        requests = [u.placement_request(id(u) in with_inner) for u in self.units]
        plan = plan_placements(requests)
        for unit, (placement, pool), scratch in zip(self.units, plan, plan_scratch(requests, plan)):
            unit.bind(placement, pool, scratch, streams, self.order)
        self.streams = streams  # only now: a failed init (out of memory, say) is tried again next step

    # -- hook entry points ----------------------------------------------------------------
    def pre_forward(self, unit: FSDPUnit) -> None:
        if unit.state is TrainingState.FORWARD and unit.in_forward_method:
            unit.nested_forwards += 1  # already unsharded by the method's call (see hooks.run_as_forward)
            return
        self.lazy_init()
        if unit is self.root and not in_backward():
            self.begin_forward()  # a new iteration (also recovers units an exception left mid-step)
        unit.pre_forward()

    def post_forward(self, unit: FSDPUnit) -> None:
        if unit.nested_forwards:
            unit.nested_forwards -= 1
            return
        if unit.post_forward() and unit is self.root:
            self.end_forward()

    def take_slots_in_module_order(self) -> None:
        """Slots alternate in execution order; before the first forward, module order stands in
        for it (a stack's forward order), whatever unshards first (a capture, module.unshard())."""
        self.lazy_init()
        for unit in self.units:
            unit.take_slot()

    def pre_backward(self, unit: FSDPUnit) -> None:
        self.lazy_init()
        unit.pre_backward()

    def queue_end_of_backward(self) -> None:
        """From inside autograd's backward: run ``end_backward`` when it ends (once per backward)."""
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    # -- iteration boundaries -------------------------------------------------------------
    def begin_forward(self) -> None:
        """Root pre-forward: a new iteration. Recover units left mid-step by an exception, once
        every rank agrees that it failed the same step."""
        self._end_of_backward_queued = False
        stuck = [unit for unit in self.units if unit.state is not TrainingState.IDLE]
        if stuck or self._failed_step is not None:
            self._agree_to_go_on(self._failed_step or f"unit {stuck[0].name} was left in {stuck[0].state.value}")
            self.streams.wait_for_all()  # the failed backward's reduces, before what they read is freed
            self._release_read_gradients()
            for unit in self.units:
                unit.grads.use.forget_pending()
        for unit in self.units:
            unit.reset_if_stuck()
            unit.param_group.clear_prefetch()
            unit.grads.sharded.release_if_dropped()  # zero_grad(set_to_none=True): memory back before activations
        self._refuse_stray_gradients("found at the next forward: the step before ran its optimizer without them")

    def note_failed_step(self, error: BaseException) -> None:
        """A training step raised (``make_train_step`` tells; units left mid-step tell by themselves)."""
        self._failed_step = f"{type(error).__name__}: {error}"[:300]

    def _agree_to_go_on(self, failure: str) -> None:
        """After a step that raised here, go on only if every rank of the group failed it too: a
        rank that went on would pair its collectives with ours (gloo aborts, NCCL mixes buffers)."""
        self._failed_step = None
        self._failed_steps += 1
        ranks = sorted({rank for unit in self.units for rank in unit.mesh.ranks})
        try:
            agree(f"go on after failed step #{self._failed_steps}", ranks, channel=f"failed-step/{self.root.name}",
                  timeout=FAILED_STEP_WAIT_S)
        except AgreementError as err:
            raise RuntimeError(
                f"a training step raised on this rank ({failure}) but not on every rank: {err}. The ranks' "
                "collectives are now out of step, so training cannot go on. Let the exception end the job "
                "(torchrun --max-restarts restarts it from the last checkpoint); catching an exception and "
                "going on works only when every rank failed the same step."
            ) from None

    def end_forward(self) -> None:
        self.order.forward_done()
        for unit in self.units:
            unit.param_group.clear_prefetch()
        self.streams.wait_for_all()

    def end_backward(self) -> None:
        """Run post-backward for units autograd did not reach (e.g. the root, whose inputs need
        no gradient), make the current stream wait for every reduce-scatter, and give ``.grad =
        None`` back to parameters no rank gave a gradient (``unused_params.py``)."""
        self._end_of_backward_queued = False
        for unit in self.units:
            if unit.state is TrainingState.BACKWARD:
                unit.post_backward()
        self.order.backward_done()
        self.streams.wait_for_all()
        self._release_read_gradients()
        settle_unused([unit.grads for unit in self.units], self.streams, self._exchange_graphs())
        self._refuse_stray_gradients("found at the end of the backward")

    def _exchange_graphs(self):
        """Where the units' steps replay as collective graphs (the layer strategies), the end-of-backward
        exchange of which parameters got a gradient replays too (``unused_params.py``): graphs of its
        own, in the pool of the first replaying unit's."""
        replaying = next((u.grads.collective_graphs for u in self.units if u.grads.collective_graphs is not None),
                         None)
        if replaying is None:
            return None
        if self._exchange is None or self._exchange[0] is not replaying:
            self._exchange = (replaying, ExchangeGraphs(replaying.spawn(f"{self.root.name} (use exchange)")))
        return self._exchange[1]

    def _refuse_stray_gradients(self, when: str) -> None:
        """Every unit is idle: gradients on its unsharded parameters were left there outside its
        backward (``stray_gradients.py``)."""
        for unit in self.units:
            refuse_stray_gradients(unit.name, unit.params, when)

    def _release_read_gradients(self) -> None:
        """After ``wait_for_all``: the gradients the reduces read go back to the allocator (on the
        compute stream, which has now waited for them)."""
        for unit in self.units:
            unit.grads.release_read(unit.param_group.buffers)

    # -- steps that are no training step (graph capture) ----------------------------------
    @contextmanager
    def outside_training_step(self) -> Iterator[None]:
        """Unit steps run by graph warm-up and capture are no training step: afterwards every unit
        is idle with nothing prefetched, and the recorded execution order and all gradients are
        as before (also when capture fails)."""
        # Capture unshards only the graphed units, in list order.
        self.take_slots_in_module_order()
        order = self.order.snapshot()
        grads = [unit.grads.snapshot() for unit in self.units]
        try:
            yield
        finally:
            self.streams.wait_for_all()
            self._release_read_gradients()
            for unit, snapshot in zip(self.units, grads):
                unit.reset_if_stuck()
                unit.param_group.clear_prefetch()
                unit.grads.restore(snapshot)
            self.order.restore(order)
            self._end_of_backward_queued = False

    @contextmanager
    def end_of_backward_deferred(self) -> Iterator[None]:
        """Backwards through part of the model (a segment graph's warm-up and capture): the root's
        end-of-backward step is not queued by them; the real backward's end runs it."""
        self._end_of_backward_queued = True
        try:
            yield
        finally:
            self._end_of_backward_queued = False

    def forget_events(self) -> None:
        """Around a whole-step capture: see ``FSDPUnit.forget_events``. Synchronises the device."""
        self.lazy_init()
        self.streams.synchronize()
        for unit in self.units:
            unit.forget_events()

    def capture_failed(self) -> None:
        """A whole-step capture failed midway: see ``FSDPUnit.capture_failed``."""
        for unit in self.units:
            unit.capture_failed()
