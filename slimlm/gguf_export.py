"""GGUF export: the model as one file that llama.cpp, Ollama and LM Studio load.

Weights are written in one GGUF block type (Q8_0, Q4_0, Q4_1, or F16/F32), 1-D tensors (norms,
biases) in F32. A slimlm layer whose codes already lie on that type's grid is written as it is,
so what GPTQ or AWQ chose reaches llama.cpp unchanged:

    Q8_0  blocks of 32, fp16 scale d, int8 q:          w = d * q         <- int8 (or fewer bits) g32 symmetric
    Q4_0  blocks of 32, fp16 scale d, 4-bit q:         w = d * (q - 8)   <- int4/int3/int2 g32 symmetric
    Q4_1  blocks of 32, fp16 scale d and minimum m:    w = d * q + m     <- int4/int3/int2 g32 asymmetric
                                                       (m = -d * zero, rounded to fp16)

A quantized layer on another grid (another group size, more bits) would lose what its method
chose if rounded again, so it is refused unless `requantize` allows it; so is a layer with a
LoRA adapter beside its codes (W + B A lies on no grid). Float tensors are
rounded to the type by the gguf package's quantizer, as llama.cpp's converter does. The
returned summary says which tensors were written exactly, rounded from float, re-quantized, or
(for F16/F32 files) dequantized.

Tensor names are llama.cpp's for the model's family (gguf's name map: `token_embd`,
`blk.N.attn_q`, ...; a block's experts stacked into `blk.N.ffn_gate_exps` and the like); what
differs between families (architecture, rotary layout, norm convention, hyper-parameters, RoPE
scaling) is one table entry each in slimlm/gguf_families.py. The tokenizer
comes from the source GGUF when there was one (every `tokenizer.*` key copied), otherwise from the
Hugging Face tokenizer, written as llama.cpp's converter writes it (slimlm/gguf_tokenizer.py).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from slimlm.errors import SlimlmError
from slimlm.experts import ExpertList, split_experts
from slimlm.gguf_families import FAMILIES, Family, family_of, write_hyperparameters
from slimlm.gguf_tokenizer import write_tokenizer
from slimlm.qlinear import QuantEmbedding, QuantLinear, QuantScheme, QuantTable
from slimlm.rundir import as_created

GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
BLOCK = 32
# The grid of each block type: (bits, symmetric). A slimlm layer with groups of 32, as many bits
# or fewer and the same symmetry lies on it (int3 codes are int4 codes that use half the range).
GRIDS = {"Q8_0": (8, True), "Q4_0": (4, True), "Q4_1": (4, False)}
# transformers' model types, and "gemma3": what a Gemma 3 GGUF source says (transformers loads
# it as gemma3_text).
ARCHITECTURES = (*FAMILIES, "gemma3")


def export_gguf(
    model: nn.Module,
    tokenizer: Any,
    path: Path,
    gguf_type: str,
    source_gguf: Optional[Path] = None,
    requantize: bool = False,
    head_type: Optional[str] = None,
) -> dict:
    """Write `model` to the GGUF file `path` (atomically); returns how each weight was stored.
    `head_type` gives the LM head its own block type, as llama.cpp's mixes do (they keep it
    wider than the rest: it is the most sensitive matrix): the output matrix, which is the
    token embedding when the two are tied; an untied embedding keeps `gguf_type`."""
    family = family_of(model.config)
    split_experts(model)  # transformers' fused experts as one Linear per projection, stacked again below
    types = _choose_types(model, family, gguf_type, head_type)
    _check_quantized_layers(model, types, requantize)
    path = Path(path)
    if path.exists():
        raise SlimlmError(
            f"'{path}' already exists; exports are never overwritten: choose another name or remove it"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}-partial-", dir=path.parent)
    os.close(fd)
    as_created(partial)
    try:
        stored = _write_file(partial, model, tokenizer, family, types, gguf_type, source_gguf)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    summary = {
        "format": "gguf",
        "gguf_type": gguf_type,
        "head_type": head_type or gguf_type,
        "path": path.name,
        "bytes_on_disk": path.stat().st_size,
    }
    for how in ("exact", "rounded", "requantized", "dequantized"):
        summary[how] = sorted(name for name, stored_as in stored.items() if stored_as == how)
    return summary


def _choose_types(model: nn.Module, family: Family, gguf_type: str, head_type: Optional[str]) -> _TypeChoice:
    """The block type of each tensor, the two types given checked first."""
    for chosen in (gguf_type, head_type or gguf_type):
        if chosen not in GGUF_TYPES:
            raise SlimlmError(f"unknown GGUF type '{chosen}'; choose one of {', '.join(GGUF_TYPES)}")
    # decided once: comparing the tables reads both whole
    return _TypeChoice(gguf_type, head_type, head_is_tied(model) and not family.output_required)


def _check_quantized_layers(model: nn.Module, types: _TypeChoice, requantize: bool) -> None:
    """Refuse, unless `requantize` allows rounding them again, quantized layers that a block
    type of theirs cannot hold as they are: with LoRA adapters, or off its grid."""
    layers = [
        (name, value) for name, value in _each_tensor(model, types.tied) if isinstance(value, QuantLinear)
    ]
    adapted = [name for name, value in layers if value.adapter_rank and types.of(name) in GRIDS]
    if adapted and not requantize:
        raise SlimlmError(
            f"GGUF {types.of(adapted[0])} has no place for the LoRA adapters beside {len(adapted)} "
            f"quantized layer(s) (e.g. {adapted[0]}): allow merging them into the weights "
            "and rounding again with requantize=true, or export format=slimlm (keeps them)"
        )
    off_grid = [
        (name, value.scheme, types.of(name))
        for name, value in layers
        if not on_grid(value.scheme, types.of(name))
    ]
    if off_grid and not requantize and any(kind in GRIDS for *_, kind in off_grid):
        name, scheme, kind = off_grid[0]
        raise SlimlmError(
            f"GGUF {kind} cannot hold {len(off_grid)} quantized layer(s) as they "
            f"are (e.g. {name}: {_describe(scheme)}); quantize with group_size "
            "32 for this type, or allow rounding them again with requantize=true"
        )


def _write_file(
    partial: str,
    model: nn.Module,
    tokenizer: Any,
    family: Family,
    types: _TypeChoice,
    gguf_type: str,
    source_gguf: Optional[Path],
) -> dict[str, str]:
    """Write the GGUF file at `partial`: metadata, tokenizer, then the tensors; returns how each
    weight was stored."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(partial, family.arch)
    writer.add_name(getattr(config, "_name_or_path", "") or "slimlm export")
    extra = write_hyperparameters(writer, config, family)
    writer.add_file_type(
        int(gguf.LlamaFileType[{"F32": "ALL_F32", "F16": "MOSTLY_F16"}.get(gguf_type, f"MOSTLY_{gguf_type}")])
    )
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if source_gguf is not None:
        _copy_tokenizer(writer, source_gguf)
    else:
        write_tokenizer(writer, tokenizer, config.vocab_size)
    for name, values in extra.items():
        writer.add_tensor(name, values)
    stored = _write_tensors(writer, model, types, family)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@dataclass(frozen=True)
