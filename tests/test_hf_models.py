"""HF transformers models under fsdp_graph, on CPU (gloo): the architectures users train (Llama,
Qwen2, Mistral, GPT-2), built from configs with HF's defaults, sharded in one call and trained
against FSDP2 on the same model; the capture path (HF's static masking in eager runs as well);
and the refusals a new user meets first, each naming its fix. The GPU tests (graphs bitwise equal
to eager) are in test_hf_models_gpu.py."""

from __future__ import annotations

import pytest
import torch

import fsdp_graph
from fsdp_graph import hf

from dist_harness import run_ranks
from examples.hf_models import ARCHS, build_hf, hf_batch

transformers = pytest.importorskip("transformers")

STEPS = 3
ROWS, SEQ = 4, 16  # global batch: split over the ranks


def _decoder_class(model) -> str:
    return next(iter(model._no_split_modules))


def _train_fsdp2(model, info) -> list[torch.Tensor]:
    """An FSDP2 user's loop: fully_shard each decoder layer then the root, AdamW, torch's clipping."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (info.world_size,))
    for layer in reversed([m for m in model.modules() if type(m).__name__ == _decoder_class(model)]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = hf_batch(model.config.vocab_size, ROWS, SEQ, step).chunk(info.world_size)[info.rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _train_ours(model, info, capture_path: bool) -> list[torch.Tensor]:
    """The same with fsdp_graph: one call shards it, make_train_step runs the step (eager on CPU)."""
    hf.shard_model(model, capture_path=capture_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss_fn(ids):
        return model(input_ids=ids, labels=ids).loss

    step = fsdp_graph.make_train_step(loss_fn, model, opt, max_grad_norm=1.0)
    return [step(hf_batch(model.config.vocab_size, ROWS, SEQ, s).chunk(info.world_size)[info.rank]).detach()
            for s in range(STEPS)]


def _full_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in fsdp_graph.full_state_dict(model).items()}


def _against_fsdp2(info, arch: str) -> None:
    theirs_model = build_hf(arch)
    theirs = _train_fsdp2(theirs_model, info)
    theirs_weights = {n: p.full_tensor().detach() for n, p in theirs_model.named_parameters()}
    for capture_path in (False, True):
        model = build_hf(arch)
        ours = _train_ours(model, info, capture_path)
        weights = _full_weights(model)
        for s, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{arch} capture_path={capture_path} step {s}: {m}")
        for name, w in theirs_weights.items():
            # atol: AdamW turns a gradient that is rounding noise into a step of up to lr (GPT-2's key
            # bias: softmax ignores it, so its exact gradient is 0); 3 steps at lr 1e-2 drift ~1e-5.
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-4,
                                       msg=lambda m: f"{arch} capture_path={capture_path} {name}: {m}")


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_architectures_train_as_under_fsdp2(arch):
    """Built from HF's default config (use_cache on, GPT-2's tied head), sharded by shard_model:
    losses and final weights equal FSDP2's on the same model to fp32 rounding, with HF's eager
    masking and with its capture path."""
    run_ranks(_against_fsdp2, 2, arch, backend="gloo")


# -- shard_model ------------------------------------------------------------------------------
def test_shard_model_makes_each_no_split_module_a_unit_then_the_root():
    model = build_hf("llama")
    layers = list(model.model.layers)
    hf.shard_model(model)
    units = {m for m in model.modules() if isinstance(m, fsdp_graph.FSDPModule)}
    assert units == {model, *layers}
    assert getattr(model, "_fsdp_graph_takes_capture_path")


@pytest.mark.parametrize("layer_classes", ["class", "name"])
def test_shard_model_takes_a_class_list(layer_classes):
    model = build_hf("gpt2")
    block = type(model.transformer.h[0])
    hf.shard_model(model, [block] if layer_classes == "class" else ["GPT2MLP"], capture_path=False)
    units = {m for m in model.modules() if isinstance(m, fsdp_graph.FSDPModule)}
    expected = list(model.transformer.h) if layer_classes == "class" else [b.mlp for b in model.transformer.h]
    assert units == {model, *expected}
    assert not hasattr(model, "_fsdp_graph_takes_capture_path")


def test_shard_model_names_the_fix_when_no_layer_class_matches():
    with pytest.raises(ValueError, match=r"no module of LlamaForCausalLM is a \['Block'\].*LlamaDecoderLayer.*"
                                         r"Pass layer_classes="):
        hf.shard_model(build_hf("llama"), ["Block"])
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"Sequential declares no _no_split_modules; pass layer_classes="):
        hf.shard_model(plain)
    with pytest.raises(TypeError, match="not a transformers PreTrainedModel"):
        hf.take_capture_path(plain)


# -- the capture path -------------------------------------------------------------------------
def _layer_masks(model, **inputs) -> list:
    """The attention mask each decoder layer received in one forward."""
    seen = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda m, a, k: seen.append(k.get("attention_mask")), with_kwargs=True)
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    return seen, out


def test_the_capture_path_holds_only_during_the_models_forward():
    """Only inside the forward of a model passed to take_capture_path, also after a forward that
    ended in an exception or a KeyboardInterrupt (a hook raising before the forward, or inside it);
    a model not passed to it keeps HF's own path."""
    from transformers.utils import import_utils

    model, other = hf.take_capture_path(build_hf("llama")), build_hf("llama")
    inside = []
    for m in (model, other):
        m.model.layers[0].register_forward_pre_hook(lambda m, a: inside.append(import_utils.is_tracing()))
    ids = hf_batch(model.config.vocab_size, 2, SEQ, 0)
    model(input_ids=ids)
    other(input_ids=ids)
    assert inside == [True, False] and not import_utils.is_tracing()
    for error in (RuntimeError("boom"), KeyboardInterrupt()):
        for where in (model, model.model.layers[1]):
            handle = where.register_forward_pre_hook(lambda m, a, error=error: (_ for _ in ()).throw(error),
                                                     prepend=True)
            with pytest.raises(type(error)):
                model(input_ids=ids)
            handle.remove()
    inside.clear()
    other(input_ids=ids)
    model(input_ids=ids)
    assert inside == [False, True] and not import_utils.is_tracing()


