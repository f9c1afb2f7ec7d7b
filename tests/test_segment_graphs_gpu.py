"""GPU: segment graphs (k FSDP blocks per graph, their FSDP steps inside) train bitwise as eager.

The sharded GPT in bf16 (fp32 reduce) trains eagerly and with ``GraphConfig(strategy="layer",
segment_size=k)`` for k = 2 and 3 (4 blocks: two segments of two; one of three and one of one),
with clipping and the capturable AdamW step: every loss and the final weights equal bit for bit.
So do a block too wide for the slots, a root too wide for the shared staging (its reduce-scatters
replayed as collective graphs between the segments), a hand-written loop that calls ``graph_segments`` after three
eager steps (``zero_grad(set_to_none=False)``, so the gradients the replay accumulates into are
kept), the gradient settings a user may change after graphing (a divide factor, a
post-accumulate-grad hook, a replaced ``.grad``; the sharded gradients given back by
``zero_grad()`` before each forward, as eagerly) and an HF Llama (keyword arguments shared by its
decoder layers).
Evaluation with gradients off runs the blocks' FSDP steps by hand and equals eager's.
Then the refusals a user can meet, each naming the fix: at replay (another input, shape,
``requires_grad``, autocast, frozen parameters, other arguments for a later block,
``torch.autograd.grad`` (it accumulates into no parameter), a reentrant checkpoint's recompute, an
eager block holding its parameters unsharded in a slot the segment writes, ``no_sync``, a skipped
block, a pending backward, a gradient for a block's output inside a segment; for chained segments,
another tensor where the previous segment's output is read in place, and a forward of the previous
segment while the chained one's backward is pending) and while graphing (a sample without gradient,
blocks of two models, a block returning a tuple, a block whose input gets no gradient).
Runs on two GPUs (NCCL) where there are two, else
on one.
"""

from __future__ import annotations

import os

import pytest
import torch

import fsdp_graph
from fsdp_graph import GraphConfig, hf
from fsdp_graph.fsdp.capture_interface import local_tensor
from fsdp_graph.fsdp.registry import units_in
from fsdp_graph.graphs.module_graphs import record_sample_args

from dist_harness import run_ranks
from test_graph_parity_gpu import CFG, _batch, _build, check_piece_replays

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS, WARMUP = 12, 2


def _ranks() -> int:
    return min(2, torch.cuda.device_count())


