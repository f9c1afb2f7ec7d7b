"""GPU: graphs replayed on a stream the caller gives (``replay_on``, ``GraphConfig.replay_stream``)
train bitwise as eager, under ``layer`` (with and without a join event) and ``full_iteration``;
forward-only layer graphs joined early evaluate as eager; an HF Llama trains bitwise as eager, 20
steps, with per-layer graphs, segments with the optimizer graph, and the whole step replayed on a
``GraphConfig(replay_stream=)`` while the caller's stream does other work.

Each block's forward records the join event after its output and then runs a *tail*: a long
sleep, then a read of one of its unsharded weights into a buffer. Under a join event the caller's
stream goes on at the event, so the next all-gather into that block's slot would overwrite the
weight before the tail reads it, unless FSDP's side streams wait for the tail (the replay tails of
``fsdp/collectives.py``). The tails' readings must equal eager's; with that wait switched off they
do not, which shows the test can see the race it guards against."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import fsdp_graph
from fsdp_graph import GraphConfig
from fsdp_graph.fsdp.registry import pinned_by
from fsdp_graph.graphs import replay_stream

from dist_harness import run_ranks
from examples.gpt import GPT, Block
from test_graph_parity_gpu import CFG, _batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS, WARMUP = 8, 3
TAIL_CYCLES = 20_000_000  # about 10 ms: far longer than the host takes to issue the next unshards


class TailedBlock(Block):
    """A block whose forward goes on after its join point: sleep, then read a weight (its slot)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.join.record()
        with torch.no_grad():
            torch.cuda._sleep(TAIL_CYCLES)
            self.tail_reading.copy_(self.mlp.fc.weight.float().sum())
        return out


def _build(info, join: fsdp_graph.JoinEvent) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        block.__class__ = TailedBlock
        block.join = join
        block.register_buffer("tail_reading", torch.zeros(()), persistent=False)
    model.to(info.device)
    policy = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fsdp_graph.fully_shard(block, mp_policy=policy)
    return fsdp_graph.fully_shard(model, mp_policy=policy)


def _train(info, strategy: str, side: bool, join: bool):
    join_event = fsdp_graph.JoinEvent()
    model = _build(info, join_event)
    stream = torch.cuda.Stream(info.device) if side else None
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), capturable=True)
    step = fsdp_graph.make_train_step(
        lambda idx, targets: model(idx, targets)[1], model, opt,
        config=GraphConfig(strategy=strategy, num_warmup_iters=WARMUP), example_batch=_batch(0, info))
    losses, readings = [], []
    for i in range(STEPS):
        with fsdp_graph.replay_on(stream, join_event=join_event if join else None):
            losses.append(step(*_batch(i, info)))
        readings.append(torch.stack([block.tail_reading.clone() for block in model.blocks]))
    return torch.stack(losses), torch.stack(readings), fsdp_graph.full_state_dict(model)


def _side_streams_match_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager = _train(info, "none", side=False, join=False)
    for strategy, join in (("layer", False), ("layer", True), ("full_iteration", False)):
        losses, readings, state = _train(info, strategy, side=True, join=join)
        what = f"{strategy}, join event {join}"
        assert torch.equal(losses, eager[0]), f"{what}: {losses.tolist()} vs eager {eager[0].tolist()}"
        assert torch.equal(readings, eager[1]), f"{what}: the tails read other weights than eager's"
        for key, value in eager[2].items():
            assert torch.equal(state[key], value), f"{what}: {key} differs from eager"
    # The negative control: without the side streams' wait for the tails, the next unshard
    # overwrites a slot that a tail still reads.
    replay_stream.note_replay_tail = lambda stream, event: None
    losses, readings, _ = _train(info, "layer", side=True, join=True)
    assert torch.equal(losses, eager[0])  # (the tails feed nothing back)
    assert not torch.equal(readings, eager[1]), "the race this test guards against did not show without the wait"


def test_graphs_replayed_on_a_side_stream_train_as_eager():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_side_streams_match_eager, min(2, torch.cuda.device_count()))


def _config_stream_for_every_graph(info) -> None:
    """``GraphConfig(replay_stream=)``: the layer graphs and the whole step replay there by
    default, and main-stream work issued meanwhile (a stand-in for another model's step) does not
    change them."""
    torch.use_deterministic_algorithms(True)
    eager = _train(info, "none", side=False, join=False)
    for strategy in ("layer", "full_iteration"):
        join_event = fsdp_graph.JoinEvent()
        model = _build(info, join_event)
        stream = torch.cuda.Stream(info.device)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), capturable=True)
        step = fsdp_graph.make_train_step(
            lambda idx, targets: model(idx, targets)[1], model, opt,
            config=GraphConfig(strategy=strategy, num_warmup_iters=WARMUP, replay_stream=stream),
            example_batch=_batch(0, info))
        other = torch.randn(1024, 1024, device=info.device)
        losses = []
        for i in range(STEPS):
            losses.append(step(*_batch(i, info)))
            other = torch.tanh(other @ other)  # independent main-stream work
        assert torch.equal(torch.stack(losses), eager[0]), f"GraphConfig(replay_stream=), {strategy}"


def test_a_config_replay_stream_is_the_default_of_every_graph():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_config_stream_for_every_graph, min(2, torch.cuda.device_count()))


