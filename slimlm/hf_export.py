"""Hugging Face export: a plain checkpoint that `AutoModelForCausalLM.from_pretrained` loads.

Every quantized layer is dequantized into an ordinary weight in the chosen dtype (a LoRA adapter
trained beside its codes merged in: W + B A), so the checkpoint runs anywhere transformers (or
vLLM, or any tool that reads HF checkpoints) runs, at the size of that dtype: the rounding slimlm
chose is kept, the memory savings are not.

The checkpoint is written one tensor at a time (slimlm/shards.py), each dequantized when its turn
comes, so the export never holds a second model: from a model in memory it adds one layer's
weight, and from an artifact on disk (`export_hf_from_artifact`) it holds one module at a time.
Tensors keep the model's own names (a mixture-of-experts block's split experts too: transformers'
loader merges them back into its fused layout).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from tqdm import tqdm

from slimlm.artifact import ArtifactParts, artifact_tokenizer, generation_config_of, save_model_files
from slimlm.errors import SlimlmError
from slimlm.models import DTYPES
from slimlm.qlinear import QuantEmbedding, QuantLinear
from slimlm.rundir import directory_bytes, staged_directory
from slimlm.shards import DEFAULT_SHARD_BYTES, TensorSpec, write_weights

HF_METADATA = {"format": "pt"}  # what transformers' loader asks of a safetensors header


def plain_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors outside its quantized layers, under transformers' names, in `dtype`."""
    quantized = {name for name, module in model.named_modules() if isinstance(module, QuantLinear)}
    return {
        key: tensor.detach().to(dtype if tensor.is_floating_point() else tensor.dtype)
        for key, tensor in model.state_dict().items()
        if key.rpartition(".")[0] not in quantized
    }


def hf_layout(model: nn.Module, dtype: torch.dtype) -> tuple[list[TensorSpec], dict[str, tuple[str, str]]]:
    """The plain checkpoint's tensors in the model's order, and for each the module and field
    it is made from: a quantized layer gives one `weight` (and its bias); a head tied to the
    embedding is left to transformers to tie again. `model` may be a meta skeleton."""
    quantized = {name: module for name, module in model.named_modules() if isinstance(module, QuantLinear)}
    names = {module: name for name, module in model.named_modules()}
    head = names[model.get_output_embeddings()]
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    specs: list[TensorSpec] = []
    origins: dict[str, tuple[str, str]] = {}

    def add(key: str, origin: tuple[str, str], tensor_dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if key not in origins:
            specs.append(TensorSpec(key, tensor_dtype, shape))
            origins[key] = origin

    for key, tensor in model.state_dict().items():
        module, _, field = key.rpartition(".")
        if tied and module == head:
            continue
        if module in quantized:
            layer = quantized[module]
            field = "bias" if field == "bias" else "weight"
            shape = (layer.out_features,) if field == "bias" else (layer.out_features, layer.in_features)
            add(f"{module}.{field}", (module, field), dtype, shape)
        else:
            add(
                key,
                (module, field),
                dtype if tensor.is_floating_point() else tensor.dtype,
                tuple(tensor.shape),
            )
    embedding = model.get_input_embeddings()
    if isinstance(embedding, QuantEmbedding):  # tied to the quantized head: the head's codes are the table
        add(
            f"{names[embedding]}.weight",
            (head, "weight"),
            dtype,
            (embedding.num_embeddings, embedding.embedding_dim),
        )
    return specs, origins


def hf_tensor(module: nn.Module, field: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of the plain checkpoint: a quantized layer's weight dequantized (adapter merged)."""
    if isinstance(module, QuantLinear) and field == "weight":
        return module.merged_weight(dtype)
    tensor = getattr(module, field).detach()
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def write_hf(
    model: nn.Module,
    module_at: Callable[[str], nn.Module],
    tokenizer: Any,
    generation_config: Any,
    path: Path,
    dtype: str,
) -> dict:
    """Write the plain checkpoint of `model` at `path` (atomically), asking `module_at(name)` for
    each module whose tensors come next."""
    if dtype not in DTYPES:
        raise SlimlmError(f"unknown dtype '{dtype}' for the HF export; choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    specs, origins = hf_layout(model, torch_dtype)
    config = copy.deepcopy(model.config)
    config.dtype = torch_dtype

    def produce(spec: TensorSpec) -> torch.Tensor:
        module, field = origins[spec.name]
        return hf_tensor(module_at(module), field, spec.dtype)

    with (
        staged_directory(path) as staging,
        tqdm(total=sum(spec.nbytes for spec in specs), unit="B", unit_scale=True, desc="hf export") as bar,
    ):
        write_weights(staging, specs, produce, DEFAULT_SHARD_BYTES, HF_METADATA, bar.update)
        save_model_files(staging, config, generation_config, tokenizer)
    path = Path(path)
    return {"format": "hf", "dtype": dtype, "path": f"{path.name}/", "bytes_on_disk": directory_bytes(path)}


def export_hf(model: nn.Module, tokenizer: Any, path: Path, dtype: str) -> dict:
    """Write the dequantized in-memory `model` as an HF checkpoint directory at `path`."""
    return write_hf(
        model, model.get_submodule, tokenizer, getattr(model, "generation_config", None), path, dtype
    )


def export_hf_from_artifact(artifact: Path, path: Path, dtype: str) -> dict:
    """Write the slimlm artifact at `artifact` as a dequantized HF checkpoint directory at
    `path`, reading one module of it at a time (checksums verified first)."""
    parts = ArtifactParts(artifact)
    return write_hf(
        parts.skeleton,
        OneModuleAtATime(parts),
        artifact_tokenizer(parts.path),
        generation_config_of(parts.path),
        path,
        dtype,
    )


class OneModuleAtATime:
    """`module_at` for an artifact: fills the module asked for from disk and sends the one
    before it back to the meta device, so memory holds one module's tensors."""

    def __init__(self, parts: ArtifactParts):
        self.parts = parts
        self.current: Optional[tuple[str, nn.Module]] = None

    def __call__(self, name: str) -> nn.Module:
        if self.current is not None and self.current[0] == name:
            return self.current[1]
        if self.current is not None:
            self.current[1].to("meta")
        module = self.parts.skeleton.get_submodule(name)
        self.parts.fill(module, f"{name}.")
        self.current = (name, module)
        return module