def _train_step(info, segment_size: int | None, oversized_block: bool = False, wide_root: bool = False,
                collective_graphs: bool | None = None):
    model = _build(info, oversized_block, wide_root=wide_root)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), capturable=True)
    config = GraphConfig() if segment_size is None else GraphConfig(
        strategy="layer", segment_size=segment_size, num_warmup_iters=WARMUP, collective_graphs=collective_graphs)
    step = fsdp_graph.make_train_step(lambda idx, targets: model(idx, targets)[1], model, opt, config=config,
                                      max_grad_norm=1.0, example_batch=_batch(0, info))
    losses = torch.stack([step(*_batch(i, info)) for i in range(STEPS)])
    if segment_size is not None:
        segments = {id(b.forward.segment): b.forward.segment for b in model.blocks}.values()
        assert len(segments) == -(-CFG.n_layers // segment_size)
        assert all(s.replays == STEPS for s in segments), [s.replays for s in segments]  # no silent eager
        _assert_chained(list(segments))
        root = units_in(model)[0]  # (a wide root's reduce-scatters and writes replay between the segments)
        on = collective_graphs is not False  # (its home is taken either way: eager writes go there too)
        assert (check_piece_replays(root, STEPS, on) > 0) == wide_root == (root.grads.sharded.home is not None)
    model.eval()
    with torch.no_grad():
        logits = model(_batch(STEPS, info)[0])
    return losses, fsdp_graph.full_state_dict(model), logits


def _assert_chained(segments: list) -> None:
    """make_train_step chains the segments (chain_static_buffers=True by default): each later segment
    reads its input where the previous one writes its output, and the previous one its output
    gradient where this one's backward writes its input's; no static copy of either."""
    for previous, segment in zip(segments, segments[1:]):
        assert segment.chain_source is previous and previous.chained_reader is segment
        assert segment.static_inputs[0].data_ptr() == previous.static_outputs[-1].data_ptr()
        assert previous.static_grad_outputs[0].data_ptr() == segment.static_grad_inputs[0].data_ptr()


def _compare(what: str, got, eager) -> None:
    assert torch.equal(got[0], eager[0]), f"{what}: losses {got[0].tolist()} vs eager {eager[0].tolist()}"
    assert eager[0][-1] < eager[0][0] - 0.1, f"the model should be learning: {eager[0].tolist()}"
    for key, value in eager[1].items():
        assert torch.equal(got[1][key], value), f"{what}: {key} differs from eager"
    if len(got) > 2:
        assert torch.equal(got[2], eager[2]), f"{what}: evaluation (gradients off) differs from eager"


def _segments_match_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager = _train_step(info, None)
    for k in (2, 3):
        _compare(f"segment_size={k}", _train_step(info, k), eager)
    # Block 1 is twice as wide: no slot, a buffer of its own, gather staging of its own inside the graph,
    # its reduce in pieces through the shared staging.
    _compare("segment_size=2, an oversized block", _train_step(info, 2, True), _train_step(info, None, True))
    # A wider vocabulary: the root reduces in pieces through the shared staging, and their
    # reduce-scatters replay as collective graphs between the segments.
    wide_eager = _train_step(info, None, wide_root=True)
    _compare("segment_size=2, a wide root", _train_step(info, 2, wide_root=True), wide_eager)
    # The same, its reduce-scatters asked to replay (True) and kept eager (False) explicitly.
    for on in (True, False):
        _compare(f"segment_size=2, a wide root, collective_graphs={on}",
                 _train_step(info, 2, wide_root=True, collective_graphs=on), wide_eager)


def test_segment_graphs_train_bitwise_as_eager():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_segments_match_eager, _ranks())


def _hand_loop(info, segmented: bool, blocks: slice = slice(None)):
    """A user's loop: backward, step, zero_grad(set_to_none=False); graph_segments after 3 eager steps
    (the prefetch order is recorded by then, and the sharded gradients hold values). ``blocks``: the
    blocks segmented, two per graph; the others stay eager, sharing the two slots with them."""
    model = _build(info, oversized_block=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for i in range(STEPS):
        if segmented and i == 3:
            sample = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device, dtype=torch.bfloat16,
                                 requires_grad=True)
            chosen = list(model.blocks)[blocks]
            fsdp_graph.graph_segments(chosen, [(sample,)] * len(chosen), segment_size=2, num_warmup_iters=WARMUP)
        loss = model(*_batch(i, info))[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.detach())
    return torch.stack(losses), fsdp_graph.full_state_dict(model)


def _hand_loop_matches_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager = _hand_loop(info, False)
    _compare("graph_segments in a hand-written loop", _hand_loop(info, True), eager)
    # Blocks 1 and 2 segmented, 0 and 3 eager: the segment overwrites block 0's slot after block 0's
    # forward, so block 0's backward must gather again (the segment's slot claims tell it to).
    _compare("blocks 1..2 segmented between eager blocks", _hand_loop(info, True, slice(1, 3)), eager)


def test_graph_segments_in_a_hand_written_loop_keeps_gradients_as_eager():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_hand_loop_matches_eager, _ranks())


