"""GPTQ or AWQ of a checkpoint larger than memory, straight into an artifact.

compress/offload.py calibrates the checkpoint one decoder block at a time. As each block is
done, its tensors (quantized layers, and norms AWQ has scaled) go into a small safetensors file
in a progress directory (compress/block_progress.py; an 8B model's w4 block is about 120 MB)
with the next block's inputs, and the block is released: a killed run, rerun, goes on from the
first unfinished block. After the last block, the artifact's shards are written a tensor at a
time, as compress/stream_rtn.py writes them: the blocks' tensors read back from the progress
files, every other tensor from the checkpoint. Memory holds one block at a time; disk holds the
quantized layers twice while the progress directory is kept (a recipe run removes it when the
run completes, so a run killed after this stage still writes the artifact again without
calibrating).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from slimlm.architecture import decoder_blocks
from slimlm.artifact import (
    WEIGHTS_METADATA,
    ManifestFacts,
    generation_config_of,
    save_model_files,
    write_manifest,
)
from slimlm.checkpoint import Checkpoint, checkpoint_tokenizer, open_checkpoint
from slimlm.compress.block_progress import finished_tensor_files
from slimlm.compress.offload import OffloadedCalibration, quantize_checkpoint
from slimlm.compress.quantize import QuantizeParams, check_shapes
from slimlm.compress.stream_rtn import artifact_specs, install_meta_layers
from slimlm.compress.targets import select_linear_modules
from slimlm.rundir import staged_directory
from slimlm.shards import DEFAULT_SHARD_BYTES, TensorSpec, write_weights


@dataclass(frozen=True)
class CalibratedArtifact:
    path: Path
    calibration: OffloadedCalibration


def targets_outside_blocks(directory: Path, params: QuantizeParams) -> list[str]:
    """The layers `params` selects that lie outside the decoder blocks (an LM head, say), which
    block-by-block calibration does not reach; read from the checkpoint's config alone."""
    _, skeleton = open_checkpoint(directory)
    prefix, _ = decoder_blocks(skeleton)
    return [
        name
        for name in select_linear_modules(skeleton, params.targets, params.ignore)
        if not name.startswith(prefix + ".")
    ]


def calibrate_into_artifact(
    checkpoint_dir: Path,
    out_dir: Path,
    progress: Path,
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
    The finished blocks wait in `progress` (compress/block_progress.py), which is kept: the
    caller removes it once nothing may need the artifact written again. `dtype`: the model's
    dtype (None: the checkpoint's own)."""
    checkpoint, skeleton = open_checkpoint(checkpoint_dir, dtype)
    names = select_linear_modules(skeleton, params.targets, params.ignore)
    check_shapes(skeleton, names, params.scheme)
    install_meta_layers(skeleton, names, params.scheme, checkpoint_dir)
    specs = artifact_specs(
        skeleton, checkpoint, dtype
    )  # before calibrating: a checkpoint that lacks a tensor is refused now
    tokenizer, generation_config = checkpoint_tokenizer(checkpoint_dir), generation_config_of(checkpoint_dir)
    with staged_directory(out_dir, "artifacts") as staging:
        calibration = quantize_checkpoint(
            checkpoint_dir, params, samples, lambda name, block: None, device, dtype, progress
        )
        write_weights(
            staging,
            specs,
            CalibratedOrCheckpoint(finished_tensor_files(progress), checkpoint),
            max_shard_bytes,
            WEIGHTS_METADATA,
        )
        save_model_files(staging, skeleton.config, generation_config, tokenizer)
        write_manifest(staging, skeleton, specs, ManifestFacts(source, recipe, None, calibration.records, {}))
    return CalibratedArtifact(Path(out_dir), calibration)


@dataclass
class CalibratedOrCheckpoint:
    """write_weights' producer: a calibrated block's tensors from its progress file (one file
    open at a time), everything else from the checkpoint."""

    calibrated: dict[str, Path]  # tensor name -> the file holding it
    checkpoint: Checkpoint
    _open: tuple = (None, None)  # (path, safe_open handle)

    def __call__(self, spec: TensorSpec) -> torch.Tensor:
        path = self.calibrated.get(spec.name)
        if path is None:
            return self.checkpoint.tensor(spec.name, spec.dtype)
        if self._open[0] != path:
            self._open = (path, safe_open(path, framework="pt"))
        return self._open[1].get_tensor(spec.name)
