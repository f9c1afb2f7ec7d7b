"""Forward-only (evaluation) graphs of a whole FSDP model: the unshards inside the capture.

    evaluate = fsdp_graph.graph_forward(model, (example_idx,))
    logits, _ = evaluate(idx)        # copies idx in, replays, returns copies of the outputs

Model granularity: the model's forward in eval mode under ``torch.no_grad()``, FSDP's
all-gathers (with their prefetch, on the all-gather stream) recorded into the graph, as in the
whole training step (``whole_graph.py``). Layer granularity (unshard outside the capture, each
block's forward graphed) is ``graph_modules(..., forward_only=True)``. ``EvalStep`` is the eager
counterpart; ``graph_config.make_eval_step`` picks one of the three from a ``GraphConfig``.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .fully_shard import units_in
from .host_sync import no_host_sync
from .module_graphs import eval_mode
from .static_inputs import StaticInputs
from .training_state import TrainingState
from .whole_graph import capture_whole, on_stream, root_contexts


class EvalStep:
    """``model(*args)`` in eval mode under ``torch.no_grad()``; the model's modes are restored."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        with eval_mode(self.model), torch.no_grad():
            return self.model(*args, **kwargs)


class GraphedForward:
    """The whole model's evaluation forward as one CUDA graph (see the module docstring)."""

    def __init__(self, model: nn.Module, example_args: tuple, *, warmup_iters: int = 2) -> None:
        from .graph_config import GraphConfig, validate_graph_config

        validate_graph_config(GraphConfig(forward_only="model", warmup_steps=warmup_iters), model)
        self.model = model
        self.units = units_in(model)
        self.inputs = StaticInputs("graph_forward", tuple(example_args), self.units[0].device)
        contexts = root_contexts(model)
        stream = torch.cuda.Stream(self.units[0].device)
        run = lambda: model(*self.inputs.tensors)  # noqa: E731
        with ExitStack() as stack:
            for ctx in contexts:
                stack.enter_context(ctx.outside_training_step())
            stack.enter_context(eval_mode(model))
            stack.enter_context(torch.no_grad())
            with on_stream(stream):
                for i in range(warmup_iters):
                    with no_host_sync("the model's forward", enabled=i > 0):
                        run()
            self.graph, self.static_outputs = capture_whole("graph_forward", run, contexts, stream)
        self.replays = 0

    def __call__(self, *args: torch.Tensor):
        busy = [u for u in self.units if u.state is not TrainingState.IDLE]
        if busy:
            raise RuntimeError(
                f"graph_forward: FSDP unit {busy[0].name} is in {busy[0].state.value}; the graph overwrites the "
                "units' parameter buffers, so call it between training steps, not inside forward/backward."
            )
        self.inputs.copy_in(args)
        self.graph.replay()
        self.replays += 1
        # Copies: the next replay overwrites the static outputs.
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.static_outputs)


def graph_forward(model: nn.Module, example_args: tuple, *, warmup_iters: int = 2) -> GraphedForward:
    """Capture ``model``'s evaluation forward on ``example_args`` as one graph, unshards included."""
    return GraphedForward(model, example_args, warmup_iters=warmup_iters)
