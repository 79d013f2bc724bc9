"""A Hugging Face checkpoint directory's safetensors, read one tensor at a time.

An 8B model does not fit a 24 GB machine in fp32, so nothing here reads the whole model: a
stage builds the model's skeleton on the meta device (no memory), fills one part (a decoder
block) from the checkpoint when its turn comes, and releases it before the next.

Files are opened with safetensors' `safe_open`, the hardened reader, which checks each header
against its file. It maps the file into memory and hands out views of the mapping, whose pages
stay resident while the mapping lives; `tensor` therefore copies each tensor into memory of
its own a bounded run of rows at a time, opening the file for each run, so a tensor costs its
own size and not twice that.

The directory holds `model.safetensors`, or shards named by `model.safetensors.index.json`;
an index that names a file outside the directory, a file that is not there, or tensors its
shards do not hold exactly, is refused in one line. The same reader serves slimlm artifacts,
which use the same layout (slimlm/artifact.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from slimlm.errors import SlimlmError
from slimlm.model_config import empty_model, first_line, read_model_config
from slimlm.resources import read_json_object
from slimlm.shards import DTYPES, INDEX, SINGLE

READ_CHUNK_BYTES = 64 * 2**20  # rows copied per opening of the file: the transient beyond a tensor's own size


class Checkpoint:
    """The tensors of a checkpoint directory, by name, without reading any of them up front.

    `ties` maps a tensor the model shares but the checkpoint does not store (a tied LM head) to
    the stored tensor it reads: `model.all_tied_weights_keys` of the model's skeleton (see
    `open_checkpoint`)."""

    def __init__(self, directory: Path, ties: Optional[dict[str, str]] = None):
        from safetensors import SafetensorError, safe_open

        self.directory = Path(directory)
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, torch.dtype] = {}
        for file, expected in _weights_files(self.directory).items():
            try:
                with safe_open(file, framework="pt") as handle:
                    names = set(handle.keys())
                    for name in names:
                        part = handle.get_slice(name)
                        self._shape[name], self._dtype[name] = (
                            tuple(part.get_shape()),
                            _dtype(part.get_dtype(), file, name),
                        )
            except (OSError, SafetensorError) as error:
                raise SlimlmError(
                    f"'{file}' is not a readable safetensors file ({str(error).splitlines()[0]}); replace it"
                ) from None
            _check_shard(file, names, expected, self._file)
            self._file.update(dict.fromkeys(names, file))
        self.ties = {
            target: source
            for target, source in (ties or {}).items()
            if target not in self._file and source in self._file
        }

    def names(self) -> list[str]:
        """The stored tensors' names (tied ones, which are not stored, excluded)."""
        return list(self._file)

    def weight_files(self) -> list[Path]:
        return sorted(set(self._file.values()))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[self._stored(name)]

    def dtype(self, name: str) -> torch.dtype:
        return self._dtype[self._stored(name)]

    def has(self, name: str) -> bool:
        return name in self._file or name in self.ties

    def weight_bytes(self) -> int:
        """Bytes of all stored tensors (each once)."""
        return sum(math.prod(shape) * self._dtype[name].itemsize for name, shape in self._shape.items())

    def tensor(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The tensor `name` in memory of its own (no view of a mapped file), in `dtype` if given."""
        from safetensors import safe_open

        stored = self._stored(name)
        shape, file = self._shape[stored], self._file[stored]
        out = torch.empty(shape, dtype=self._dtype[stored])
        rows = shape[0] if shape else 1
        step = max(1, READ_CHUNK_BYTES // max(1, out.nbytes // max(rows, 1)))
        for start in range(0, rows, step):
            with safe_open(
                file, framework="pt"
            ) as handle:  # a mapping for each run of rows: its pages go with it
                part = handle.get_slice(stored)
                if shape:
                    out[start : start + step] = part[start : start + step]
                else:
                    out.copy_(handle.get_tensor(stored))
        return out if dtype is None or dtype == out.dtype else out.to(dtype)

    def materialize(
        self, module: nn.Module, prefix: str, device: torch.device, dtype: Optional[torch.dtype] = None
    ) -> None:
        """Fill `module`, built on the meta device, from the tensors named `prefix` + each of its
        parameters' and persistent buffers' local names, on `device`; floating tensors in `dtype`
        (None: the dtype the skeleton gave them). Non-persistent buffers (rotary frequencies,
        Gemma's embedding scale), which no checkpoint stores, are the skeleton's own, moved to
        `device` (see model_skeleton_from_config)."""
        expected = module.state_dict(keep_vars=True)
        missing = [prefix + key for key in expected if not self.has(prefix + key)]
        if missing:
            raise SlimlmError(
                f"checkpoint '{self.directory}' lacks {len(missing)} tensors of "
                f"{prefix or 'the model'} (e.g. {missing[0]}); it does not match its config.json"
            )
        shared = {key: source for key in expected if (source := self._tie_within(prefix, key)) in expected}
        tensors = {}
        for key, meta in expected.items():
            if key in shared:
                continue
            if self.shape(prefix + key) != tuple(meta.shape):
                raise SlimlmError(
                    f"checkpoint '{self.directory}': {prefix + key} has the shape "
                    f"{list(self.shape(prefix + key))}, its config.json gives {list(meta.shape)}"
                )
            tensors[key] = self.tensor(
                prefix + key, dtype if dtype is not None and meta.is_floating_point() else meta.dtype
            ).to(device)
        module.load_state_dict(
            tensors, strict=False, assign=True
        )  # assign: the tensors just read become the module's own
        for target, source in shared.items():  # a tie inside `module` stays one tensor
            owner, _, leaf = target.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, module.get_parameter(source))
        _place_unstored_buffers(module, device)

    def release(self, module: nn.Module) -> None:
        """`module` back on the meta device: its tensors' memory is freed (unless held elsewhere).
        Its non-persistent buffers stay: no checkpoint holds them, and they are small."""
        kept = [
            (sub, key, getattr(sub, key))
            for sub in module.modules()
            for key in sub._non_persistent_buffers_set
            if getattr(sub, key, None) is not None
        ]
        module.to("meta")
        for sub, key, buffer in kept:
            setattr(sub, key, buffer)

    def _tie_within(self, prefix: str, key: str) -> Optional[str]:
        """The local name of the tensor that `prefix + key` is tied to, if it is under `prefix`."""
        source = self.ties.get(prefix + key)
        return source[len(prefix) :] if source is not None and source.startswith(prefix) else None

    def _stored(self, name: str) -> str:
        stored = self.ties.get(name, name)
        if stored not in self._file:
            raise SlimlmError(f"checkpoint '{self.directory}' has no tensor {name}")
        return stored


def _weights_files(directory: Path) -> dict[Path, Optional[set[str]]]:
    """The weights files and, for shards, the tensors the index puts in each."""
    single, index = directory / SINGLE, directory / INDEX
    if single.is_file() and index.is_file():
        raise SlimlmError(f"'{directory}' holds both {SINGLE} and {INDEX}; remove the one that is stale")
    if single.is_file():
        return {single: None}
    if not index.is_file():
        raise SlimlmError(
            f"'{directory}' holds no {SINGLE} or {INDEX}; give a "
            "Hugging Face checkpoint directory with safetensors weights"
        )
    weight_map = read_json_object(index, "replace the checkpoint's index").get("weight_map")
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise SlimlmError(
            f"'{index}' has no weight_map of tensor names to files; replace the checkpoint's index"
        )
    files: dict[Path, set[str]] = {}
    for name, file in weight_map.items():
        if Path(file).name != file or file in (".", "..") or not file.endswith(".safetensors"):
            raise SlimlmError(
                f"'{index}' names '{file}', which is not a safetensors "
                "file of its directory; replace the checkpoint's index"
            )
        if not (directory / file).is_file():
            raise SlimlmError(
                f"'{index}' names '{file}', which '{directory}' does not hold; the checkpoint is incomplete"
            )
        files.setdefault(directory / file, set()).add(name)
    return files


def _check_shard(file: Path, names: set[str], expected: Optional[set[str]], seen: dict[str, Path]) -> None:
    """Every tensor in exactly one shard, the one the index says."""
    twice = sorted(names & seen.keys())
    if twice:
        raise SlimlmError(
            f"tensor {twice[0]} is in both '{seen[twice[0]].name}' "
            f"and '{file.name}'; the checkpoint is damaged"
        )
    if expected is not None and names != expected:
        extra, lacking = sorted(names - expected), sorted(expected - names)
        detail = (
            f"holds {extra[0]}, which the index puts elsewhere"
            if extra
            else f"lacks {lacking[0]}, which the index puts there"
        )
        raise SlimlmError(f"'{file}' {detail}; the checkpoint is damaged")


def _dtype(name: str, file: Path, tensor: str) -> torch.dtype:
    if name not in DTYPES:
        raise SlimlmError(f"'{file}': tensor {tensor} has dtype {name}, which slimlm does not read")
    return DTYPES[name]


def _place_unstored_buffers(module: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers on `device`; one left on the meta device (a skeleton built there
    whole) computed again by a fresh instance of its module (transformers' rotary embeddings
    take only the config)."""
    for name, sub in module.named_modules():
        unstored = [key for key in sub._non_persistent_buffers_set if getattr(sub, key, None) is not None]
        if any(getattr(sub, key).is_meta for key in unstored):
            try:
                fresh = type(sub)(sub.config)
            except (AttributeError, TypeError) as error:
                raise SlimlmError(
                    f"the buffer {name}.{unstored[0]} is not stored in checkpoints "
                    f"and {type(sub).__name__} cannot compute it again ({error})"
                ) from None
            for key in unstored:
                setattr(sub, key, getattr(fresh, key))
        for key in unstored:
            setattr(sub, key, getattr(sub, key).to(device))


def model_skeleton_from_config(directory: Path, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The checkpoint's model on the meta device (slimlm/model_config.py: its config.json
    checked first); dtype None: the config's own."""
    remedy = "fix or replace the checkpoint's config.json"
    return empty_model(read_model_config(directory, remedy), dtype, directory, remedy)


def open_checkpoint(directory: Path, dtype: Optional[torch.dtype] = None) -> tuple[Checkpoint, nn.Module]:
    """The checkpoint and its model's meta skeleton, experts split into per-expert Linear layers
    (slimlm/experts.py: as MoE checkpoints store them), with the model's tied tensors resolved
    and the names its family's checkpoints use for its modules (Mixtral's `block_sparse_moe` for
    `mlp`) read under the skeleton's names."""
    from slimlm.experts import split_experts

    skeleton = model_skeleton_from_config(directory, dtype)
    split_experts(skeleton)
    ties = dict(getattr(skeleton, "all_tied_weights_keys", None) or {})
    return Checkpoint(directory, ties={**stored_names(skeleton), **ties}), skeleton


def stored_names(skeleton: nn.Module) -> dict[str, str]:
    """Skeleton tensor name -> the name its family's checkpoints give it, where transformers
    renames on loading (its plain `WeightRenaming` rules for the model type, applied backwards)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    rules = [
        (re.escape(target), source)
        for rule in get_checkpoint_conversion_mapping(skeleton.config.model_type) or []
        if type(rule) is WeightRenaming
        for source, target in zip(rule._original_source_patterns, rule._original_target_patterns)
        if re.fullmatch(r"[\w.]+", source) and re.fullmatch(r"[\w.]+", target)  # literal renamings only
    ]
    names = {}
    for name in skeleton.state_dict(keep_vars=True):
        renamed = name
        for target, source in rules:
            renamed = re.sub(target, source, renamed)
        if renamed != name:
            names[name] = renamed
    return names


def checkpoint_tokenizer(directory: Path):
    """The checkpoint's tokenizer, which a stage working on its files needs (to calibrate, score
    or generate), refused in one line when there is none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as error:  # tokenizers raises a bare Exception for a malformed tokenizer.json
        raise SlimlmError(
            f"'{directory}' has no readable tokenizer ({first_line(error)}); add the model's tokenizer files"
        ) from None
