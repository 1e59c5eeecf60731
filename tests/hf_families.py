"""Tiny seeded configs of the transformers families the integration supports (no downloads).

Shared by tests/test_hf_integration.py (CPU) and tests/gpu/test_hf_gpu.py.
"""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2")

_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 101,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def config(family: str, **overrides: Any) -> Any:
    """A tiny config of ``family`` (4 heads, 2 KV heads, 2 layers, vocab 101)."""
    import transformers as tf

    if family == "gpt2":
        kw: dict[str, Any] = {
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "vocab_size": 101,
            "n_positions": 256,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        }
        kw.update(overrides)
        return tf.GPT2Config(**kw)
    cls = {
        "llama": tf.LlamaConfig,
        "qwen2": tf.Qwen2Config,
        "qwen3": tf.Qwen3Config,
        "mistral": tf.MistralConfig,
        "phi3": tf.Phi3Config,
    }[family]
    kw = dict(_DIMS)
    if family == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    return cls(**kw)


def model(
    family: str,
    *,
    seed: int = 0,
    attn: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **overrides: Any,
) -> Any:
    """A seeded random-weight causal LM of ``family`` in eval mode."""
    import transformers as tf

    cfg = config(family, **overrides)
    cfg._attn_implementation = attn
    cls = tf.GPT2LMHeadModel if family == "gpt2" else tf.AutoModelForCausalLM
    torch.manual_seed(seed)
    m = cls(cfg) if family == "gpt2" else cls.from_config(cfg)
    return m.to(device=device, dtype=dtype).eval()


def prompts(batch: int, *, seed: int = 0, longest: int = 7, vocab: int = 101) -> tuple[Any, Any]:
    """Left-padded prompts of different lengths (token ids avoid 0..2: pad, bos, eos)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, longest), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        pad = (b * 2) % longest  # row 0 full, the others 1..longest-1 tokens shorter
        ids[b, :pad] = 0
        mask[b, :pad] = 0
    return ids, mask


OTHER_FAMILIES = (
    "Gemma,Gemma2,Gemma3Text,Olmo,Olmo2,Olmo3,StableLm,Granite,Cohere,Phi,GPTNeoX,Falcon,"
    "SmolLM3,Glm,Starcoder2,Exaone4,Ernie4_5,Helium,Arcee,Apertus,GPTJ,CodeGen,GPTBigCode,"
    "OPT,Nemotron,Cwm,Mixtral,Bloom"
)
"""More architectures, by their transformers class prefix (``bench/probes/probe_hf_families.py``
generates with each; the CPU tests check what does not need a generation)."""
_EAGER_ONLY = ("Gemma", "Bloom")  # no sdpa in transformers for these (Gemma2/3)


def other_model(name: str, device: str = "cpu") -> Any:
    """A seeded tiny ``<name>ForCausalLM`` (the tests' dims, 3 layers), sdpa where the family
    has it."""
    import transformers as tf

    cfg = getattr(tf, name + "Config")(**{**_DIMS, "num_hidden_layers": 3})
    cfg._attn_implementation = "eager" if name.startswith(_EAGER_ONLY) else "sdpa"
    if name == "Helium":
        cfg.head_dim = 16
    if name in ("GPTJ", "CodeGen"):
        cfg.rotary_dim = 8
    torch.manual_seed(0)
    try:
        m = tf.AutoModelForCausalLM.from_config(cfg)
    except ValueError as exc:  # no sdpa for this family in this transformers version
        if "scaled_dot_product_attention" not in str(exc):
            raise
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        m = tf.AutoModelForCausalLM.from_config(cfg)
    return m.to(device).eval()
