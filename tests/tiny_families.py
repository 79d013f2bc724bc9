"""Tiny random-weight models of the families slimlm compresses, from transformers' own config
classes: each family's real block structure (fused projections, Gemma's norms, experts) at a
size that runs in milliseconds."""

from __future__ import annotations

import torch

from slimlm.experts import split_experts

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=3,
    pad_token_id=0,
)
MOE = dict(num_experts_per_tok=2, initializer_range=0.1)


def _settings(model_type: str) -> tuple[type, type, dict]:
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    return {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(intermediate_size=128)),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(intermediate_size=128, head_dim=16)),
        # sliding_window 8 and a global layer every 2: both attention kinds in two layers
        "gemma3_text": (
            Gemma3TextConfig,
            Gemma3ForCausalLM,
            dict(
                intermediate_size=128,
                head_dim=16,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                final_logit_softcapping=30.0,
            ),
        ),
        # no grouped-query attention: qkv_proj's v rows feed o_proj, and AWQ folds a scale there
        "phi3": (Phi3Config, Phi3ForCausalLM, dict(intermediate_size=128, num_key_value_heads=4)),
        "mixtral": (
            MixtralConfig,
            MixtralForCausalLM,
            dict(intermediate_size=32, num_local_experts=8, **MOE),
        ),
        "qwen3_moe": (
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8, head_dim=16, **MOE),
        ),
        "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(intermediate_size=32, num_experts=8, **MOE)),
    }[model_type]


FAMILY_TYPES = ("llama", "qwen3", "gemma3_text", "phi3", "mixtral", "qwen3_moe", "olmoe")
MOE_TYPES = ("mixtral", "qwen3_moe", "olmoe")
DENSE_FIRST_LAYER = dict(
    mlp_only_layers=[0]
)  # qwen3_moe: a dense MLP in the first layer, experts in the second


def build_tiny(model_type: str, vocab_size: int, seed: int = 0, split: bool = True, **overrides):
    """A tiny model of `model_type`, experts split into per-expert Linear layers as slimlm loads
    them (split=False keeps transformers' fused layout)."""
    config_class, model_class, extra = _settings(model_type)
    torch.manual_seed(seed)
    model = model_class(config_class(vocab_size=vocab_size, **{**COMMON, **extra, **overrides})).eval()
    if split:
        split_experts(model)
    return model
