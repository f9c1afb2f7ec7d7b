"""One original parameter of a unit: where modules hold it, its master shard, its unsharded form.

* The **master** is this rank's rows of the parameter (``flat_layout.py``), stored in the unit's
  fp32 (or wider) ``master_flat`` and presented as FSDP2 presents it: an ``nn.Parameter`` DTensor of
  the global shape, ``Shard(0)`` over the unit's mesh (``mesh.py``), whose local tensor is that
  view of ``master_flat``. It replaces the parameter in every module that referenced it, under the
  original name, so the optimizer, torch's clipping and DCP see it.
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
from .mesh import ShardMesh, local_tensor

MASTER_TAG = "_fsdp_graph_master_of"  # on every master parameter: weakref to its unit
REPLACED_TAG = "_fsdp_graph_replaced_by"  # on an original parameter: weakref to the unit that sharded it
UNSHARDED_TAG = "_fsdp_graph_unsharded_of"  # on every unsharded parameter: weakref to its unit


def _live_owner(param: torch.Tensor, tag: str):
    ref = getattr(param, tag, None)
    owner = ref() if ref is not None else None
    return owner if owner is not None and owner.active else None


def master_owner(param: torch.Tensor):
    """The unit whose master ``param`` is (None for ordinary parameters)."""
    return _live_owner(param, MASTER_TAG)


def unsharded_owner(param: torch.Tensor):
    """The unit whose unsharded parameter ``param`` is (None for any other tensor)."""
    return _live_owner(param, UNSHARDED_TAG)


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
    __slots__ = ("name", "refs", "dtype", "requires_grad", "local", "local_ptr", "storage_ptr", "master", "original",
                 "unsharded",
                 "span", "mesh", "owner")

    def __init__(self, name: str, refs: list[tuple[nn.Module, str]], original: nn.Parameter,
                 local: torch.Tensor, span: ParamSpan, mesh: ShardMesh) -> None:
        self.name = name
        self.refs = refs  # (module, attribute) of every place that held the original
        self.dtype = original.dtype
        self.requires_grad = original.requires_grad
        self.original = weakref.ref(original)  # to recognise ties that cross unit boundaries
        self.span, self.mesh = span, mesh
        self.local = local  # this rank's rows: a view of master_flat
        if not original.is_meta:  # meta: the model's own init fills the masters after to_empty
            with torch.no_grad():
                local.copy_(original.detach().narrow(0, span.row_start, span.local_rows))
        self.master = nn.Parameter(mesh.wrap(local, span.shape), requires_grad=self.requires_grad)
        self.local_ptr = local.data_ptr() if local.numel() else None  # to notice a replaced tensor
        self.storage_ptr = local.untyped_storage().data_ptr()  # the same for a rank with no rows
        self.unsharded: nn.Parameter | None = None

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """A tensor of this rank's rows (a gradient) as the master's kind: DTensor or plain."""
        return self.mesh.wrap(local, self.span.shape)

    def reattach(self) -> None:
        """After ``Module._apply`` (``to_empty``, ``.to(device)``): the master's tensor is no longer the
        view of ``master_flat``; copy its values there and point the master back at the view. A move
        to another device than the unit's is refused."""
        found = local_tensor(self.master)
        if not self.moved():
            return
        if found.dtype != self.local.dtype or found.shape != self.local.shape:
            raise RuntimeError(
                f"parameter '{self.name}' changed to dtype {found.dtype} / shape {tuple(found.shape)}: the sharded "
                f"parameters of a fully_shard-ed module stay {self.local.dtype} (the master copy). Set compute "
                "dtypes with fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...)), not .to(dtype)."
            )
        if not found.is_meta and found.device != self.local.device:
            raise RuntimeError(
                f"parameter '{self.name}' was moved to {found.device}, but fully_shard placed its unit on "
                f"{self.local.device}. Move the model before fully_shard (or pass a mesh of the device type you "
                "want); for a meta-device model, call to_empty(device=...) with the unit's device."
            )
        if not found.is_meta:
            with torch.no_grad():
                self.local.copy_(found)
        if self.master is not found:  # a DTensor: re-point its local tensor, as FSDP2 does
            self.master._local_tensor = self.local
        else:
            self.master.data = self.local

    def retag(self) -> None:
        """Tag the master again (``Module._apply`` swaps a DTensor's ``__dict__``, tags included)."""
        setattr(self.master, MASTER_TAG, self.owner)

    def moved(self) -> bool:
        """Whether the master's memory is no longer its view of ``master_flat``."""
        found = local_tensor(self.master)
        if self.local_ptr is not None:
            return found.data_ptr() != self.local_ptr
        return found.untyped_storage().data_ptr() != self.storage_ptr

    def tag(self, unit) -> None:
        """Let ``master_owner`` / ``replaced_by`` find ``unit`` from the master and the original."""
        self.owner = weakref.ref(unit)
        setattr(self.master, MASTER_TAG, self.owner)
        original = self.original()
        if original is not None:
            setattr(original, REPLACED_TAG, weakref.ref(unit))

    def bind(self, view: torch.Tensor) -> bool:
        """Point the unsharded parameter at ``view`` of a flat buffer; True when it was created now."""
        if self.unsharded is None:
            self.unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
            setattr(self.unsharded, UNSHARDED_TAG, self.owner)
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
        local = master._local_tensor if self.mesh.mesh is not None else master
        if self.local_ptr is not None:
            if local.data_ptr() != self.local_ptr:
                self._replaced(unit_name)
        elif local.untyped_storage().data_ptr() != self.storage_ptr:  # no rows here: every rank must refuse
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
