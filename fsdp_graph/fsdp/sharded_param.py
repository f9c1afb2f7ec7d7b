"""One original parameter of a unit: where modules hold it, its master shard, its unsharded form.

* The **master** is this rank's piece of the parameter: a 1-D ``nn.Parameter`` view of the unit's
  fp32 (or wider) ``master_flat``. It replaces the parameter in every module that referenced it,
  under the original name, so the optimizer sees it.
* The **unsharded** parameter is a full-shape ``nn.Parameter`` view of the unit's persistent
  parameter buffer, created once and the same object (at the same address, except for dynamic
  placement) forever. It is swapped into the modules for compute and swapped out at reshard.

FSDP2 keeps the same split (``FSDPParam``); here both forms are views of flat buffers.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from .flat_layout import ParamSpan

MASTER_TAG = "_fsdp_graph_master_of"  # on every master parameter: weakref to its unit
REPLACED_TAG = "_fsdp_graph_replaced_by"  # on an original parameter: weakref to the unit that sharded it


def _live_owner(param: torch.Tensor, tag: str):
    ref = getattr(param, tag, None)
    owner = ref() if ref is not None else None
    return owner if owner is not None and owner.active else None


def master_owner(param: torch.Tensor):
    """The unit whose master ``param`` is (None for ordinary parameters)."""
    return _live_owner(param, MASTER_TAG)


def replaced_by(param: torch.Tensor):
    """The unit that already sharded this original parameter (it is tied across units)."""
    return _live_owner(param, REPLACED_TAG)


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """Same memory, separate autograd version counter.

    The unsharded parameters are saved for backward, and the buffer under them is rewritten in
    place by later all-gathers (slot reuse) and by the re-gather before backward. That is by
    design (the data is restored before backward reads it), so those writes, made through the
    buffer tensor, must not bump the version counter autograd checks on the parameter views.
    """
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )


class ShardedParam:
    __slots__ = ("name", "refs", "dtype", "requires_grad", "master", "master_ptr", "original", "unsharded")

    def __init__(self, name: str, refs: list[tuple[nn.Module, str]], original: nn.Parameter,
                 master_piece: torch.Tensor, span: ParamSpan) -> None:
        self.name = name
        self.refs = refs  # (module, attribute) of every place that held the original
        self.dtype = original.dtype
        self.requires_grad = original.requires_grad
        self.original = weakref.ref(original)  # to recognise ties that cross unit boundaries
        with torch.no_grad():
            master_piece.copy_(original.detach().reshape(-1)[span.piece_start : span.piece_start + span.piece_numel])
        self.master = nn.Parameter(master_piece, requires_grad=self.requires_grad)
        self.master_ptr = self.master.data_ptr()
        self.unsharded: nn.Parameter | None = None

    def tag(self, unit) -> None:
        """Let ``master_owner`` / ``replaced_by`` find ``unit`` from the master and the original."""
        setattr(self.master, MASTER_TAG, weakref.ref(unit))
        original = self.original()
        if original is not None:
            setattr(original, REPLACED_TAG, weakref.ref(unit))

    def bind(self, view: torch.Tensor) -> bool:
        """Point the unsharded parameter at ``view`` of a flat buffer; True when it was created now."""
        if self.unsharded is None:
            self.unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
            return True
        self.unsharded.data = view
        return False

    # The group swaps its parameters in one loop (``ParamGroup.use`` / ``use_masters``): per-layer
    # host time matters, so the per-parameter work on the hot path is this one call.
    def use_unsharded(self, unit_name: str) -> None:
        """Swap the unsharded parameter into every module that holds this one, after checking that
        nobody replaced the master (or reassigned its ``.data``) since fully_shard."""
        master, unsharded = self.master, self.unsharded
        for module, attr in self.refs:
            current = module._parameters.get(attr)
            if current is not master and current is not unsharded:
                self._replaced(unit_name)
        if master.data_ptr() != self.master_ptr and master.numel():
            self._replaced(unit_name)
        for module, attr in self.refs:
            module._parameters[attr] = unsharded

    def follow_requires_grad(self) -> None:
        """Take over a ``requires_grad`` change made on the master after fully_shard."""
        self.requires_grad = self.master.requires_grad
        self.unsharded.requires_grad_(self.requires_grad)

    def _replaced(self, unit_name: str) -> None:
        raise RuntimeError(
            f"FSDP unit {unit_name}: parameter '{self.name}' was replaced after fully_shard (the module "
            "no longer holds the sharded parameter fully_shard installed, or its .data was reassigned). "
            "Update values in place instead: fsdp_graph.load_full_state_dict(model, state_dict), or "
            "`with torch.no_grad(): param.copy_(...)` on the sharded parameter."
        )
