"""The benchmark's smoke mode, launched the way a user would (torchrun, 2 ranks): gloo on CPU,
NCCL with every system (graphs included) on 2 GPUs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = {"fsdp2_eager", "fsdp2_full_graph", "ours_eager", "ours_layer_graphs", "ours_layer_graphs_eager_fsdp",
           "ours_layer_and_optimizer_graphs", "ours_segment_graphs", "ours_segment_and_optimizer_graphs",
           "ours_full_iteration", "floor"}
GRAPH_SYSTEMS = {"fsdp2_full_graph", "ours_layer_graphs", "ours_layer_graphs_eager_fsdp",
                 "ours_layer_and_optimizer_graphs", "ours_segment_graphs", "ours_segment_and_optimizer_graphs",
                 "ours_full_iteration", "floor"}


def run_smoke(out: Path, *args: str) -> dict[str, dict]:
    """``benchmark.py --smoke --deterministic`` on 2 ranks; its records by system."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "examples" / "benchmark.py"), "--smoke", "--deterministic", "--out", str(out), *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    model = args[args.index("--model") + 1] if "--model" in args else "gpt"
    records = {r["system"]: r for r in json.loads((out / f"results-{model}.json").read_text())}
    assert set(records) == SYSTEMS and all(r["model"] == model for r in records.values())
    return records


def test_benchmark_smoke_run_writes_records_table_and_chart(tmp_path):
    records = run_smoke(tmp_path, "--hot-path", "--memory")
    measured = [r for r in records.values() if not r.get("skipped")]
    assert {"fsdp2_eager", "ours_eager"} <= {r["system"] for r in measured}
    for r in measured:
        assert r["world_size"] == 2 and r["timed_steps"] == 3
        assert 0 < r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
        assert r["x_fsdp2_eager"] > 0
        if r["system"] != "floor":
            assert len(r["losses"]) == 4 and r["losses_match_ours"], r
    assert records["ours_eager"]["losses_bitwise_equal_ours"]
    assert "unit.pre_forward (unshard, prefetch)" in records["ours_eager"]["hot_path_us"]
    for r in measured:  # --memory: what is alive at the peak (GPU only: read from the CUDA allocator)
        if r["device"] == "cpu":
            assert "memory" not in r
            continue
        parts = r["memory"]["categories"]
        # The breakdown's run (warm-up and three steps) is part of what the timed run did (after ones).
        # Its trace counts a pool whole from the moment a segment is made, the timed run's peak only
        # after the last capture (before, what is allocated in it): they differ by at most the pools.
        pools = r["memory"]["pool"]["pools_gib_at_end"] if "pool" in r["memory"] else 0
        assert 0 < r["memory"]["peak_gib"] <= r["peak_mem_gib"] + pools + 2**-10, (r["memory"], r["peak_mem_gib"])
        assert parts[next(c for c in parts if c.startswith("parameters"))] > 0, r["memory"]
        if r["system"] in ("ours_eager", "ours_full_iteration", "fsdp2_eager", "fsdp2_full_graph"):
            assert parts.get("optimizer state", 0) > 0, r["memory"]
        # The layer-graph systems warm up and capture their blocks inside make_train_step, from the
        # example batch, before the optimizer has any state; on this tiny model that warm-up and the
        # later steps peak within 0.0001 GiB of each other, so which one is "the peak" (and whether
        # AdamW's state is in it) turns on a few KiB. What must be there is the graphs' pool.
        if r["system"] in GRAPH_SYSTEMS:
            assert parts.get("CUDA graph pool (the captured step's activations and temporaries)", 0) > 0, r["memory"]
    table = (tmp_path / "results-gpt.md").read_text()
    assert "| smoke | fsdp2_eager |" in table and "| smoke | ours_eager |" in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "step_time-gpt.png").stat().st_size > 1000