class _TypeChoice:
    """The block type of each tensor: the file's type, the head's for the tensor that is the LM head."""

    default: str
    head: Optional[str]
    tied: bool  # the LM head is the token embedding (head_is_tied): llama.cpp's LM head is then token_embd

    def of(self, hf_name: str) -> str:
        head_tensor = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        return self.head if self.head and hf_name == head_tensor else self.default


def on_grid(scheme: QuantScheme, gguf_type: str) -> bool:
    """Whether a slimlm scheme's values are exactly representable in the block type."""
    if gguf_type not in GRIDS:
        return False
    bits, symmetric = GRIDS[gguf_type]
    return scheme.group_size == BLOCK and scheme.bits <= bits and scheme.symmetric == symmetric


def _describe(scheme: QuantScheme) -> str:
    group = f"groups of {scheme.group_size}" if scheme.group_size else "one scale per row"
    return f"int{scheme.bits}, {group}, {'symmetric' if scheme.symmetric else 'asymmetric'}"


def _copy_tokenizer(writer, source: Path) -> None:
    """Every tokenizer.* key of the source GGUF, as it was."""
    import gguf

    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)


def _write_tensors(writer, model: nn.Module, types: _TypeChoice, family: Family) -> dict[str, str]:
    import gguf

    config = model.config
    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == family.arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    stored: dict[str, str] = {}
    for hf_name, value in _named_tensors(model, types.tied):
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise SlimlmError(f"GGUF export: no llama.cpp {family.arch} name for tensor '{hf_name}'")
        if isinstance(value, ExpertStack):
            encoded = [_encode(layer, types.default, None) for layer in value.layers]
            data, raw_type = np.stack([part[0] for part in encoded]), encoded[0][1]
            stored.update({name: how for name, (*_, how) in zip(value.names, encoded) if how != "float"})
        else:
            if family.norm_offset and hf_name.endswith("norm.weight"):
                value = value.detach() + family.norm_offset
            heads = _rotary_heads(hf_name, config) if family.permute_rotary else None
            data, raw_type, how = _encode(value, types.of(hf_name), heads)
            if how != "float":
                stored[hf_name] = how
        writer.add_tensor(gguf_name, data, raw_dtype=raw_type)
    return stored


