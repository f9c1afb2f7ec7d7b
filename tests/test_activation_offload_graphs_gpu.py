"""GPU: activation offload under CUDA graphs (``GraphConfig(offload_activations=...)``), on one device
and, for the sharded GPT with its collectives, on two ranks.

Per-layer graphs and the whole step record the copies; every loss and the final weights must equal
an eager run without offload, bitwise, also with every copy delayed (so a missing wait would let
the pool's memory be reused before its copy read it), and the graphs' memory must fall by at
least half of what they offload. A negative control drops the whole step's wait before reuse and
shows the test sees that race. An HF Llama does the same under both strategies."""

from __future__ import annotations

import gc
import os

import pytest
import torch

import fsdp_graph
from fsdp_graph import GraphConfig
from fsdp_graph.graphs.activation_offload import ActivationOffload

from models import Block, TinyLM, lm_loss, shard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
STEPS = 20


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)  # attention's backward is otherwise nondeterministic
    yield
    torch.use_deterministic_algorithms(False)


def _model(size: str) -> TinyLM:
    torch.manual_seed(0)
    dims = dict(vocab=101, d=64, n_blocks=4, hidden=192, seq=32) if size == "tiny" else dict(
        vocab=512, d=256, n_blocks=12, hidden=1024, seq=256)
    model = TinyLM(**dims).cuda()
    shard(model, mp_policy=fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return model


def _batch(step: int, model: TinyLM, batch: int, accum: int = 1):
    """One step's (idx, targets); with ``accum`` > 1, that many micro-batches stacked."""
    g = torch.Generator().manual_seed(step)
    vocab, seq = model.emb.num_embeddings, model.pos.shape[0]
    idx = torch.randint(0, vocab, (accum, batch, seq), generator=g)
    idx, targets = idx.cuda(), torch.roll(idx, -1, dims=-1).cuda()
    return (idx, targets) if accum > 1 else (idx[0], targets[0])


def _step(model: TinyLM, strategy: str, offload: bool, batch: int, accum: int = 1, **fields):
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="cuda"), capturable=True)
    if fields.get("modules") == "every other block":
        fields["modules"] = list(model.blocks[::2])  # (the others stay eager, offloaded all the same)
    chosen = list(model.blocks[::2]) if fields.pop("offload_every_other", False) else type(model.blocks[0])
    config = GraphConfig(strategy=strategy, num_warmup_iters=2, offload_min_bytes=0,
                         offload_activations=chosen if offload else None, **fields)
    return fsdp_graph.make_train_step(lambda i, t: lm_loss(model, i, t), model, opt, config=config,
                                      max_grad_norm=1.0, example_batch=_batch(0, model, batch, accum),
                                      grad_accum_steps=accum)


def _train(strategy: str, offload: bool, size: str = "tiny", batch: int = 4, accum: int = 1, **fields):
    model = _model(size)
    step = _step(model, strategy, offload, batch, accum, **fields)
    losses = torch.stack([step(*_batch(s, model, batch, accum)).detach().clone() for s in range(STEPS)])
    return losses, fsdp_graph.full_state_dict(model), step


def _offloaded_bytes(model: TinyLM, step) -> int:
    """What the graphs copy to host memory per step: the pinned buffers of their plans."""
    if hasattr(step, "host_plans"):
        plans = [plan for _, plan in step.host_plans.values()]
    else:
        plans = [model.blocks[0].forward.group.host_plan]
    return sum(b.numel() * b.element_size() for plan in plans for b in plan.buffers)


def _assert_same(got, want, what: str) -> None:
    assert torch.equal(got[0], want[0]), f"{what}: losses {got[0].tolist()} vs eager {want[0].tolist()}"
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), f"{what}: {key} differs from eager"


def _delayed_copies(monkeypatch, cycles: int = 2_000_000) -> None:
    """Every offload and fetch copy waits ~1 ms on its stream first (recorded into the graphs)."""
    fork = ActivationOffload._fork

    def delayed(self, stream):
        fork(self, stream)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)

    monkeypatch.setattr(ActivationOffload, "_fork", delayed)


@pytest.mark.parametrize("strategy", ["layer", "full_iteration"])
def test_offload_under_graphs_trains_bitwise_as_eager_without_offload(strategy, monkeypatch):
    eager = _train("none", offload=False)
    losses, state, step = _train(strategy, offload=True)
    _assert_same((losses, state), eager, f"{strategy} with offload")
    if strategy == "layer":
        runners = [block.forward for block in step.model.blocks]
        assert [r.prefetched_by for r in runners[:-1]] == runners[1:], "each backward graph prefetches the one before"
        assert runners[0].group.host_plan.buffers, "the layer graphs recorded no offload"
    else:
        assert step.replays == STEPS - 2 and step.host_plans, "the whole step recorded no offload"
    with pytest.raises(RuntimeError, match="remove\\(\\) cannot take the copies out"):
        step.offload.remove()
    _delayed_copies(monkeypatch)
    _assert_same(_train(strategy, offload=True)[:2], eager, f"{strategy} with offload, every copy delayed")