def test_benchmark_smoke_run_on_an_hf_llama(tmp_path):
    """``--model hf-llama``: transformers' LlamaForCausalLM (tiny) through the same systems; on CPU
    the eager ones run (FSDP2 on HF's default path, ours on its capture path: close, not bitwise)."""
    records = run_smoke(tmp_path, "--model", "hf-llama")
    measured = {name for name, r in records.items() if not r.get("skipped")}
    assert {"fsdp2_eager", "ours_eager"} <= measured
    for name in measured - {"floor"}:
        r = records[name]
        # hf_models.py's tiny Llama: untied embedding and head 2 x 256 x 64, per layer q, k, v, o
        # 64 x (64 + 32 + 32 + 64), MLP 3 x 64 x 160 and two norms 2 x 64, two layers, final norm 64
        assert r["params"] == 2 * 256 * 64 + 2 * (64 * 192 + 3 * 64 * 160 + 128) + 64, r
        assert r["world_size"] == 2 and r["timed_steps"] == 3, r
        assert len(r["losses"]) == 4 and all(math.isfinite(x) for x in r["losses"]), r
        assert r["losses_match_ours"], r
    assert "| smoke | ours_eager |" in (tmp_path / "results-hf-llama.md").read_text()


def test_host_call_counter_counts_the_hot_path():
    """The deterministic host-cost measure: every unit step shows up, the same count every time."""
    sys.path.insert(0, str(REPO / "examples"))
    from host_calls import count_calls

    first, second = count_calls(steps=2), count_calls(steps=2)
    assert first["fsdp_graph"] == second["fsdp_graph"] > 0 and first["all"] > first["fsdp_graph"]
    assert first["fsdp/unit.py:pre_forward"] == 13 and first["fsdp/unit.py:post_backward"] == 13  # 12 blocks + root


def test_the_offload_overlap_counts_copy_time_under_overlapping_compute_kernels_once():
    """--profile's "copies hidden behind compute": a copy's time inside the union of compute kernels."""
    sys.path.insert(0, str(REPO / "examples"))
    from step_profile import covered_us

    copies = [(0.0, 10.0), (20.0, 30.0), (40.0, 50.0)]
    compute = [(8.0, 25.0), (5.0, 12.0), (44.0, 46.0), (45.0, 47.0)]  # overlapping kernels (two streams)
    assert covered_us(copies, compute) == 5.0 + 5.0 + 3.0
    assert covered_us(copies, []) == 0.0 and covered_us(copies, [(-1.0, 60.0)]) == 30.0
    assert covered_us([(0.0, 100.0)], [(30.0, 40.0), (10.0, 20.0)]) == 20.0  # one copy over two kernels


def test_deterministic_mode_names_our_systems_that_are_not_bitwise():
    from examples.benchmark import compare_losses, ours_not_bitwise

    records = [{"config": "small", "system": name, "losses": losses} for name, losses in (
        ("ours_eager", [2.0, 1.5]), ("ours_layer_graphs", [2.0, 1.5]), ("ours_full_iteration", [2.0, 1.5000001]),
        ("fsdp2_eager", [2.0, 1.4]))]
    compare_losses(records)
    assert ours_not_bitwise(records) == ["small/ours_full_iteration"]  # FSDP2's differences are reported only


def test_soak_smoke_run_checks_every_strategy_it_runs():
    """``examples/soak.py`` for a few steps: eager on CPU, every strategy on 2 GPUs; its memory and
    loss checks pass (12 steps say nothing about timing: the slow-step check is made lenient)."""
    import torch

    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "OMP_NUM_THREADS": "1"}
    strategies = ["none", "layer", "full_iteration"] if torch.cuda.device_count() >= 2 else ["none"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "examples" / "soak.py"), "--config", "tiny", "--steps", "12", "--settle", "6",
           "--slow-factor", "100", "--strategies", *strategies]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout
    for strategy in strategies:
        assert f"| {strategy} | 12 |" in out, out + result.stderr[-3000:]
    assert result.returncode == 0 and "soak: every check passed" in out, out + result.stderr[-3000:]


