"""Benchmark: how much faster is a training step than with FSDP2, at what memory? One run, side by side.

    torchrun --nproc-per-node 2 examples/benchmark.py --config small medium --out bench/
    torchrun --nproc-per-node 2 examples/benchmark.py --model hf-llama --config small medium --out bench/
    torchrun --nproc-per-node 2 examples/benchmark.py --smoke --out /tmp/bench   # CPU/gloo, tiny (CI)
    python examples/benchmark.py --plot bench/results-gpt.json                   # chart elsewhere

Every system trains the same model from the same seed on the same batches with fused AdamW (ours:
capturable, learning rate on the device), bf16 compute and fp32 gradient reduction. The model
(--model): ``gpt``, our GPT (untied embeddings, examples/gpt.py), or ``hf-llama``, transformers'
LlamaForCausalLM built from a config (examples/hf_models.py; its decoder layers are the blocks
below; use_cache off). HF models branch on CUDA graph capture: ours and the whole-graph systems
make them take that path in eager runs too (fsdp_graph.hf.take_capture_path: a materialised causal
mask), fsdp2_eager keeps HF's default (SDPA's is_causal kernels).

  fsdp2_eager        torch.distributed.fsdp.fully_shard per block and on the root
  fsdp2_full_graph   the same, forward+backward captured as one CUDA graph, optimizer step outside
  ours_eager         fsdp_graph.fully_shard per block and on the root (hf-llama:
                     fsdp_graph.hf.shard_model)
  ours_layer_graphs  the same, every block graphed: fsdp_graph.make_train_step with
                     GraphConfig(strategy="layer", modules=<the block class>)
  ours_layer_graphs_eager_fsdp  the same with GraphConfig(collective_graphs=False): the units'
                     unshard and reduce run eagerly between the graphed blocks (the system before
                     collective graphs, for comparison in the same run)
  ours_layer_and_optimizer_graphs  ours_layer_graphs with the optimizer step replayed as a graph of
                     its own, reading the gradients where the layer graphs homed them:
                     GraphConfig(strategy="layer", optimizer_graph=True)
  ours_segment_graphs  the same, the blocks graphed --segment-size (3) at a time with their FSDP
                     steps inside: GraphConfig(strategy="layer", segment_size=3)
  ours_segment_and_optimizer_graphs  the same, the optimizer step replayed as a graph of its own:
                     GraphConfig(strategy="layer", segment_size=3, optimizer_graph=True)
  ours_full_iteration  the same, the whole step (collectives and a capturable AdamW step
                     included) as one graph: fsdp_graph.make_train_step with
                     GraphConfig(strategy="full_iteration")
  floor              the unsharded model's forward+backward as one graph on one GPU: no
                     communication, no optimizer; the time a step cannot beat

With --offload (GPU only), activation offload to pinned host memory as well
(GraphConfig(offload_activations=...)): ours_eager_offload[_every2|3|4] (every block's, or every
k-th block's, eager), ours_layer_graphs_offload[_every3] and ours_full_iteration_offload[_every3]
(recorded in the graphs).

A step is forward, backward and optimizer step (floor: forward and backward), timed between two
device synchronisations; the first --warmup steps are not timed. Each system's losses over all
steps are compared with ours_eager's. Outputs in --out, MODEL being --model: results-MODEL.json
(one record per config and system), results-MODEL.md (a table), step_time-MODEL.png (if matplotlib
is installed; else use --plot).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

_EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _EXAMPLES_DIR)
sys.path.insert(1, os.path.dirname(_EXAMPLES_DIR))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hf_models import SIZES, build_hf  # noqa: E402
from memory_breakdown import breakdown, graph_pool_bytes, graph_pool_ids, release_cublas_workspaces  # noqa: E402
from mfu import mfu  # noqa: E402

import fsdp_graph  # noqa: E402
import fsdp_graph.hf  # noqa: E402

from gpt import CONFIGS, GPT, GPTConfig  # noqa: E402
from hot_path import HotPathTimer  # noqa: E402
from step_profile import kernel_breakdown  # noqa: E402

SYSTEMS = ("fsdp2_eager", "fsdp2_full_graph", "ours_eager", "ours_layer_graphs", "ours_layer_graphs_eager_fsdp",
           "ours_layer_and_optimizer_graphs", "ours_segment_graphs", "ours_segment_and_optimizer_graphs",
           "ours_full_iteration", "floor")
# Added by --offload (GPU only): every block's activations offloaded, then every 2nd, 3rd, 4th block's; and
# under per-layer graphs and the whole step, every block's and every 3rd block's.
OFFLOAD_SYSTEMS = ("ours_eager_offload", "ours_eager_offload_every2", "ours_eager_offload_every3",
                   "ours_eager_offload_every4", "ours_layer_graphs_offload", "ours_layer_graphs_offload_every3",
                   "ours_full_iteration_offload", "ours_full_iteration_offload_every3")
GRAPH_SYSTEMS = ("fsdp2_full_graph", "ours_layer_graphs", "ours_layer_graphs_eager_fsdp",
                 "ours_layer_and_optimizer_graphs", "ours_segment_graphs",
                 "ours_segment_and_optimizer_graphs", "ours_full_iteration", "floor", *OFFLOAD_SYSTEMS[4:])
DEFAULT_ALLOC_CONF = "expandable_segments:True"
SEGMENT_SIZE = [3]  # ours_segment_graphs' blocks per graph (--segment-size)
WHOLE_GRAPH_SYSTEMS = ("fsdp2_full_graph", "floor")
LOSS_RTOL = 1e-2  # bf16 compute: different reduction orders drift apart by far less than this
LR = 3e-4


@dataclass(frozen=True)
class HFModel:
    """An examples/hf_models.py causal LM, ``build_hf(arch, size)``, trained on ``seq_len`` tokens."""
    arch: str
    size: str
    seq_len: int

    @property
    def vocab_size(self) -> int:
        return SIZES[self.size][-1]


@dataclass(frozen=True)
class BenchConfig:
    name: str
    model: GPTConfig | HFModel
    micro_batch: int  # sequences per GPU per step


PRESETS = {  # --model gpt
    "small": BenchConfig("small", replace(CONFIGS["small"], tie_embeddings=False), 4),
    "medium": BenchConfig("medium", replace(CONFIGS["medium"], tie_embeddings=False), 4),
    "large": BenchConfig("large", GPTConfig(32768, 2048, 16, 24, 1024, tie_embeddings=False), 4),  # 1.34B
    "smoke": BenchConfig("smoke", GPTConfig(256, 64, 4, 2, 64, tie_embeddings=False), 2),
}
HF_LLAMA_PRESETS = {  # --model hf-llama: hf_models.py's sizes, the GPT presets' sequences and batches
    "small": BenchConfig("small", HFModel("llama", "small", 512), 4),
    "medium": BenchConfig("medium", HFModel("llama", "medium", 1024), 4),
    "smoke": BenchConfig("smoke", HFModel("llama", "tiny", 64), 2),
}
MODELS = {"gpt": PRESETS, "hf-llama": HF_LLAMA_PRESETS}


@dataclass
class Env:
    rank: int
    world_size: int
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# -- model, data, optimizer (identical for every system) ---------------------------------
# The only place where GPT and an HF model differ: building, blocks, loss, data, capture path.
def build_model(bench: BenchConfig, env: Env) -> torch.nn.Module:
    if isinstance(bench.model, HFModel):
        model = build_hf(bench.model.arch, bench.model.size, seed=0, device=env.device)
        model.config.use_cache = False  # training needs no KV cache (per-layer graphs refuse HF's DynamicCache)
        return model
    torch.manual_seed(0)
    return GPT(bench.model).to(env.device)


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded (and layer-graphed) one unit each: GPT's blocks, HF's decoder layers."""
    return list(model.blocks) if isinstance(model, GPT) else fsdp_graph.hf.decoder_layers(model)