@pytest.mark.parametrize("batch", ["plain", "padded", "packed"])
def test_the_capture_path_builds_the_mask_from_shapes_and_computes_the_same(batch):
    """HF's eager path reads the batch on the host and skips the mask when it can (SDPA's
    is_causal); the capture path always builds it, also for padding and packed sequences: the
    same logits to fp32 rounding, and no host read that a graph could not contain. (No KV cache:
    HF looks for packed sequences only without one.)"""
    eager, captured = build_hf("llama"), hf.take_capture_path(build_hf("llama"))
    for model in (eager, captured):
        model.config.use_cache = False
    ids = hf_batch(eager.config.vocab_size, 2, SEQ, 0)
    inputs = {"input_ids": ids}
    if batch == "padded":
        inputs["attention_mask"] = torch.ones_like(ids).index_fill_(1, torch.arange(SEQ - 4, SEQ), 0)
    if batch == "packed":  # two sequences in each row: positions restart at token 6
        inputs["position_ids"] = torch.cat([torch.arange(6), torch.arange(SEQ - 6)]).expand(2, -1)
    eager_masks, eager_out = _layer_masks(eager, **inputs)
    captured_masks, captured_out = _layer_masks(captured, **inputs)
    if batch == "plain":
        assert eager_masks == [None]  # SDPA's is_causal fast path, chosen after reading the batch
    mask = captured_masks[0]
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
    torch.testing.assert_close(captured_out.logits, eager_out.logits, rtol=1e-5, atol=1e-5)
    if batch == "packed":  # the second sequence sees nothing of the first: as if it ran alone
        assert not mask[..., 6:, :6].any() and mask[..., 6:, 6:].any()
        alone = captured(input_ids=ids[:, 6:]).logits
        torch.testing.assert_close(captured_out.logits[:, 6:], alone, rtol=1e-5, atol=1e-5)