def test_scaling_gathers_runs_at_several_world_sizes_into_one_table(tmp_path):
    """examples/scaling.py over two smoke runs, at 2 and 3 ranks (issue #16's table and chart)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    files = []
    for n in (2, 3):
        out = tmp_path / f"ws{n}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               str(REPO / "examples" / "benchmark.py"), "--smoke", "--systems", "fsdp2_eager", "ours_eager",
               "--out", str(out)]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        files.append(str(out / "results-gpt.json"))
    scaling = [sys.executable, str(REPO / "examples" / "scaling.py")]
    result = subprocess.run([*scaling, *files, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    table = (tmp_path / "scaling-gpt.md").read_text()
    records = [r for f in files for r in json.loads(open(f).read())]
    assert {r["world_size"] for r in records} == {2, 3}
    for r in records:
        per_gpu = f"{r['tokens_per_s'] / r['world_size']:,.0f}"
        assert f"| {r['system']} | {r['world_size']} | {r['step_ms_median']:.2f} | {per_gpu} |" in table, table
    result = subprocess.run([*scaling, files[0], files[0]], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "both hold" in result.stderr
    other_model = tmp_path / "results-hf-llama.json"
    renamed = [{**r, "model": "hf-llama", "world_size": 4} for r in json.loads(open(files[0]).read())]
    other_model.write_text(json.dumps(renamed))
    result = subprocess.run([*scaling, files[0], str(other_model)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "runs of several models" in result.stderr


def _event(action: str, addr: int, size: int, frames=()) -> dict:
    """One entry of the allocator's trace, as ``torch.cuda.memory._snapshot()`` records it."""
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_the_memory_breakdown_counts_an_expandable_graph_pool_by_its_mapped_pages():
    """With expandable_segments:True a pool is one address range that grows by mapped pages: counted
    as mapped (and its blocks as the pool's), not from a segment_alloc that never comes."""
    sys.path.insert(0, str(REPO / "examples"))
    from memory_breakdown import GRAPH_POOL, categorized

    mib = 2**20
    model = [{"filename": "/x/gpt.py", "line": 60, "name": "forward"},
             {"filename": "/x/fsdp_graph/graphs/capture.py", "line": 212, "name": "forward_pass"}]

    base = 1 << 40
    trace = [
        _event("segment_map", 0, 64 * mib),  # an ordinary expandable segment
        _event("alloc", 0, 10 * mib),  # a parameter (by storage)
        _event("segment_map", base, 20 * mib),  # the pool's range, mapped page by page as the capture needs
        _event("alloc", base, 12 * mib, model),
        _event("segment_map", base + 20 * mib, 20 * mib),
        _event("alloc", base + 12 * mib, 26 * mib, model),
        _event("free_completed", base + 12 * mib, 26 * mib),
        _event("segment_unmap", base + 20 * mib, 20 * mib),  # pages given back: the pool is 20 MiB ...
        _event("alloc", 10 * mib, 35 * mib, model),  # ... while an eager activation lives beside it
        _event("free_completed", 10 * mib, 35 * mib),
        _event("segment_map", base + 20 * mib, 20 * mib),  # 40 MiB again
    ]
    result = categorized(trace, [(base, base + 40 * mib)], {0: "parameters"})
    gib = 2**-30
    assert result["peak_gib"] == (10 + 20 + 35) * mib * gib
    assert result["categories"] == {GRAPH_POOL: 20 * mib * gib, "activations and forward temporaries": 35 * mib * gib,
                                    "parameters": 10 * mib * gib}
    assert result["pool"]["alive_gib"] == 38 * mib * gib and result["pool"]["pool_gib"] == 40 * mib * gib
    assert result["pool"]["pools_gib_at_end"] == 40 * mib * gib