def _gradient_settings_loop(info, segmented: bool):
    """After graphing, what a user may do to the gradients, each taking effect as eagerly: a divide
    factor set on block 0 (step 5), a post-accumulate-grad hook on a parameter of block 1 (it sees
    each reduced gradient) and one on every block (the order they run in), a ``.grad`` of block 2
    replaced by the user's own tensor and accumulated into (step 7, without zero_grad). Segmented,
    the blocks' sharded gradients are given back by ``zero_grad()`` before the next forward, as
    eagerly (they are not pinned)."""
    model = _build(info, oversized_block=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seen, order = [], []
    hooked = units_in(model.blocks[1])[0].params[0].master
    hooked.register_post_accumulate_grad_hook(lambda p: seen.append(local_tensor(p.grad).clone()))
    for i, block in enumerate(model.blocks):  # (the order the hooks run in: last block first, as eager reduces)
        units_in(block)[0].params[-1].master.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
    replaced = units_in(model.blocks[2])[0].params[1].master
    units = [units_in(b)[0] for b in model.blocks]
    losses = []
    for i in range(STEPS):
        if segmented and i == 3:
            fsdp_graph.graph_segments(list(model.blocks), [(_hidden(info),)] * CFG.n_layers, segment_size=2,
                                      num_warmup_iters=WARMUP)
        if i == 5:
            model.blocks[0].set_gradient_divide_factor(2.0)
        loss = model(*_batch(i, info))[1]
        if segmented and i > 3 and i != 8:  # (step 7 kept its gradients for step 8 to add into)
            # (given back, or at their home in the segments' pool: grad_homes.py)
            assert not any(u.grads.sharded.owns_memory for u in units), f"step {i}: gradients kept over zero_grad"
        loss.backward()
        opt.step()
        if i == 7:
            replaced.grad = replaced.grad.clone()
        else:
            opt.zero_grad()
        losses.append(loss.detach())
    assert len(seen) == STEPS
    return torch.stack(losses), fsdp_graph.full_state_dict(model), torch.stack(seen), order


def _gradient_settings_match_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    eager = _gradient_settings_loop(info, False)
    got = _gradient_settings_loop(info, True)
    _compare("gradient settings changed after graphing", got[:2], eager[:2])
    assert torch.equal(got[2], eager[2]), "the post-accumulate-grad hook saw other gradients than eagerly"
    assert got[3] == eager[3], f"hooks ran in another order than eagerly: {got[3][:8]} vs {eager[3][:8]}"


def test_gradient_settings_changed_after_graphing_take_effect_as_eagerly():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_gradient_settings_match_eager, _ranks())


def _hf_train(info, segment_size: int | None):
    from examples.hf_models import build_hf, hf_batch

    model = build_hf("llama", "tiny", device=info.device)
    model.config.use_cache = False
    policy = fsdp_graph.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    hf.shard_model(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), capturable=True)
    layers = hf.decoder_layers(model)
    config = GraphConfig() if segment_size is None else GraphConfig(
        strategy="layer", modules=type(layers[0]), segment_size=segment_size, num_warmup_iters=WARMUP)
    vocab = model.config.vocab_size

    def batch(step):
        return hf_batch(vocab, 4 * info.world_size, 64, step).chunk(info.world_size)[info.rank].to(info.device)

    step = fsdp_graph.make_train_step(lambda ids: model(input_ids=ids, labels=ids).loss, model, opt, config=config,
                                      max_grad_norm=1.0, example_batch=(batch(0),))
    losses = torch.stack([step(batch(s)).detach().clone() for s in range(STEPS)])
    if segment_size is not None:
        assert all(layer.forward.segment.replays == STEPS for layer in layers)
    return losses, fsdp_graph.full_state_dict(model)


def _hf_matches_eager(info) -> None:
    torch.use_deterministic_algorithms(True)
    _compare("HF Llama, segment_size=2", _hf_train(info, 2), _hf_train(info, None))


def test_an_hf_model_trains_bitwise_as_eager_under_segment_graphs():
    pytest.importorskip("transformers")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    run_ranks(_hf_matches_eager, _ranks())


def _segmented(info, model=None, chained: bool = False):
    model = model or _build(info, oversized_block=False)
    sample = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device, dtype=torch.bfloat16, requires_grad=True)
    links = None
    if chained:  # (as make_train_step finds them: from an example forward)
        links = record_sample_args(list(model.blocks), lambda: model(*_batch(0, info))).links
    fsdp_graph.graph_segments(list(model.blocks), [(sample,)] * CFG.n_layers, segment_size=2, num_warmup_iters=1,
                              chained_inputs=links)
    return model


