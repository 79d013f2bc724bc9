"""Config values transformers' GGUF reader does not take from a GGUF file, read back so that a
converted checkpoint is the model the file holds: the head width of qwen3 and gemma3 (it assumes
hidden / heads), Gemma 3's attention scale and logit soft-capping, Phi-3's LongRoPE and partial
rotary, and Llama 3's RoPE scaling, which llama.cpp stores as one divisor per frequency
(`rope_freqs`) and which is fitted back to its four parameters here (the inverse of
gguf_families.llama3_divisors). What cannot be read back is refused rather than run wrongly.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from slimlm.errors import SlimlmError
from slimlm.gguf_families import llama3_divisors


def config_corrections(path: Path) -> dict[str, Any]:
    """Config attributes to set on transformers' config of the GGUF file at `path`."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {
        name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")
    }
    tensors = {
        tensor.name: np.asarray(tensor.data, dtype=np.float64)
        for tensor in reader.tensors
        if tensor.name.startswith("rope_")
    }
    arch = fields.get("general.architecture")
    corrections = (
        {"head_dim": fields[f"{arch}.attention.key_length"]}
        if f"{arch}.attention.key_length" in fields
        else {}
    )
    return {**corrections, **FAMILY_CORRECTIONS.get(arch, _nothing)(arch, fields, tensors)}


def _nothing(arch: str, fields: dict, tensors: dict) -> dict:
    return {}


def _gemma3(arch: str, fields: dict, tensors: dict) -> dict:
    """llama.cpp scales Gemma 3's scores by 1/sqrt(head width), the 27B's (62 layers) by
    1/sqrt(hidden / heads): it keeps no query_pre_attn_scalar."""
    wide = fields[f"{arch}.block_count"] == 62
    scalar = (
        fields[f"{arch}.embedding_length"] // fields[f"{arch}.attention.head_count"]
        if wide
        else fields[f"{arch}.attention.key_length"]
    )
    corrections = {"query_pre_attn_scalar": scalar}
    if f"{arch}.final_logit_softcapping" in fields:
        corrections["final_logit_softcapping"] = fields[f"{arch}.final_logit_softcapping"]
    return corrections


def _head_width(arch: str, fields: dict) -> int:
    return (
        fields.get(f"{arch}.attention.key_length")
        or fields[f"{arch}.embedding_length"] // fields[f"{arch}.attention.head_count"]
    )


def _rotary_width(arch: str, fields: dict) -> int:
    return fields.get(f"{arch}.rope.dimension_count") or _head_width(arch, fields)


def _rope_base(arch: str, fields: dict) -> dict:
    rotary, width = _rotary_width(arch, fields), _head_width(arch, fields)
    parameters = {"rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0))}
    if rotary != width:
        parameters["partial_rotary_factor"] = rotary / width
    return parameters


def _phi3(arch: str, fields: dict, tensors: dict) -> dict:
    base = _rope_base(arch, fields)
    if "rope_factors_long.weight" not in tensors:
        return {"rope_parameters": {"rope_type": "default", **base}}
    original = int(fields[f"{arch}.rope.scaling.original_context_length"])
    rope = {
        "rope_type": "longrope",
        **base,
        "long_factor": tensors["rope_factors_long.weight"].tolist(),
        "short_factor": tensors["rope_factors_short.weight"].tolist(),
        "original_max_position_embeddings": original,
    }
    if f"{arch}.rope.scaling.attn_factor" in fields:
        rope["attention_factor"] = float(fields[f"{arch}.rope.scaling.attn_factor"])
    return {"rope_parameters": rope, "original_max_position_embeddings": original}


def _qwen3moe(arch: str, fields: dict, tensors: dict) -> dict:
    """The experts' width (transformers takes its default of 768 otherwise) and the rescaled
    top-k weights llama.cpp's qwen3moe always computes."""
    return {"moe_intermediate_size": fields[f"{arch}.expert_feed_forward_length"], "norm_topk_prob": True}


def _llama(arch: str, fields: dict, tensors: dict) -> dict:
    if f"{arch}.expert_count" in fields:
        raise SlimlmError(
            "this GGUF file is a llama-architecture mixture of experts (Mixtral), which transformers' GGUF "
            "reader reads as a dense Llama without its experts; convert the original checkpoint instead"
        )
    if "rope_freqs.weight" not in tensors:
        return {}
    base = _rope_base(arch, fields)
    rotary = _rotary_width(arch, fields)
    inverse = 1.0 / base["rope_theta"] ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary)
    return {
        "rope_parameters": {
            "rope_type": "llama3",
            **base,
            **llama3_parameters(inverse, tensors["rope_freqs.weight"]),
        }
    }


def llama3_parameters(inverse: np.ndarray, divisors: np.ndarray) -> dict:
    """Llama 3's factor, low/high frequency factors and original context from its per-frequency
    divisors: 1 for short wavelengths, `factor` for long ones, and between them 1 / divisor
    linear in 1 / wavelength. Only the ratios of the last three are fixed by the divisors; the
    low frequency factor is taken as 1, as in every Llama 3 release."""
    factor = float(divisors.max())
    wavelength = 2 * math.pi / inverse
    if factor <= 1.0 + 1e-6:
        raise SlimlmError("the GGUF file's rope_freqs divide no frequency; it is not Llama 3's RoPE scaling")
    smooth = (1.0 / divisors - 1.0 / factor) / (1.0 - 1.0 / factor)  # 0 at `factor`, 1 at no scaling
    between = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if between.sum() < 2:
        raise SlimlmError(
            "the GGUF file's rope_freqs blend fewer than two frequencies, too few to "
            "read Llama 3's RoPE scaling back; convert the original checkpoint instead"
        )
    # smooth = context / (high - low) / wavelength - low / (high - low), with low = 1
    slope, intercept = np.polyfit(1.0 / wavelength[between], smooth[between], 1)
    high = 1.0 - 1.0 / intercept
    context = slope * (high - 1.0)
    parameters = {
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(round(context)),
    }
    if not np.allclose(llama3_divisors(inverse, parameters), divisors, rtol=1e-4):
        raise SlimlmError(
            "the GGUF file's rope_freqs are not Llama 3's RoPE scaling (no factor, low/high "
            "frequency factors and context give them); convert the original checkpoint instead"
        )
    return parameters


def _unread(arch: str, fields: dict, tensors: dict) -> dict:
    raise SlimlmError(
        f"transformers' GGUF reader does not read {arch} files; convert the original checkpoint instead"
    )


FAMILY_CORRECTIONS: dict[str, Callable[[str, dict, dict], dict]] = {
    "gemma3": _gemma3,
    "phi3": _phi3,
    "llama": _llama,
    "qwen3moe": _qwen3moe,
    "olmoe": _unread,
}
