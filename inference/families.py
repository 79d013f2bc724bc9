"""What the decoder's blocks do differently per model family: one small description per family,
read once from the transformers config, instead of flags scattered over the forward pass.

A block is always: norm, attention, (norm), residual; norm, MLP, (norm), residual. The families
differ in which of the optional norms they have and how a norm scales (Gemma's `1 + w`), whether
queries and keys are normed before RoPE (per head in Qwen3 and Gemma 3, over the whole projection
in OLMoE), the MLP's activation, q/k/v bias, an embedding scale and the attention scale, per
layer in the attention window and the RoPE table (Gemma 3 interleaves sliding-window layers with
a local RoPE base and global layers), and in whether the MLP is a mixture of experts and how its
router weighs the chosen experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from slimlm.errors import SlimlmError

LLAMA_NORMS = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma's "sandwich": the attention's and the MLP's outputs are normed too, before the residual add.
GEMMA_NORMS = {
    "attention_norm": "input_layernorm",
    "after_attention": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "after_ffn": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class Family:
    """The fixed facts of one family's block; sizes and settings come from each model's config."""

    norms: dict[str, str] = field(
        default_factory=lambda: LLAMA_NORMS
    )  # decoder block's norm -> HF layer's module
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w)
    qk_norm: Optional[str] = (
        None  # before RoPE, an RMSNorm over each query and key "head", or over the whole "projection"
    )
    qkv_bias: bool = False
    scaled_embedding: bool = False  # embeddings times sqrt(hidden_size), in the table's dtype
    activation_key: str = "hidden_act"  # the config's name for the MLP's activation
    stored_fused: bool = (
        False  # checkpoints hold qkv_proj and gate_up_proj (phi3), not the separate projections
    )
    experts_key: str = "num_experts"  # the config's name for a mixture of experts' expert count
    routes_normalized: Optional[bool] = (
        None  # top-k routing weights rescaled to sum to 1; None: as the config's norm_topk_prob says
    )


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm="head"),
    "gemma3_text": Family(
        norms=GEMMA_NORMS,
        norm_offset=1.0,
        qk_norm="head",
        scaled_embedding=True,
        activation_key="hidden_activation",
    ),
    "phi3": Family(stored_fused=True),  # qkv_proj and gate_up_proj read as stored (inference/build.py)
    "qwen3_moe": Family(qk_norm="head"),
    "mixtral": Family(experts_key="num_local_experts", routes_normalized=True),
    "olmoe": Family(qk_norm="projection"),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class Rope:
    """One RoPE table: per-pair frequencies (the first `rotary_dim` channels of a head rotate),
    cos and sin scaled by `attention_scaling` (longrope, yarn). longrope has a second set of
    frequencies for contexts past the original training length."""

    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    long_inv_freq: Optional[tuple[float, ...]] = None
    original_context: int = 0  # longrope: the context up to which `inv_freq` holds

    def frequencies(self, context: int) -> torch.Tensor:
        """The frequencies a cache of `context` slots uses: longrope's long ones when it outgrows
        the original context (transformers switches as a sequence outgrows it)."""
        long = self.long_inv_freq is not None and context > self.original_context
        return torch.tensor(self.long_inv_freq if long else self.inv_freq, dtype=torch.float32)


@dataclass(frozen=True)
class Routing:
    """A mixture of experts' router: each token goes to the `top_k` of `experts` with the highest
    softmax probabilities, weighted by them (rescaled to sum to 1 when `normalized`)."""

    experts: int
    top_k: int
    normalized: bool
    expert_size: int  # each expert's intermediate width


@dataclass(frozen=True)
class LayerKind:
    """What differs between a model's kinds of attention layer: the window (None: global) and
    the RoPE table."""

    window: Optional[int]
    rope: Rope


def family_of(config: dict) -> Family:
    """The family's description; a family the decoder does not run is refused in one line."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise SlimlmError(
            f"the bundled decoder runs {', '.join(FAMILIES)} models; this one is '{model_type}': "
            "quantize it with slimlm, export it in a recipe stage {stage: export, format: hf} or "
            "{format: compressed-tensors}, and serve it with transformers or vLLM"
        )
    return FAMILIES[model_type]