def _refusals(info) -> None:
    idx, targets = _batch(0, info)
    # Code between the blocks of a segment that changes the hidden state.
    model = _segmented(info)
    x = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match="another input than the output of the block before it"):
        model.blocks[1](model.blocks[0](x) * 2.0)
    # no_sync: the backward graph reduce-scatters at every backward.
    model = _segmented(info)
    with model.no_sync():
        loss = model(idx, targets)[1]
        with pytest.raises(RuntimeError, match="accumulates without synchronising"):
            loss.backward()
    # Accumulation in a step: refused before any capture, naming the alternatives.
    model = _build(info, oversized_block=False)
    stacked = (torch.stack([idx, idx]), torch.stack([targets, targets]))
    with pytest.raises(ValueError, match="grad_accum_steps=2"):
        fsdp_graph.make_train_step(lambda i, t: model(i, t)[1], model, None, grad_accum_steps=2,
                                   config=GraphConfig(strategy="layer", segment_size=2), example_batch=stacked)
    # A parameter that gets no gradient: the graph would give it zeros.
    model = _build(info, oversized_block=False)
    fc = model.blocks[1].mlp.fc  # its weight read through .detach(): no gradient reaches it
    fc.forward = lambda x: torch.nn.functional.linear(x, fc.weight.detach(), fc.bias)
    with pytest.raises(ValueError, match="got no gradient in the warm-up"):
        _segmented(info, model)
    # A forward that skips a segment's last block: the backward graph would give it zero gradients.
    model = _segmented(info)
    x = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device, dtype=torch.bfloat16, requires_grad=True)
    out = model.blocks[0](x)
    with pytest.raises(RuntimeError, match="stopped before its last block"):
        out.sum().backward()
    # A second forward while the first one's backward is pending (its activations are the graph's).
    kept = model.blocks[1](model.blocks[0](x))
    with pytest.raises(RuntimeError, match="previous forward's backward is still pending"):
        model.blocks[0](x)
    del kept
    # A loss on a block's output inside a segment: the backward graph takes only the last block's gradient.
    inner = model.blocks[0](x)
    loss = model.blocks[1](inner).float().sum() + inner.float().sum()
    with pytest.raises(RuntimeError, match="output of block 0 .* got a gradient from outside the segment.*ends a"):
        loss.backward()
    # Forward-only graphs of a segment's blocks.
    model = _segmented(info)
    with pytest.raises(ValueError, match="block of a segment graph"):
        sample = torch.randn(4, CFG.seq_len, CFG.d_model, device=info.device)
        fsdp_graph.graph_modules(list(model.blocks), [(sample,)] * CFG.n_layers, forward_only=True)


def test_segment_refusals_name_the_fix():
    run_ranks(_refusals, 1)


def _hidden(info, batch: int = 4, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(batch, CFG.seq_len, CFG.d_model, device=info.device, dtype=torch.bfloat16,
                       requires_grad=requires_grad)


def _replay_refusals(info) -> None:
    """The refusals a segment makes when it is called, each on a freshly graphed model."""
    x = _hidden(info)
    model = _segmented(info)
    with pytest.raises(ValueError, match=r"is shape \(2, .*pad the input to the captured shape"):
        model.blocks[0](_hidden(info, batch=2))
    with pytest.raises(ValueError, match="has requires_grad=False, but was captured with requires_grad=True"):
        model.blocks[0](_hidden(info, requires_grad=False))
    with torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="autocast is .* at capture"):
        model.blocks[0](x)
    master = units_in(model.blocks[0])[0].params[0].master
    master.requires_grad_(False)
    with pytest.raises(RuntimeError, match="require a gradient changed since the capture.*Freeze or unfreeze"):
        model.blocks[0](x)
    master.requires_grad_(True)
    out = model.blocks[0](x)
    with pytest.raises(RuntimeError, match="called with other arguments \\(besides its input\\).*segment_size=1"):
        model.blocks[1](out, 2.0)
    del out
    # torch.autograd.grad accumulates into no parameter; the segment's backward graph reduces them all.
    model = _segmented(info)
    with pytest.raises(RuntimeError, match="backward runs under torch.autograd.grad or backward\\(inputs=.*"
                                           "segment_size=1"):
        torch.autograd.grad(model.blocks[1](model.blocks[0](x)).float().sum(), [x])
    # Activation checkpointing that reruns the forward inside the backward (reentrant).
    model = _segmented(info)
    pair = lambda h: model.blocks[1](model.blocks[0](h))  # noqa: E731
    loss = torch.utils.checkpoint.checkpoint(pair, x, use_reentrant=True).float().sum()
    with pytest.raises(RuntimeError, match="forward ran inside a backward.*out of activation checkpointing"):
        loss.backward()
    # An eager block holding its parameters unsharded (module.unshard()) in a slot a segment writes.
    idx, targets = _batch(0, info)
    model = _build(info, oversized_block=False)
    model(idx, targets)[1].backward()  # (an eager step first: block 0 has run, and holds a slot)
    blocks = list(model.blocks)
    fsdp_graph.graph_segments(blocks[1:3], [(_hidden(info),)] * 2, segment_size=2, num_warmup_iters=1)
    model.blocks[0].unshard()
    with pytest.raises(RuntimeError, match="holds its parameters unsharded .* Call its reshard\\(\\)"):
        model.blocks[2](model.blocks[1](x))
    _chain_refusals(info, x)


