"""What a graph holding ``optimizer.step()`` fixed at its capture, checked before every replay.

A captured optimizer step keeps the tensors and constants it was captured with: the param groups'
state tensors, every hyperparameter (``weight_decay``, ``betas``, ``eps``) as a kernel argument, and
the learning rate as the device tensor it read. A change made afterwards in Python would be
ignored by the replay, silently. So the learning rate moves into a device tensor up front (filled
in place by ``torch.optim.lr_scheduler``), and every other change is refused with the fix: the
groups or the state replaced (``load_state_dict``, ``add_param_group``), a learning rate replaced
instead of filled, a hyperparameter changed (``OneCycleLR(cycle_momentum=True)`` changes
``betas``). Used by the whole-step graph and the optimizer-step graph.
"""

from __future__ import annotations

import torch


class CapturedOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer | None, device: torch.device, what: str) -> None:
        self.optimizer = optimizer
        self.what = what
        self.learning_rates = _learning_rates_on_device(optimizer, device)
        self._state = None  # the optimizer's state and each group's other hyperparameters, once captured
        self._hyperparameters: list[dict] = []

    def freeze(self) -> None:
        """At the capture: from now on the graph holds the state and the hyperparameters."""
        if self.optimizer is not None:
            self._state = self.optimizer.state
            self._hyperparameters = [_hyperparameters(g) for g in self.optimizer.param_groups]

    def check(self) -> None:
        """Refuse a change the graph would not see (see the module docstring)."""
        optimizer = self.optimizer
        if optimizer is None:
            return
        groups = optimizer.param_groups
        if len(groups) != len(self.learning_rates) or any(
            g is not captured for g, (captured, _) in zip(groups, self.learning_rates)
        ) or (self._state is not None and optimizer.state is not self._state):
            raise RuntimeError(
                f"{self.what}: the optimizer's param groups were replaced, or its state (optimizer.load_state_dict, "
                "add_param_group); the graph holds the old ones. Load state before building the step, or build a "
                "new step."
            )
        for i, (group, lr) in enumerate(self.learning_rates):
            if group["lr"] is not lr:
                raise RuntimeError(
                    f"{self.what}: param group {i}'s learning rate was replaced (now {group['lr']!r}); "
                    "the graph reads the device tensor it was captured with. Change it in place: "
                    "group['lr'].fill_(value) (torch.optim.lr_scheduler schedulers do this)."
                )
        for i, (group, captured) in enumerate(zip(groups, self._hyperparameters)):
            for key, value in captured.items():
                if not _same(group.get(key), value):
                    raise RuntimeError(
                        f"{self.what}: param group {i}'s {key!r} changed from {value!r} to {group.get(key)!r} after "
                        "the optimizer step was captured; the graph keeps the value it was captured with. Set it "
                        "before building the step (or build a new step); only the learning rate may change, in "
                        "place (a scheduler with cycle_momentum=True changes betas: pass cycle_momentum=False)."
                    )


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "lr")}


def _same(a, b) -> bool:
    """Equal as the graph sees it: tensors by identity (the graph reads that tensor), the rest by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _learning_rates_on_device(optimizer, device: torch.device) -> list[tuple[dict, torch.Tensor]]:
    """Every group's learning rate as a 0-dim fp32 tensor on ``device`` (in the group, in place)."""
    if optimizer is None:
        return []
    rates = []
    for group in optimizer.param_groups:
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device):
            lr = torch.tensor(float(lr), dtype=torch.float32, device=device)
            group["lr"] = lr
        rates.append((group, lr))
    return rates
