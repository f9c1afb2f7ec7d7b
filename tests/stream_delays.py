"""Delay injection for the stream-ordering suite (issue #17): widen every cross-stream window.

``inject(stream)`` patches the engine, for the duration of a ``with`` block, so that a
``torch.cuda._sleep`` is queued on one stream before and after every step it runs at a hook
boundary:

* ``"compute"``: each unit step (pre/post forward, pre/post backward, gradient ``prepare``), the
  end of backward, and the optimizer step (through optimizer step hooks);
* ``"all_gather"``: entering the all-gather stream (before the cast), the all-gather and the
  copy-out;
* ``"reduce"``: entering the reduce stream (before the copy-in), the copy-in, the reduce-scatter,
  the replica all-reduce, and the accumulation into the sharded gradients.

A sleep is a kernel, so it is captured into a whole-step graph and replayed with it. A missing
stream dependency shows up as a changed value. The patches live here, never on the engine's
default path.

The sleep that opens each side-stream step is long (``ENTER_CYCLES``, about 10 ms): in eager and
layer-graph runs the host takes a millisecond or two per unit to issue the next one, which hides a
short delay; a side stream that lags by more than that exposes a missing wait on it (a slot's
gradient buffer written again before the earlier unit's copy-in read it: without the wait on
``reduce_done``, only the whole-step case caught that with 0.2 ms sleeps).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from fsdp_graph.fsdp import collectives, param_group, unit_reduce
from fsdp_graph.fsdp.flat_layout import FlatLayout
from fsdp_graph.fsdp.gradients import UnitGradients
from fsdp_graph.fsdp.root import RootContext
from fsdp_graph.fsdp.sharded_grads import ShardedGrads
from fsdp_graph.fsdp.unit import FSDPUnit

CYCLES = 400_000  # about 0.2 ms at the H200's clock: longer than any kernel of the test model
ENTER_CYCLES = 20_000_000  # about 10 ms: longer than the host's gap between two units' steps
STREAMS = ("compute", "all_gather", "reduce")
SITES = {
    "compute": [(FSDPUnit, "pre_forward"), (FSDPUnit, "post_forward"), (FSDPUnit, "pre_backward"),
                (FSDPUnit, "post_backward"), (UnitGradients, "prepare"), (RootContext, "end_backward")],
    "all_gather": [(param_group, "all_gather_inplace"), (FlatLayout, "copy_out")],
    "reduce": [(FlatLayout, "copy_in"), (unit_reduce, "copy_piece_in"), (unit_reduce, "reduce_scatter_sum"),
               (unit_reduce, "all_reduce"), (ShardedGrads, "accumulate")],
}


queued = [0]  # sleeps queued so far: a test checks the sites were reached


def _sleep(cycles: int = CYCLES) -> None:
    torch.cuda._sleep(cycles)
    queued[0] += 1


def _delayed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _sleep()
        try:
            return fn(*args, **kwargs)
        finally:
            _sleep()

    return wrapper


@contextlib.contextmanager
def inject(stream: str | None):
    """Sleeps on ``stream`` (one of ``STREAMS``) at every boundary while the block runs; None: none."""
    if stream is None:
        yield
        return
    assert stream in STREAMS, stream
    originals = [(owner, name, owner.__dict__[name]) for owner, name in SITES[stream]]
    for owner, name, fn in originals:
        setattr(owner, name, _delayed(fn))
    hooks = []
    if stream == "compute":
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        hooks = [register_optimizer_step_pre_hook(lambda *_: _sleep()),
                 register_optimizer_step_post_hook(lambda *_: _sleep())]
    else:
        enter = collectives.CommStreams.enter
        originals.append((collectives.CommStreams, "enter", enter))

        @contextlib.contextmanager
        def delayed_enter(self, side):
            with enter(self, side):
                delay = side is not None and side is getattr(self, stream)
                if delay:
                    _sleep(ENTER_CYCLES)  # before the first op on the side stream: a long lag
                yield
                if delay:
                    _sleep()  # after the last one

        collectives.CommStreams.enter = delayed_enter
    try:
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        for hook in hooks:
            hook.remove()
