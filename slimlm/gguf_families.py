"""What llama.cpp needs to know about each model family: one small table entry per family.

Every family gets the common hyper-parameters (sizes, heads, head width, RoPE base, norm epsilon);
its entry adds what only it has, as llama.cpp's converter (convert_hf_to_gguf.py) writes it and
llama.cpp's loader reads it:
  llama, mistral  llama.cpp's "llama": it rotates interleaved pairs, so q/k rows are permuted from
                  Hugging Face's halves. Llama 3's RoPE scaling is a `rope_freqs` tensor (one divisor
                  per frequency). Mistral's sliding window has no key in llama.cpp's llama (as in its
                  converter): beyond the window llama.cpp attends to everything.
  qwen2, qwen3    rotate halves as Hugging Face does; qwen3's per-head q/k norms map to attn_q/k_norm.
  gemma3 (text)   Gemma's RMSNorm multiplies by (1 + w), llama.cpp's by w: norms are written as 1 + w.
                  llama.cpp scales the embedding by sqrt(hidden) itself. The sliding window, which
                  layers slide (a per-layer pattern) and the sliding layers' RoPE base are keys (llama.cpp
                  releases before these keys assume every 6th layer global and base 10000, as Gemma 3's
                  checkpoints have); the attention scale has no key (1/sqrt(head width), or the 27B's rule),
                  so a config with another query_pre_attn_scalar is refused rather than run wrongly.
  phi3            fused qkv and gate_up (llama.cpp splits them itself), a sliding window on every layer,
                  LongRoPE as rope_factors_long/short tensors with the original context and attention factor.
  qwen3_moe, olmoe, mixtral (llama.cpp's "qwen3moe", "olmoe" and, with experts, "llama")
                  each block's experts stacked into one 3-D tensor per projection (ffn_*_exps), the
                  router as ffn_gate_inp, the expert count, the experts a token uses and their width.
                  llama.cpp rescales the chosen experts' weights to sum to 1 for qwen3moe and
                  llama (Mixtral) and not for olmoe, and has every block use experts: a config
                  that says otherwise is refused. llama.cpp's olmoe norms keys over the hidden size
                  (no grouped-query attention), does not clamp q/k/v as transformers does (a
                  config with clip_qkv is refused) and needs output.weight even where the head is tied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from slimlm.errors import SlimlmError

ExtraTensors = dict[str, np.ndarray]


def _no_keys(writer, config) -> None:
    """A family with nothing beyond the common keys."""


def _gemma3_keys(writer, config) -> None:
    layers = config.num_hidden_layers
    expected_scale = (
        config.hidden_size // config.num_attention_heads if layers == 62 else head_dim(config)
    )  # llama.cpp's 27B rule
    if config.query_pre_attn_scalar != expected_scale or getattr(config, "attn_logit_softcapping", None):
        raise SlimlmError(
            "GGUF export: llama.cpp scales Gemma 3's attention by "
            f"1/sqrt({expected_scale}) without soft-capping; this config differs"
        )
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    writer.add_rope_freq_base_swa(float(rope_parameters(config, "sliding_attention")["rope_theta"]))
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def _phi3_keys(writer, config) -> None:
    writer.add_sliding_window(config.sliding_window or 0)  # 0: no window (llama.cpp's Phi-4 convention)
    writer.add_rope_scaling_orig_ctx_len(original_context(config))


def _olmoe_keys(writer, config) -> None:
    if (config.num_key_value_heads or config.num_attention_heads) != config.num_attention_heads:
        raise SlimlmError(
            "GGUF export: llama.cpp's olmoe norms the keys over the hidden size, so it has no "
            "grouped-query attention; this config has fewer key/value heads than query heads"
        )
    if getattr(config, "clip_qkv", None):
        raise SlimlmError(
            "GGUF export: llama.cpp's olmoe does not clamp queries, keys and values where transformers "
            "does (measured: the logits part after a few tokens); this config sets clip_qkv"
        )
    _experts_keys(normalized=False)(writer, config)


def _experts_keys(normalized: bool) -> Callable[[Any, Any], None]:
    """The keys of a mixture of experts whose llama.cpp graph rescales the top-k weights (or not)."""

    def keys(writer, config) -> None:
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        if bool(getattr(config, "norm_topk_prob", normalized)) != normalized:
            raise SlimlmError(
                f"GGUF export: llama.cpp's {config.model_type} "
                f"{'rescales' if normalized else 'does not rescale'} the chosen experts' "
                "weights to sum to 1; this config's norm_topk_prob says otherwise"
            )
        if (
            getattr(config, "mlp_only_layers", None)
            or (getattr(config, "decoder_sparse_step", None) or 1) != 1
        ):
            raise SlimlmError(
                "GGUF export: llama.cpp runs experts in every block; this config "
                "keeps dense MLPs in some (mlp_only_layers, decoder_sparse_step)"
            )
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(
            getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        )

    return keys


@dataclass(frozen=True)
class Family:
    """One family as llama.cpp knows it."""

    arch: str  # llama.cpp's architecture name
    permute_rotary: bool = False  # llama.cpp's "llama" rotates interleaved pairs; the others halves, as HF
    norm_offset: float = 0.0  # added to every norm weight (Gemma's (1 + w))
    rope_kinds: tuple[str, ...] = ("default", "linear")  # the RoPE scalings llama.cpp runs for it
    keys: Callable[[Any, Any], None] = field(default=_no_keys)  # family-only hyper-parameters
    output_required: bool = (
        False  # llama.cpp loads no model without output.weight (olmoe): a tied head is written twice
    )


LLAMA = Family("llama", permute_rotary=True, rope_kinds=("default", "linear", "llama3"))
FAMILIES = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "gemma3_text": Family("gemma3", norm_offset=1.0, keys=_gemma3_keys),
    "phi3": Family("phi3", rope_kinds=("default", "longrope"), keys=_phi3_keys),
    "qwen3_moe": Family("qwen3moe", keys=_experts_keys(normalized=True)),
    "olmoe": Family("olmoe", keys=_olmoe_keys, output_required=True),
    "mixtral": Family("llama", permute_rotary=True, keys=_experts_keys(normalized=True)),
}


def family_of(config) -> Family:
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise SlimlmError(
            f"GGUF export supports {', '.join(FAMILIES)} models; this one is {config.model_type}"
        )
    return family


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config, layer_kind: str = "full_attention") -> dict:
    """The RoPE settings (transformers 5's rope_parameters; Gemma 3 keeps one set per layer kind)."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if layer_kind in parameters:
        parameters = dict(parameters[layer_kind])
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return parameters


def original_context(config) -> int:
    parameters = rope_parameters(config)
    return int(
        getattr(config, "original_max_position_embeddings", None)
        or parameters.get("original_max_position_embeddings")
        or config.max_position_embeddings
    )


def write_hyperparameters(writer, config, family: Family) -> ExtraTensors:
    """The `<arch>.*` keys; returns the tensors RoPE scaling needs (rope_freqs, rope_factors_long/short)."""
    width = head_dim(config)
    rotary = int(
        width
        * rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    )
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_key_length(width)
    writer.add_value_length(width)
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(float(rope_parameters(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    family.keys(writer, config)
    return _rope_scaling(writer, config, family, rotary)


def _rope_scaling(writer, config, family: Family, rotary: int) -> ExtraTensors:
    import gguf

    parameters = rope_parameters(config)
    kind = parameters.get("rope_type", "default")
    if kind not in family.rope_kinds:
        raise SlimlmError(
            f"GGUF export: llama.cpp's {family.arch} takes RoPE scaling "
            f"{', '.join(family.rope_kinds)}; this model uses '{kind}'"
        )
    inverse = 1.0 / parameters["rope_theta"] ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary)
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(parameters["factor"]))
    elif kind == "llama3":
        return {"rope_freqs.weight": llama3_divisors(inverse, parameters)}
    elif kind == "longrope":
        return _longrope(writer, config, parameters, len(inverse))
    return {}


def llama3_divisors(inverse: np.ndarray, parameters: dict) -> np.ndarray:
    """Llama 3's scaling as llama.cpp applies it: each frequency divided by a factor (1 for short
    wavelengths, `factor` for long ones, smoothly between), the same frequencies transformers computes."""
    factor, low, high = (
        parameters["factor"],
        parameters.get("low_freq_factor", 1.0),
        parameters.get("high_freq_factor", 4.0),
    )
    context = parameters.get("original_max_position_embeddings", 8192)
    wavelength = 2 * math.pi / inverse
    smooth = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    scaled = inverse * ((1 - smooth) / factor + smooth)
    return (inverse / scaled).astype(np.float32)


def _longrope(writer, config, parameters: dict, pairs: int) -> ExtraTensors:
    """Phi-3's LongRoPE: per-frequency divisors for short and long contexts and one attention factor."""
    long, short = parameters.get("long_factor"), parameters.get("short_factor")
    if long is None or short is None or len(long) != pairs or len(short) != pairs:
        raise SlimlmError(f"GGUF export: LongRoPE needs long_factor and short_factor of {pairs} values each")
    scale = config.max_position_embeddings / original_context(config)
    attention = parameters.get("attention_factor") or (
        math.sqrt(1 + math.log(scale) / math.log(original_context(config))) if scale > 1 else 1.0
    )
    writer.add_rope_scaling_attn_factors(float(attention))
    return {
        "rope_factors_long.weight": np.asarray(long, dtype=np.float32),
        "rope_factors_short.weight": np.asarray(short, dtype=np.float32),
    }
