"""A training step as one object: forward + loss + backward (+ clip) (+ optimizer step).

    config = fsdp_graph.GraphConfig(strategy="full_iteration")
    step = fsdp_graph.make_train_step(loss_fn, model, opt, config=config, example_batch=batch)
    for batch in loader:
        loss = step(*batch)          # copies the batch in, replays, returns the loss

``TrainStep`` is the step body, run eagerly; ``GraphedTrainStep`` runs the *same* body, so
its result is bitwise the eager one:

1. The first ``num_warmup_iters`` calls are real eager steps on the capture stream (optimizer state,
   the recorded prefetch order, NCCL communicators and cuBLAS handles come into being; the
   second and later ones also prove the body free of host syncs, see ``host_sync.py``).
2. The next call captures the body once (``whole_graph.py``: FSDP's all-gathers and
   reduce-scatters, on their side streams, inside the graph) and replays it: that is its step.
3. Every later call copies the batch into the static inputs and replays.

Gradient accumulation happens inside the one graph: with ``grad_accum_steps=K`` each argument
carries K micro-batches stacked on a new leading dimension (``torch.stack(micro_batches)``);
micro-batches 1..K-1 run under FSDP's ``no_sync`` and the last one reduce-scatters the sum.
The loss of each micro-batch is divided by K, so the step's gradient is the mean over micro-batches
and the returned loss their mean.

With an ``optimizer`` the step ends with ``optimizer.step()`` and ``zero_grad()``, in the graph.
It must be capturable (``capturable=True`` for Adam/AdamW, best with ``fused=True``; ``fused=True``
for SGD); each param
group's learning rate is moved into a device tensor, which the graph reads at every replay, so
``group["lr"].fill_(value)`` and ``torch.optim.lr_scheduler`` schedulers (which fill tensor
learning rates in place) take effect without re-capture. Without an optimizer, the sharded
``.grad`` hold this step's gradient after each call (as after ``zero_grad()`` + backward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..fsdp.capture_interface import root_contexts, units_in
from ..fsdp.clip_grad import clip_grad_norm_
from ..graphs.activation_offload import add_host_plans, offload_passes
from ..graphs.capture import backward_on_this_thread
from ..graphs.capture_streams import capture_stream
from ..graphs.host_sync import no_host_sync
from ..graphs.replay_stream import replay_target, replay_whole, whole_target
from ..graphs.static_inputs import StaticInputs
from ..graphs.whole_graph import capture_whole, on_stream
from .captured_optimizer import CapturedOptimizer


class TrainStep:
    """The eager step body (strategies ``none`` and ``layer``); see the module docstring."""

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable returning the scalar loss, not {type(loss_fn).__name__}")
        if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an int >= 1, got {grad_accum_steps!r}")
        self.loss_fn = loss_fn
        self.model = model
        self.optimizer = optimizer
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self.units = units_in(model)
        self.optimizer_step: Callable[[], object] | None = None  # clip + step as graphs (optimizer_graph=True)
        self.offload = None  # GraphConfig.offload_activations: the ActivationOffload handle

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        return self.run(batch)

    def micro_batches(self, batch: tuple) -> list[tuple]:
        k = self.grad_accum_steps
        if k == 1:
            return [tuple(batch)]
        for i, x in enumerate(batch):
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != k:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"train step with grad_accum_steps={k}: argument {i} has shape {shape}; each argument must "
                    f"stack the {k} micro-batches on a new leading dimension (torch.stack(micro_batches))."
                )
        return [tuple(x[i] for x in batch) for i in range(k)]

    def run(self, batch: tuple) -> torch.Tensor:
        """One step on ``batch``; returns the (mean micro-batch) loss, detached. If it raises, the
        next step first checks that every rank failed it too (``RootContext.note_failed_step``)."""
        try:
            return self._run(batch)
        except BaseException as err:
            self.note_failure(err)
            raise

    def _run(self, batch: tuple) -> torch.Tensor:
        micro = self.micro_batches(batch)
        k = len(micro)
        previous_sync = [u.requires_gradient_sync for u in self.units]
        if self.optimizer is None:
            self.clear_grads()  # each call's gradient replaces the last one's (as a graph replay does)
        total = None
        try:
            for i, args in enumerate(micro):
                for unit in self.units:
                    unit.requires_gradient_sync = i == k - 1  # reduce once, the sum, after the last
                loss = self._loss(args)
                if k > 1:
                    loss = loss / k
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
        except BaseException:
            self.clear_grads()  # no partial gradient may leak into the next step
            raise
        finally:
            for unit, flag in zip(self.units, previous_sync):
                unit.requires_gradient_sync = flag
        if self.optimizer_step is not None:
            self.optimizer_step()
        else:
            if self.max_grad_norm is not None:
                clip_grad_norm_(self.model, self.max_grad_norm)
            if self.optimizer is not None:
                self.optimizer.step()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        return total

    def note_failure(self, error: BaseException) -> None:
        """This rank's step raised: the next step first checks that every rank failed it too."""
        for ctx in root_contexts(self.model):
            ctx.note_failed_step(error)

    def clear_grads(self) -> None:
        for unit in self.units:
            unit.grads.clear()

    def _loss(self, args: tuple) -> torch.Tensor:
        loss = self.loss_fn(*args)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
            got = f"a tensor of shape {tuple(loss.shape)} (requires_grad={loss.requires_grad})" if isinstance(
                loss, torch.Tensor) else type(loss).__name__
            raise TypeError(
                f"loss_fn must return the scalar loss that backward starts from (e.g. "
                f"lambda x, y: model(x, y)[1]), got {got}"
            )
        return loss