class InputProbe(torch.nn.Module):
    """A module whose rest, after its join point, sleeps and then reads its input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.join = fsdp_graph.JoinEvent()
        self.register_buffer("total", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.join.record()
        with torch.no_grad():
            torch.cuda._sleep(TAIL_CYCLES)
            self.total.add_(x.double().sum())
        return out


def test_a_repeated_call_waits_for_the_rest_of_the_last_one_before_writing_its_inputs():
    """The rest of a replay that joined early reads its static input; the next call of the same
    graph must not overwrite that input first (the caller's stream waits at the call)."""
    module = InputProbe().cuda()
    stream = torch.cuda.Stream()
    graphed = fsdp_graph.make_graphed_callables(module, (torch.zeros(8, 64, device="cuda"),),
                                                replay_stream=stream, join_event=module.join)
    module.total.zero_()
    with torch.no_grad():
        for i in range(1, 5):
            graphed(torch.full((8, 64), float(i), device="cuda"))
    torch.cuda.synchronize()
    assert module.total.item() == 8 * 64 * (1 + 2 + 3 + 4)


def test_a_join_event_the_forward_never_records_is_refused_before_anything_is_installed():
    module = torch.nn.Linear(64, 64).cuda()
    stray = fsdp_graph.JoinEvent()
    with pytest.raises(ValueError, match="was not recorded by this module's forward during its capture"):
        fsdp_graph.graph_modules([module], [(torch.zeros(8, 64, device="cuda"),)],
                                 replay_stream=torch.cuda.Stream(), join_event=stray)
    assert "forward" not in module.__dict__ and pinned_by(module) is None
    fsdp_graph.graph_modules([module], [(torch.zeros(8, 64, device="cuda"),)])  # graphed as usual afterwards


def _evaluate(info, graphed: bool, side: bool):
    """Evaluation forwards of the tailed GPT: eager, or forward-only layer graphs replayed on a side
    stream that the caller's stream joins at each block's join event."""
    join_event = fsdp_graph.JoinEvent()
    model = _build(info, join_event)
    config = GraphConfig(forward_only="layer", num_warmup_iters=WARMUP) if graphed else GraphConfig()
    evaluate = fsdp_graph.make_eval_step(model, config=config, example_args=(_batch(0, info)[0],))
    stream = torch.cuda.Stream(info.device) if side else None
    logits, readings = [], []
    for i in range(4):
        with fsdp_graph.replay_on(stream, join_event=join_event if side else None):
            logits.append(evaluate(_batch(i, info)[0])[0].clone())
        readings.append(torch.stack([block.tail_reading.clone() for block in model.blocks]))
    return torch.stack(logits), torch.stack(readings)


def _forward_only_joins_match_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager = _evaluate(info, graphed=False, side=False)
    logits, readings = _evaluate(info, graphed=True, side=True)
    assert torch.equal(logits, eager[0]), "forward-only graphs joined early: outputs differ from eager"
    assert torch.equal(readings, eager[1]), "forward-only graphs joined early: the tails read other weights"
    replay_stream.note_replay_tail = lambda stream, event: None  # the negative control, as in training
    logits, readings = _evaluate(info, graphed=True, side=True)
    assert not torch.equal(readings, eager[1]), "the race this test guards against did not show without the wait"


def test_forward_only_graphs_joined_early_evaluate_as_eager():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_forward_only_joins_match_eager, min(2, torch.cuda.device_count()))


def _hf_on_a_config_stream(info, config: GraphConfig | None, stream: torch.cuda.Stream | None):
    from examples.hf_models import build_hf, hf_batch

    model = build_hf("llama", "tiny", device=info.device)
    model.config.use_cache = False
    policy = fsdp_graph.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp_graph.hf.shard_model(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), capturable=True)
    if config is not None and config.strategy == "layer":
        config = replace(config, modules=type(fsdp_graph.hf.decoder_layers(model)[0]))
    vocab = model.config.vocab_size

    def batch(step):
        return hf_batch(vocab, 4 * info.world_size, 64, step).chunk(info.world_size)[info.rank].to(info.device)

    step = fsdp_graph.make_train_step(lambda ids: model(input_ids=ids, labels=ids).loss, model, opt,
                                      config=config, max_grad_norm=1.0, example_batch=(batch(0),))
    other = torch.randn(1024, 1024, device=info.device)
    losses = []
    for s in range(20):
        losses.append(step(batch(s)).detach().clone())
        other = torch.tanh(other @ other)  # independent work on the caller's stream meanwhile
    return torch.stack(losses), fsdp_graph.full_state_dict(model)


def _hf_every_graph_kind_on_a_side_stream(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager = _hf_on_a_config_stream(info, None, None)
    for fields in ({"strategy": "layer"}, {"strategy": "layer", "segment_size": 2, "optimizer_graph": True},
                   {"strategy": "full_iteration"}):
        stream = torch.cuda.Stream(info.device)
        config = GraphConfig(num_warmup_iters=WARMUP, replay_stream=stream, **fields)
        losses, state = _hf_on_a_config_stream(info, config, stream)
        assert torch.equal(losses, eager[0]), f"HF Llama, {fields} on a side stream: {losses.tolist()} vs eager"
        for key, value in eager[1].items():
            assert torch.equal(state[key], value), f"HF Llama, {fields} on a side stream: {key} differs from eager"


def test_an_hf_model_trains_as_eager_with_every_graph_kind_on_a_side_stream():
    pytest.importorskip("transformers")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_hf_every_graph_kind_on_a_side_stream, min(2, torch.cuda.device_count()))
