"""Writing safetensors weights one tensor at a time, in shards of bounded size (the HF layout).

A model larger than memory cannot be gathered into a dict for `safetensors.torch.save_file`:
its tensors are produced one by one (read from a checkpoint, quantized) and must leave the
process as they come. A safetensors file starts with a header that gives every tensor's dtype,
shape and byte range, so the layout is planned first from `TensorSpec`s (which need no data),
the header written, and each tensor appended as `produce(spec)` returns it. Memory then holds
one tensor, not one shard. The files are read back with safetensors' own reader, which checks
the header against the file.

    model.safetensors                     everything, when it fits in one shard
    model-00001-of-00003.safetensors ...  otherwise, plus
    model.safetensors.index.json          {"metadata": {"total_size": N}, "weight_map": {tensor: file}}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from slimlm.errors import SlimlmError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 2**30  # about 2 GiB a shard, as transformers' save_pretrained writes

# safetensors' dtype names (the format's spec); what is not here, slimlm neither writes nor reads.
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as the file will hold it, known before its values are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, tensor.dtype, tuple(tensor.shape))


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(specs: Iterable[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """`specs` in order, cut into runs of at most `max_shard_bytes` (a larger tensor alone)."""
    if max_shard_bytes < 1:
        raise SlimlmError(f"max_shard_bytes must be at least 1, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_weights(
    directory: Path,
    specs: list[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Optional[dict[str, str]] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> list[str]:
    """Write the tensors `specs` names into `directory`, one shard at a time and one tensor at a
    time; returns the weights files' names (the index, when there is one, last). `progress`
    is told the bytes of each tensor written."""
    shards = plan_shards(specs, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [shard_name(i, len(shards)) for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _write_shard(directory / name, shard, produce, metadata or {}, progress)
    if len(shards) == 1:
        return names
    weight_map = {spec.name: name for name, shard in zip(names, shards) for spec in shard}
    index = {"metadata": {"total_size": sum(spec.nbytes for spec in specs)}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX]


def _write_shard(
    path: Path,
    specs: list[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    metadata: dict[str, str],
    progress: Optional[Callable[[int], None]],
) -> None:
    header: dict[str, dict] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for spec in specs:
            tensor = produce(spec)
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(
                    f"{spec.name}: produced {tensor.dtype} "
                    f"{tuple(tensor.shape)}, planned {spec.dtype} {spec.shape}"
                )
            handle.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            if progress is not None:
                progress(spec.nbytes)