def _chain_refusals(info, x: torch.Tensor) -> None:
    """Chained segments: the second one reads its input where the first writes its output."""
    model = _segmented(info, chained=True)
    first, second = model.blocks[0].forward.segment, model.blocks[2].forward.segment
    assert second.chain_source is first
    out = model.blocks[1](model.blocks[0](x))
    with pytest.raises(RuntimeError, match="segment modules 2..3: its input .* is read where .* writes its output.*"
                                           "chain_static_buffers=False"):
        model.blocks[2]((out.detach() * 2.0).requires_grad_())  # (a copy would overwrite the first one's output)
    # The second segment's backward pending, the first one's autograd graph let go (its output detached):
    # the first segment's forward would overwrite the output the second reads.
    hidden = out.detach().requires_grad_()
    del out
    loss = model.blocks[3](model.blocks[2](hidden)).float().sum()
    with pytest.raises(RuntimeError, match="segment modules 0..1: its forward would overwrite its output.*"
                                           "segment modules 2..3 reads in place.*backward first"):
        model.blocks[0](x)
    loss.backward()
    model.blocks[1](model.blocks[0](x))  # (now it may)


def _graphing_refusals(info) -> None:
    """What graph_segments refuses while graphing (needs CUDA: the model must be on a GPU first)."""
    model = _build(info, oversized_block=False)
    with pytest.raises(ValueError, match="hidden state as the first positional argument, a tensor that requires grad"):
        fsdp_graph.graph_segments(list(model.blocks), [(_hidden(info, requires_grad=False),)] * CFG.n_layers,
                                  segment_size=2)
    other = _build(info, oversized_block=False)
    with pytest.raises(ValueError, match="belong to different FSDP roots.*in a call of its own"):
        fsdp_graph.graph_segments([model.blocks[0], other.blocks[1]], [(_hidden(info),)] * 2, segment_size=2)
    model = _build(info, oversized_block=False)
    block = model.blocks[1]
    block.forward = lambda h, _forward=block.forward: (_forward(h),)  # a tuple, not the next block's input
    with pytest.raises(TypeError, match="block 1 of segment modules 0..1 returned a tuple.*graph_modules"):
        fsdp_graph.graph_segments(list(model.blocks), [(_hidden(info),)] * CFG.n_layers, segment_size=2)
    model = _build(info, oversized_block=False)
    block = model.blocks[1]
    block.forward = lambda h, _forward=block.forward: _forward(h.detach())  # block 0 gets no gradient
    with pytest.raises(RuntimeError, match="did not finish its backward .*previous block's output"):
        fsdp_graph.graph_segments(list(model.blocks), [(_hidden(info),)] * CFG.n_layers, segment_size=2)


def test_segment_refusals_at_replay_and_while_graphing_name_the_fix():
    run_ranks(_replay_refusals, 1)
    run_ranks(_graphing_refusals, 1)