@pytest.mark.parametrize("case", ["two micro-batches", "side stream", "eager blocks between",
                                  "graphed blocks between"])
def test_offload_under_graphs_with_accumulation_a_replay_stream_and_eager_blocks(case):
    """Two micro-batches in the whole step (each module called twice per step), per-layer graphs
    replayed on a side stream, per-layer graphs of every other block with all offloaded, and every
    block graphed with every other one offloaded (a backward graph that prefetches nothing replays
    between a prefetch and its reader: the benchmark's every-3rd system on two GPUs was refused)."""
    if case == "two micro-batches":
        runs = [("full_iteration", {"accum": 2})]
    elif case == "side stream":
        runs = [("layer", {"replay_stream": torch.cuda.Stream()})]
    elif case == "eager blocks between":
        runs = [("layer", {"modules": "every other block"})]
    else:
        runs = [("layer", {"offload_every_other": True})]
    for strategy, fields in runs:
        eager = _train("none", offload=False, accum=fields.get("accum", 1))
        losses, state, step = _train(strategy, offload=True, **fields)
        _assert_same((losses, state), eager, f"{strategy} with offload, {case}")
        if case == "graphed blocks between":
            runners = [block.forward for block in step.model.blocks]
            assert runners[0].prefetched_by is runners[2], "block 2's backward graph prefetches block 0's tensors"


def test_the_whole_step_test_sees_a_missing_wait_before_reuse(monkeypatch):
    """Negative control: the whole step's compute stream no longer waits for a copy before the pool
    reuses the tensor's memory; with the copies delayed, the offloaded activations are overwritten."""
    eager = _train("none", offload=False)
    _delayed_copies(monkeypatch, cycles=20_000_000)
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", _skip_offload_waits(torch.cuda.Stream.wait_event))
    losses, _, _ = _train("full_iteration", offload=True)
    assert not torch.equal(losses, eager[0]), "the race this test guards against did not show without the wait"


def _skip_offload_waits(wait_event):
    """``wait_event`` that skips the waits ``ActivationOffload._release`` makes (found by caller)."""
    import sys

    def patched(stream, event):
        if sys._getframe(1).f_code.co_name == "_release":
            return None
        return wait_event(stream, event)

    return patched


def _peak(strategy: str, offload: bool) -> tuple[int, int]:
    """The peak of allocated memory from building the step to its fourth step (the benchmark's
    measure: the capture's pool allocations count), and the bytes offloaded per step."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = _model("small")
    step = _step(model, strategy, offload, batch=16)
    for s in range(4):
        step(*_batch(s, model, 16))
    torch.cuda.synchronize()
    peak, offloaded = torch.cuda.max_memory_allocated() - base, _offloaded_bytes(model, step) if offload else 0
    del model, step
    return peak, offloaded


@pytest.mark.parametrize("strategy", ["layer", "full_iteration"])
def test_offload_under_graphs_lowers_the_peak_by_half_the_offloaded_bytes_or_more(strategy):
    plain, _ = _peak(strategy, offload=False)
    peak, offloaded = _peak(strategy, offload=True)
    print(f"{strategy}: peak allocated {plain / 2**20:.0f} MiB -> {peak / 2**20:.0f} MiB, "
          f"offloaded {offloaded / 2**20:.0f} MiB per step")
    assert offloaded > 256 * 2**20, offloaded
    assert plain - peak >= offloaded / 2, (plain, peak, offloaded)


def test_a_layer_graph_whose_prefetching_backward_did_not_run_is_refused():
    model = _model("tiny")
    handle = fsdp_graph.offload_activations(list(model.blocks), min_bytes=0)
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fsdp_graph.graph_modules(list(model.blocks), [(x,)] * 4, num_warmup_iters=2)
    with pytest.raises(RuntimeError, match="remove\\(\\) cannot take the copies out"):
        handle.remove()
    idx, targets = _batch(0, model, 4)

    def skipping(skip):
        def forward(idx):  # (the root's FSDP hooks still run around it)
            h = model.emb(idx) + model.pos
            for i, block in enumerate(model.blocks):
                if i != skip:
                    h = block(h)
            return model.head(model.ln_f(h))

        model.forward = forward
        try:
            return lm_loss(model, idx, targets)
        finally:
            del model.forward

    skipping(None).backward()  # in the captured order: fine
    with pytest.raises(RuntimeError, match="brought back from host memory by the backward graph of module 1.*order"):
        skipping(1).backward()


def _plain_blocks(offload: bool):
    """Four plain (unsharded) blocks, graphed one by one, offloaded or not."""
    torch.manual_seed(0)
    blocks = [Block(64, 192).cuda() for _ in range(4)]
    if offload:
        fsdp_graph.offload_activations(blocks, min_bytes=0)
    x = torch.randn(4, 32, 64, device="cuda", requires_grad=True)
    fsdp_graph.graph_modules(blocks, [(x,)] * 4, num_warmup_iters=2)
    return blocks, x


def test_a_forward_replay_between_a_prefetch_and_its_reader_is_refused():
    """Backward 3 brings block 2's tensors back into the pool, then a forward replay of block 3
    (under no_grad) may overwrite them: block 2's backward must not read them."""
    blocks, x = _plain_blocks(offload=True)
    h = [x.detach().clone().requires_grad_()]
    for block in blocks:
        h.append(block(h[-1]))
    (g,) = torch.autograd.grad(h[4].square().sum(), h[3])  # backward 3 only
    with torch.no_grad():
        blocks[3](h[3].detach())
    with pytest.raises(RuntimeError, match="a forward graph of the group or another prefetching backward replayed"):
        h[3].backward(g)


