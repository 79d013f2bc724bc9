"""Round-to-nearest quantization of a checkpoint larger than memory, straight into an artifact.

RTN needs no calibration, so no layer ever needs the model around it: each target Linear's
weight is read from the checkpoint's safetensors (slimlm/checkpoint.py), rounded a bounded run
of rows at a time (compress/rtn.py), packed as QuantLinear stores it, and written into the
artifact's shards as it comes (slimlm/shards.py); every other tensor is copied in its dtype.
Memory holds one tensor and its codes, never the model or a whole shard: an 8B checkpoint in
bf16 (16 GB) quantizes to w4 g128 within about 3 GB (bench/scale.py).

The artifact is the one save_artifact writes for the same model (the same names, records,
size account and checksums): the layout is planned on the model's meta skeleton with
QuantLinear layers in place, from the same code that loading uses (install_quantized_layers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from slimlm.architecture import untied_table
from slimlm.artifact import (
    WEIGHTS_METADATA,
    ManifestFacts,
    generation_config_of,
    install_quantized_layers,
    module_record,
    save_model_files,
    unique_state,
    write_manifest,
)
from slimlm.checkpoint import Checkpoint, checkpoint_tokenizer, open_checkpoint
from slimlm.compress.rtn import quantize_rtn
from slimlm.compress.targets import select_linear_modules
from slimlm.errors import SlimlmError
from slimlm.qlinear import QuantLinear, QuantScheme
from slimlm.rundir import staged_directory
from slimlm.shards import DEFAULT_SHARD_BYTES, TensorSpec, write_weights
from slimlm.sparse_storage import zero_codes

ROUND_CHUNK_BYTES = 32 * 2**20  # float32 rows rounded at once: packing's int64 temporaries are 4x this


@dataclass(frozen=True)
class StreamedArtifact:
    path: Path
    weight_rel_error: dict[str, float]  # ||W - Q(W)|| / ||W|| of each quantized module, as reports plot it


def stream_rtn(
    checkpoint_dir: Path,
    out_dir: Path,
    scheme: QuantScheme,
    targets: Sequence[str],
    ignore: Sequence[str] = (),
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    source: Optional[dict] = None,
    recipe: Optional[dict] = None,
    dtype: Optional[torch.dtype] = None,
) -> StreamedArtifact:
    """Quantize the Linear layers of the checkpoint at `checkpoint_dir` that match `targets` and
    no `ignore` pattern (regexes over module names) with RTN in `scheme`, and write the artifact
    to `out_dir` (atomically; an existing one is refused). `dtype`: the model's dtype, as a model
    loaded in it would be rounded and stored (None: each tensor's stored dtype)."""
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint, skeleton = open_checkpoint(checkpoint_dir, dtype)
    scheme = dataclasses.replace(scheme, method="rtn")
    names = select_linear_modules(skeleton, targets, ignore)
    for name in names:
        problem = scheme.shape_problem(skeleton.get_submodule(name).in_features)
        if problem:
            raise SlimlmError(
                f"cannot quantize {name}: {problem}; change the group size or add the layer to the ignore "
                "patterns"
            )
    table = untied_table(skeleton)
    if table is not None and any(
        skeleton.get_submodule(name) is skeleton.get_output_embeddings() for name in names
    ):
        names.append(table)  # the embedding is rounded with its head, as compress/quantize.py does
    install_meta_layers(skeleton, names, scheme, checkpoint_dir)
    tokenizer, generation_config = checkpoint_tokenizer(checkpoint_dir), generation_config_of(checkpoint_dir)
    specs = artifact_specs(skeleton, checkpoint, dtype)
    rounding = StreamedRounding(checkpoint, {name: skeleton.get_submodule(name) for name in names}, dtype)
    with (
        staged_directory(out_dir, "artifacts") as staging,
        tqdm(total=sum(spec.nbytes for spec in specs), unit="B", unit_scale=True, desc="stream rtn") as bar,
    ):
        write_weights(staging, specs, rounding, max_shard_bytes, WEIGHTS_METADATA, bar.update)
        save_model_files(staging, skeleton.config, generation_config, tokenizer)
        modules = {
            name: module_record(
                skeleton.get_submodule(name), scheme.to_dict(), rounding.sparsity[name], "dense"
            )
            for name in names
        }
        write_manifest(
            staging,
            skeleton,
            specs,
            ManifestFacts(source or {"path": str(checkpoint_dir)}, recipe, None, modules, {}),
        )
    return StreamedArtifact(Path(out_dir), rounding.errors)


def install_meta_layers(
    skeleton: torch.nn.Module, names: Sequence[str], scheme: QuantScheme, checkpoint_dir: Path
) -> None:
    """Puts empty (meta) QuantLinear layers in `scheme` in place of the modules `names` (Linear
    layers, or an embedding rounded with its head), as loading the artifact will: the layout an
    out-of-core writer plans the artifact's tensors on."""
    records = {
        name: {**scheme.to_dict(), "shape": list(skeleton.get_submodule(name).weight.shape)} for name in names
    }
    with torch.device("meta"):
        install_quantized_layers(
            skeleton, records, bool(getattr(skeleton.config, "tie_word_embeddings", False)), checkpoint_dir
        )


def artifact_specs(
    skeleton: torch.nn.Module, checkpoint: Checkpoint, dtype: Optional[torch.dtype] = None
) -> list[TensorSpec]:
    """The artifact's tensors, in the skeleton's order: QuantLinear buffers as the layer holds
    them, everything else as the checkpoint stores it (floating ones in `dtype` when given)."""
    quantized = {name for name, module in skeleton.named_modules() if isinstance(module, QuantLinear)}
    specs = []
    for key, meta in unique_state(skeleton).items():
        module, _, field = key.rpartition(".")
        if module in quantized and field != "bias":
            specs.append(TensorSpec.of(key, meta))
        elif not checkpoint.has(key):
            raise SlimlmError(
                f"checkpoint '{checkpoint.directory}' has no tensor {key}, which its config.json needs"
            )
        elif checkpoint.shape(key) != tuple(meta.shape):
            raise SlimlmError(
                f"checkpoint '{checkpoint.directory}': {key} has the shape {list(checkpoint.shape(key))}, "
                f"its config.json gives {list(meta.shape)}"
            )
        else:
            stored = checkpoint.dtype(key)
            specs.append(
                TensorSpec(
                    key,
                    dtype if dtype is not None and stored.is_floating_point else stored,
                    tuple(meta.shape),
                )
            )
    return specs


class StreamedRounding:
    """Produces the artifact's tensors on request (slimlm.shards.write_weights): a quantized
    layer's buffers from its weight, rounded when the first of them is asked for and kept until
    the next layer's are; any other tensor read from the checkpoint."""

    def __init__(
        self, checkpoint: Checkpoint, layers: dict[str, QuantLinear], dtype: Optional[torch.dtype] = None
    ):
        self.checkpoint = checkpoint
        self.layers = layers
        self.dtype = dtype
        self.sparsity: dict[str, float] = {}
        self.errors: dict[str, float] = {}
        self._current: tuple[Optional[str], dict[str, torch.Tensor]] = (None, {})

    def __call__(self, spec: TensorSpec) -> torch.Tensor:
        module, _, field = spec.name.rpartition(".")
        if module not in self.layers or field == "bias":
            return self.checkpoint.tensor(spec.name, spec.dtype)
        if self._current[0] != module:
            self._current = (None, {})  # the previous layer's codes go before this one's are made
            rounded = round_weight(
                self.checkpoint.tensor(f"{module}.weight", self.dtype), self.layers[module].scheme
            )
            self.sparsity[module], self.errors[module] = rounded.zero_fraction, rounded.relative_error
            self._current = (module, dict(rounded.layer.named_buffers()))
        return self._current[1][field]


@dataclass(frozen=True)
class RoundedWeight:
    layer: QuantLinear
    zero_fraction: float  # of its codes that stand for 0.0
    relative_error: float  # ||W - Q(W)|| / ||W||


def round_weight(weight: torch.Tensor, scheme: QuantScheme) -> RoundedWeight:
    """`weight` [out, in] rounded with RTN into a QuantLinear, a run of rows at a time (the
    float32 copies and packing temporaries of a whole LM head would be several GB)."""
    out_features, in_features = weight.shape
    layer = QuantLinear(in_features, out_features, scheme)
    step = max(1, ROUND_CHUNK_BYTES // (4 * in_features))
    zero, error, norm = 0, 0.0, 0.0
    for start in range(0, out_features, step):
        rows = weight[start : start + step].float()
        quantized = quantize_rtn(rows, scheme)
        part = QuantLinear.from_codes(quantized.codes, quantized.scales, quantized.zeros, scheme, None)
        for name, buffer in part.named_buffers():
            layer.get_buffer(name)[start : start + step] = buffer
        zero += int((quantized.codes == zero_codes(part)).sum())
        error += float(torch.sum((rows - part.dequantize()) ** 2))
        norm += float(torch.sum(rows**2))
    return RoundedWeight(layer, zero / weight.numel(), (error / max(norm, 1e-24)) ** 0.5)
