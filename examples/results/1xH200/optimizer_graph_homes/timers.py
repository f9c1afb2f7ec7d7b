"""Deterministic host timers: wrap named methods/functions, accumulate inclusive host µs per call site,
split by thread (main / autograd). Usage: timers.install(); ... ; timers.report(steps)."""
import collections, functools, importlib, threading, time

TOTAL = collections.Counter()
CALLS = collections.Counter()
_main = threading.main_thread().ident

TARGETS = [
    ("fsdp_graph.fsdp.root", "RootContext", ["end_backward", "_release_read_gradients", "_refuse_stray_gradients", "pre_forward", "pre_backward", "begin_forward", "end_forward"]),
    ("fsdp_graph.fsdp.unit", "FSDPUnit", ["post_backward", "pre_backward", "pre_forward", "post_forward", "prefetch"]),
    ("fsdp_graph.fsdp.gradients", "UnitGradients", ["finish", "_reduce", "_take_sharded", "_hand_on", "prepare", "release_read"]),
    ("fsdp_graph.fsdp.unit_reduce", "UnitReduce", ["whole", "_reduce_scatter"]),
    ("fsdp_graph.fsdp.sharded_grads", "ShardedGrads", ["accumulate", "take"]),
    ("fsdp_graph.fsdp.param_group", "ParamGroup", ["_issue_unshard", "use", "reshard", "drop", "_gather"]),
    ("fsdp_graph.fsdp.collectives", "CommStreams", ["enter", "wait_for_all", "wait"]),
    ("fsdp_graph.fsdp.collective_graphs", "CollectiveGraphs", ["run"]),
    ("fsdp_graph.fsdp.grad_homes", "HomeRows", ["write"]),
    ("fsdp_graph.fsdp.grad_homes", "GradHomes", ["vacate"]),
    ("fsdp_graph.fsdp.unused_params", None, ["settle_unused"]),
    ("fsdp_graph.fsdp.sharded_grads", None, ["run_post_accumulate_hooks"]),
    ("fsdp_graph.fsdp.stray_gradients", None, ["refuse_stray_gradients", "drop_unsharded_grads"]),
    ("fsdp_graph.fsdp.reduce_pieces", None, ["copy_piece_in"]),
    ("fsdp_graph.fsdp.gradients", None, ["_take_written"]),
    ("fsdp_graph.graphs.graphed_segment", "GraphedSegment", ["accumulate_parked"]),
    ("fsdp_graph.fsdp.gradients", "UnitGradients", ["accumulate_parked", "take_parked", "finish_parked"]),
    ("fsdp_graph.graphs.graphed_callable", "GraphedCallable", ["__call__", "_check_params", "_live_inputs", "_check_no_pending_backward", "_check_chain"]),
    ("fsdp_graph.graphs.graphed_callable", "_Replay", ["forward", "backward"]),
    ("fsdp_graph.steps.optimizer_graph", "GraphedOptimizerStep", ["__call__", "_same_gradients"]),
    ("fsdp_graph.steps.train_step", "TrainStep", ["_run", "_loss"]),
    ("fsdp_graph.fsdp.param_group", "ParamGroup", ["prefetch", "use_masters", "sync_requires_grad"]),
    ("fsdp_graph.fsdp.sharded_param", "ShardedParam", ["use_unsharded"]),
]


def _wrap(name, fn):
    @functools.wraps(fn)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            key = ("main" if threading.get_ident() == _main else "bwd", name)
            TOTAL[key] += time.perf_counter() - t
            CALLS[key] += 1
    return timed


def install():
    for modname, cls, names in TARGETS:
        mod = importlib.import_module(modname)
        owner = getattr(mod, cls) if cls else mod
        for n in names:
            if not hasattr(owner, n):
                print("timers: missing", modname, cls, n)
                continue
            setattr(owner, n, _wrap(f"{cls or modname.rsplit('.', 1)[1]}.{n}", getattr(owner, n)))
    # module-level functions imported by name elsewhere
    import fsdp_graph.fsdp.gradients as g, fsdp_graph.fsdp.root as r, fsdp_graph.fsdp.unit_reduce as ur
    import fsdp_graph.fsdp.unused_params as up, fsdp_graph.fsdp.sharded_grads as sg, fsdp_graph.fsdp.reduce_pieces as rp
    import fsdp_graph.fsdp.stray_gradients as st
    r.settle_unused = up.settle_unused
    g.run_post_accumulate_hooks = sg.run_post_accumulate_hooks
    g.refuse_stray_gradients = st.refuse_stray_gradients
    g.drop_unsharded_grads = st.drop_unsharded_grads
    ur.copy_piece_in = rp.copy_piece_in


def reset():
    TOTAL.clear(); CALLS.clear()


def report(steps):
    lines = ["| thread | function | calls/step | µs/call | µs/step |", "|---|---|---|---|---|"]
    for key, t in sorted(TOTAL.items(), key=lambda kv: (kv[0][0], -kv[1])):
        c = CALLS[key]
        lines.append(f"| {key[0]} | {key[1]} | {c/steps:.1f} | {1e6*t/c:.1f} | {1e6*t/steps:.1f} |")
    return "\n".join(lines)
