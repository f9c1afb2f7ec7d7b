"""CPU: hook extraction, sentinel reroute, restore, and graph_modules' refusals (before any capture)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.fsdp.hooks import (
    cast_forward_inputs,
    install_post_backward,
    install_pre_backward,
    post_backward_handler,
    post_forward_reshard,
    pre_backward_handler,
    pre_forward_unshard,
)
from fsdp_graph.fsdp.introspect import unit_buffers
from fsdp_graph.fsdp.registry import pinned_by, root_contexts
from fsdp_graph.fsdp.sharded_param import master_owner
from fsdp_graph.fsdp.training_state import TrainingState
from fsdp_graph.graphs.graphed_callable import GraphedCallable
from fsdp_graph.graphs.reroute import hooks_taken_off, seal_submodule_hooks

from models import Block, TinyLM

HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
              "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def _hooked_linear(calls: list):
    """A Linear with one hook of every kind; each hook appends its name to ``calls``."""
    m = nn.Linear(3, 3)
    handles = {
        "pre": m.register_forward_pre_hook(lambda mod, args: calls.append("pre")),
        "pre_kw": m.register_forward_pre_hook(
            lambda mod, args, kwargs: (calls.append("pre_kw"), ((args[0] * 2,), kwargs))[1], with_kwargs=True),
        "fwd": m.register_forward_hook(lambda mod, args, out: calls.append("fwd")),
        "fwd_kw": m.register_forward_hook(
            lambda mod, args, kwargs, out: calls.append(("fwd_kw", dict(kwargs))), with_kwargs=True, always_call=True),
        "bwd_pre": m.register_full_backward_pre_hook(lambda mod, grad_out: calls.append(("bwd_pre", grad_out))),
        "bwd": m.register_full_backward_hook(lambda mod, grad_in, grad_out: calls.append(("bwd", grad_in, grad_out))),
    }
    return m, handles


def test_hooks_come_off_during_capture_and_return_unchanged():
    calls: list = []
    m, handles = _hooked_linear(calls)
    before = {attr: getattr(m, attr) for attr in HOOK_DICTS}
    snapshot = {attr: list(d.items()) for attr, d in before.items()}
    with hooks_taken_off([m], ["m"]):
        assert all(not getattr(m, attr) for attr in HOOK_DICTS)
        m(torch.ones(1, 3)).sum().backward()
        assert calls == []  # nothing of the hooks runs (or would be captured) meanwhile
    for attr in HOOK_DICTS:
        assert getattr(m, attr) is before[attr]  # the same dict objects: ids, order and flags intact
        assert list(getattr(m, attr).items()) == snapshot[attr]
    m(torch.ones(1, 3, requires_grad=True)).sum().backward()
    assert [c if isinstance(c, str) else c[0] for c in calls] == ["pre", "pre_kw", "fwd", "fwd_kw", "bwd_pre", "bwd"]
    handles["pre"].remove()  # handles still act on the restored dicts
    assert handles["pre"].id not in m._forward_pre_hooks


def test_hooks_return_when_capture_fails():
    m, _ = _hooked_linear([])
    before = {attr: (getattr(m, attr), list(getattr(m, attr))) for attr in HOOK_DICTS}
    with pytest.raises(RuntimeError, match="capture blew up"):
        with hooks_taken_off([m], ["m"]):
            raise RuntimeError("capture blew up")
    for attr, (obj, ids) in before.items():
        assert getattr(m, attr) is obj and list(obj) == ids


def test_hook_registered_during_capture_is_reported_not_lost_silently():
    m = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="registered on m while it was being captured"):
        with hooks_taken_off([m], ["m"]):
            m.register_forward_hook(lambda *a: None)
    assert not m._forward_hooks


def test_plain_hooks_become_capture_time_hooks_under_their_ids():
    calls: list = []
    m, handles = _hooked_linear(calls)
    with hooks_taken_off([m], ["m"]) as (taken,):
        hooks = taken.capture_time_hooks()
        taken.set_call_kwargs({"scale": 3})
    assert list(hooks["pre_forward"]) == [handles["pre"].id, handles["pre_kw"].id]
    assert list(hooks["forward"]) == [handles["fwd"].id, handles["fwd_kw"].id]
    assert list(hooks["pre_backward"]) == [handles["bwd_pre"].id]
    assert list(hooks["backward"]) == [handles["bwd"].id]

    x = torch.ones(1, 3)
    args, kwargs = (x,), {"scale": 3}
    for fn in hooks["pre_forward"].values():
        args, kwargs = fn(m, args, kwargs)
    assert torch.equal(args[0], x * 2)  # the with-kwargs hook's replacement arguments are passed on
    for fn in hooks["forward"].values():
        fn(m, args, "out")
    hooks["pre_backward"][handles["bwd_pre"].id](m)
    hooks["backward"][handles["bwd"].id](m)
    assert calls == ["pre", "pre_kw", "fwd", ("fwd_kw", {"scale": 3}), ("bwd_pre", ()), ("bwd", (), ())]


def test_pre_forward_hook_returning_a_single_value_becomes_the_args_tuple():
    m = nn.Linear(2, 2)
    m.register_forward_pre_hook(lambda mod, args: args[0] + 1)
    with hooks_taken_off([m], ["m"]) as (taken,):
        (fn,) = taken.capture_time_hooks()["pre_forward"].values()
    args, kwargs = fn(m, (torch.zeros(2),), {})
    assert isinstance(args, tuple) and torch.equal(args[0], torch.ones(2)) and kwargs == {}


def _sharded_block(**kwargs) -> nn.Module:
    fsdp_graph.init_distributed()
    return fsdp_graph.fully_shard(Block(8, 16), **kwargs)


def test_fsdp_wrapper_hooks_are_withheld_and_their_handlers_rerouted():
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16)
    block = _sharded_block(mp_policy=policy)
    ids = {hook: hid for d in (block._forward_pre_hooks, block._forward_hooks) for hid, hook in d.items()}
    with hooks_taken_off([block], ["block"]) as (taken,):
        hooks = taken.capture_time_hooks()
    assert list(hooks["pre_forward"]) == [ids[pre_forward_unshard], ids[cast_forward_inputs]]
    assert list(hooks["forward"]) == [ids[post_forward_reshard]]
    # The wrapper's id now carries the inner handler, which runs around the backward capture.
    assert hooks["pre_backward"] == {ids[install_pre_backward]: pre_backward_handler}
    assert hooks["backward"] == {ids[install_post_backward]: post_backward_handler}


def test_capture_time_unit_steps_leave_fsdp_state_as_before():
    """Drive a unit through its capture-time hooks the way a warm-up pass does, inside the
    guard graph_modules uses: the unit ends idle, the masters' .grad and the recorded order untouched."""
    block = _sharded_block()
    unit = block.fsdp_unit
    (ctx,) = root_contexts(block)
    with hooks_taken_off([block], ["block"]) as (taken,):
        hooks = taken.capture_time_hooks()
        with ctx.outside_training_step():
            x = torch.randn(2, 4, 8, requires_grad=True)
            args, kwargs = (x,), {}
            for fn in hooks["pre_forward"].values():
                args, kwargs = fn(block, args, kwargs) or (args, kwargs)
            out = block(*args)
            for fn in hooks["forward"].values():
                fn(block, args, out)
            for fn in hooks["pre_backward"].values():
                fn(block)
            params = [p for p in block.parameters() if p.requires_grad]
            grads = torch.autograd.grad(out.sum(), [x, *params])
            for fn in hooks["backward"].values():
                fn(block)
            assert all(g.abs().sum() > 0 for g in grads[:2])
            assert any(m.grad is not None for m in unit.module.parameters())  # the capture reduced (zeros)
    assert unit.state is TrainingState.IDLE
    assert all(p.grad is None and master_owner(p) is unit for p in block.parameters())  # masters back, .grad as before
    assert ctx.order.forward == [] and ctx.order.backward == []