# -- refusals that name the fix ---------------------------------------------------------------
def test_whole_step_graphs_of_an_hf_model_need_the_capture_path_first():
    model = build_hf("qwen2")
    model.config.use_cache = False
    fsdp_graph.fully_shard(list(model.model.layers))
    fsdp_graph.fully_shard(model)
    config = fsdp_graph.GraphConfig(strategy="full_iteration")
    with pytest.raises(ValueError, match=r"HF model FSDPQwen2ForCausalLM, whose masking code takes another path under "
                                         r"CUDA graph capture.*fsdp_graph.hf.take_capture_path\(model\)"):
        fsdp_graph.make_train_step(lambda ids: model(input_ids=ids).logits.sum(), model, None, config=config,
                                   example_batch=(torch.zeros(2, SEQ, dtype=torch.long),))
    layered = fsdp_graph.GraphConfig(strategy="layer", modules=type(model.model))
    with pytest.raises(ValueError, match=r"a graphed Qwen2Model would capture the forward of HF model Qwen2Model"):
        fsdp_graph.make_train_step(lambda ids: model(input_ids=ids).logits.sum(), model, None, config=layered,
                                   example_batch=(torch.zeros(2, SEQ, dtype=torch.long),))
    hf.take_capture_path(model)
    with pytest.raises(RuntimeError, match="needs CUDA"):  # past the HF check: only CUDA is missing here
        fsdp_graph.make_train_step(lambda ids: model(input_ids=ids).logits.sum(), model, None, config=config,
                                   example_batch=(torch.zeros(2, SEQ, dtype=torch.long),))


def test_hf_default_kv_cache_is_refused_before_capture_with_use_cache_false():
    """HF builds a new DynamicCache on every forward (use_cache defaults to True) and hands it to
    every layer: a per-layer graph would freeze it. Refused from two example forwards, before any
    capture, naming the type and the one-line fix; with the fix the samples are recorded."""
    from fsdp_graph.graphs.module_graphs import record_sample_args

    model = build_hf("mistral")
    layers = list(model.model.layers)
    ids = hf_batch(model.config.vocab_size, 2, SEQ, 0)
    with pytest.raises(ValueError, match=r"graphing module 0 \(MistralDecoderLayer\): argument "
                                         r"kwargs\['past_key_values'\] is a transformers.cache_utils.DynamicCache, "
                                         r"a new object on each call.*"
                                         r"model.config.use_cache = False"):
        record_sample_args(layers, lambda: model(input_ids=ids))
    model.config.use_cache = False
    samples = record_sample_args(layers, lambda: model(input_ids=ids))
    assert len(samples) == len(layers) and samples[0][1]["past_key_values"] is None


def test_a_host_sync_names_the_line_outside_torch_that_made_it():
    from fsdp_graph.graphs.host_sync import syncing_line

    def user_code(x):
        return torch.nn.functional.cross_entropy(x, torch.zeros(3, dtype=torch.long))  # raises inside torch

    try:
        user_code(torch.zeros(2, 4))
    except (RuntimeError, ValueError) as err:
        line = syncing_line(err)
    assert line is not None and "test_hf_models.py" in line and "in user_code: return torch.nn.functional" in line


def test_a_transformers_that_asks_about_capture_another_way_is_refused(monkeypatch):
    """take_capture_path relies on transformers asking through import_utils.is_cuda_stream_capturing;
    a version without it, or whose is_tracing() does not follow it, is refused, naming the version."""
    from transformers.utils import import_utils

    monkeypatch.delattr(import_utils, "is_cuda_stream_capturing")
    with pytest.raises(RuntimeError, match=r"has no utils.import_utils.is_cuda_stream_capturing.*transformers>=5.17"):
        hf.take_capture_path(build_hf("llama"))
    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: False, raising=False)
    monkeypatch.setattr(import_utils, "is_tracing", lambda tensor=None: False)
    with pytest.raises(RuntimeError, match=r"is_tracing\(\) does not consult is_cuda_stream_capturing"):
        hf.take_capture_path(build_hf("llama"))
    assert not getattr(import_utils.is_cuda_stream_capturing, "_fsdp_graph", False)  # put back as found


def test_shard_model_refuses_layer_classes_that_are_not_classes_or_names():
    with pytest.raises(TypeError, match="layer_classes is a list of module classes or class names"):
        hf.shard_model(build_hf("llama"), [3])
