"""What the compression stages need to know about a model's architecture.

Most of it is found generically, on any causal LM transformers builds: the decoder blocks are
the model's ModuleList with one entry per hidden layer, and the layers to compress are its
nn.Linear modules. What cannot be found that way is written once per family in FAMILIES: which
operation feeds which Linear layers (AWQ folds its scales there), how the norms compute
(Gemma's RMSNorm multiplies by 1 + w), what the mixture-of-experts projections are called in
the family's checkpoints, whether the logits are a plain LM-head product, and which block
tensors structured pruning slices along which width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from slimlm.errors import SlimlmError


@dataclass(frozen=True)
class ScaleMapping:
    """An operation (`previous`, relative to a decoder block) whose output the `linears` read.

    `previous` absorbs 1/s: an RMSNorm through its weight (`norm_offset` 1 for Gemma's
    x * (1 + w)), a Linear through its output rows. A fused projection's output is `fused_parts`
    equal sections of which the linears read the last (Phi-3's qkv_proj ends with v, its
    gate_up_proj with up); where the sections are not equal (grouped-query attention) or the
    widths do not line up, the mapping is skipped. `{e}` in a name stands for each expert.
    """

    previous: str
    linears: tuple[str, ...]
    norm_offset: float = 0.0
    fused_parts: int = 1


@dataclass(frozen=True)
class ExpertNames:
    """The projections of one expert as the family's checkpoints name them."""

    gate: str
    up: str
    down: str


# The widths structured pruning (compress/prune.py) narrows: the hidden (residual stream)
# channels, the query heads' rows (head_dim each, whole GQA groups), the key/value heads' rows
# and the MLP's intermediate channels.
HIDDEN, QUERY_HEADS, KV_HEADS, MLP = "hidden", "query_heads", "kv_heads", "mlp"


@dataclass(frozen=True)
class PruneSlice:
    """A module of a decoder block whose tensors pruning slices (`module`.weight and .bias).

    The outputs (a Linear's weight rows and its bias, a norm's weight) follow the width `rows`,
    a Linear's inputs (its weight columns) the width `columns`; None: that axis keeps its size.
    """

    module: str
    rows: Optional[str] = None
    columns: Optional[str] = None


@dataclass(frozen=True)
class Family:
    """What one model family needs written down."""

    mappings: tuple[ScaleMapping, ...]
    experts: Optional[ExpertNames] = None
    plain_logits: bool = True  # logits = lm_head(final hidden state), nothing scaled or capped
    # every block tensor that depends on a width, for compress/prune.py; empty: not prunable
    pruning: tuple[PruneSlice, ...] = ()


ATTENTION = (
    ScaleMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ScaleMapping("self_attn.v_proj", ("self_attn.o_proj",)),
)
DENSE_MLP = (
    ScaleMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ScaleMapping("mlp.up_proj", ("mlp.down_proj",)),
)
LLAMA_PRUNING = (
    PruneSlice("input_layernorm", rows=HIDDEN),
    # heads: q/k/v rows (and biases), o_proj columns
    PruneSlice("self_attn.q_proj", rows=QUERY_HEADS, columns=HIDDEN),
    PruneSlice("self_attn.k_proj", rows=KV_HEADS, columns=HIDDEN),
    PruneSlice("self_attn.v_proj", rows=KV_HEADS, columns=HIDDEN),
    PruneSlice("self_attn.o_proj", rows=HIDDEN, columns=QUERY_HEADS),
    PruneSlice("post_attention_layernorm", rows=HIDDEN),
    # MLP width: gate/up rows, down_proj columns
    PruneSlice("mlp.gate_proj", rows=MLP, columns=HIDDEN),
    PruneSlice("mlp.up_proj", rows=MLP, columns=HIDDEN),
    PruneSlice("mlp.down_proj", rows=HIDDEN, columns=MLP),
)
LLAMA = Family(mappings=ATTENTION + DENSE_MLP, pruning=LLAMA_PRUNING)
QWEN3 = Family(mappings=ATTENTION + DENSE_MLP)  # no pruning table: its q/k norms are not in one yet
GEMMA3 = Family(
    mappings=(
        ScaleMapping(
            "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), norm_offset=1.0
        ),
        ScaleMapping("self_attn.v_proj", ("self_attn.o_proj",)),
        ScaleMapping("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), norm_offset=1.0),
        ScaleMapping("mlp.up_proj", ("mlp.down_proj",)),
    ),
    plain_logits=False,  # final_logit_softcapping where the config sets it
)
PHI3 = Family(
    mappings=(
        ScaleMapping("input_layernorm", ("self_attn.qkv_proj",)),
        ScaleMapping("self_attn.qkv_proj", ("self_attn.o_proj",), fused_parts=3),
        ScaleMapping("post_attention_layernorm", ("mlp.gate_up_proj",)),
        ScaleMapping("mlp.gate_up_proj", ("mlp.down_proj",), fused_parts=2),
    )
)
# Mixture of experts: the norm before the experts is not scaled, because the router reads it
# too and every expert sees other tokens; each expert's up -> down is. Blocks with a dense MLP
# (Qwen3-MoE's mlp_only_layers) take DENSE_MLP, which is skipped where its modules are absent.
QWEN_MOE_EXPERTS = ExpertNames(gate="gate_proj", up="up_proj", down="down_proj")
QWEN_MOE = Family(
    mappings=ATTENTION
    + DENSE_MLP
    + (ScaleMapping("mlp.experts.{e}.up_proj", ("mlp.experts.{e}.down_proj",)),),
    experts=QWEN_MOE_EXPERTS,
)
MIXTRAL = Family(
    mappings=ATTENTION + (ScaleMapping("mlp.experts.{e}.w3", ("mlp.experts.{e}.w2",)),),
    experts=ExpertNames(gate="w1", up="w3", down="w2"),
)

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": QWEN3,
    "gemma3_text": GEMMA3,
    "phi3": PHI3,
    "mixtral": MIXTRAL,
    "qwen3_moe": QWEN_MOE,
    "olmoe": QWEN_MOE,
}