def loss_fn_of(model: torch.nn.Module) -> Callable:
    """``loss(idx, targets)``; an HF model shifts its labels itself, so its targets are the ids."""
    if isinstance(model, GPT):
        return lambda idx, targets: model(idx, targets)[1]
    return lambda ids, labels: model(input_ids=ids, labels=labels).loss


def with_capture_path(model: torch.nn.Module) -> torch.nn.Module:
    """For a whole-step graph: an HF model must take, in its eager warm-up steps too, the path it
    takes under capture (fsdp_graph.hf.take_capture_path; forward hooks only, no sharding)."""
    return model if isinstance(model, GPT) else fsdp_graph.hf.take_capture_path(model)


def shard_ours(model: torch.nn.Module, policy: fsdp_graph.MixedPrecision) -> torch.nn.Module:
    if not isinstance(model, GPT):
        return fsdp_graph.hf.shard_model(model, mp_policy=policy)  # each decoder layer, the root; capture path
    for block in model.blocks:
        fsdp_graph.fully_shard(block, mp_policy=policy)
    return fsdp_graph.fully_shard(model, mp_policy=policy)


def make_batches(bench: BenchConfig, env: Env, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step i's global batch, this rank's part, already on the device (no copies in the timing).
    Learnable, so that losses fall and comparing them means something: GPT's target is a function
    of the token; in an HF model's ids (also its labels) every other token follows from the one before."""
    cfg, out = bench.model, []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, cfg.vocab_size, (bench.micro_batch * env.world_size, cfg.seq_len), generator=g)
        if isinstance(cfg, HFModel):
            idx[:, 1::2] = (idx[:, :-1:2] * 7 + 3) % cfg.vocab_size
            targets = idx
        else:
            targets = (idx * 7 + 3) % cfg.vocab_size
        out.append((idx.chunk(env.world_size)[env.rank].to(env.device),
                    targets.chunk(env.world_size)[env.rank].to(env.device)))
    return out