@dataclass(frozen=True)
class ExpertStack:
    """One projection of every expert of a block (`names`: each expert's own tensor name):
    llama.cpp keeps them as one 3-D tensor, expert by expert."""

    names: tuple[str, ...]
    layers: tuple  # QuantLinear or float weight, one per expert


def _stacked_experts(name: str, experts: ExpertList):
    """(name, ExpertStack) per projection, under the names gguf's tensor map knows for every family."""
    own = experts[0].names
    for canonical, projection in (("gate_proj", own.gate), ("up_proj", own.up), ("down_proj", own.down)):
        layers = [getattr(expert, projection) for expert in experts]
        values = tuple(layer if isinstance(layer, QuantLinear) else layer.weight for layer in layers)
        yield (
            f"{name}.{canonical}.weight",
            ExpertStack(tuple(f"{name}.{e}.{projection}.weight" for e in range(len(experts))), values),
        )


def _named_tensors(model: nn.Module, tied: bool):
    """(Hugging Face name, float tensor or QuantLinear) for every tensor llama.cpp needs. A tied
    LM head is written once, as token_embd: llama.cpp reuses it when output.weight is absent. So is
    a float head equal to the embedding (transformers unties them when it reads a GGUF without an
    output tensor: a second copy would add a fifth to a 0.5B model's file); `tied`: head_is_tied."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    yield (
        "model.embed_tokens.weight",
        head
        if isinstance(embedding, QuantEmbedding)
        else embedding
        if isinstance(embedding, QuantTable)
        else embedding.weight,
    )
    stacked: list[str] = []  # ExpertLists written whole: their modules are not visited again
    for name, module in model.named_modules():
        if module is head or module is embedding or any(name.startswith(f"{prefix}.") for prefix in stacked):
            continue
        if isinstance(module, ExpertList):
            stacked.append(name)
            yield from _stacked_experts(name, module)
        elif isinstance(module, (nn.Linear, QuantLinear)):
            yield f"{name}.weight", module if isinstance(module, QuantLinear) else module.weight
            if module.bias is not None:
                yield f"{name}.bias", module.bias
        else:
            for key, parameter in module.named_parameters(recurse=False):
                yield f"{name}.{key}", parameter
    if not tied:
        yield "lm_head.weight", head if isinstance(head, QuantLinear) else head.weight


def _each_tensor(model: nn.Module, tied: bool):
    """_named_tensors with each expert's projections on their own, under their own names."""
    for name, value in _named_tensors(model, tied):
        if isinstance(value, ExpertStack):
            yield from zip(value.names, value.layers)
        else:
            yield name, value


