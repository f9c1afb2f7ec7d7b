"""HF transformers causal LMs built from a config (nothing is downloaded), for the examples,
the benchmark and the tests: ``build_hf(arch, size, seed)``.

Sizes: ``tiny`` (tests, CPU), ``small`` (hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 8192:
the model of issue #12), ``medium`` (hidden 1024, 16 layers, 16 / 8 heads, vocab 32000). Dropout
is off, so eager and graphed runs, and ranks, compute the same thing; attention is SDPA.
"""

from __future__ import annotations

import torch

ARCHS = ("llama", "qwen2", "mistral", "gpt2")
SIZES = {
    #        hidden, layers, heads, kv heads, ffn,  vocab
    "tiny": (64, 2, 4, 2, 160, 256),
    "small": (512, 8, 8, 4, 1408, 8192),
    "medium": (1024, 16, 16, 8, 2816, 32000),
}


def hf_config(arch: str, size: str, max_positions: int = 2048):
    """The transformers config of ``arch`` at ``size`` (HF's defaults otherwise: use_cache on)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"size {size!r}: choose one of {', '.join(SIZES)}")
    hidden, layers, heads, kv_heads, ffn, vocab = SIZES[size]
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn, vocab_size=vocab, n_positions=max_positions,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig}[arch]
    return config_class(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=max_positions,
        bos_token_id=0, eos_token_id=0,
    )


def build_hf(arch: str, size: str = "tiny", seed: int = 0, device: torch.device | str = "cpu",
             max_positions: int = 2048) -> torch.nn.Module:
    """A freshly initialised ``<Arch>ForCausalLM`` (GPT2LMHeadModel) with SDPA attention, in train mode."""
    import transformers

    config = hf_config(arch, size, max_positions)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.train()


def hf_batch(vocab: int, batch: int, seq: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Token ids for ``step``, the same on every rank (each rank then takes its own rows). Learnable:
    each row counts up by a stride from a random start, so the loss visibly falls within steps."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return ((start + stride * torch.arange(seq)) % vocab).to(device)
