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
# families only unit tests load (not in the run matrix)
MORE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {**TINY, "head_dim": 8, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "olmoe": ("OlmoeConfig", {**TINY, "num_experts": 4, "num_experts_per_tok": 2}),
    # experts stored transposed, with biases and a clamped gate of their own
    "gpt_oss": ("GptOssConfig", {**TINY, "head_dim": 8, "num_local_experts": 4,
                                 "num_experts_per_tok": 2}),
    # experts outside transformers' experts interface: they run unsharded
    "llama4": ("Llama4TextConfig", {**TINY, "head_dim": 8, "num_local_experts": 4,
                                    "num_experts_per_tok": 1, "intermediate_size_mlp": 64}),
}


def write_config(folder: Path, family: str, weights: bool = False, seed: int = 1) -> Path:
    """`folder` with the family's tiny config.json (and random weights in safetensors)."""
    import torch
    import transformers

    cls, kwargs = {**FAMILIES, **MORE_FAMILIES}[family]
    config = getattr(transformers, cls)(**kwargs)
    if weights:
        torch.manual_seed(seed)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder

# Llama-3.1-8B's config.json as published with the model (no weights needed to plan)
LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def write_llama_31_8b(folder: Path) -> Path:
    """The real Llama-3.1-8B config.json in `folder`; returns the file."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(LLAMA_31_8B, indent=2))
    return path