def head_is_tied(model: nn.Module) -> bool:
    """Whether the LM head is the token embedding (shared, or a float copy of the same values)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    head_weight, table = getattr(head, "weight", None), getattr(embedding, "weight", None)
    same_values = (
        isinstance(head_weight, torch.Tensor)
        and isinstance(table, torch.Tensor)
        and head_weight.shape == table.shape
        and torch.equal(head_weight, table)
    )
    return (
        isinstance(embedding, QuantEmbedding)
        or (head_weight is not None and head_weight is table)
        or same_values
    )


def _rotary_heads(tensor_name: str, config) -> Optional[int]:
    """Heads whose rows llama.cpp orders differently (q_proj: attention heads, k_proj: KV heads)."""
    if ".self_attn.q_proj." in tensor_name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in tensor_name:
        return config.num_key_value_heads
    return None


def _permute_rows(rows: torch.Tensor, heads: Optional[int]) -> torch.Tensor:
    """Hugging Face's rotary layout (halves) to llama.cpp's (interleaved pairs), per head."""
    if heads is None:
        return rows
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .transpose(1, 2)
        .reshape(rows.shape)
    )


def _encode(value, gguf_type: str, heads: Optional[int]) -> tuple[np.ndarray, Any, str]:
    """The bytes (or floats) of one tensor, its GGML type and whether it was written exactly."""
    import gguf

    if isinstance(value, QuantLinear) and not value.adapter_rank and on_grid(value.scheme, gguf_type):
        bits, symmetric = GRIDS[gguf_type]
        codes = value.codes() + (
            2 ** (bits - 1) - value.scheme.symmetric_zero if symmetric else 0
        )  # same values, wider range
        codes = _permute_rows(codes, heads)
        scales = _permute_rows(value.scales, heads)
        zeros = None if value.zeros is None else _permute_rows(value.zeros, heads)
        return _blocks(codes, scales, zeros, gguf_type), gguf.GGMLQuantizationType[gguf_type], "exact"
    weight = value.merged_weight() if isinstance(value, QuantLinear) else value
    weight = _permute_rows(weight.detach().float().cpu(), heads)
    array = weight.numpy()
    if array.ndim == 1 or gguf_type in ("F32", "F16"):
        how = "dequantized" if isinstance(value, QuantLinear) else "float"
        if array.ndim == 1 or gguf_type == "F32":
            return array.astype(np.float32), gguf.GGMLQuantizationType.F32, how
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16, how
    qtype = gguf.GGMLQuantizationType[gguf_type]
    if array.shape[-1] % BLOCK:
        raise SlimlmError(
            f"GGUF {gguf_type} needs rows that are a multiple of {BLOCK} values; "
            f"a tensor of shape {tuple(array.shape)} is not; export as F16"
        )
    return (
        gguf.quants.quantize(array, qtype),
        qtype,
        "requantized" if isinstance(value, QuantLinear) else "rounded",
    )


def _blocks(
    codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], gguf_type: str
) -> np.ndarray:
    """GGML blocks of 32 from slimlm codes [rows, in], fp16 scales and zeros [rows, in / 32]."""
    rows, columns = codes.shape
    blocks = columns // BLOCK
    q = codes.cpu().numpy().reshape(rows, blocks, BLOCK)
    d = scales.cpu().numpy().astype(np.float16).reshape(rows, blocks, 1).view(np.uint8)
    if gguf_type == "Q8_0":
        payload = (q.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        return np.concatenate([d, payload], axis=-1).reshape(rows, -1)
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)  # element j low, j + 16 high
    if gguf_type == "Q4_0":
        return np.concatenate([d, nibbles], axis=-1).reshape(rows, -1)
    minimum = (
        (-scales.float() * zeros.float())
        .cpu()
        .numpy()
        .astype(np.float16)
        .reshape(rows, blocks, 1)
        .view(np.uint8)
    )
    return np.concatenate([d, minimum, nibbles], axis=-1).reshape(rows, -1)
