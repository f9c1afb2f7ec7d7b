"""The module hooks fully_shard installs, and the sentinel protocol a graph wrapper relies on.

Per unit module, these hooks, each doing one thing:

=============================  ==============  ==============================================
hook                           kind            does
=============================  ==============  ==============================================
``pre_forward_unshard``        forward-pre     unshard (all-gather into the buffer), prefetch next
``cast_forward_inputs``        forward-pre     cast floating inputs to ``param_dtype`` (only with
                                               a ``MixedPrecisionPolicy.param_dtype``)
``install_post_backward``      forward-pre     wrap the inputs in an autograd function whose
                                               backward calls ``post_backward_handler``
``post_forward_reshard``       forward         reshard (mark the buffer free); ``always_call``, so
                                               a forward that raises still puts the masters back
                                               (and notes the failed step, see root.py)
``install_pre_backward``       forward         register grad hooks on the outputs that call
                                               ``pre_backward_handler`` (and queue the root's
                                               end-of-backward step)
``cast_forward_outputs``       forward         cast floating outputs to ``output_dtype`` (only
                                               with a ``MixedPrecisionPolicy.output_dtype``;
                                               after the pre-backward hooks, as in FSDP2)
=============================  ==============  ==============================================

Each hook enters the engine through the unit's root (``root.py``), which does the lazy init and
the iteration boundaries, then runs the unit's checked step (``unit.py``).

Sentinel protocol. The two *wrapper* hooks (the ones that install backward handlers through
autograd) carry an attribute naming the inner handler they install:

* ``install_pre_backward._cuda_graph_backward_pre_handler is pre_backward_handler``
* ``install_post_backward._cuda_graph_backward_handler is post_backward_handler``

Each inner handler is callable on its own as ``handler(module)``, outside autograd. A CUDA-graph
wrapper that finds a hook with one of these attributes withholds the hook during capture and
calls the handler itself around the backward capture; plain hooks (unshard, reshard) it calls
around the forward capture. The unit's training state checks that the order is legal.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .registry import root_of, unit_of
from .stray_gradients import drop_unsharded_grads, stray_gradient_error
from .training_state import TrainingState

BACKWARD_PRE_SENTINEL = "_cuda_graph_backward_pre_handler"
BACKWARD_SENTINEL = "_cuda_graph_backward_handler"


# -- inner handlers (callable on their own) ------------------------------------------------
def pre_backward_handler(module: nn.Module) -> None:
    """Unshard for backward, choose where the gradients go (``UnitGradients.prepare``), prefetch the previous unit."""
    root_of(module).pre_backward(unit_of(module))


def post_backward_handler(module: nn.Module) -> None:
    """Reduce-scatter the unit's gradients into the sharded .grad, then release its buffers."""
    unit_of(module).post_backward()


# -- plain hooks ---------------------------------------------------------------------------
def pre_forward_unshard(module: nn.Module, args: tuple, kwargs: dict) -> None:
    root_of(module).pre_forward(unit_of(module))