def test_offloading_a_module_graphed_without_offload_is_refused():
    blocks, _ = _plain_blocks(offload=False)
    with pytest.raises(ValueError, match="has a training graph already.*Offload before graphing"):
        fsdp_graph.offload_activations([blocks[0]])


def _hf_with_offload(info) -> None:
    from test_replay_stream_gpu import _hf_on_a_config_stream
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.use_deterministic_algorithms(True)
    eager = _hf_on_a_config_stream(info, None, None)
    for strategy in ("layer", "full_iteration"):
        config = GraphConfig(strategy=strategy, num_warmup_iters=2, offload_activations=LlamaDecoderLayer,
                             offload_min_bytes=0)
        _assert_same(_hf_on_a_config_stream(info, config, None), eager, f"HF Llama, {strategy} with offload")


def test_an_hf_model_trains_bitwise_as_eager_with_offload_under_both_strategies():
    pytest.importorskip("transformers")
    from dist_harness import run_ranks

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_hf_with_offload, 1)


def test_a_capture_this_package_did_not_set_up_is_refused():
    """A user's own ``torch.cuda.graph`` around an offloaded module would record copies into host
    memory nobody keeps: refused at the first saved tensor, naming the fix."""
    torch.manual_seed(0)
    block = Block(64, 192).cuda()
    fsdp_graph.offload_activations([block], min_bytes=0)
    x = torch.randn(4, 32, 64, device="cuda", requires_grad=True)
    block(x).sum().backward()  # (eager offload: fine)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="did not set up for its offload.*graph_modules or make_train_step"):
        with torch.cuda.graph(graph):
            block(x)


# -- two ranks (NCCL): the sharded GPT, its collectives recorded beside the copies ---------------------
TWO_RANK_CASES = {  # case -> (strategy, blocks offloaded, GraphConfig fields, micro-batches)
    "layer, every block": ("layer", slice(None), {}, 1),
    "layer, every other block, side stream": ("layer", slice(None, None, 2), {"replay_stream": "new"}, 1),
    "whole step, two micro-batches": ("full_iteration", slice(None), {}, 2),
}


def _sharded_gpt_offload_matches_eager(info, case: str) -> None:
    """The sharded GPT of the parity tests, clipped, 20 steps: offload under graphs against the
    eager step without offload, every loss and the final weights bitwise."""
    from test_full_iteration_gpu import _stacked_batch
    from test_graph_parity_gpu import STEPS as GPT_STEPS
    from test_graph_parity_gpu import _build

    torch.use_deterministic_algorithms(True)
    strategy, chosen, fields, accum = TWO_RANK_CASES[case]

    def train(offload: bool):
        model = _build(info, oversized_block=False)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), capturable=True)
        extra = {k: torch.cuda.Stream() if v == "new" else v for k, v in fields.items()} if offload else {}
        config = GraphConfig(strategy=strategy if offload else "none", num_warmup_iters=2, offload_min_bytes=0,
                             offload_activations=list(model.blocks[chosen]) if offload else None, **extra)
        step = fsdp_graph.make_train_step(lambda i, t: model(i, t)[1], model, opt, config=config, max_grad_norm=1.0,
                                          example_batch=_stacked_batch(0, info, accum), grad_accum_steps=accum)
        losses = torch.stack([step(*_stacked_batch(s, info, accum)).detach().clone() for s in range(GPT_STEPS)])
        if offload and strategy == "layer":
            runners = [block.forward for block in model.blocks[chosen]]
            assert [r.prefetched_by for r in runners[:-1]] == runners[1:], "the backward graphs prefetch no copies"
        elif offload:
            assert step.replays == GPT_STEPS - 2 and step.host_plans, "the whole step recorded no offload"
        return losses, fsdp_graph.full_state_dict(model)

    eager = train(offload=False)
    assert eager[0][-1] < eager[0][0] - 0.1, f"the model should be learning: {eager[0].tolist()}"
    _assert_same(train(offload=True), eager, f"rank {info.rank}, {case}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("case", list(TWO_RANK_CASES))
def test_offload_under_graphs_on_two_ranks_trains_bitwise_as_eager(case):
    from dist_harness import run_ranks

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_sharded_gpt_offload_matches_eager, 2, case)