def test_the_memory_breakdown_counts_a_graph_pool_whole_and_opens_it_at_its_fullest():
    """--memory's trace replay: the peak counts a private pool's segments whole from their creation
    (a replay uses all of it), the blocks outside by category, and the pool's contents at its fullest."""
    sys.path.insert(0, str(REPO / "examples"))
    from memory_breakdown import GRAPH_POOL, STATICS, _by_frames, categorized

    mib = 2**20
    model = [{"filename": "/x/gpt.py", "line": 60, "name": "forward"},
             {"filename": "/x/fsdp_graph/graphs/capture.py", "line": 212, "name": "forward_pass"}]
    copy = [{"filename": "/x/fsdp_graph/graphs/capture.py", "line": 113, "name": "static_copy"}]
    engine = [{"filename": "/x/torch/autograd/graph.py", "line": 841, "name": "_engine_run_backward"},
              {"filename": "/x/fsdp_graph/graphs/capture.py", "line": 277, "name": "backward_pass"}]

    pool = (1000 * mib, 1064 * mib)  # one 64 MiB segment of a graph's pool
    trace = [
        _event("segment_alloc", pool[0], 64 * mib),  # an ordinary segment where the pool's will be ...
        _event("alloc", pool[0], 60 * mib, model),  # (an eager activation)
        _event("free_requested", pool[0], 60 * mib),
        _event("segment_free", pool[0], 64 * mib),  # ... given back before the capture
        _event("segment_alloc", 0, 512 * mib),  # an ordinary segment
        _event("alloc", 0, 10 * mib),  # a parameter (by storage)
        _event("alloc", 10 * mib, 4 * mib, copy),  # a static input
        _event("segment_alloc", pool[0], 64 * mib),
        _event("alloc", pool[0], 30 * mib, model),  # captured forward: saved activations
        _event("alloc", pool[0] + 30 * mib, 12 * mib),  # captured backward: autograd's thread, no frame
        _event("alloc", pool[0] + 42 * mib, 8 * mib, engine),  # ... or the calling thread, in the engine
        _event("free_requested", pool[0] + 30 * mib, 12 * mib),
        _event("free_requested", pool[0] + 42 * mib, 8 * mib),
        _event("free_completed", pool[0], 30 * mib),
        _event("alloc", 20 * mib, 40 * mib, model),  # an eager activation later, beside the whole pool
        _event("free_requested", 20 * mib, 40 * mib),
        _event("alloc", 20 * mib, 5 * mib, model),
    ]
    result = categorized(trace, [pool], {0: "parameters"})
    gib = 2**-30
    assert result["peak_gib"] == (10 + 4 + 64 + 40) * mib * gib  # the eager moment, the pool counted whole
    assert result["categories"] == {GRAPH_POOL: 64 * mib * gib, "activations and forward temporaries": 40 * mib * gib,
                                    "parameters": 10 * mib * gib, STATICS: 4 * mib * gib}
    opened = result["pool"]
    assert opened["alive_gib"] == 50 * mib * gib and opened["pool_gib"] == opened["pools_gib_at_end"] == 64 * mib * gib
    assert opened["kinds"] == {"forward graphs: saved activations and outputs": 30 * mib * gib,
                               "backward graphs: gradients and temporaries (autograd)": 20 * mib * gib}
    assert opened["sites"][0] == {"site": "gpt.py:60 forward", "blocks": 1, "gib": 30 * mib * gib}
    assert result["outside_sites"] == [{"site": "gpt.py:60 forward", "blocks": 1, "gib": 40 * mib * gib},
                                       {"site": "capture.py:113 static_copy", "blocks": 1, "gib": 4 * mib * gib}]
    assert _by_frames(engine) == "backward: gradients and temporaries (autograd)"  # (outside the pools alike)


def test_the_memory_breakdown_names_cublas_workspaces_by_the_release_that_frees_them():
    """cuBLAS's workspaces (allocated by a thread's first matmul on a stream, kept for the process's
    life) are told from that matmul's activations by the release at the end of the run: only the
    blocks it frees are workspaces, and they leave the sites table."""
    sys.path.insert(0, str(REPO / "examples"))
    from memory_breakdown import WORKSPACES, categorized

    mib = 2**20
    matmul = [{"filename": "/x/torch/nn/modules/linear.py", "line": 134, "name": "forward"},
              {"filename": "/x/gpt.py", "line": 52, "name": "forward"}]
    release = [{"filename": "/x/examples/memory_breakdown.py", "line": 1, "name": "release_cublas_workspaces"}]

    trace = [
        _event("segment_alloc", 0, 512 * mib),
        _event("alloc", 0, 32 * mib, matmul),  # the forward thread's workspace
        _event("alloc", 32 * mib, 32 * mib, matmul),  # an activation of the same size
        _event("alloc", 64 * mib, 32 * mib),  # autograd's thread's workspace: no Python frame
        _event("alloc", 96 * mib, 8 * mib),  # a gradient, no frame
        _event("free_requested", 96 * mib, 8 * mib),
        _event("free_requested", 32 * mib, 32 * mib),
        _event("alloc", 32 * mib, 32 * mib, matmul),  # the next step's activation at the same address
        _event("free_requested", 32 * mib, 32 * mib),
        _event("free_requested", 0, 32 * mib, release),
        _event("free_completed", 0, 32 * mib, release),
        _event("free_requested", 64 * mib, 32 * mib, release),
    ]
    result = categorized(trace, [], {})
    gib = 2**-30
    assert result["peak_gib"] == (32 + 32 + 32 + 8) * mib * gib
    assert result["categories"] == {WORKSPACES: 64 * mib * gib, "activations and forward temporaries": 32 * mib * gib,
                                    "backward: gradients and temporaries (autograd)": 8 * mib * gib}
    assert result["outside_sites"][0] == {"site": "gpt.py:52 forward", "blocks": 1, "gib": 32 * mib * gib}