def _cast_floating(tree, dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def cast_forward_inputs(module: nn.Module, args: tuple, kwargs: dict):
    dtype = unit_of(module).compute_dtype
    if not kwargs and all(isinstance(x, torch.Tensor) and (x.dtype == dtype or not x.is_floating_point())
                          for x in args):
        return None  # the usual call, tensors already in the compute dtype: no tree to rebuild
    return _cast_floating((args, kwargs), dtype)


def cast_forward_outputs(module: nn.Module, args: tuple, output):
    return _cast_floating(output, unit_of(module).config.mp_policy.output_dtype)


def post_forward_reshard(module: nn.Module, args: tuple, output) -> None:
    unit = unit_of(module)
    raised = sys.exc_info()[1] if output is None else None  # always_call: the forward raised
    if raised is not None:
        root_of(module).note_failed_step(raised)  # the next forward checks every rank failed it too
    if unit.state is TrainingState.IDLE and raised is not None:
        return  # always_call after pre_forward itself raised: nothing was unsharded
    root_of(module).post_forward(unit)


# -- wrapper hooks (carry sentinels) -------------------------------------------------------
class _PostBackwardTrigger(torch.autograd.Function):
    """Identity on the unit's inputs; its backward runs once the gradients w.r.t. all inputs
    exist, i.e. after the unit's whole backward: the moment to reduce-scatter."""

    @staticmethod
    def forward(ctx, module: nn.Module, *inputs: torch.Tensor):
        ctx.module = module
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        unit = unit_of(ctx.module)
        if unit.state is TrainingState.IDLE:  # no gradient passed through the unit's outputs first
            drop_unsharded_grads(unit.params)  # (what autograd left there: the next step starts clean)
            raise stray_gradient_error(unit.name, "its inputs", "its post-backward trigger ran while it was idle")
        post_backward_handler(ctx.module)
        return (None, *grads)


POST_BACKWARD_TRIGGER_NODE = _PostBackwardTrigger._backward_cls  # (passes each gradient on unchanged)


def _hooks_active(module: nn.Module) -> bool:
    """Not during backward (a recompute), nor for a forward nested inside the module's own one:
    the outer call's backward handlers cover it."""
    unit = unit_of(module)
    return torch.is_grad_enabled() and unit.state is not TrainingState.BACKWARD and not unit.nested_forwards


def install_post_backward(module: nn.Module, args: tuple, kwargs: dict):
    if not _hooks_active(module):
        return None
    plain = not kwargs and all(isinstance(x, torch.Tensor) for x in args)  # the usual call: no tree
    flat, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        unit_of(module).post_backward_at_end()  # nothing to hang the trigger on (token ids, say)
        return None
    wrapped = _PostBackwardTrigger.apply(module, *(flat[i] for i in positions))
    for i, tensor in zip(positions, wrapped):
        flat[i] = tensor
    return (tuple(flat), kwargs) if plain else tree_unflatten(flat, spec)


install_post_backward._cuda_graph_backward_handler = post_backward_handler


def install_pre_backward(module: nn.Module, args: tuple, output):
    if not _hooks_active(module):
        return None
    for tensor in _grad_tensors(output):
        tensor.register_hook(_OutputGradHook(module))
    return None


install_pre_backward._cuda_graph_backward_pre_handler = pre_backward_handler


def _grad_tensors(output) -> list[torch.Tensor]:
    """The tensors that need a gradient in a module's output: pytree containers, and dataclasses
    (an HF ``ModelOutput`` is a registered container; a plain ``@dataclass`` is not), as FSDP2 finds them."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += _grad_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found


class _OutputGradHook:
    """Fires when a unit output's gradient is ready: the unit's backward is about to start."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, grad: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # autograd runs backward with grad mode on only for create_graph=True
            raise RuntimeError(
                f"FSDP unit {unit_of(self.module).name}: a backward with create_graph=True (a double backward: "
                "a gradient penalty, say) runs through this unit. Its backward graph would keep the unsharded "
                "parameters, which the next unit to gather overwrites before the second backward reads them "
                "(FSDP2 refuses it too). Compute the penalty outside the sharded modules, or train those modules "
                "without fully_shard."
            )
        root_of(self.module).queue_end_of_backward()
        pre_backward_handler(self.module)


def _unit_hooks(module: nn.Module) -> tuple[list, list]:
    """The unit's forward-pre hooks and forward hooks, each list in the order they run."""
    policy = unit_of(module).config.mp_policy
    cast_in = [cast_forward_inputs] if policy.param_dtype is not None and policy.cast_forward_inputs else []
    cast_out = [cast_forward_outputs] if policy.output_dtype is not None else []
    pre = [pre_forward_unshard, *cast_in, install_post_backward]
    return pre, [post_forward_reshard, install_pre_backward, *cast_out]


def register_unit_hooks(module: nn.Module) -> list:
    """Install the hooks; returns their handles (removed if the unit is re-planned). The
    forward-pre hooks go before any the module already has, as in FSDP2."""
    pre, post = _unit_hooks(module)
    handles = [module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True) for hook in reversed(pre)]
    for hook in post:  # post_forward_reshard also when forward raises
        handles.append(module.register_forward_hook(hook, always_call=hook is post_forward_reshard))
    return handles


def run_as_forward(module: nn.Module, method, args: tuple, kwargs: dict):
    """``method(*args, **kwargs)`` between the unit's forward hooks, as ``module(...)`` would run
    ``forward`` (FSDP2's ``register_fsdp_forward_method``: ``model.generate()``, say)."""
    pre, post = _unit_hooks(module)
    for hook in pre:
        result = hook(module, args, kwargs)
        if result is not None:
            args, kwargs = result
    unit = unit_of(module)
    unit.in_forward_method = True  # the method may call the module itself: that forward is nested
    try:
        output = method(*args, **kwargs)
    except BaseException:
        unit.in_forward_method = False
        post_forward_reshard(module, args, None)
        raise
    unit.in_forward_method = False
    for hook in post:
        result = hook(module, args, output)
        if result is not None:
            output = result
    return output
