"""Compressed HF export: a compressed-tensors `pack-quantized` checkpoint.

transformers (with the `compressed-tensors` package) and vLLM load this format directly, and
it keeps slimlm's integers as they are: a code c of a symmetric scheme becomes the signed
integer c - 2**(b-1), packed into int32 words by compressed-tensors' own packer, with the same
fp16 group scales, so q * scale is exactly slimlm's weight. Asymmetric schemes are refused:
transformers (5.x, compressed-tensors 0.20) builds unpacked zero-point placeholders and cannot
load the packed zero points vLLM expects. vLLM runs 4- and 8-bit groups; transformers any width.

Layers are grouped by scheme (bits, group size, symmetry) into one config group each, named
module by module, so mixed-precision models export as they are. A quantized LM head tied to the
embedding is untied here: the head stays quantized and the embedding gets the head's
dequantized table, because the format quantizes Linear layers only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from slimlm.errors import SlimlmError
from slimlm.hf_export import plain_tensors
from slimlm.models import DTYPES
from slimlm.qlinear import QuantEmbedding, QuantLinear, QuantScheme, QuantTable
from slimlm.rundir import directory_bytes, staged_directory

CT_FORMAT = "pack-quantized"


def _ct_modules():
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    except ImportError as error:
        raise SlimlmError(
            "the compressed-tensors export needs the `compressed-tensors` "
            "package: pip install 'slimlm[hf]' (or compressed-tensors)"
        ) from error
    return pack_to_int32, QuantizationArgs, QuantizationConfig, QuantizationScheme


def packed_tensors(name: str, layer: QuantLinear) -> dict[str, torch.Tensor]:
    """One layer's tensors in compressed-tensors' pack-quantized layout."""
    pack_to_int32 = _ct_modules()[0]
    scheme = layer.scheme
    signed = (layer.codes().to(torch.int16) - scheme.symmetric_zero).to(torch.int8)
    tensors = {
        f"{name}.weight_packed": pack_to_int32(signed, scheme.bits),
        f"{name}.weight_scale": layer.scales.detach().to(torch.float16).contiguous(),
        f"{name}.weight_shape": torch.tensor([layer.out_features, layer.in_features], dtype=torch.int64),
    }
    if layer.bias is not None:
        tensors[f"{name}.bias"] = layer.bias.detach().to(torch.float16)
    return tensors


def quantization_config(groups: dict[QuantScheme, list[str]], ignore: list[str]) -> dict:
    """The `quantization_config` entry of config.json: one config group per scheme."""
    _, QuantizationArgs, QuantizationConfig, QuantizationScheme = _ct_modules()
    config_groups = {}
    for index, (scheme, names) in enumerate(
        sorted(groups.items(), key=lambda item: (item[0].bits, item[0].group_size or 0, item[0].symmetric))
    ):
        weights = QuantizationArgs(
            num_bits=scheme.bits,
            type="int",
            symmetric=scheme.symmetric,
            strategy="channel" if scheme.group_size is None else "group",
            group_size=scheme.group_size,
            scale_dtype=torch.float16,
        )
        config_groups[f"group_{index}"] = QuantizationScheme(
            targets=sorted(names), weights=weights, format=CT_FORMAT
        )
    config = QuantizationConfig(
        config_groups=config_groups, format=CT_FORMAT, quantization_status="compressed", ignore=sorted(ignore)
    )
    return config.model_dump(exclude_none=True, mode="json")


def export_compressed(model: nn.Module, tokenizer: Any, path: Path, dtype: str) -> dict:
    """Write `model` as a compressed-tensors checkpoint directory at `path` (atomically)."""
    if dtype not in DTYPES:
        raise SlimlmError(
            f"unknown dtype '{dtype}' for the compressed export; choose one of {', '.join(DTYPES)}"
        )
    quantized = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear) and not isinstance(module, QuantTable)
    }
    if not quantized:
        raise SlimlmError(
            "the compressed-tensors export needs a quantized model: "
            "add a quantize stage before it (or use export.format=hf)"
        )
    adapted = sorted(name for name, layer in quantized.items() if layer.adapter_rank)
    if adapted:
        raise SlimlmError(
            "the compressed-tensors export has no place for the LoRA adapters beside "
            f"{len(adapted)} quantized layers (e.g. {adapted[0]}): export format=slimlm (keeps them; "
            "the bundled decoder runs them) or format=hf (merged into dequantized weights)"
        )
    asymmetric = sorted(name for name, layer in quantized.items() if not layer.scheme.symmetric)
    if asymmetric:
        raise SlimlmError(
            f"the compressed-tensors export holds symmetric schemes only ({len(asymmetric)} layers, "
            f"e.g. {asymmetric[0]}, are asymmetric): transformers cannot load packed zero "
            "points yet; quantize with symmetric: true, or export format=hf (dequantized)"
        )
    torch_dtype = DTYPES[dtype]
    tensors = plain_tensors(model, torch_dtype)
    groups: dict[QuantScheme, list[str]] = {}
    for name, layer in quantized.items():
        tensors.update(packed_tensors(name, layer))
        groups.setdefault(layer.scheme, []).append(name)
    config = model.config.to_dict()
    names = {module: name for name, module in model.named_modules()}
    embedding = model.get_input_embeddings()
    if isinstance(embedding, QuantEmbedding):
        tensors[f"{names[embedding]}.weight"] = embedding.head.dequantize(torch_dtype).contiguous()
        config["tie_word_embeddings"] = False
    elif isinstance(
        embedding, QuantTable
    ):  # compressed-tensors quantizes Linear layers only: the table goes dequantized
        tensors[f"{names[embedding]}.weight"] = embedding.dequantize(torch_dtype).contiguous()
    elif config.get("tie_word_embeddings"):  # transformers ties the plain head to the embedding again
        tensors.pop(f"{names[model.get_output_embeddings()]}.weight", None)
    ignore = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    config["quantization_config"] = quantization_config(groups, ignore)
    config["dtype"] = dtype
    with staged_directory(path) as staging:
        save_file(
            {key: value.contiguous() for key, value in tensors.items()},
            staging / "model.safetensors",
            metadata={"format": "pt"},
        )
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    path = Path(path)
    return {
        "format": "compressed-tensors",
        "dtype": dtype,
        "path": f"{path.name}/",
        "bytes_on_disk": directory_bytes(path),
        "quantized_layers": len(quantized),
    }
