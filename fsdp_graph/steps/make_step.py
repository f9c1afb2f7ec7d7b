"""``make_train_step`` / ``make_eval_step``: a ``GraphConfig`` turned into a step, the one entry point.

A training script switches between eager, per-layer and whole-step graphs by the config alone:

    step = fsdp_graph.make_train_step(loss_fn, model, opt, config=GraphConfig(strategy="full_iteration"),
                                      example_batch=batch)
    for batch in loader:
        loss = step(*batch)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import torch
import torch.nn as nn

from ..fsdp.capture_interface import root_contexts
from ..graphs.activation_offload import offload_activations
from ..graphs.chained_buffers import SampleCalls
from ..graphs.module_graphs import eval_mode, graph_modules, record_sample_args
from ..graphs.segment_graphs import graph_segments
from .eval_step import EvalStep, GraphedForward
from .graph_config import GraphConfig, check_capturable_optimizer, selected_modules, validate_graph_config
from .optimizer_graph import graph_optimizer_step, refuse_ungraphable_step
from .train_step import GraphedTrainStep, TrainStep


def _require_example(example, what: str, config: GraphConfig):
    if example is None:
        raise ValueError(f"{what} with {config} needs an example batch: its shapes fix the graph's shapes")
    return tuple(example)


def make_train_step(
    loss_fn: Callable[..., torch.Tensor],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    config: GraphConfig | None = None,
    example_batch: tuple | None = None,
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
) -> TrainStep | GraphedTrainStep:
    """A training step ``step(*batch) -> loss`` for ``config.strategy`` (see ``train_step.py``).

    ``loss_fn(*batch)`` runs the forward and returns the scalar loss; the step does the backward,
    the reduce-scatters, optional clipping (``max_grad_norm``) and the optional optimizer step.
    ``example_batch`` (needed by graphs) fixes the arguments' shapes and dtypes; with
    ``grad_accum_steps=K`` each argument stacks K micro-batches: ``[K, *micro_batch_shape]``.
    """
    config = validate_graph_config(config, model)
    body = TrainStep(loss_fn, model, optimizer, grad_accum_steps=grad_accum_steps, max_grad_norm=max_grad_norm)
    if config.strategy == "none":
        _offload(body, model, config)
        return body
    example = _require_example(example_batch, "make_train_step", config)
    if config.strategy == "full_iteration":
        check_capturable_optimizer(optimizer)
        step = GraphedTrainStep(body, example, num_warmup_iters=config.num_warmup_iters,
                                replay_stream=config.replay_stream)
        _offload(body, model, config)
        return step
    if config.optimizer_graph and optimizer is None:
        raise ValueError(
            "make_train_step: GraphConfig(optimizer_graph=True) graphs the optimizer step, but no optimizer was "
            "given. Pass the optimizer, or drop optimizer_graph."
        )
    if config.optimizer_graph:  # (refused before any module is graphed)
        refuse_ungraphable_step(model, optimizer, config.num_warmup_iters, max_grad_norm)
    if config.segment_size > 1 and grad_accum_steps > 1:
        raise ValueError(
            f"make_train_step: GraphConfig(segment_size={config.segment_size}) with grad_accum_steps="
            f"{grad_accum_steps}: a segment's backward graph reduce-scatters at every backward, but accumulation "
            "runs the first micro-batches under no_sync. Use segment_size=1, or strategy='full_iteration' (which "
            "accumulates inside its graph)."
        )
    modules = selected_modules(model, config)
    micro = body.micro_batches(example)[0]
    _offload(body, model, config)  # (first: the sample forwards keep their activations too)
    try:
        samples = _samples(model, modules, lambda: loss_fn(*micro))
        _graph_layers(config, modules, samples)
    except BaseException:
        if body.offload is not None and not body.offload.owned:  # (no graph recorded it: it goes with the step)
            body.offload.remove()
        raise
    if config.optimizer_graph:  # last: it reads the homes the module graphs took (pins the rest for good)
        body.optimizer_step = graph_optimizer_step(model, optimizer, max_grad_norm=max_grad_norm,
                                                   num_warmup_iters=config.num_warmup_iters,
                                                   replay_stream=config.replay_stream)
    return body


def _offload(body: TrainStep, model: nn.Module, config: GraphConfig) -> None:
    """Install ``config.offload_activations`` (before anything runs a forward)."""
    if config.offload_activations is not None:
        body.offload = offload_activations(selected_modules(model, config, "offload_activations"),
                                           min_bytes=config.offload_min_bytes)


def _graph_layers(config: GraphConfig, modules: list, samples: SampleCalls) -> None:
    chained = samples.links if config.chain_static_buffers else None
    if config.segment_size > 1:
        graph_segments(modules, [a for a, _ in samples], sample_kwargs=[k for _, k in samples],
                       segment_size=config.segment_size, num_warmup_iters=config.num_warmup_iters,
                       replay_stream=config.replay_stream, chained_inputs=chained,
                       collective_graphs=config.collective_graphs)
    else:
        graph_modules(modules, [a for a, _ in samples], sample_kwargs=[k for _, k in samples],
                      num_warmup_iters=config.num_warmup_iters, collective_graphs=config.collective_graphs,
                      replay_stream=config.replay_stream, chained_inputs=chained)


def make_eval_step(model: nn.Module, *, config: GraphConfig | None = None, example_args: tuple | None = None):
    """An evaluation step ``evaluate(*args) -> model outputs`` (eval mode, no gradients) for
    ``config.forward_only``: eager, per-layer forward-only graphs, or the whole forward as one graph."""
    config = validate_graph_config(config, model)
    if config.forward_only == "none":
        return EvalStep(model)
    example = _require_example(example_args, "make_eval_step", config)
    if config.forward_only == "model":
        return GraphedForward(model, example, num_warmup_iters=config.num_warmup_iters,
                              replay_stream=config.replay_stream)
    modules = selected_modules(model, config)
    with eval_mode(model), torch.no_grad():
        samples = _samples(model, modules, lambda: model(*example))
    graph_modules(modules, [a for a, _ in samples], sample_kwargs=[k for _, k in samples],
                  num_warmup_iters=config.num_warmup_iters, forward_only=True,
                  collective_graphs=config.collective_graphs, replay_stream=config.replay_stream)
    return EvalStep(model)


def _samples(model: nn.Module, modules: list[nn.Module], run: Callable[[], object]) -> SampleCalls:
    """Each module's arguments in the example forwards, which are no training step and leave the
    random number generators as they found them (the warm-ups and the capture that follow do
    draw from them, as before)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        for ctx in root_contexts(model):
            stack.enter_context(ctx.outside_training_step())
        return record_sample_args(modules, run)
