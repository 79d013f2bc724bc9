"""Hugging Face export: a plain checkpoint that `AutoModelForCausalLM.from_pretrained` loads.

Every quantized layer is dequantized into an ordinary weight in the chosen dtype (a LoRA adapter
trained beside its codes merged in: W + B A), so the
checkpoint runs anywhere transformers (or vLLM, or any tool that reads HF checkpoints) runs,
at the size of that dtype: the rounding slimlm chose is kept, the memory savings are not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimlm.errors import SlimlmError
from slimlm.models import DTYPES
from slimlm.qlinear import QuantEmbedding, QuantLinear
from slimlm.rundir import directory_bytes, staged_directory


def plain_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors outside its quantized layers, under transformers' names, in `dtype`."""
    quantized = {name for name, module in model.named_modules() if isinstance(module, QuantLinear)}
    return {
        key: tensor.detach().to(dtype if tensor.is_floating_point() else tensor.dtype)
        for key, tensor in model.state_dict().items()
        if key.rpartition(".")[0] not in quantized
    }


def dequantized_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers' names, quantized layers as dequantized weights
    (adapters merged)."""
    tensors = plain_tensors(model, dtype)
    for name, layer in model.named_modules():
        if isinstance(layer, QuantLinear):
            tensors[f"{name}.weight"] = layer.merged_weight(dtype)
            if layer.bias is not None:
                tensors[f"{name}.bias"] = layer.bias.detach().to(dtype)
    embedding = model.get_input_embeddings()
    if isinstance(embedding, QuantEmbedding):  # tied to the quantized head: one table, the head's
        names = {module: name for name, module in model.named_modules()}
        tensors[f"{names[embedding]}.weight"] = tensors[f"{names[embedding.head]}.weight"]
    return tensors


def export_hf(model: nn.Module, tokenizer: Any, path: Path, dtype: str) -> dict:
    """Write the dequantized model as an HF checkpoint directory at `path` (atomically)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    if dtype not in DTYPES:
        raise SlimlmError(f"unknown dtype '{dtype}' for the HF export; choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    with no_init_weights():
        plain = AutoModelForCausalLM.from_config(model.config, dtype=torch_dtype)
    result = plain.load_state_dict(dequantized_state_dict(model, torch_dtype), strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise SlimlmError(f"HF export: the model's tensors do not match its config (missing {sorted(set(result.missing_keys) - tied)[:3]}, unexpected {result.unexpected_keys[:3]})")
    if tied:
        plain.tie_weights()
    with staged_directory(path) as staging:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    path = Path(path)
    return {"format": "hf", "dtype": dtype, "path": f"{path.name}/", "bytes_on_disk": directory_bytes(path)}
