"""Forward-only (evaluation) graphs of a whole FSDP model: the unshards inside the capture.

    config = fsdp_graph.GraphConfig(forward_only="model")
    evaluate = fsdp_graph.make_eval_step(model, config=config, example_args=(example_idx,))
    logits, _ = evaluate(idx)        # copies idx in, replays, returns copies of the outputs

Model granularity: the model's forward in eval mode under ``torch.no_grad()``, FSDP's
all-gathers (with their prefetch, on the all-gather stream) recorded into the graph, as in the
whole training step (``whole_graph.py``). Layer granularity (unshard outside the capture, each
block's forward graphed) is ``graph_modules(..., forward_only=True)``. ``EvalStep`` is the eager
counterpart; ``make_step.make_eval_step`` picks one of the three from a ``GraphConfig``.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..fsdp.capture_interface import TrainingState, root_contexts, units_in
from ..graphs.capture_streams import capture_stream
from ..graphs.host_sync import no_host_sync
from ..graphs.module_graphs import eval_mode
from ..graphs.replay_stream import replay_target, replay_whole, whole_target
from ..graphs.static_inputs import StaticInputs
from ..graphs.whole_graph import capture_whole, on_stream


class EvalStep:
    """``model(*args)`` in eval mode under ``torch.no_grad()``; the model's modes are restored."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        with eval_mode(self.model), torch.no_grad():
            return self.model(*args, **kwargs)


class GraphedForward:
    """The whole model's evaluation forward as one CUDA graph (see the module docstring; built by
    ``make_eval_step``, which validates the model first)."""

    def __init__(self, model: nn.Module, example_args: tuple, *, num_warmup_iters: int = 3,
                 replay_stream: torch.cuda.Stream | None = None) -> None:
        self.model = model
        self.replay_default = replay_target(replay_stream, None, "make_eval_step")
        self.units = units_in(model)
        self.inputs = StaticInputs("make_eval_step", tuple(example_args), self.units[0].device)
        contexts = root_contexts(model)
        stream = capture_stream(self.units[0].device, self)  # (one no live graph set of ours shares)
        run = lambda: model(*self.inputs.tensors)  # noqa: E731
        with ExitStack() as stack:
            for ctx in contexts:
                stack.enter_context(ctx.outside_training_step())
            stack.enter_context(eval_mode(model))
            stack.enter_context(torch.no_grad())
            with on_stream(stream):
                for i in range(num_warmup_iters):
                    with no_host_sync("the model's forward", enabled=i > 0):
                        run()
            self.graph, self.static_outputs = capture_whole("make_eval_step", run, contexts, stream)
        self.replays = 0

    def __call__(self, *args: torch.Tensor):
        target = whole_target(self.replay_default, "make_eval_step", self.units[0].device)
        busy = [u for u in self.units if u.state is not TrainingState.IDLE]
        if busy:
            raise RuntimeError(
                f"make_eval_step: FSDP unit {busy[0].name} is in {busy[0].state.value}; the graph overwrites the "
                "units' parameter buffers, so call it between training steps, not inside forward/backward."
            )
        self.inputs.copy_in(args)
        replay_whole(self.graph, target)
        self.replays += 1
        # Copies: the next replay overwrites the static outputs.
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.static_outputs)