def test_graph_modules_refuses_units_without_persistent_buffers():
    for flags in ({"double_buffer": False}, {"persist_buffer_on_alloc_fail": False}):
        block = _sharded_block(**flags)
        with pytest.raises(ValueError, match="double_buffer=True and persist_buffer_on_alloc_fail=True"):
            fsdp_graph.graph_modules([block], [(torch.randn(2, 4, 8),)])
        with pytest.raises(ValueError, match="double_buffer=True and persist_buffer_on_alloc_fail=True"):
            fsdp_graph.graph_modules([block.qkv], [(torch.randn(2, 4, 8),)])  # a module inside the unit


def _sharded_tiny_lm(**kwargs) -> TinyLM:
    fsdp_graph.init_distributed()
    model = TinyLM(**kwargs)
    for block in model.blocks:
        fsdp_graph.fully_shard(block)
    return fsdp_graph.fully_shard(model)


def test_graph_modules_refuses_modules_containing_units_and_nested_selections():
    model = _sharded_tiny_lm()
    with pytest.raises(ValueError, match="contains FSDP unit"):
        fsdp_graph.graph_modules([model], [(torch.zeros(2, 8, dtype=torch.long),)])
    block = model.blocks[0]
    with pytest.raises(ValueError, match="inside .* and both are selected"):
        fsdp_graph.graph_modules([block, block.qkv], [(torch.randn(2, 8, 10),)] * 2)