class GraphedTrainStep:
    """A ``TrainStep`` captured as one CUDA graph after ``num_warmup_iters`` eager calls (built by
    ``make_train_step``, which validates the model and the optimizer first)."""

    def __init__(self, body: TrainStep, example_batch: tuple, *, num_warmup_iters: int = 3,
                 replay_stream: torch.cuda.Stream | None = None) -> None:
        self.body = body
        body.micro_batches(tuple(example_batch))  # the stacked-micro-batch layout, checked up front
        self.device = body.units[0].device
        self.inputs = StaticInputs("make_train_step", tuple(example_batch), self.device)
        self.num_warmup_iters = num_warmup_iters
        self.contexts = root_contexts(body.model)
        self.stream = capture_stream(self.device, self)  # (one no live graph set of ours shares)
        self.graph = None
        self.static_loss: torch.Tensor | None = None
        self.eager_steps = 0
        self.replays = 0
        self.captured_optimizer = CapturedOptimizer(body.optimizer, self.device, "make_train_step")
        self._divide_factors: list | None = None  # each unit's, as captured
        self._unused: list[frozenset[int]] = []  # each unit's parameters that get no gradient, as captured
        self.replay_default = replay_target(replay_stream, None, "make_train_step")
        self.host_plans: dict = {}  # activation offload: each offload's pinned buffers, which the graph copies to

    @property
    def offload(self):
        """GraphConfig.offload_activations: the ActivationOffload handle (None without)."""
        return self.body.offload

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        try:
            target = whole_target(self.replay_default, "make_train_step", self.device)
            self.captured_optimizer.check()
            self._check_divide_factors()
            self.inputs.copy_in(batch)
        except BaseException as err:  # (a short last batch on one rank, say)
            self.body.note_failure(err)
            raise
        if self.graph is None:
            if self.eager_steps < self.num_warmup_iters:
                return self._eager_step()
            self._capture()
        replay_whole(self.graph, target)
        self.replays += 1
        if self.body.optimizer is None:
            self._expose_grads()
        return self.static_loss.clone()

    def _eager_step(self) -> torch.Tensor:
        add_host_plans(self.body.model, self.host_plans, "make_train_step")
        # (Backward on this thread, as in the capture: one cuBLAS workspace for the step's stream.)
        with (on_stream(self.stream), backward_on_this_thread(),
              no_host_sync("the training step", enabled=self.eager_steps > 0),
              offload_passes(self.host_plans, capturing=False)):
            loss = self.body.run(tuple(self.inputs.tensors))
        self.eager_steps += 1  # only steps that completed count as warm-up
        loss.record_stream(torch.cuda.current_stream(self.device))
        return loss

    def _capture(self) -> None:
        self._refuse_post_accumulate_hooks()
        for unit in self.body.units:
            unit.grads.pin_sharded()  # the graph writes the gradients at fixed addresses
        # The capture records one Python path: start it from "no gradient", as every eager step
        # does, so the graph overwrites the sharded gradients instead of adding to them.
        self.body.clear_grads()
        self._divide_factors = [unit.grads.divide_factor for unit in self.body.units]
        self.captured_optimizer.refuse_tensor_hyperparameters()
        keys = self.captured_optimizer.state_keys()
        try:
            graph, loss = capture_whole("make_train_step", self._captured_run, self.contexts, self.stream)
        finally:
            made = self.captured_optimizer.drop_state_made_since(keys)
        if made:
            raise RuntimeError(
                f"make_train_step: {made} parameter(s) got their first gradient in the captured step, so the "
                "optimizer made their state inside the graph, which would reset it at every replay. Raise "
                f"GraphConfig.num_warmup_iters (now {self.num_warmup_iters}) until every trained parameter gets a "
                "gradient in an eager warm-up step, or use strategy='layer' (optimizer_graph=True makes such a step "
                "eagerly first)."
            )
        self.captured_optimizer.freeze()
        self.graph, self.static_loss = graph, loss
        self._unused = [unit.grads.use.unused for unit in self.body.units]

    def _captured_run(self) -> torch.Tensor:
        add_host_plans(self.body.model, self.host_plans, "make_train_step")
        with offload_passes(self.host_plans, capturing=True):  # (offloaded modules' copies are recorded)
            return self.body.run(tuple(self.inputs.tensors))

    def _refuse_post_accumulate_hooks(self) -> None:
        """A post-accumulate-grad hook (optimizer in backward) is Python the graph would run once, at
        capture, and never at replay: refused before the capture starts (a refusal raised inside it
        would leave the capture, and the process's CUDA RNG, broken)."""
        hooked = [f"{param.name} of unit {unit.name}" for unit in self.body.units for param in unit.params
                  if param.master._post_accumulate_grad_hooks]
        if hooked:
            raise RuntimeError(
                f"make_train_step: {', '.join(hooked)} has a post-accumulate-grad hook (optimizer in backward), "
                "which a whole-step CUDA graph cannot replay. Step the optimizer after backward, or use "
                "GraphConfig(strategy='layer') / 'none'."
            )

    def _expose_grads(self) -> None:
        """The graph wrote this step's gradients into the units' sharded gradient buffers: point
        ``.grad`` back at them if ``zero_grad()`` set it to None (not for parameters that got no
        gradient in the captured step: theirs stays None, see ``docs/unused_parameters.md``)."""
        for unit, unused in zip(self.body.units, self._unused):
            unit.grads.expose_sharded(unused)

    def _check_divide_factors(self) -> None:
        """The graph holds each unit's gradient scale as a constant: a later
        ``set_gradient_divide_factor`` cannot reach it, so it is refused, not ignored."""
        factors = [unit.grads.divide_factor for unit in self.body.units]
        if self._divide_factors is not None and factors != self._divide_factors:
            raise RuntimeError(
                "make_train_step: set_gradient_divide_factor was called after the whole-step graph was captured; "
                "the graph keeps the factor it was captured with. Set it before building the step, or build a "
                "new step."
            )
