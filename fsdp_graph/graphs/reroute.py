"""Take a module's hooks off for capture, turn them into capture-time hooks, put them back.

A module's four hook dicts (forward-pre, forward, backward-pre, backward) and their flags
(with-kwargs, always-call, full-backward) are swapped for empty ones while the module is
captured, so nothing of them ends up inside a graph. The original dict objects are kept
untouched and put back afterwards (also when capture fails): every hook returns under its
original id, in its original order, with its flags, and existing ``RemovableHandle``s keep
working.

Meanwhile each hook becomes a capture-time hook under its own id:

* a plain forward-pre hook -> ``pre_forward``, a plain forward hook -> ``forward``;
* a *wrapper* hook carrying a sentinel (``_cuda_graph_backward_pre_handler`` /
  ``_cuda_graph_backward_handler``; see ``hooks.py``) is withheld: it would install autograd
  machinery on tensors of the capture. Its inner handler goes to ``pre_backward`` / ``backward``
  instead, and runs around the backward capture;
* a plain backward-pre / backward hook -> ``pre_backward`` / ``backward``. Gradients do not
  exist outside the replayed graph, so at capture time it receives empty gradient tuples; at
  replay it runs eagerly with the real gradients, like every restored hook.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager

import torch.nn as nn

from ..fsdp.capture_interface import BACKWARD_PRE_SENTINEL, BACKWARD_SENTINEL
from .capture import HOOK_KEYS

# Every attribute nn.Module keeps hook state in, and the empty value it gets during capture.
_HOOK_STATE = {
    "_forward_pre_hooks": OrderedDict,
    "_forward_pre_hooks_with_kwargs": OrderedDict,
    "_forward_hooks": OrderedDict,
    "_forward_hooks_with_kwargs": OrderedDict,
    "_forward_hooks_always_called": OrderedDict,
    "_backward_pre_hooks": OrderedDict,
    "_backward_hooks": OrderedDict,
    "_is_full_backward_hook": lambda: None,
}
_SENTINELS = {BACKWARD_PRE_SENTINEL: "pre_backward", BACKWARD_SENTINEL: "backward"}


def _sentinel_key(hook: Callable) -> tuple[str, Callable] | None:
    for attr, key in _SENTINELS.items():
        handler = getattr(hook, attr, None)
        if handler is not None:
            return key, handler
    return None


class ModuleHooks:
    """One module's hook state, taken off the module until ``restore()``."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name
        self.saved = {attr: getattr(module, attr) for attr in _HOOK_STATE}
        self._placeholders = {attr: make() for attr, make in _HOOK_STATE.items()}
        for attr, empty in self._placeholders.items():
            setattr(module, attr, empty)
        self._kwargs: dict = {}  # the kwargs of the current capture-time call, for with-kwargs forward hooks

    def restore(self) -> None:
        added = [attr for attr, empty in self._placeholders.items() if empty]
        for attr, original in self.saved.items():
            setattr(self.module, attr, original)
        if added:
            raise RuntimeError(
                f"graph_modules: a hook was registered on {self.name} while it was being captured "
                f"({', '.join(added)}); it was dropped. Register hooks before graph_modules or after it returns."
            )

    def capture_time_hooks(self) -> dict[str, dict]:
        """The module's hooks as capture-time hooks (sentinel wrappers replaced by their handlers)."""
        s = self.saved
        out: dict[str, dict] = {key: {} for key in HOOK_KEYS}
        for hook_id, hook in s["_forward_pre_hooks"].items():
            self._place(
                out, "pre_forward", hook_id, hook,
                self._pre_forward(hook, hook_id in s["_forward_pre_hooks_with_kwargs"]),
            )
        for hook_id, hook in s["_forward_hooks"].items():
            self._place(out, "forward", hook_id, hook, self._forward(hook, hook_id in s["_forward_hooks_with_kwargs"]))
        for hook_id, hook in s["_backward_pre_hooks"].items():
            self._place(out, "pre_backward", hook_id, hook, lambda m, h=hook: h(m, ()))
        for hook_id, hook in s["_backward_hooks"].items():
            self._place(out, "backward", hook_id, hook, lambda m, h=hook: h(m, (), ()))
        return out

    @staticmethod
    def _place(out: dict, key: str, hook_id, hook: Callable, adapted: Callable) -> None:
        rerouted = _sentinel_key(hook)
        if rerouted is not None:
            key, adapted = rerouted
        out[key][hook_id] = adapted

    def _pre_forward(self, hook: Callable, with_kwargs: bool) -> Callable:
        def pre_forward(module, args, kwargs):
            if with_kwargs:
                result = hook(module, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(module, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
            self._kwargs = kwargs
            return args, kwargs

        return pre_forward

    def _forward(self, hook: Callable, with_kwargs: bool) -> Callable:
        if with_kwargs:
            return lambda module, args, output: hook(module, args, self._kwargs, output)
        return hook

    def set_call_kwargs(self, kwargs: dict) -> None:
        self._kwargs = kwargs


@contextmanager
def hooks_taken_off(modules: list[nn.Module], names: list[str]) -> Iterator[list[ModuleHooks]]:
    """Every module without hooks inside the block; all restored on the way out, also on error."""
    taken: list[ModuleHooks] = []
    try:
        for module, name in zip(modules, names):
            taken.append(ModuleHooks(module, name))
        yield taken
    except BaseException:
        for hooks in taken:
            try:
                hooks.restore()
            except RuntimeError:
                pass  # the capture's own error is the one to report
        raise
    errors = []
    for hooks in taken:
        try:
            hooks.restore()
        except RuntimeError as e:
            errors.append(e)
    if errors:
        raise errors[0]


class SealedHooks(MutableMapping):
    """A hook dict of a module *inside* a graphed module. The graph replays its kernels, never
    its Python, so a hook registered on it now would silently never run at replay: refused.
    Reads and removals go to the original dict, so existing hooks and handles are unchanged (and
    still run when the graphed module falls back to eager)."""

    def __init__(self, original: dict, where: str) -> None:
        self.original = original
        self.where = where

    def __getitem__(self, key):
        return self.original[key]

    def __setitem__(self, key, value) -> None:
        raise RuntimeError(
            f"cannot register a hook on {self.where}: a replay runs the graph's kernels, not this "
            "submodule's Python, so the hook would never run. Register it before graph_modules, or on "
            "the graphed module itself (its hooks run eagerly around the replay)."
        )

    def __delitem__(self, key) -> None:
        del self.original[key]

    def __iter__(self):
        return iter(self.original)

    def __len__(self) -> int:
        return len(self.original)


def seal_submodule_hooks(module: nn.Module, name: str) -> None:
    for sub_name, sub in module.named_modules():
        if sub is module:
            continue
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            current = getattr(sub, attr)
            if not isinstance(current, SealedHooks):
                setattr(sub, attr, SealedHooks(current, f"'{sub_name}' ({type(sub).__name__}) of graphed {name}"))