# Other names of a family: Gemma 3's multimodal config, llama.cpp's GGUF architectures.
ALIASES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}


def family_of(model_type: Optional[str]) -> Optional[Family]:
    """The family's entry, or None: such a model still quantizes with RTN and GPTQ."""
    return FAMILIES.get(ALIASES.get(model_type or "", model_type or ""))


def require_family(model_type: Optional[str], what: str) -> Family:
    """The family's entry, or one line saying that `what` needs one."""
    family = family_of(model_type)
    if family is None:
        raise SlimlmError(
            f"{what} needs a table of which layers feed which for the model family; '{model_type}' has none "
            f"(families with one: {', '.join(sorted(FAMILIES))}); RTN and GPTQ work on any family"
        )
    return family


def check_compressible(where: str, model_type: Optional[str]) -> None:
    """Refuse, before any weights load, a model type no stage can work on: one transformers
    cannot build as a causal LM, or one without attention blocks (a state-space model)."""
    if model_type is None:
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SlimlmError(
            f"model '{where}' has architecture '{model_type}', which transformers does not build as a causal "
            "language model; slimlm compresses causal LMs (llama, qwen3, gemma3, phi3, mixtral, ...)"
        )
    config = AutoConfig.for_model(model_type)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_attention_heads", None) is None:
        raise SlimlmError(
            f"model '{where}' has architecture '{model_type}', a model without attention blocks "
            "(a state-space or recurrent model); slimlm compresses transformer decoders"
        )


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder's block list and its qualified name: the first ModuleList (in module order)
    with one block of a single class per hidden layer of the text model."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 0
            and (layers is None or len(module) == layers)
        ):
            if len({type(block) for block in module}) == 1 and not isinstance(module[0], nn.Linear):
                return name, module
    raise SlimlmError(
        f"{type(model).__name__} has no list of {layers} decoder blocks; "
        "slimlm's layer-by-layer stages need one"
    )


def block_index(name: str, prefix: str) -> int:
    """The index of the decoder block a module belongs to: ('model.layers.3.self_attn.q_proj',
    'model.layers') -> 3."""
    return int(name[len(prefix) + 1 :].split(".", 1)[0])


def model_type(model: Any) -> Optional[str]:
    """The text model's type (Gemma 3's multimodal wrapper calls its text part gemma3_text)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None)


def untied_table(model: nn.Module) -> Optional[str]:
    """The name of the model's input embedding when it is a float table of its own (not tied to
    the LM head): the table that quantizing the head quantizes too (compress/quantize.py)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding).forward is not nn.Embedding.forward and not hasattr(embedding, "scalar_embed_scale"):
        return None  # an embedding that does more than look rows up (and scale them, as Gemma's does)
    if (
        not isinstance(embedding, nn.Embedding)
        or getattr(head, "weight", None) is embedding.weight
        or getattr(model.config, "tie_word_embeddings", False)
    ):
        return None
    return next(name for name, module in model.named_modules() if module is embedding)
