"""The host timers of ../../4xH200/reduce_write_graph/timers.py with more functions timed: the graphed
callables', the optimizer graph's, the step's and the parameter swaps. Used in place of that
``timers`` module by that folder's ``host_timers.py`` (copied beside this file as it ran)."""
import importlib.util
import os

_base_path = os.path.join(os.path.dirname(__file__), "..", "..", "4xH200", "reduce_write_graph", "timers.py")
_spec = importlib.util.spec_from_file_location("reduce_write_graph_timers", _base_path)
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)
_base.TARGETS.extend([
    ("fsdp_graph.graphs.graphed_callable", "GraphedCallable",
     ["__call__", "_check_params", "_live_inputs", "_check_no_pending_backward", "_check_chain"]),
    ("fsdp_graph.graphs.graphed_callable", "_Replay", ["forward", "backward"]),
    ("fsdp_graph.steps.optimizer_graph", "GraphedOptimizerStep", ["__call__", "_same_gradients"]),
    ("fsdp_graph.steps.train_step", "TrainStep", ["_run", "_loss"]),
    ("fsdp_graph.fsdp.param_group", "ParamGroup", ["prefetch", "use_masters", "sync_requires_grad"]),
    ("fsdp_graph.fsdp.sharded_param", "ShardedParam", ["use_unsharded"]),
])
install, reset, report = _base.install, _base.reset, _base.report
