"""Tiny Hugging Face configurations of the decoder families users bring, written as folders
the way `save_pretrained` writes them (tests build models from these, never from a hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SEQ = 16
BATCH = 8
TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(TINY)),  # grouped-query attention: 4 query, 2 kv heads
    "qwen3": ("Qwen3Config", {**TINY, "head_dim": 8, "tie_word_embeddings": True}),
    "gpt2": ("GPT2Config", {"vocab_size": 128, "n_embd": 32, "n_layer": 4, "n_head": 4,
                            "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                            "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
    "mixtral": ("MixtralConfig", {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2}),
}


def write_config(folder: Path, family: str, weights: bool = False, seed: int = 1) -> Path:
    """`folder` with the family's tiny config.json (and random weights in safetensors)."""
    import torch
    import transformers

    cls, kwargs = FAMILIES[family]
    config = getattr(transformers, cls)(**kwargs)
    if weights:
        torch.manual_seed(seed)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder
