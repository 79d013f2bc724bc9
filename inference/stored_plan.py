"""Plans for models the bundled decoder does not run: the weights as stored and the KV cache.

A GGUF file, or a checkpoint of a family the decoder does not run (Gemma 3, Phi-3, a mixture of
experts), is served by llama.cpp or vLLM, which hold its tensors as stored and a key/value
cache. The tensors' bytes come from safetensors headers (every shape and dtype, no weights read;
shards through their index) or from the GGUF file's size (its tensors plus a small header); the
cache's shape from config.json or the GGUF header. An engine's compute buffers are not counted
beyond the runtime reserve, so this plan is a floor, not the decoder planner's exact count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from slimlm.errors import SlimlmError
from slimlm.inference.planner import LABEL_WIDTH, GiB, Hardware, budget_line

KV_ELEMENT_BYTES = {"float": 2.0, "int8": 34 / 32}  # fp16; llama.cpp's q8_0 (32 codes and an fp16 scale)


@dataclass(frozen=True)
class CacheShape:
    """What one token adds to the key/value cache, and how far back each layer keeps it."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    window_layers: int = 0  # of `layers`, those with a sliding window: they keep `window` positions
    window: Optional[int] = None

    def bytes(self, context: int, batch: int, element_bytes: float) -> int:
        kept = (self.layers - self.window_layers) * context + self.window_layers * min(
            context, self.window or context
        )
        return math.ceil(batch * kept * self.kv_heads * (self.key_dim + self.value_dim) * element_bytes)


@dataclass(frozen=True)
class StoredModel:
    """A model as an engine other than the bundled decoder holds it."""

    family: str
    weight_bytes: int
    stored_as: str  # what the weights are: "bfloat16 safetensors", "GGUF MOSTLY_Q5_0"
    cache: CacheShape
    max_context: Optional[int]
    experts: bool  # a mixture of experts reads only its routed experts per token


def checkpoint_model(directory: Path, config: dict) -> StoredModel:
    """From a checkpoint directory's config.json and safetensors headers (or shard index)."""
    from slimlm.checkpoint import Checkpoint

    checkpoint = Checkpoint(directory)
    dtypes = sorted({str(checkpoint.dtype(name)).removeprefix("torch.") for name in checkpoint.names()})
    text = (
        config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    )  # multimodal: the language model's
    shape = config_cache_shape(text, directory)
    experts = any(
        isinstance(text.get(key), int) and text[key] > 1
        for key in ("num_experts", "num_local_experts", "n_routed_experts")
    )
    family = str(config.get("model_type") or text.get("model_type") or "unknown")
    return StoredModel(
        family,
        checkpoint.weight_bytes(),
        f"{'/'.join(dtypes)} safetensors",
        shape,
        text.get("max_position_embeddings"),
        experts,
    )


def config_cache_shape(c: dict[str, Any], directory: Path) -> CacheShape:
    """The key/value cache of a transformers config: GQA heads, head_dim, sliding-window layers."""
    layers, heads, hidden = c.get("num_hidden_layers"), c.get("num_attention_heads"), c.get("hidden_size")
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads)):
        raise SlimlmError(
            f"'{directory / 'config.json'}' gives no attention shape (num_hidden_layers, "
            "num_attention_heads): a model without a key/value cache of that kind (a state-space model?) "
            "cannot be planned by slimlm plan"
        )
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    if not all(isinstance(v, int) and v > 0 for v in (kv_heads, head_dim)):
        raise SlimlmError(
            f"'{directory / 'config.json'}' gives no head size (head_dim or hidden_size) to size the "
            "key/value cache; fix the config"
        )
    kinds = c.get("layer_types") if isinstance(c.get("layer_types"), list) else []
    window = c.get("sliding_window") if isinstance(c.get("sliding_window"), int) else None
    sliding = sum(kind == "sliding_attention" for kind in kinds) if window else 0
    return CacheShape(layers, kv_heads, head_dim, head_dim, sliding, window)


def gguf_model(path: Path) -> StoredModel:
    """From a GGUF file's key/value header alone (tensor data and the vocabulary are not read)."""
    from gguf import LlamaFileType

    from slimlm.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise SlimlmError(
            f"GGUF file '{path.name}' has no general.architecture key; it was not written by a GGUF converter"
        )

    def number(key: str) -> Optional[int]:
        value = meta.get(f"{arch}.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    layers, heads, width = number("block_count"), number("attention.head_count"), number("embedding_length")
    if layers is None or heads is None or (width is None and number("attention.key_length") is None):
        per_layer = (
            " (it varies per layer)"
            if f"{arch}.attention.head_count" in header.arrays
            or f"{arch}.attention.head_count_kv" in header.arrays
            else ""
        )
        raise SlimlmError(
            f"GGUF file '{path.name}' ({arch}) gives no single attention shape{per_layer} "
            f"({arch}.block_count, .attention.head_count, .embedding_length); "
            "slimlm plan cannot size its key/value cache"
        )
    key_dim = number("attention.key_length") or width // heads
    shape = CacheShape(
        layers,
        number("attention.head_count_kv") or heads,
        key_dim,
        number("attention.value_length") or key_dim,
    )
    try:
        kind = LlamaFileType(meta.get("general.file_type")).name
    except ValueError:
        kind = "of unrecorded type"
    return StoredModel(
        arch,
        path.stat().st_size,
        f"GGUF file type {kind}, the file's size",
        shape,
        number("context_length"),
        (number("expert_count") or 0) > 1,
    )


def format_stored_plan(
    model: StoredModel, hardware: Hardware, context: int, batch: int, kv_cache: str, name: str, note: str
) -> str:
    """The plan's text (`note` says why it is planned as stored); SlimlmError with the same
    numbers when it does not fit the device."""
    if context < 1 or batch < 1:
        raise SlimlmError(f"context ({context}) and batch ({batch}) must be at least 1")
    if model.max_context is not None and context > model.max_context:
        raise SlimlmError(
            f"a context of {context} is longer than the model's {model.max_context}; "
            f"give --context {model.max_context} or less"
        )
    kv = model.cache.bytes(context, batch, KV_ELEMENT_BYTES[kv_cache])
    total = model.weight_bytes + kv + hardware.reserve_bytes
    per_token = (
        model.weight_bytes + model.cache.bytes(context, 1, KV_ELEMENT_BYTES[kv_cache]) / 2
    )  # the cache half full on average
    lines = [
        f"{name} ({model.family}) on {hardware.name}: "
        f"{'fits' if total <= hardware.memory_bytes else 'does not fit'}; context {context}, batch {batch}",
        f"  note: {note}",
        f"  note: weights as stored: {model.stored_as}",
        *(
            [
                f"  note: {model.cache.window_layers} of {model.cache.layers} layers keep only a "
                f"{model.cache.window}-token window in the cache"
            ]
            if model.cache.window_layers
            else []
        ),
        budget_line("weights as stored", model.weight_bytes),
        budget_line(f"KV cache ({'fp16' if kv_cache == 'float' else 'q8_0'})", kv),
        budget_line("runtime reserve", hardware.reserve_bytes),
        budget_line("total", total),
        budget_line(f"{hardware.name} memory", hardware.memory_bytes),
        f"  {'decode bound (batch 1)':<{LABEL_WIDTH}} {hardware.bandwidth_bytes_s / per_token:9.1f} "
        f"tokens/s at {hardware.bandwidth_bytes_s / 1e9:.0f} GB/s"
        + (" (a mixture of experts reads only its routed experts: faster)" if model.experts else ""),
    ]
    if total > hardware.memory_bytes:
        raise SlimlmError(
            f"{name} does not fit {hardware.name} ({hardware.memory_bytes / GiB:.1f} GiB) as stored at "
            f"{context} tokens: {total / GiB:.2f} GiB. Plan:\n" + "\n".join(lines)
        )
    return "\n".join(lines)
