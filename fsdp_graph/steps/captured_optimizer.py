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
    def __init__(self, optimizer: torch.optim.Optimizer | None, device: torch.device, what: str,
                 rebuild: str = "build a new step") -> None:
        self.optimizer = optimizer
        self.what, self.rebuild = what, rebuild
        self.learning_rates = _learning_rates_on_device(optimizer, device)
        self._state = None  # the optimizer's state and each group's other hyperparameters, once captured
        self._hyperparameters: list[dict] = []

    def refuse_tensor_hyperparameters(self) -> None:
        """Before a capture: a hyperparameter in a tensor (other than the learning rate) would be read
        as a number at the capture, and an in-place change of it ignored by every replay."""
        optimizer = self.optimizer
        for i, group in enumerate(optimizer.param_groups if optimizer is not None else ()):
            for key, value in _hyperparameters(optimizer, group).items():
                if key != "params" and _holds_tensor(value):
                    raise ValueError(
                        f"{self.what}: param group {i}'s {key!r} holds a tensor; the captured step reads it as a "
                        f"number fixed at the capture, so a later change in place would be ignored. Pass {key} as "
                        "a Python number (only the learning rate lives in a device tensor)."
                    )

    def freeze(self) -> None:
        """After the capture: from now on the graph holds the state and the hyperparameters."""
        optimizer = self.optimizer
        if optimizer is not None:
            self._state = optimizer.state
            self._hyperparameters = [_hyperparameters(optimizer, g) for g in optimizer.param_groups]

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
                f"add_param_group); the graph holds the old ones. Load state before building the step, or "
                f"{self.rebuild}."
            )
        for i, (group, lr) in enumerate(self.learning_rates):
            if group["lr"] is not lr:
                raise RuntimeError(
                    f"{self.what}: param group {i}'s learning rate was replaced (now {group['lr']!r}); "
                    "the graph reads the device tensor it was captured with. Change it in place: "
                    "group['lr'].fill_(value) (torch.optim.lr_scheduler schedulers do this)."
                )
        for i, (group, captured) in enumerate(zip(groups, self._hyperparameters)):
            now = _hyperparameters(optimizer, group)
            for key, value in captured.items():
                if _same(now.get(key), value):
                    continue
                if key == "params":
                    raise RuntimeError(
                        f"{self.what}: param group {i}'s list of parameters changed after the optimizer step was "
                        f"captured; the graph steps the parameters it was captured with. {self.rebuild.capitalize()} "
                        "after changing it (add_param_group, or the optimizer built again)."
                    )
                raise RuntimeError(
                    f"{self.what}: param group {i}'s {key!r} changed from {value!r} to {now.get(key)!r} after "
                    "the optimizer step was captured; the graph keeps the value it was captured with. Set it "
                    f"before building the step (or {self.rebuild}); only the learning rate may change, in "
                    "place (a scheduler with cycle_momentum=True changes betas: pass cycle_momentum=False)."
                )


    def state_keys(self) -> dict[int, tuple]:
        """Each parameter's state keys now (before a capture)."""
        optimizer = self.optimizer
        return {} if optimizer is None else {id(p): tuple(s) for p, s in optimizer.state.items()}

    def drop_state_made_since(self, keys: dict[int, tuple]) -> int:
        """Undo the state a capture made (``state_keys`` from before it); how many parameters had some.

        Adam and its kin make a parameter's state at its first gradient. Made inside a capture, its
        zero-fill is recorded, never run, and would reset that state at every replay; its tensors hold
        garbage until then. So such a capture is thrown away and the state made again by an eager step."""
        optimizer = self.optimizer
        made = 0
        for param, state in list(optimizer.state.items()) if optimizer is not None else ():
            before = keys.get(id(param))
            if before is None:
                made += bool(state)
                del optimizer.state[param]
            elif len(state) != len(before):
                made += 1
                for key in [k for k in state if k not in before]:
                    del state[key]
        return made


def _hyperparameters(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    """What the step reads from a group besides the learning rate: the optimizer's hyperparameters
    (its ``defaults``' keys; a scheduler's own keys such as ``initial_lr`` are not read), and which
    parameters."""
    values = {k: group.get(k) for k in optimizer.defaults if k not in ("lr", "params")}
    values["params"] = tuple(map(id, group["params"]))
    return values


def _holds_tensor(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(map(_holds_tensor, value))
    return isinstance(value, torch.Tensor)


def _same(a, b) -> bool:
    """Equal as the graph sees it (tensors, refused at the capture, by identity)."""
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