def make_optimizer(model: torch.nn.Module, capturable: bool = False) -> torch.optim.Optimizer:
    """AdamW, fused on GPU (one kernel pass; the fastest stock form for every system). Our systems
    all use the capturable form with the learning rate in a device tensor, which the whole-step
    graph needs, so their losses are comparable with each other."""
    device = next(model.parameters()).device
    if device.type != "cuda":  # fused / capturable AdamW are for accelerators
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    lr = torch.tensor(LR, device=device) if capturable else LR
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True, capturable=capturable)


def train_step(model, opt, set_to_none: bool = True) -> Callable:
    loss_fn = loss_fn_of(model)

    def step(idx, targets):
        loss = loss_fn(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss

    return owning(step, model, opt)


def owning(step, model: torch.nn.Module, opt: torch.optim.Optimizer | None):
    """Let --memory find the step's model and optimizer (their tensors are categories of their own)."""
    step.bench_model, step.bench_optimizer = model, opt
    return step


# -- the systems: each returns step(idx, targets) -> loss ----------------------------------
def fsdp2_sharded(bench: BenchConfig, env: Env) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(bench, env)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks_of(model):
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def ours_sharded(bench: BenchConfig, env: Env) -> torch.nn.Module:
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return shard_ours(build_model(bench, env), policy)


def fsdp2_eager(bench, env, batches, warmup):
    model = fsdp2_sharded(bench, env)
    return train_step(model, make_optimizer(model)), None


def ours_eager(bench, env, batches, warmup):
    model = ours_sharded(bench, env)
    return train_step(model, make_optimizer(model, capturable=True)), None


def _offloading(every: int):
    """ours_eager with the saved activations of every ``every``-th block (from the first) in pinned
    host memory between its forward and backward (``fsdp_graph.offload_activations``). Spread out,
    each block's copy back has ``every`` blocks' backward to hide behind (prefetch is one
    offloaded module ahead)."""

    def build(bench, env, batches, warmup):
        model = ours_sharded(bench, env)
        step = train_step(model, make_optimizer(model, capturable=True))
        step.offload = fsdp_graph.offload_activations(blocks_of(model)[::every])  # (lives as long as the step)
        return step, None

    return build


ours_eager_offload = _offloading(1)
ours_eager_offload_every2 = _offloading(2)
ours_eager_offload_every3 = _offloading(3)
ours_eager_offload_every4 = _offloading(4)


def ours_layer_graphs(bench, env, batches, warmup, collective_graphs=True, segment_size=1, optimizer_graph=False,
                      offload_every=0):
    """Every block graphed (captured now, from an example forward on the first batch); with
    ``offload_every`` k, every k-th block's activations offloaded (recorded in its graph)."""
    model = ours_sharded(bench, env)
    block_class = type(blocks_of(model)[0])  # FSDP<Block>, which every sharded block is
    config = fsdp_graph.GraphConfig(strategy="layer", modules=block_class, segment_size=segment_size,
                                    collective_graphs=collective_graphs if segment_size == 1 else None,
                                    optimizer_graph=optimizer_graph,
                                    offload_activations=_offloaded(model, offload_every),
                                    num_warmup_iters=max(1, min(3, warmup - 1)))  # (the optimizer capture untimed)
    opt = make_optimizer(model, capturable=True)
    step = fsdp_graph.make_train_step(loss_fn_of(model), model, opt, config=config, example_batch=batches[0])
    return owning(step, model, opt), None


def _offloaded(model, every: int) -> list | None:
    return blocks_of(model)[::every] if every else None


def ours_layer_graphs_offload(bench, env, batches, warmup):
    return ours_layer_graphs(bench, env, batches, warmup, offload_every=1)


def ours_layer_graphs_offload_every3(bench, env, batches, warmup):
    return ours_layer_graphs(bench, env, batches, warmup, offload_every=3)


def ours_layer_graphs_eager_fsdp(bench, env, batches, warmup):
    return ours_layer_graphs(bench, env, batches, warmup, collective_graphs=False)


def ours_layer_and_optimizer_graphs(bench, env, batches, warmup):
    return ours_layer_graphs(bench, env, batches, warmup, optimizer_graph=True)


def ours_segment_graphs(bench, env, batches, warmup):
    return ours_layer_graphs(bench, env, batches, warmup, segment_size=SEGMENT_SIZE[0])


def ours_segment_and_optimizer_graphs(bench, env, batches, warmup):
    return ours_layer_graphs(bench, env, batches, warmup, segment_size=SEGMENT_SIZE[0], optimizer_graph=True)


def ours_full_iteration(bench, env, batches, warmup, offload_every=0):
    """The first ``warmup`` calls are eager steps inside the graphed step, then it captures."""
    model = ours_sharded(bench, env)
    opt = make_optimizer(model, capturable=True)
    config = fsdp_graph.GraphConfig(strategy="full_iteration", num_warmup_iters=warmup,
                                    offload_activations=_offloaded(model, offload_every))
    step = fsdp_graph.make_train_step(loss_fn_of(model), model, opt, config=config, example_batch=batches[0])
    step.optimizer_ms = lambda: optimizer_step_ms(opt)
    return owning(step, model, opt), None


def ours_full_iteration_offload(bench, env, batches, warmup):
    return ours_full_iteration(bench, env, batches, warmup, offload_every=1)


def ours_full_iteration_offload_every3(bench, env, batches, warmup):
    return ours_full_iteration(bench, env, batches, warmup, offload_every=3)


def optimizer_step_ms(opt: torch.optim.Optimizer, replays: int = 20) -> float:
    """The optimizer step alone, captured as a graph (as it runs inside the whole step): the
    "+ optimizer" of the floor comparison. Changes the weights: call it after the timed steps."""
    for group in opt.param_groups:  # the whole step's zero_grad left them None
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / replays


def whole_graph_step(forward_backward: Callable, batches, warmup: int, eager_step: Callable, after: Callable):
    """The first ``warmup`` steps run ``eager_step`` on a side stream (real, untimed steps), then
    forward+backward is captured once; each later step copies its batch into the static inputs,
    replays and runs ``after``. Returns (step, the warm-up losses)."""
    static_idx, static_targets = (t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm_losses = [eager_step(*batches[i]).detach() for i in range(warmup)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = forward_backward(static_idx, static_targets)

    def step(idx, targets):
        static_idx.copy_(idx)
        static_targets.copy_(targets)
        graph.replay()
        after()
        return static_loss

    return step, warm_losses


def forward_backward_of(model) -> Callable:
    loss_fn = loss_fn_of(model)

    def forward_backward(idx, targets):
        loss = loss_fn(idx, targets)
        loss.backward()
        return loss

    return forward_backward


def fsdp2_full_graph(bench, env, batches, warmup):
    model = with_capture_path(fsdp2_sharded(bench, env))
    opt = make_optimizer(model)

    def after():
        opt.step()
        opt.zero_grad(set_to_none=False)  # the graph adds into these gradient tensors

    eager_step = train_step(model, opt, set_to_none=False)
    step, warm_losses = whole_graph_step(forward_backward_of(model), batches, warmup, eager_step, after)
    return owning(step, model, opt), warm_losses


def floor(bench, env, batches, warmup):
    model = with_capture_path(build_model(bench, env)).to(torch.bfloat16)
    forward_backward = forward_backward_of(model)
    step, _ = whole_graph_step(forward_backward, batches, warmup, forward_backward, lambda: None)
    return owning(step, model, None), None  # no optimizer: its losses are not comparable


BUILDERS = {name: globals()[name] for name in SYSTEMS + OFFLOAD_SYSTEMS}


# -- measuring ------------------------------------------------------------------------------
def param_count(bench: BenchConfig) -> int:
    """The model's parameters (built on the meta device: shapes only)."""
    meta = torch.device("meta")
    with meta:
        return sum(p.numel() for p in build_model(bench, Env(0, 1, meta)).parameters())


def synchronize(env: Env) -> None:
    if env.cuda:
        torch.cuda.synchronize()


def max_over_ranks(value: float, env: Env) -> float:
    if env.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class PeakMemory:
    """The peak of the memory a system holds. ``max_memory_allocated`` alone misses a CUDA graph's
    pool once its capture is over: replays use the pool's memory, but no tensor is allocated in it
    (per-layer graphs, captured while the step is built, then replayed with the optimizer state and
    the eager code's tensors beside them). So after the last capture (the first timed step has run,
    which captures the whole step), the steady state counts the pools whole: the peak allocated
    since, minus what is allocated inside the pools, plus their size. Only this system's pools:
    those an earlier system's graphs left (``earlier_pools``, taken before this system was built)
    are not counted, as the baseline leaves out the tensors it left."""

    def __init__(self, cuda: bool, earlier_pools: set = frozenset()) -> None:
        self.cuda, self.before, self.earlier_pools = cuda, None, earlier_pools

    def graphs_captured(self) -> None:
        if self.cuda:
            self.before = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def peak_allocated(self) -> int:
        return max(self.before or 0, torch.cuda.max_memory_allocated())

    def peak(self) -> int:
        if self.before is None:
            return self.peak_allocated()
        pool_size, pool_allocated = graph_pool_bytes(exclude=self.earlier_pools)
        return max(self.before, torch.cuda.max_memory_allocated() - pool_allocated + pool_size)


def measure(system: str, bench: BenchConfig, env: Env, warmup: int, steps: int, hot_path: bool,
            profile: bool = False, memory: bool = False) -> dict:
    batches = make_batches(bench, env, warmup + steps)
    baseline, earlier_pools, left = 0, set(), None
    if env.cuda:
        release_cublas_workspaces()  # (this system is charged the workspaces it makes, not the first system)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()  # anything an earlier system left: not this system's
        earlier_pools = graph_pool_ids()
        pool_size, pool_allocated = graph_pool_bytes()
        left = max_over_ranks((baseline + pool_size - pool_allocated) / 2**30, env)
    # A system built with a whole-step graph ran its warm-up steps while building (warm_losses).
    step, warm_losses = BUILDERS[system](bench, env, batches, warmup)
    first = warmup if system in WHOLE_GRAPH_SYSTEMS else 0
    losses = list(warm_losses or [])
    times, host = [], []
    peak = PeakMemory(env.cuda, earlier_pools)
    for i in range(first, warmup + steps):
        if i == warmup + 1:
            peak.graphs_captured()
        synchronize(env)
        t0 = time.perf_counter()
        loss = step(*batches[i])
        t1 = time.perf_counter()
        synchronize(env)
        t2 = time.perf_counter()
        losses.append(loss.detach().clone())
        if i >= warmup:
            times.append(t2 - t0)
            host.append(t1 - t0)
    timer = None
    if hot_path and system.startswith("ours"):
        timer = HotPathTimer()  # on extra steps: its own overhead stays out of the timings above
        timer.start()
        for i in range(5):
            step(*batches[warmup + i % steps])
        synchronize(env)
        timer.stop()
    step_ms = max_over_ranks(statistics.median(times) * 1e3, env)
    tokens = bench.micro_batch * bench.model.seq_len * env.world_size
    params = param_count(bench)
    record = {
        "config": bench.name,
        "system": system,
        "world_size": env.world_size,
        "device": torch.cuda.get_device_name() if env.cuda else "cpu",
        "torch": torch.__version__,
        "params": params,
        "params_m": round(params / 1e6, 1),
        "micro_batch": bench.micro_batch,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "step_ms_median": step_ms,
        "step_ms_min": max_over_ranks(min(times) * 1e3, env),
        "step_ms_max": max_over_ranks(max(times) * 1e3, env),
        "host_ms_median": max_over_ranks(statistics.median(host) * 1e3, env),
        "tokens_per_s": tokens / (step_ms / 1e3),
        "mfu": mfu(params, tokens / (step_ms / 1e3), env.world_size, env.device) if system != "floor" else None,
        "peak_mem_gib": max_over_ranks((peak.peak() - baseline) / 2**30, env) if env.cuda else None,
        "peak_allocated_gib": max_over_ranks((peak.peak_allocated() - baseline) / 2**30, env)
        if env.cuda else None,
        "losses": [float(x) for x in losses] if system != "floor" else None,
        "left_by_earlier_systems_gib": left,  # (tensors and graph pools, none of it counted above)
    }
    if timer is not None:
        record["hot_path_us"] = timer.per_call_us()
    if profile and env.cuda and system in WHOLE_GRAPH_SYSTEMS + ("ours_full_iteration",) + OFFLOAD_SYSTEMS:
        record["profile"] = kernel_breakdown(step, batches[warmup:])  # extra steps, after the timed ones
    if hasattr(step, "optimizer_ms"):
        record["optimizer_ms"] = max_over_ranks(step.optimizer_ms(), env)
    del step
    gc.collect()
    if memory and env.cuda:
        record["memory"] = memory_at_peak(system, bench, env, batches, warmup)
    return record


def memory_at_peak(system: str, bench: BenchConfig, env: Env, batches, warmup: int) -> dict:
    """The system built again and run for its warm-up and three steps while the allocator records
    (examples/memory_breakdown.py): what is alive at its peak, by category, in GiB."""
    kept = []

    def run():
        step, _ = BUILDERS[system](bench, env, batches, warmup)
        first = warmup if system in WHOLE_GRAPH_SYSTEMS else 0
        for i in range(first, warmup + 3):
            step(*batches[i])
        kept.append(step)  # (alive until breakdown released the workspaces: a graph destroyed earlier frees its own)
        return step.bench_model, step.bench_optimizer

    result = breakdown(run)  # this rank's
    kept.clear()
    gc.collect()
    result["peak_gib_max_over_ranks"] = max_over_ranks(result["peak_gib"], env)
    return result


def make_deterministic() -> None:
    """Before CUDA and NCCL start: deterministic kernels (cuBLAS needs its workspace setting) and one
    NCCL algorithm and protocol, so that a rerun, or another system of ours, gives the same bits."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    os.environ.setdefault("NCCL_PROTO", "Simple")
    torch.use_deterministic_algorithms(True)


def ours_not_bitwise(records: list[dict]) -> list[str]:
    """Our systems whose losses are not ours_eager's bit for bit (a bug, in deterministic mode)."""
    return [f"{r['config']}/{r['system']}" for r in records
            if r["system"].startswith("ours_") and r.get("losses_bitwise_equal_ours") is False]


def compare_losses(records: list[dict]) -> None:
    """Each system's losses against ours_eager's: bitwise equal, or within LOSS_RTOL."""
    by_key = {(r["config"], r["system"]): r for r in records}
    for r in records:
        ref = by_key.get((r["config"], "ours_eager"))
        if r.get("losses") is None or ref is None or ref.get("losses") is None:
            r["losses_match_ours"] = None
            continue
        a, b = r["losses"], ref["losses"]
        diff = max(abs(x - y) for x, y in zip(a, b))
        rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
        r["loss_max_abs_diff_vs_ours"] = diff
        r["losses_bitwise_equal_ours"] = a == b
        r["losses_match_ours"] = len(a) == len(b) and rel <= LOSS_RTOL


def add_ratios(records: list[dict]) -> None:
    by_key = {(r["config"], r["system"]): r for r in records if r.get("step_ms_median")}
    for r in records:
        if not r.get("step_ms_median"):
            continue
        for base in ("fsdp2_eager", "fsdp2_full_graph", "floor"):
            other = by_key.get((r["config"], base))
            r[f"x_{base}"] = r["step_ms_median"] / other["step_ms_median"] if other else None
        floor = by_key.get((r["config"], "floor"))
        if r.get("optimizer_ms") is not None and floor:
            r["x_floor_plus_optimizer"] = r["step_ms_median"] / (floor["step_ms_median"] + r["optimizer_ms"])


# -- reporting ------------------------------------------------------------------------------
def model_of(records: list[dict]) -> str:
    return records[0].get("model", "gpt")  # (results from before --model: GPT)


def markdown(records: list[dict]) -> str:
    def f(value, fmt):
        return "–" if value is None else format(value, fmt)

    params = {r["config"]: r["params_m"] for r in records if "params_m" in r}
    confs = {r.get("alloc_conf") for r in records if r.get("alloc_conf") is not None}
    allocator = f"; allocator: PYTORCH_CUDA_ALLOC_CONF={'/'.join(sorted(confs)) or '(defaults)'}" if confs else ""
    lines = [
        f"Model: {model_of(records)} ({', '.join(f'{c} {m}M' for c, m in params.items())} parameters){allocator}", "",
        "| config | system | step ms (median, min–max) | host ms | tokens/s | MFU | peak GiB | × fsdp2_eager "
        "| × fsdp2_full_graph | × floor | losses vs ours_eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r.get("skipped"):
            lines.append(f"| {r['config']} | {r['system']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        match = r.get("losses_match_ours")
        match_text = "–" if match is None else (
            "bitwise" if r.get("losses_bitwise_equal_ours")
            else f"{'yes' if match else 'NO'} (max |Δ| {r['loss_max_abs_diff_vs_ours']:.2g})"
        )
        lines.append(
            f"| {r['config']} | {r['system']} | {r['step_ms_median']:.2f} "
            f"({r['step_ms_min']:.2f}–{r['step_ms_max']:.2f}) "
            f"| {r['host_ms_median']:.2f} | {r['tokens_per_s']:,.0f} "
            f"| {'–' if r.get('mfu') is None else format(r['mfu'], '.1%')} | {f(r['peak_mem_gib'], '.2f')} "
            f"| {f(r.get('x_fsdp2_eager'), '.2f')} | {f(r.get('x_fsdp2_full_graph'), '.2f')} "
            f"| {f(r.get('x_floor'), '.2f')} | {match_text} |"
        )
    for r in records:
        if r.get("optimizer_ms") is not None:
            lines += ["", f"{r['config']} / {r['system']}: the optimizer step alone (graphed) takes "
                      f"{r['optimizer_ms']:.2f} ms; "
                      f"step / (floor + optimizer) = {f(r.get('x_floor_plus_optimizer'), '.2f')}"]
    for r in records:
        prof = r.get("profile") or {}
        if prof.get("kernel_ms_per_step"):
            lines += ["", f"GPU time per step, {r['config']} / {r['system']} (--profile): "
                      f"span {prof['gpu_span_ms_per_step']:.2f} ms, "
                      f"not covered by compute kernels {prof['exposed_ms_per_step']:.2f} ms", "",
                      "| kernels | ms per step |", "|---|---|"]
            lines += [f"| {kind} | {ms:.2f} |" for kind, ms in prof["kernel_ms_per_step"].items()]
            if prof.get("host_copy_ms_per_step"):
                lines += ["", f"Copies between device and host memory: {prof['host_copy_ms_per_step']:.2f} "
                          f"ms per step, {prof['host_copy_hidden_ms_per_step']:.2f} ms of it while compute kernels "
                          "ran"]
            lines += ["", "| heaviest kernels | ms per step |", "|---|---|"]
            lines += [f"| `{name}` | {ms:.3f} |" for name, ms in prof.get("top_kernels_ms_per_step", {}).items()]
    lines += memory_tables(records)
    for r in records:
        if r.get("hot_path_us"):
            lines += ["", f"Host time per call, {r['config']} / {r['system']} (--hot-path, extra steps):", "",
                      "| step | calls | µs per call |", "|---|---|---|"]
            lines += [f"| {label} | {v['calls']} | {v['us_per_call']:.1f} |" for label, v in r["hot_path_us"].items()]
    return "\n".join(lines) + "\n"


def memory_tables(records: list[dict]) -> list[str]:
    """Per config, GiB alive at each system's peak by category (--memory), systems side by side."""
    lines = []
    for config in dict.fromkeys(r["config"] for r in records):
        rows = [r for r in records if r["config"] == config and r.get("memory")]
        if not rows:
            continue
        categories = list(dict.fromkeys(c for r in rows for c in r["memory"]["categories"]))
        lines += ["", f"Memory alive at the peak, {config} (GiB, rank 0; --memory, from the allocator's trace):", "",
                  "| category | " + " | ".join(r["system"] for r in rows) + " |",
                  "|---|" + "---|" * len(rows)]
        for c in categories:
            lines.append(f"| {c} | " + " | ".join(f"{r['memory']['categories'].get(c, 0):.3f}" for r in rows) + " |")
        peaks = " | ".join(f"{r['memory']['peak_gib']:.3f}" for r in rows)
        lines.append(f"| **peak (rank 0)** | {peaks} |")
        lines += [f"| peak at | {' | '.join(str(r['memory'].get('peak_site')) for r in rows)} |"]
        for r in rows:
            if r["memory"].get("pool"):
                lines += pool_table(config, r["system"], r["memory"]["pool"])
                lines += site_table(config, r["system"], r["memory"]["outside_sites"])
    return lines


def pool_table(config: str, system: str, pool: dict) -> list[str]:
    """A system's graph pools at their fullest: what was alive in them, by kind and by site."""
    lines = ["", f"Graph pools of {config} / {system} at their fullest (GiB): size {pool['pool_gib']:.3f} "
             f"({pool['pools_gib_at_end']:.3f} at the end), alive {pool['alive_gib']:.3f}:", "",
             "| alive in the pools | GiB | blocks |", "|---|---|---|"]
    lines += [f"| {kind} | {gib:.3f} | |" for kind, gib in pool["kinds"].items()]
    lines += [f"| at {site['site']} | {site['gib']:.3f} | {site['blocks']} |" for site in pool["sites"]]
    return lines


def site_table(config: str, system: str, sites: list[dict]) -> list[str]:
    """Where the blocks alive outside the pools at a system's peak were allocated (its tensors aside)."""
    return ["", f"Allocated outside the graph pools and alive at the peak, {config} / {system} (parameters, "
            "gradients and optimizer state aside):", "", "| site | GiB | blocks |", "|---|---|---|",
            *(f"| {site['site']} | {site['gib']:.3f} | {site['blocks']} |" for site in sites)]


def plot(records: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart "
              "(run `python examples/benchmark.py --plot results.json` where it is)")
        return False
    measured = [r for r in records if r.get("step_ms_median")]
    configs = list(dict.fromkeys(r["config"] for r in measured))
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), squeeze=False)
    for ax, config in zip(axes[0], configs):
        rows = [r for r in measured if r["config"] == config]
        ax.bar([r["system"] for r in rows], [r["step_ms_median"] for r in rows],
               yerr=[[r["step_ms_median"] - r["step_ms_min"] for r in rows],
                     [r["step_ms_max"] - r["step_ms_median"] for r in rows]],
               color=["#888" if r["system"].startswith("fsdp2")
                      else "#2a7" if r["system"].startswith("ours") else "#ccc" for r in rows])
        ax.set_title(f"{model_of(rows)} {config} ({rows[0]['world_size']} x {rows[0]['device']})", fontsize=9)
        ax.set_ylabel("step time, ms (median; bars: min–max)")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# -- main ---------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", choices=sorted(MODELS),
                   help="our GPT (examples/gpt.py) or transformers' LlamaForCausalLM (examples/hf_models.py)")
    p.add_argument("--config", nargs="+", default=["small"],
                   help="presets (small, medium; gpt also large, 1.3B) or, for gpt, "
                        "custom:VOCAB,D,HEADS,LAYERS,SEQ,MICRO_BATCH")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS + OFFLOAD_SYSTEMS)
    p.add_argument("--offload", action="store_true",
                   help="also run ours_eager_offload[_everyN], ours_layer_graphs_offload[_every3] and "
                        "ours_full_iteration_offload[_every3]: the activations of every (every N-th) block "
                        "offloaded to pinned host memory, eagerly or recorded in the graphs")
    p.add_argument("--segment-size", type=int, default=SEGMENT_SIZE[0],
                   help="blocks per graph of ours_segment_graphs")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps per system")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 warm-up and 3 timed steps (CPU/gloo in CI)")
    p.add_argument("--hot-path", action="store_true", help="also time our per-layer hooks and replays (adds overhead)")
    p.add_argument("--profile", action="store_true",
                   help="also break the whole-graph and offload systems' GPU time down by kernel kind (offload: the "
                        "host copies, and how much of them ran while compute kernels did)")
    p.add_argument("--memory", action="store_true",
                   help="also break each system's peak memory down by category (builds and runs it again)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels and a fixed NCCL algorithm: every system of ours must then give "
                        "ours_eager's losses bit for bit (a difference is a bug; the run exits with status 1)")
    p.add_argument("--alloc-conf", default=None, metavar="CONF",
                   help="the CUDA caching allocator's settings for every system (PYTORCH_CUDA_ALLOC_CONF's syntax). "
                        "Default: the environment's PYTORCH_CUDA_ALLOC_CONF, else " + DEFAULT_ALLOC_CONF + " "
                        "(torchtitan's setting: a CUDA graph's pool then grows by pages instead of 20 MiB segments "
                        "with room left in them); '' for the allocator's own defaults")
    p.add_argument("--out", default="bench")
    p.add_argument("--plot", metavar="RESULTS_JSON", help="only draw the chart from an earlier run's results")
    args = p.parse_args(argv)
    if args.smoke:
        args.config, args.warmup, args.steps = ["smoke"], 1, 3
    return args


