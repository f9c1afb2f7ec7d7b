"""GPU, two devices on NCCL: HF causal LMs (Llama, Qwen2, Mistral, GPT-2, built from configs with
HF's defaults) train under every strategy, bf16 compute / fp32 reduce, bitwise equal to eager.

Each architecture trains 20 steps eagerly (``strategy='none'``), with per-layer graphs of its
decoder layers and as one whole-step graph (collectives, clipping and the capturable AdamW step
inside); every loss and the final weights must be equal bit for bit. Sharded by
``fsdp_graph.hf.shard_model``, which puts the model on HF's capture path in every run. Also the
refusals a new user meets: HF's default ``use_cache=True`` under per-layer graphs, and a host
sync in a warm-up, which names the library line that synced.
"""

from __future__ import annotations

import os

import pytest
import torch

import fsdp_graph
from fsdp_graph import hf

from dist_harness import run_ranks
from examples.hf_models import ARCHS, build_hf, hf_batch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)

STEPS, ROWS, SEQ = 20, 4, 64  # ROWS per rank
STRATEGIES = ("none", "layer", "full_iteration")


def _batch(vocab: int, step: int, info) -> torch.Tensor:
    return hf_batch(vocab, ROWS * info.world_size, SEQ, step).chunk(info.world_size)[info.rank].to(info.device)


def _train(info, arch: str, strategy: str):
    model = build_hf(arch, "tiny", device=info.device)
    model.config.use_cache = False  # per-layer graphs refuse HF's per-forward KV cache (tested below)
    policy = fsdp_graph.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    hf.shard_model(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device=info.device), capturable=True)
    config = fsdp_graph.GraphConfig(strategy=strategy, num_warmup_iters=2,
                                    modules=type(hf.decoder_layers(model)[0]) if strategy == "layer" else None)

    def loss_fn(ids):
        return model(input_ids=ids, labels=ids).loss

    vocab = model.config.vocab_size
    step = fsdp_graph.make_train_step(loss_fn, model, opt, config=config, max_grad_norm=1.0,
                                      example_batch=None if strategy == "none" else (_batch(vocab, 0, info),))
    losses = torch.stack([step(_batch(vocab, s, info)).detach().clone() for s in range(STEPS)])
    if strategy == "full_iteration":
        assert step.graph is not None, "the whole step was never captured"
    if strategy == "layer":
        assert all(m.forward.replays > 0 for m in hf.decoder_layers(model)), "a decoder layer never replayed"
    return losses, fsdp_graph.full_state_dict(model)


def _every_strategy_bitwise(info, arch: str) -> None:
    torch.use_deterministic_algorithms(True)
    eager_losses, eager_state = _train(info, arch, "none")
    assert eager_losses[-1] < eager_losses[0] - 0.1, f"{arch} should be learning: {eager_losses.tolist()}"
    for strategy in STRATEGIES[1:]:
        losses, state = _train(info, arch, strategy)
        differing = [i for i in range(STEPS) if not torch.equal(losses[i], eager_losses[i])]
        assert not differing, (f"{arch} {strategy}: losses differ from step {differing[0]}: "
                               f"{losses.tolist()} vs eager {eager_losses.tolist()}")
        for key, value in eager_state.items():
            assert torch.equal(state[key], value), f"{arch} {strategy}: {key} differs after {STEPS} steps"


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_models_train_bitwise_equal_to_eager_under_every_strategy(arch):
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # inherited by the ranks; needed by deterministic cuBLAS
    run_ranks(_every_strategy_bitwise, 2, arch)


def _default_cache_refused(info) -> None:
    model = build_hf("llama", "tiny", device=info.device)  # HF's default: use_cache=True
    hf.shard_model(model)
    layer_class = type(hf.decoder_layers(model)[0])

    def loss_fn(ids):
        return model(input_ids=ids, labels=ids).loss

    config = fsdp_graph.GraphConfig(strategy="layer", modules=layer_class)
    with pytest.raises(ValueError, match=r"argument kwargs\['past_key_values'\] is a transformers.cache_utils."
                                         r"DynamicCache, a new object on each call.*model.config.use_cache = False"):
        fsdp_graph.make_train_step(loss_fn, model, None, config=config,
                                   example_batch=(_batch(model.config.vocab_size, 0, info),))
    assert not any(hasattr(m.forward, "replays") for m in hf.decoder_layers(model)), "refused, yet graphed"


def test_hfs_default_kv_cache_is_refused_before_any_capture_with_the_one_line_fix():
    run_ranks(_default_cache_refused, 2)


def test_a_host_sync_in_the_warm_up_names_the_library_line():
    """HF's eager masking reads the batch on the host (are sequences packed?); graphing an HF model
    without the capture path finds that sync in the warm-up and names transformers' own line."""
    model = build_hf("llama", "tiny", device="cuda")
    model.config.use_cache = False
    ids = hf_batch(model.config.vocab_size, 2, SEQ, 0).cuda()
    with pytest.raises(fsdp_graph.HostSyncError,
                       match=r"synchronises with the host at \S*transformers/masking_utils.py:\d+ in "
                             r"find_packed_sequence_indices"):
        fsdp_graph.make_graphed_callables(model.model, (ids,), num_warmup_iters=2)
    hf.take_capture_path(model)  # the same model on the capture path captures, and replays like eager
    eager = model.model(ids).last_hidden_state
    (graphed,) = fsdp_graph.graph_modules([model.model], [(ids,)], num_warmup_iters=2)
    assert torch.equal(model.model(ids).last_hidden_state, eager) and graphed.replays == 1
