"""GPTQ or AWQ of a checkpoint larger than memory, straight into an artifact.

compress/offload.py calibrates the checkpoint one decoder block at a time. As each block is
done, its tensors (quantized layers, and norms AWQ has scaled) are spilled into a small
safetensors file inside the artifact's staging directory (an 8B model's w4 block is about
120 MB) and the block is released. After the last block, the artifact's shards are written a
tensor at a time, as compress/stream_rtn.py writes them: the blocks' tensors read back from the
spill files, every other tensor from the checkpoint. Memory holds one block at a time; disk holds the quantized layers twice
until the spill files are deleted, just before the manifest is written.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from slimlm.architecture import decoder_blocks
from slimlm.artifact import WEIGHTS_METADATA, ManifestFacts, generation_config_of, quantized_module_record, save_model_files, write_manifest
from slimlm.checkpoint import Checkpoint, checkpoint_tokenizer, open_checkpoint
from slimlm.compress.offload import OffloadedCalibration, quantize_checkpoint
from slimlm.compress.quantize import QuantizeParams, check_shapes
from slimlm.compress.stream_rtn import artifact_specs, install_meta_layers
from slimlm.compress.targets import select_linear_modules
from slimlm.qlinear import QuantLinear
from slimlm.rundir import staged_directory
from slimlm.shards import DEFAULT_SHARD_BYTES, TensorSpec, write_weights

SPILL = "calibrated-blocks"  # in the staging directory, gone before the manifest is written


@dataclass(frozen=True)
class CalibratedArtifact:
    path: Path
    calibration: OffloadedCalibration


def targets_outside_blocks(directory: Path, params: QuantizeParams) -> list[str]:
    """The layers `params` selects that lie outside the decoder blocks (an LM head, say), which
    block-by-block calibration does not reach; read from the checkpoint's config alone."""
    _, skeleton = open_checkpoint(directory)
    prefix, _ = decoder_blocks(skeleton)
    return [name for name in select_linear_modules(skeleton, params.targets, params.ignore) if not name.startswith(prefix + ".")]


def calibrate_into_artifact(
    checkpoint_dir: Path,
    out_dir: Path,
    params: QuantizeParams,
    samples: torch.Tensor,
    source: dict,
    recipe: Optional[dict] = None,
    dtype: Optional[torch.dtype] = None,
    device: torch.device = torch.device("cpu"),
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> CalibratedArtifact:
    """GPTQ or AWQ (params.method, one scheme for every layer) of the decoder layers of the
    checkpoint at `checkpoint_dir` that `params` targets, calibrated on `samples` (token ids
    [n, seq_len]), written as an artifact to `out_dir` (atomically; an existing one is refused).
    `dtype`: the model's dtype (None: the checkpoint's own)."""
    checkpoint, skeleton = open_checkpoint(checkpoint_dir, dtype)
    names = select_linear_modules(skeleton, params.targets, params.ignore)
    check_shapes(skeleton, names, params.scheme)
    install_meta_layers(skeleton, names, params.scheme, checkpoint_dir)
    specs = artifact_specs(skeleton, checkpoint, dtype)  # before calibrating: a checkpoint that lacks a tensor is refused now
    tokenizer, generation_config = checkpoint_tokenizer(checkpoint_dir), generation_config_of(checkpoint_dir)
    with staged_directory(out_dir, "artifacts") as staging:
        spill = BlockSpill(staging / SPILL)
        calibration = quantize_checkpoint(checkpoint_dir, params, samples, spill, device, dtype)
        write_weights(staging, specs, SpilledOrCheckpoint(spill, checkpoint), max_shard_bytes, WEIGHTS_METADATA)
        shutil.rmtree(spill.directory)
        save_model_files(staging, skeleton.config, generation_config, tokenizer)
        write_manifest(staging, skeleton, specs, ManifestFacts(source, recipe, None, spill.records, {}))
    return CalibratedArtifact(Path(out_dir), calibration)


@dataclass
class BlockSpill:
    """quantize_checkpoint's on_block: writes a finished block's tensors into a file of their own
    (all of them: AWQ has scaled its norms too) and keeps each quantized layer's manifest record
    (its scheme says `rtn` for an expert that no calibration token reached)."""

    directory: Path
    files: dict[str, Path] = field(default_factory=dict)  # tensor name -> the spill file holding it
    records: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory.mkdir()

    def __call__(self, block_name: str, block: nn.Module) -> None:
        path = self.directory / f"{block_name}.safetensors"
        tensors = {f"{block_name}.{key}": value.detach().cpu().contiguous() for key, value in block.state_dict().items()}
        for name, layer in block.named_modules():
            if isinstance(layer, QuantLinear):  # stored dense: no bitmask storage here
                self.records[f"{block_name}.{name}"] = quantized_module_record(f"{block_name}.{name}", layer, layer.scheme.to_dict(), {})
        save_file(tensors, path)
        self.files.update(dict.fromkeys(tensors, path))


@dataclass
class SpilledOrCheckpoint:
    """write_weights' producer: a calibrated block's tensors from its spill file (one file open at
    a time), everything else from the checkpoint."""

    spill: BlockSpill
    checkpoint: Checkpoint
    _open: tuple = (None, None)  # (path, safe_open handle)

    def __call__(self, spec: TensorSpec) -> torch.Tensor:
        path = self.spill.files.get(spec.name)
        if path is None:
            return self.checkpoint.tensor(spec.name, spec.dtype)
        if self._open[0] != path:
            self._open = (path, safe_open(path, framework="pt"))
        return self._open[1].get_tensor(spec.name)
