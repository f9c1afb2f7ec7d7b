"""Gradients that reach a unit outside its backward: refused, since they cannot be right.

A unit's backward runs between ``pre_backward`` (a gradient reached one of its outputs: gather
the parameters, choose where gradients go) and ``post_backward`` (reduce what autograd left,
then clear the unsharded ``.grad``). Autograd can reach a unit's parameters or inputs without
passing through its outputs: a loss term computed from a tensor the forward kept but did not
return (stored on the module, appended to a list). Such a backward reads whatever the unit's
parameter buffer holds by then (another unit's weights, where they share a slot), and the
gradients it leaves on the unsharded parameters are read by no reduce: lost without a word. Four
checks raise this error (each drops what it found, so the next step starts clean): the
post-backward trigger on the inputs firing in an idle unit, gradients found on the unsharded
parameters when the unit's backward starts, gradients left on an idle unit at the end of the
backward, and (when no unit's output got a gradient, so no end-of-backward step ran) at the next
forward, after that step's optimizer step ran without them.
"""

from __future__ import annotations

from collections.abc import Iterable


class StrayGradientError(RuntimeError):
    """A gradient reached an FSDP unit's parameters or inputs outside the unit's backward."""


def stray_gradient_error(unit_name: str, what: str, when: str) -> StrayGradientError:
    return StrayGradientError(
        f"FSDP unit {unit_name}: a gradient reached {what} outside the unit's backward ({when}). A unit's "
        "backward starts when a gradient reaches one of its outputs; here a loss term was most likely computed "
        "from a tensor the unit's forward kept but did not return (stored on the module, appended to a list). "
        "That backward would read parameters another unit may have overwritten since, and no reduce-scatter "
        "would read its gradients. Return the tensor from the module's forward (as an extra output) and "
        "compute the loss term from the returned value, or detach the kept tensor if the term should not "
        "train the unit. (A unit run more than once, or a double backward, can show the same way.)"
    )


def drop_unsharded_grads(params: Iterable) -> list[str]:
    """Clear ``.grad`` of these ``ShardedParam``s' unsharded parameters; the names of those that
    had one. Outside a unit's backward every one is None, so any found then is a stray gradient."""
    found = []
    for param in params:
        unsharded = param.unsharded
        if unsharded is not None and unsharded.grad is not None:
            unsharded.grad = None
            found.append(param.name)
    return found


def refuse_stray_gradients(unit_name: str, params: Iterable, when: str) -> None:
    """Outside the unit's backward: gradients on its unsharded parameters are dropped, and refused."""
    names = drop_unsharded_grads(params)
    if names:
        raise stray_gradient_error(unit_name, f"its parameters {', '.join(names)}", when)
