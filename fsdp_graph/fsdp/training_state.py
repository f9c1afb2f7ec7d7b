"""The explicit per-unit training state.

Hooks are driven by autograd in eager mode, but a graph wrapper calls them one by one, outside
autograd, in the order its capture needs. The state makes every step check that it is legal:

    IDLE --pre_forward--> FORWARD --post_forward--> IDLE
    IDLE --pre_backward--> BACKWARD --post_backward--> IDLE

A forward that starts while the unit is in BACKWARD is an activation-checkpoint recompute and
leaves the state alone. Anything else is an impossible transition and raises.
"""

from __future__ import annotations

from enum import Enum


class TrainingState(Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class TransitionError(RuntimeError):
    """A hook ran in a state it cannot run in (e.g. post-backward before pre-backward)."""


def check_transition(unit_name: str, step: str, state: TrainingState, allowed: tuple[TrainingState, ...]) -> None:
    if state not in allowed:
        expected = " or ".join(s.value for s in allowed)
        raise TransitionError(
            f"FSDP unit {unit_name}: cannot run {step} in state {state.value} (expected {expected}). "
            "Hooks must run in the order pre_forward -> post_forward, pre_backward -> post_backward; "
            "if you drive them by hand (e.g. around a CUDA-graph capture), call them in that order."
        )