def test_graph_modules_refuses_a_module_reading_another_units_parameters():
    fsdp_graph.init_distributed()
    model = TinyLM()
    model.shared = nn.Linear(10, 10)
    model.blocks[0].proj.weight = model.shared.weight  # tied across units: the root owns it
    for block in model.blocks:
        fsdp_graph.fully_shard(block)
    fsdp_graph.fully_shard(model)
    with pytest.raises(ValueError, match=r"reads parameters of FSDP unit <root>.*tied across units"):
        fsdp_graph.graph_modules([model.blocks[0]], [(torch.randn(2, 8, 10),)])


def test_graph_modules_refuses_units_mid_step():
    model = _sharded_tiny_lm()
    unit = model.blocks[0].fsdp_unit
    unit.state = TrainingState.FORWARD  # as if called from inside a step
    try:
        with pytest.raises(ValueError, match="between training steps"):
            fsdp_graph.graph_modules([model.blocks[0]], [(torch.randn(2, 8, 10),)])
    finally:
        unit.state = TrainingState.IDLE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_without_cuda_graphing_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        fsdp_graph.graph_modules([nn.Linear(2, 2)], [(torch.zeros(1, 2),)])
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        fsdp_graph.make_graphed_callables([nn.Linear(2, 2)], [(torch.zeros(1, 2),)])
    with pytest.raises(RuntimeError, match="needs a CUDA device"):  # one Sequential is one callable
        fsdp_graph.make_graphed_callables(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), (torch.zeros(1, 2),))


def test_make_graphed_callables_checks_its_arguments_first():
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['post_forward'\]"):
        fsdp_graph.make_graphed_callables([lin], [(torch.zeros(1, 2),)], capture_time_hooks=[{"post_forward": {}}])
    with pytest.raises(ValueError, match="one tuple per callable"):
        fsdp_graph.make_graphed_callables([lin, nn.Linear(2, 2)], [(torch.zeros(1, 2),)])
    with pytest.raises(TypeError, match=r"sample_args\[0\] must be a tuple"):
        fsdp_graph.make_graphed_callables([lin], [torch.zeros(1, 2)])
    with pytest.raises(ValueError, match="num_warmup_iters"):
        fsdp_graph.make_graphed_callables([lin], [(torch.zeros(1, 2),)], num_warmup_iters=0)
    lin.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="has hooks registered.*graph_modules"):
        fsdp_graph.make_graphed_callables([lin], [(torch.zeros(1, 2),)])


def test_hooks_on_submodules_of_a_graphed_module_are_refused():
    calls = []
    outer = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    handle = outer[0].register_forward_hook(lambda *a: calls.append("kept"))
    seal_submodule_hooks(outer, "outer")
    with pytest.raises(RuntimeError, match=r"'0' \(Linear\) of graphed outer.*never run"):
        outer[0].register_forward_hook(lambda *a: None)
    outer.register_forward_hook(lambda *a: calls.append("outer"))  # the graphed module itself: fine
    outer(torch.ones(1, 2))  # eager (e.g. the other training mode): existing hooks still run
    assert calls == ["kept", "outer"]
    handle.remove()
    outer(torch.ones(1, 2))
    assert calls == ["kept", "outer", "outer"]


def test_make_graphed_callables_refuses_hooks_a_capture_would_bake_in():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    seq[0].register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="'0' has _forward_hooks.*run at capture only"):
        fsdp_graph.make_graphed_callables([seq], [(torch.zeros(1, 2),)])
    lin = nn.Linear(2, 2)
    lin.weight.register_hook(lambda g: g * 2)
    with pytest.raises(ValueError, match="parameter 'weight' has a tensor hook.*register_post_accumulate_grad_hook"):
        fsdp_graph.make_graphed_callables([lin], [(torch.zeros(1, 2),)])


