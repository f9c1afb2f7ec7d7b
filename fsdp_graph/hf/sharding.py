"""Shard an HF transformers model in one call, the way accelerate's FSDP plugin picks its units.

An HF model names the classes that must not be split across FSDP units in ``_no_split_modules``
(its decoder layers): each such module becomes a unit, innermost first, then the root, exactly the
manual loop of the README. A class list overrides the choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from ..fsdp.fully_shard import fully_shard
from .capture_path import take_capture_path


def _class_names(model: nn.Module, layer_classes) -> set[str] | tuple[type, ...]:
    if layer_classes is None:
        names = getattr(model, "_no_split_modules", None)
        if not names:
            raise ValueError(
                f"fsdp_graph.hf.shard_model: {type(model).__name__} declares no _no_split_modules; pass "
                "layer_classes=[YourDecoderLayer] (the classes to shard one unit each)."
            )
        return set(names)
    if isinstance(layer_classes, (str, type)):
        layer_classes = [layer_classes]
    if not all(isinstance(c, (str, type)) for c in layer_classes):
        raise TypeError("fsdp_graph.hf.shard_model: layer_classes is a list of module classes or class names")
    return set(c if isinstance(c, str) else c.__name__ for c in layer_classes)


def decoder_layers(model: nn.Module, layer_classes: Sequence[type | str] | None = None) -> list[nn.Module]:
    """The modules ``shard_model`` makes units (``named_modules`` order): instances of
    ``layer_classes`` (classes or class names), by default of the model's ``_no_split_modules``."""
    names = _class_names(model, layer_classes)
    # By any class in the MRO: a sharded module's class is FSDP<Name>, a subclass of <Name>.
    layers = [m for m in model.modules() if m is not model and any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"fsdp_graph.hf.shard_model: no module of {type(model).__name__} is a {sorted(names)}; its classes "
            f"are {present}. Pass layer_classes= with the decoder layer's class."
        )
    return layers


def shard_model(
    model: nn.Module,
    layer_classes: Sequence[type | str] | None = None,
    *,
    capture_path: bool = True,
    **fully_shard_kwargs,
) -> nn.Module:
    """``fully_shard`` every decoder layer (see ``decoder_layers``), innermost first, then the root;
    returns ``model``. ``fully_shard_kwargs`` (``mp_policy``, ``mesh``, ``reshard_after_forward``,
    ``verify``, ...) apply to every unit.

    ``capture_path=True`` also calls ``take_capture_path(model)``, so eager and graphed steps run
    the same kernels (required by whole-step graphs; see ``capture_path.py`` for the cost).
    ``False`` keeps HF's eager shortcuts (FSDP2's kernels) for eager runs and per-layer graphs of decoder layers.
    """
    for layer in reversed(decoder_layers(model, layer_classes)):
        fully_shard(layer, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    if capture_path:
        take_capture_path(model)
    return model
