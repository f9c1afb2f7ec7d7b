"""``fully_shard``: turn a module into an FSDP unit, FSDP2 style (bottom-up, in place).

Call it on each unit (e.g. every transformer block), then on the root. A parameter belongs to
the innermost unit whose subtree holds *every* reference to it. A parameter tied across two
units (an embedding shared with the LM head, each wrapped on its own) therefore belongs to
their common ancestor: when that ancestor is wrapped, the child unit that took the parameter
first is rebuilt without it (one all-gather, at set-up time only).

The module's class is swapped for a subclass that also derives from ``FSDPModule``, which adds
``no_sync()`` and ``set_requires_gradient_sync()``, as FSDP2 does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .fsdp_options import Options, list_of_modules, resolve_options
from .hooks import register_unit_hooks, run_as_forward
from .local_optimizer_step import install as install_local_optimizer_steps
from .mesh import ShardMesh, resolve_mesh
from .mixed_precision import MixedPrecisionPolicy
from .param_group import ShardState, note_master_writes, watch_master_writes
from .registry import ENCLOSING_ATTR, ROOT_ATTR, UNIT_ATTR, pinned_by, root_of, unit_of, units_in
from .replaced_params_check import install as install_replaced_params_check
from .root import RootContext
from .sharded_grads import reattach_grads
from .sharded_param import master_owner, replaced_by
from .unit import FSDPUnit, UnitConfig
from .verify import verify_same_weights

_HOOKS_ATTR = "_fsdp_hook_handles"
IGNORED_TAG = "_fsdp_graph_ignored"  # on a parameter passed in ignored_params: no unit ever owns it


class FSDPModule:
    """Mixin added to every module passed to ``fully_shard``."""

    @property
    def fsdp_unit(self) -> FSDPUnit:
        return unit_of(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps unsharded gradients (accumulating) and skips the reduce-scatter;
        the next backward with True reduces the accumulated sum."""
        units = units_in(self) if recurse else [unit_of(self)]
        for unit in units:
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: after a backward without gradient sync (accumulation, as FSDP2 uses it) the unit
        keeps its gathered parameters, and the next forward uses them without an all-gather. A
        synchronised backward always reshards (the optimizer step follows), and an optimizer step
        or a ``load_state_dict`` in between makes the next forward gather again. Not seen: other
        writes to the parameters (in place through them, ``.data``, a bare ``dcp.load``) between an
        unsynchronised backward and the next forward. A unit sharing a double-buffer slot keeps its parameters
        only until another unit takes the slot."""
        units = units_in(self) if recurse else [unit_of(self)]
        if not reshard_after_backward:
            watch_master_writes()
        for unit in units:
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters when this module's forward starts, instead of the
        next unit in the recorded order (FSDP2's explicit prefetching). A prefetch that finds its
        double-buffer slot busy is skipped (the unit gathers when it runs)."""
        unit_of(self).forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """As ``set_modules_to_forward_prefetch``, when this module's backward starts."""
        unit_of(self).backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def __deepcopy__(self, memo):
        raise TypeError(
            f"copy.deepcopy of a fully_shard-ed module ({type(self).__name__}) is not supported: its sharded "
            "parameters live in per-unit buffers tied to process groups and CUDA streams. Deep-copy the model "
            "before fully_shard and shard the copy too, or build a second model and load this one's "
            "weights (torch.distributed.checkpoint.state_dict.get_model_state_dict / set_model_state_dict)."
        )

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (not recursive) and put the unsharded ones in
        the module, as FSDP2 does; the next forward uses them without gathering again, and
        ``reshard()`` (or that forward's end) puts the sharded ones back. The all-gather runs on its
        stream and only the compute stream waits for it, so ``async_op=True`` does the same and
        returns a handle whose ``wait()`` has nothing left to wait for."""
        unit = unit_of(self)
        root_of(self).take_slots_in_module_order()
        if unit.shard_state is not ShardState.UNSHARDED:
            unit.require_idle("unshard()")
            unit.param_group.prefetch(strict=True)
            unit.param_group.use()  # the compute stream waits on the device; the host never blocks
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Put the sharded parameters back into this module (not recursive)."""
        unit = unit_of(self)
        unit.require_idle("reshard()", unsharded_ok=True)
        if unit.shard_state is ShardState.UNSHARDED:
            unit.param_group.reshard()

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradient sum by ``factor`` instead of the world size (this
        module's unit only, not recursive; set it before a whole-step graph is captured)."""
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be a number > 0, got {factor!r}")
        unit_of(self).grads.divide_factor = float(factor)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor  # FSDP2's earlier name

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2's scripts: here every reduction is a plain sum, scaled afterwards."""

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2's scripts: FSDP2 skips waiting for the last reduce-scatters when
        False. Here the end of every backward joins them, which is correct either way."""

    def _apply(self, fn, recurse: bool = True):
        """``to_empty(device=...)`` (meta-device initialisation, as in FSDP2), ``.to(device)``,
        ``.cuda()``: torch swaps the sharded parameters' tensors for new ones; this unit takes their
        values back into its master shard and re-points them, so the masters stay views of it (and
        on the unit's device). Dtype changes are refused (``ShardedParam.reattach``)."""
        unit = unit_of(self)
        unit.require_idle(f"{type(self).__name__}._apply (to_empty, .to, .cuda)")
        result = super()._apply(fn, recurse)
        unit.param_group.reattach_masters()
        reattach_grads(unit.grads.sharded)
        return result

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside the block skip gradient reduction."""
        units = units_in(self)
        previous = [u.requires_gradient_sync for u in units]
        for unit in units:
            unit.requires_gradient_sync = False
        try:
            yield
        finally:
            for unit, value in zip(units, previous):
                unit.requires_gradient_sync = value


def _units_of(modules, method: str) -> list[FSDPUnit]:
    modules = list(modules)
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise TypeError(f"{method}: {type(module).__name__} is not a fully_shard-ed module; pass modules that "
                            "were passed to fully_shard")
    return [unit_of(m) for m in modules]


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns (see there: nothing is left to wait for)."""

    def wait(self) -> None:
        return None


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` between the unit's forward hooks, as ``forward`` runs (FSDP2's
    function of the same name, e.g. for ``generate``). A no-op for a module that is not sharded."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register")
    method = getattr(module, method_name)

    def as_forward(*args, **kwargs):
        return run_as_forward(module, method, args, kwargs)

    setattr(module, method_name, as_forward)


_fsdp_classes: dict[type, type] = {}


def _original_class(module: nn.Module) -> type:
    """The module's own class, also after ``_swap_class`` (a unit rebuilt when a tie moves up)."""
    cls = type(module)
    return cls.__bases__[1] if issubclass(cls, FSDPModule) else cls


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    if cls not in _fsdp_classes:
        _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    module.__class__ = _fsdp_classes[cls]


def _param_refs(module: nn.Module) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]]:
    """Every parameter object under ``module`` with all the places that reference it."""
    refs: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    seen_places: set[tuple[int, str]] = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, param in sub._parameters.items():
            if param is None or (id(sub), attr) in seen_places:
                continue
            seen_places.add((id(sub), attr))
            fqn = f"{prefix}.{attr}" if prefix else attr
            refs.setdefault(id(param), (param, []))[1].append((sub, attr, fqn))
    return list(refs.values())


def _choose_device(module: nn.Module, mesh: ShardMesh) -> torch.device:
    """Where the unit lives, as FSDP2 decides: the mesh's device type, on the current CUDA device
    for CUDA (a given mesh; one made from a process group is NCCL's CUDA, else the parameters'
    device type, and CUDA for a meta-device model when there is a GPU, see ``_param_device_type``).
    Without a process group: the parameters' device, or for a meta-device model (initialised after
    ``to_empty``, see ``FSDPModule._apply``) the current CUDA device when there is one, else the CPU."""
    if mesh.mesh is not None and mesh.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if mesh.mesh is not None:
        return torch.device(mesh.mesh.device_type)
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        break
    return torch.device("cpu")


def _param_device_type(module: nn.Module) -> str:
    """The device type of the mesh fully_shard makes from a process group: NCCL's CUDA, else the
    parameters' (a meta-device model: CUDA when there is one)."""
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device.type
        break
    return "cuda" if torch.cuda.is_available() else "cpu"


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:  # to_empty materialises meta ones
                sub._buffers[name] = buf.to(device)


def _build_unit(
    module: nn.Module,
    refs: list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]],
    config: UnitConfig,
    mesh: ShardMesh,
    device: torch.device,
) -> FSDPUnit:
    """Make ``module`` a unit owning the parameters all of whose references lie in its subtree
    and that no unit owns yet (a parameter another unit already sharded is tied across units:
    it waits for their common ancestor)."""
    inside = {id(m) for m in module.modules()}
    owned = []
    for param, places in refs:
        if not any(id(m) in inside for m, _, _ in places):
            continue
        owner = master_owner(param)
        if owner is not None and id(owner.module) not in inside:
            raise ValueError(
                f"fully_shard({type(module).__name__}): submodule '{places[0][2].rsplit('.', 1)[0]}' is "
                f"shared with unit {owner.name}, which already owns its parameters. A parameter can "
                "belong to one unit only: fully_shard their common ancestor instead of each of them."
            )
        if owner is not None or replaced_by(param) or not all(id(m) in inside for m, _, _ in places):
            continue
        if getattr(param, IGNORED_TAG, False):
            continue
        prefix = next((name for name, m in module.named_modules() if m is places[0][0]), "")
        name = f"{prefix}.{places[0][1]}" if prefix else places[0][1]
        owned.append((name, param, [(m, attr) for m, attr, _ in places]))
    unit = FSDPUnit(module, owned, config, mesh, device, class_name=_original_class(module).__name__)
    module.__dict__[UNIT_ATTR] = unit
    module.__dict__[_HOOKS_ATTR] = register_unit_hooks(module) + [
        module.register_state_dict_pre_hook(_refuse_state_dict_mid_step),
        module.register_load_state_dict_pre_hook(lambda *_: note_master_writes())]
    _swap_class(module)
    return unit


def _refuse_state_dict_mid_step(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """Mid-step (or after ``unshard()``) the modules hold the unsharded parameters, not the sharded
    ones: a state dict (DCP, get_model_state_dict) would hold the wrong tensors."""
    unit_of(module).require_idle("state_dict()")


def _dissolve(unit: FSDPUnit, refs) -> None:
    """Undo a unit (set-up time only): full parameters back in place of its masters, ties re-joined."""
    places_of = {id(param): places for param, places in refs}
    for param, value in zip(unit.params, unit.param_group.full_params()):
        restored = nn.Parameter(value, requires_grad=param.requires_grad)
        for module, attr in param.refs:
            module._parameters[attr] = restored
        original = param.original()
        for module, attr, _ in places_of.get(id(original), []) if original is not None else []:
            module._parameters[attr] = restored
    for handle in unit.module.__dict__.pop(_HOOKS_ATTR):
        handle.remove()
    del unit.module.__dict__[UNIT_ATTR]
    unit.active = False


def _carry_settings(old: FSDPUnit, new: FSDPUnit, units: list[FSDPUnit]) -> None:
    """A unit rebuilt without a tied parameter keeps what was set on it, and the prefetch lists
    that named it name the new unit."""
    new.requires_gradient_sync = old.requires_gradient_sync
    new.reshard_after_backward = old.reshard_after_backward
    new.grads.divide_factor = old.grads.divide_factor
    new.forward_prefetch, new.backward_prefetch = old.forward_prefetch, old.backward_prefetch
    for unit in units:
        for targets in (unit.forward_prefetch, unit.backward_prefetch):
            if targets is not None:
                targets[:] = [new if t is old else t for t in targets]


def _depth(module: nn.Module, root: nn.Module) -> int:
    for name, sub in root.named_modules():
        if sub is module:
            return name.count(".") + (1 if name else 0)
    return 0


def _link(root_unit: FSDPUnit) -> None:
    """Parents, names and the enclosing mark for every unit under ``root_unit``, and one new
    root context for them all (its lazy init re-plans their buffers)."""
    all_units: list[FSDPUnit] = []

    def walk(module: nn.Module, name: str, enclosing: FSDPUnit | None) -> None:
        unit = module.__dict__.get(UNIT_ATTR)
        if unit is not None and unit is not enclosing:
            unit.parent = enclosing
            unit.rename(f"{name or '<root>'} ({unit.class_name})")
            all_units.append(unit)
            enclosing = unit
        module.__dict__[ENCLOSING_ATTR] = enclosing
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, enclosing)

    walk(root_unit.module, "", None)
    root = RootContext(root_unit, all_units)
    for unit in all_units:
        unit.module.__dict__[ROOT_ATTR] = root


def _refuse_if_pinned(module: nn.Module) -> None:
    """Whoever pinned a module (a CUDA graph) holds the addresses of its buffers now; sharding re-plans them."""
    for name, sub in module.named_modules():
        by = pinned_by(sub)
        if by is not None:
            raise ValueError(
                f"fully_shard({type(module).__name__}): '{name or '<root>'}' ({type(sub).__name__}) is already "
                f"graphed ({by}), and its graphs would keep reading the parameters' old addresses. Call "
                "fully_shard on every unit and the root first, then graph_modules."
            )


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh=None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy=None,
    ignored_params: set[nn.Parameter] | None = None,
    double_buffer: bool = True,
    persist_buffer_on_alloc_fail: bool = True,
    process_group: dist.ProcessGroup | None = None,
    verify: bool = False,
):
    """Shard ``module``'s parameters (those not owned by an inner unit) across the data-parallel
    ranks, in place; returns ``module``. FSDP2's signature (``fsdp_options.py`` says how each of
    its options maps here), plus this package's own:

    ``double_buffer``: unsharded parameters/gradients of leaf units alternate between two
    persistent slots, so their addresses never change (required for CUDA graphs).
    ``persist_buffer_on_alloc_fail``: a unit that cannot use a slot (too large, or it contains
    other units) gets its own persistent buffer instead of a fresh allocation per unshard
    (required for CUDA graphs too). With ``double_buffer=False`` every unshard allocates, as in
    FSDP2. ``process_group``: the group to shard over (the alternative to a 1-D ``mesh``).
    ``verify``: first check that every rank passes the same weights (``verify.py``; one small
    collective per unit), naming the first that differs (a forgotten seed).
    """
    options = resolve_options(mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
                              ignored_params, process_group)
    if isinstance(module, (list, tuple)):
        modules = list_of_modules(module)
        return [_shard_one(m, options, double_buffer, persist_buffer_on_alloc_fail, verify) for m in modules]
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(module).__name__}")
    return _shard_one(module, options, double_buffer, persist_buffer_on_alloc_fail, verify)


def _shard_one(module: nn.Module, options: Options, double_buffer: bool, persist_buffer_on_alloc_fail: bool,
               verify: bool = False):
    enclosing = module.__dict__.get(ENCLOSING_ATTR)
    if enclosing is not None:
        if enclosing.module is module:
            raise ValueError(f"fully_shard: {enclosing.name} is already sharded; call fully_shard once per module")
        raise ValueError(
            f"fully_shard({type(module).__name__}) called after fully_shard on the enclosing module "
            f"{enclosing.name}. Call fully_shard bottom-up, as in FSDP2: every inner unit (e.g. each "
            "transformer block) first, then the root."
        )
    _refuse_if_pinned(module)
    mesh = resolve_mesh(options.mesh, options.process_group, _param_device_type(module))
    if mesh.shard_group is not None:
        install_local_optimizer_steps()  # the masters will be DTensors: step them on their local shards
    install_replaced_params_check()
    device = _choose_device(module, mesh)
    _move_buffers(module, device)
    config = UnitConfig(options.mp_policy, double_buffer, persist_buffer_on_alloc_fail, options.reshard_after_forward)
    for param in options.ignored_params:
        setattr(param, IGNORED_TAG, True)

    # Parameters tied across an inner unit's boundary move up: rebuild that unit without them.
    refs = _param_refs(module)
    inner = units_in(module)
    crossing = []
    for param, _ in refs:
        unit = replaced_by(param)
        if unit is not None and unit in inner and unit not in crossing:
            crossing.append(unit)
    for unit in crossing:
        unit.require_idle(f"fully_shard({type(module).__name__}), which moves a tied parameter out of it,")
    for unit in crossing:
        _dissolve(unit, refs)
    if crossing:
        refs = _param_refs(module)
        for unit in sorted(crossing, key=lambda u: -_depth(u.module, module)):
            # Innermost first; each rebuilt unit is linked at once, so it has a live root even if
            # building the enclosing unit below fails.
            rebuilt = _build_unit(unit.module, refs, unit.config, unit.mesh, unit.device)
            _carry_settings(unit, rebuilt, units_in(module))
            _link(rebuilt)
            refs = _param_refs(module)

    if verify:
        _verify_same_weights(module, mesh)
    unit = _build_unit(module, refs, config, mesh, device)
    _link(unit)
    return module


def _verify_same_weights(module: nn.Module, mesh) -> None:
    """The weights this call shards (not yet sharded by an inner unit) and the module's buffers,
    the same on every rank of the mesh."""
    named = [(n, t) for n, t in list(module.named_parameters()) + list(module.named_buffers())
             if replaced_by(t) is None and not isinstance(t, DTensor)]
    if any(t.is_meta for _, t in named):
        raise ValueError(
            f"fully_shard(verify=True) on {type(module).__name__}: its parameters are on the meta device, so there "
            "are no weights to compare yet (each rank initialises its own shard after to_empty). Pass verify=False "
            "for a meta-device model."
        )
    groups = [g for g in (mesh.shard_group, mesh.replicate_group) if g is not None]
    verify_same_weights(type(module).__name__, named, groups)