def test_capture_binds_slots_in_module_order():
    """Graphing a subset before the first step must not let the capture's unshard order decide
    which blocks share a slot: neighbours alternate, as in training."""
    model = _sharded_tiny_lm(n_blocks=4)
    units = [b.fsdp_unit for b in model.blocks]
    (ctx,) = root_contexts(model)
    with ctx.outside_training_step():
        ctx.pre_forward(units[3])  # capture of blocks[3] only, say
        ctx.post_forward(units[3])
    slots = [unit_buffers(u).params for u in units]
    assert slots[0] == slots[2] and slots[1] == slots[3] and slots[0] != slots[1]


def test_graph_modules_puts_hooks_and_fsdp_state_back_when_capture_fails(monkeypatch):
    import fsdp_graph.graphs.module_graphs as gm

    model = _sharded_tiny_lm()
    block = model.blocks[1]
    before = {attr: (getattr(block, attr), list(getattr(block, attr))) for attr in HOOK_DICTS}

    def failing_capture(modules, names, sample_args, sample_kwargs, warmup, hooks, *rest, **options):
        (x,) = sample_args[0]
        args, kwargs = (x,), {}
        for fn in hooks[0]["pre_forward"].values():  # unshard, as a capture would, then fail mid-way
            args, kwargs = fn(modules[0], args, kwargs) or (args, kwargs)
        raise RuntimeError("CUDA error during capture")

    monkeypatch.setattr(gm, "require_cuda", lambda what: None)
    monkeypatch.setattr(gm, "capture_callables", failing_capture)
    with pytest.raises(RuntimeError, match="CUDA error during capture"):
        fsdp_graph.graph_modules([block], [(torch.randn(2, 8, 10),)])
    for attr, (obj, ids) in before.items():
        assert getattr(block, attr) is obj and list(obj) == ids
    assert block.fsdp_unit.state is TrainingState.IDLE and pinned_by(block) is None
    assert all(master_owner(p) is not None and p.grad is None for p in block.parameters())  # masters back in place
    assert not isinstance(block.__dict__.get("forward"), GraphedCallable)


def test_make_graphed_callables_refuses_duplicates_bad_hook_dicts_and_kwargs_counts():
    lin = nn.Linear(2, 2)
    x = (torch.zeros(1, 2),)
    with pytest.raises(ValueError, match="a callable appears twice"):
        fsdp_graph.make_graphed_callables([lin, lin], [x, x])
    with pytest.raises(TypeError, match=r"capture_time_hooks\[0\]\['forward'\] must be a dict of hook id -> callable"):
        fsdp_graph.make_graphed_callables([lin], [x], capture_time_hooks=[{"forward": [print]}])
    with pytest.raises(ValueError, match="sample_kwargs has 2 entries for 1 callables"):
        fsdp_graph.make_graphed_callables([lin], [x], sample_kwargs=[{}, {}])


def test_graph_modules_refuses_modules_already_graphed_or_containing_one():
    from test_graphed_callable import emulated

    inner = nn.Linear(3, 3)
    inner.forward, _ = emulated(inner, (torch.randn(2, 3, requires_grad=True),))
    outer = nn.Sequential(inner, nn.ReLU())
    for module in (inner, outer):
        with pytest.raises(ValueError, match="is already graphed, or contains a graphed module"):
            fsdp_graph.graph_modules([module], [(torch.randn(2, 3),)])
    with pytest.raises(ValueError, match="already graphed; capture each module once"):
        fsdp_graph.make_graphed_callables([inner], [(torch.randn(2, 3),)])
    with pytest.raises(TypeError, match="expects nn.Module objects; item 0 is a function"):
        fsdp_graph.graph_modules([lambda x: x], [()])


def test_select_modules_by_class_tuple_or_predicate():
    model = TinyLM(n_blocks=2)
    assert fsdp_graph.select_modules(model, Block) == list(model.blocks)
    assert fsdp_graph.select_modules(model, (Block, nn.Embedding)) == [model.emb, *model.blocks]
    assert fsdp_graph.select_modules(model, lambda name, m: name.endswith(".fc")) == [b.fc for b in model.blocks]
    with pytest.raises(TypeError, match="selection must be a module class"):
        fsdp_graph.select_modules(model, "Block")