def set_allocator(conf: str | None) -> str | None:
    """The caching allocator's settings for the whole run (every system the same), before the first
    CUDA allocation; returns them (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", DEFAULT_ALLOC_CONF) if conf is None else conf
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf  # (read when the allocator starts, if it has not yet)
    if conf:
        with warnings.catch_warnings():  # (torch 2.13 deprecates it for the accelerator-wide call it forwards to)
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings(conf)
    return conf


def bench_config(text: str, model: str = "gpt") -> BenchConfig:
    if text in MODELS[model]:
        return MODELS[model][text]
    if text.startswith("custom:") and model == "gpt":
        vocab, d, heads, layers, seq, mb = (int(v) for v in text[len("custom:"):].split(","))
        return BenchConfig(text, GPTConfig(vocab, d, heads, layers, seq, tie_embeddings=False), mb)
    custom = " or custom:VOCAB,D,HEADS,LAYERS,SEQ,MICRO_BATCH" if model == "gpt" else ""
    raise SystemExit(f"unknown config {text!r} for --model {model}: use {sorted(MODELS[model])}{custom}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot:
        with open(args.plot) as fh:
            records = json.load(fh)
        path = os.path.join(os.path.dirname(args.plot) or ".", f"step_time-{model_of(records)}.png")
        if plot(records, path):
            print(f"wrote {path}")
        return
    if args.deterministic:
        make_deterministic()
    SEGMENT_SIZE[0] = args.segment_size
    alloc_conf = set_allocator(args.alloc_conf)
    info = fsdp_graph.init_distributed()
    env = Env(info.rank, info.world_size, info.device)
    records = []
    for config in args.config:
        bench = bench_config(config, args.model)
        systems = list(args.systems) + [s for s in OFFLOAD_SYSTEMS if args.offload and s not in args.systems]
        for system in systems:
            if system in OFFLOAD_SYSTEMS and not env.cuda:
                records.append({"model": args.model, "config": bench.name, "system": system,
                                "skipped": "activation offload needs a GPU"})
                continue
            if system in GRAPH_SYSTEMS and not env.cuda:
                records.append({"model": args.model, "config": bench.name, "system": system,
                                "skipped": "CUDA graphs need a GPU"})
                continue
            if info.is_main:
                print(f"[{args.model} {bench.name}] {system} ...", flush=True)
            record = measure(system, bench, env, args.warmup, args.steps, args.hot_path, args.profile, args.memory)
            records.append({"model": args.model, **record, "alloc_conf": alloc_conf if env.cuda else None})
            if env.world_size > 1:
                dist.barrier()
    compare_losses(records)
    add_ratios(records)
    if info.is_main:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"results-{args.model}.json"), "w") as fh:
            json.dump(records, fh, indent=1)
        table = markdown(records)
        with open(os.path.join(args.out, f"results-{args.model}.md"), "w") as fh:
            fh.write(table)
        print(table)
        plot(records, os.path.join(args.out, f"step_time-{args.model}.png"))
    differing = ours_not_bitwise(records) if args.deterministic else []
    if differing and info.is_main:
        print(f"deterministic mode: losses differ from ours_eager's for {', '.join(differing)}: a bug")
    if dist.is_initialized():
        time.sleep(0.05)  # gloo shutdown race, see train_gpt.py
        dist.destroy_process_group()
    if differing:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