def hf_config(config: Any) -> Any:
    """A transformers config object (a dict is read by its model type's config class, which
    fills in what this transformers version derives: layer types, standard RoPE parameters).
    The model type is one of FAMILIES (family_of said so)."""
    if not isinstance(config, dict):
        return config
    from transformers import AutoConfig

    settings = {
        key: value
        for key, value in config.items()
        if key not in ("model_type", "transformers_version", "architectures")
    }
    return AutoConfig.for_model(config["model_type"], **settings)


def layer_kinds(config: Any, head_dim: int) -> tuple[tuple[LayerKind, ...], tuple[int, ...]]:
    """The model's kinds of attention layer and each layer's kind (an index into them). Configs
    with `layer_types` (qwen2/3, gemma3) say per layer whether it slides; mistral and phi3 slide
    in every layer when `sliding_window` is set."""
    layers = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if not types:
        types = ["sliding_attention" if window is not None else "full_attention"] * layers
    names = sorted(set(types))
    kinds = tuple(
        LayerKind(window if name == "sliding_attention" else None, rope_of(config, name, head_dim))
        for name in names
    )
    return kinds, tuple(names.index(kind) for kind in types)


def rope_of(config: Any, layer_type: str, head_dim: int) -> Rope:
    """The RoPE table of `layer_type`'s layers, computed by transformers' own functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = config.rope_parameters
    per_type = layer_type in parameters  # Gemma 3: one RoPE per layer type
    own = parameters[layer_type] if per_type else parameters
    rope_type = own.get("rope_type", own.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise SlimlmError(
            f"the decoder does not implement RoPE type '{rope_type}' (it does {', '.join(ROPE_TYPES)})"
        )
    if rope_type == "default":
        dim = int(head_dim * own.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (own["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return Rope(tuple(inv_freq.float().tolist()))
    compute = ROPE_INIT_FUNCTIONS[rope_type]
    kind = {"layer_type": layer_type} if per_type else {}
    inv_freq, scaling = compute(config, None, **kind)
    if rope_type != "longrope":
        return Rope(tuple(inv_freq.tolist()), float(scaling))
    original = own["original_max_position_embeddings"]
    long_inv_freq, _ = compute(config, None, seq_len=original + 1, **kind)
    return Rope(tuple(inv_freq.tolist()), float(scaling), tuple(long_inv_freq.tolist()), original)


def routing_of(config: Any, family: Family) -> Optional[Routing]:
    """The router of the model's mixture-of-experts layers; None for a dense model."""
    experts = getattr(config, family.experts_key, None) or 0
    if not experts:
        return None
    normalized = (
        family.routes_normalized
        if family.routes_normalized is not None
        else bool(getattr(config, "norm_topk_prob", False))
    )
    size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return Routing(experts, config.num_experts_per_tok, normalized, size)


def expert_layers(config: Any, routing: Optional[Routing]) -> tuple[bool, ...]:
    """Whether each layer's MLP is a mixture of experts: Qwen3-MoE keeps a dense MLP in its
    `mlp_only_layers` and between every `decoder_sparse_step`-th layer; the others use experts throughout."""
    if routing is None:
        return (False,) * config.num_hidden_layers
    dense, step = (
        set(getattr(config, "mlp_only_layers", None) or ()),
        getattr(config, "decoder_sparse_step", None) or 1,
    )
    return tuple(index not in dense and (index + 1) % step == 0 for index in range(config.num_hidden_layers))


def attention_scale(config: Any, head_dim: int) -> float:
    """Scores are q.k times this: Gemma's `query_pre_attn_scalar` ** -0.5, else head_dim ** -0.5."""
    return (getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5


def embedding_scale(config: Any, family: Family) -> Optional[float]:
    return math.sqrt(config.hidden_size) if family.scaled_embedding else None


def activation_of(config: Any, family: Family) -> str:
    activation = getattr(config, family.activation_key, None) or "silu"
    if activation not in ACTIVATIONS:
        raise SlimlmError(
            f"the decoder's MLP activations are {', '.join(ACTIVATIONS)}; this model uses '{activation}'"
        )
    return activation
