"""The slimlm artifact: a directory a compressed model leaves the process in.

    manifest.json      format name and version, source model, recipe, per-module schemes (bits,
                       group size, symmetry, method, shape, packing, sparsity), evaluation
                       results, a size account, and the sha256 and size of every other file
    model.safetensors  (or, above max_shard_bytes, model-0000N-of-0000M.safetensors and
                       model.safetensors.index.json, the HF layout; slimlm/shards.py)
                       quantized layers as `<module>.qweight` (b-bit codes packed 8 per b bytes,
                       see slimlm.packing), `<module>.scales` (fp16, one per group) and, for
                       asymmetric schemes, `<module>.zeros` (uint8 zero points) and, where
                       LoRA trained an adapter on the frozen codes, `<module>.lora_a` [rank, in]
                       and `<module>.lora_b` [out, rank] (scale included); every other
                       tensor as it was; a tied LM head is stored once (quantized, the embedding
                       reads its codes); a sparse weight or code matrix as `<key>.bitmask` and
                       `<key>.nonzeros` where that is smaller (slimlm.sparse_storage)
    config.json, generation_config.json, tokenizer files (the HF layout)

Writing is atomic (a hidden staging directory renamed into place), an existing artifact is
never overwritten, and loading verifies the format version and every checksum before any
tensor is used. Tensors are read with safetensors only: nothing is unpickled. Weights are
written one tensor at a time, so a model streamed from a checkpoint larger than memory
(compress/stream_rtn.py) is written by the same code as one held in memory.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from slimlm import __version__
from slimlm.architecture import untied_table
from slimlm.checkpoint import Checkpoint
from slimlm.errors import SlimlmError
from slimlm.experts import split_experts
from slimlm.model_config import empty_model, first_line, read_model_config
from slimlm.packing import PACKABLE_BITS
from slimlm.qlinear import (
    QuantLinear,
    QuantScheme,
    QuantTable,
    embedding_scale,
    set_submodule,
    tie_quantized_head,
)
from slimlm.resources import read_json_object, sha256_file
from slimlm.rundir import staged_directory
from slimlm.shards import DEFAULT_SHARD_BYTES, SINGLE, TensorSpec, write_weights
from slimlm.sparse_storage import decode_bitmask, encode_bitmask, sparse_candidates, zero_codes

FORMAT = "slimlm"
# 6: weights may be sharded (model-0000N-of-0000M.safetensors and model.safetensors.index.json);
# 5: low-rank adapters beside quantized layers; 4: bitmask storage of sparse weights; 3: module
# shapes, packing, sparsity and a size account; 2: packed codes with group scales
FORMAT_VERSION = 6
OLDEST_READABLE = 2
PACKING = "lsb-8"  # slimlm.packing: 8 codes fill `bits` bytes, code i at bits [i*b, (i+1)*b)
SCHEME_FIELDS = tuple(QuantScheme.__dataclass_fields__)
MANIFEST = "manifest.json"
WEIGHTS = SINGLE  # the weights file of an artifact that fits in one shard
WEIGHTS_METADATA = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}  # in each weights file's header


@dataclass
class Artifact:
    model: Any
    tokenizer: Any
    manifest: dict
    path: Path


def save_artifact(
    model,
    tokenizer,
    out_dir: Path,
    schemes: dict[str, dict],
    source: dict,
    recipe: Optional[dict] = None,
    results: Optional[dict] = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write `model` (with its QuantLinear layers) as an artifact directory at `out_dir`."""
    with staged_directory(out_dir, "artifacts") as staging:
        tensors = _unique_state_dict(model)
        sparse = _store_sparse_compactly(model, tensors)
        specs = [TensorSpec.of(name, tensor) for name, tensor in tensors.items()]
        write_weights(staging, specs, lambda spec: tensors[spec.name], max_shard_bytes, WEIGHTS_METADATA)
        save_model_files(staging, model.config, getattr(model, "generation_config", None), tokenizer)
        modules = {
            name: quantized_module_record(name, model.get_submodule(name), scheme, sparse)
            for name, scheme in schemes.items()
        }
        write_manifest(staging, model, specs, ManifestFacts(source, recipe, results, modules, sparse))
    return Path(out_dir)


@dataclass
class ManifestFacts:
    """What the manifest says that the weights alone do not: where the model came from, how,
    how it scored, each quantized module's record and the bitmask-stored tensors."""

    source: dict
    recipe: Optional[dict]
    results: Optional[dict]
    modules: dict[str, dict]
    sparse: dict[str, dict]


def save_model_files(staging: Path, config, generation_config, tokenizer) -> None:
    """config.json, generation_config.json (when there is one) and the tokenizer's files."""
    config.save_pretrained(staging)
    if generation_config is not None:
        generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)


def write_manifest(staging: Path, model, specs: list[TensorSpec], facts: ManifestFacts) -> None:
    """The manifest of the files in `staging`, last: it holds every other file's checksum.
    `model` may be a meta skeleton with QuantLinear layers (only shapes and schemes are read)."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "slimlm_version": __version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": facts.source,
        "recipe": facts.recipe,
        "dtype": _model_dtype(model),
        "tensor_dtypes": sorted(
            {str(spec.dtype).removeprefix("torch.") for spec in specs if spec.dtype.is_floating_point}
        ),
        "modules": facts.modules,
        "sparse_tensors": facts.sparse,
        "size": _size_account(model, specs, staging),
        "tied_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        "results": facts.results or {},
        "files": _describe_files(staging),
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False))


def _unique_state_dict(model) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor once, on the CPU (safetensors refuses aliases)."""
    return {name: tensor.detach().cpu().contiguous() for name, tensor in unique_state(model).items()}


def unique_state(model) -> dict[str, torch.Tensor]:
    """The state dict's tensors (not detached) with each shared one once, under its first name;
    a meta skeleton's too (its tensors have no storage, so they are told apart by identity)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor) if tensor.is_meta else tensor.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor
    return tensors


def _store_sparse_compactly(model, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Swap each weight that a bitmask stores in fewer bytes for its bitmask and kept values;
    returns the manifest entries that say how to rebuild them."""
    entries = {}
    for candidate in sparse_candidates(model):
        nonzero = candidate.nonzero
        if candidate.key not in tensors or candidate.bitmask_bytes(nonzero) >= candidate.dense_bytes():
            continue
        del tensors[candidate.key]
        tensors.update(encode_bitmask(candidate))
        entries[candidate.key] = {
            "shape": list(candidate.values.shape),
            "nonzero": nonzero,
            "bits": candidate.bits,
            "codes": candidate.codes,
        }
    return entries


def _rebuild_sparse(model, tensors: dict[str, torch.Tensor], entries: dict[str, dict], path: Path) -> None:
    """Dense tensors back from their bitmask encoding, in place in `tensors`."""
    for key, entry in entries.items():
        module_name = key.rpartition(".")[0]
        try:
            bitmask, nonzeros = tensors.pop(f"{key}.bitmask"), tensors.pop(f"{key}.nonzeros")
            module = model.get_submodule(module_name)
            zero = (
                zero_codes(module, None if module.zeros is None else tensors[f"{module_name}.zeros"])
                if entry["codes"]
                else 0.0
            )
            tensors[key] = decode_bitmask(
                bitmask, nonzeros, entry["shape"], zero, entry["bits"], entry["codes"]
            )
        except (KeyError, AttributeError, ValueError, RuntimeError) as error:
            raise SlimlmError(
                f"artifact '{path}': the sparse tensor {key} cannot "
                f"be rebuilt ({error}); re-export the artifact"
            ) from None


def scheme_of(record: dict) -> QuantScheme:
    """The quantization scheme in a manifest's module entry (which also holds shape, packing...)."""
    return QuantScheme(**{key: value for key, value in record.items() if key in SCHEME_FIELDS})


def planner_inputs(manifest: dict) -> tuple[dict[str, QuantScheme], dict[str, int]]:
    """What the memory planner reads from an artifact instead of its weights: each quantized
    module's scheme and its adapter's rank (0: none)."""
    modules = manifest["modules"]
    return {name: scheme_of(record) for name, record in modules.items()}, {
        name: record.get("adapter_rank", 0) for name, record in modules.items()
    }


def quantized_module_record(name: str, layer: QuantLinear, scheme: dict, sparse: dict[str, dict]) -> dict:
    """A quantized module's entry, its sparsity counted from its codes."""
    sparsity = (layer.codes() == zero_codes(layer)).float().mean().item()
    return module_record(layer, scheme, sparsity, "bitmask" if f"{name}.qweight" in sparse else "dense")


def module_record(layer: QuantLinear, scheme: dict, sparsity: float, storage: str) -> dict:
    """A quantized module's entry: its scheme, its shape (checked against config.json on load),
    how its codes are packed and stored, and its sparsity (the fraction of weights exactly zero)."""
    adapter = {"adapter_rank": layer.adapter_rank} if layer.adapter_rank else {}
    return {
        **scheme,
        "shape": [layer.out_features, layer.in_features],
        "packing": PACKING,
        "storage": storage,
        "sparsity": round(sparsity, 6),
        **adapter,
    }


def _size_account(model, specs: list[TensorSpec], staging: Path) -> dict:
    """What the weights files should weigh from the bits, scales and zero points alone, next to
    what they weigh: the difference is safetensors' headers, so a bloated file shows here."""
    quantized = {name: module for name, module in model.named_modules() if isinstance(module, QuantLinear)}
    accounted = 0
    for spec in specs:
        module_name, _, field = spec.name.rpartition(".")
        layer = quantized.get(module_name)
        if layer is not None and field == "qweight":
            accounted += layer.out_features * layer.in_features * layer.scheme.bits // 8
        else:
            accounted += spec.nbytes
    weights_bytes = sum(file.stat().st_size for file in staging.glob("*.safetensors"))
    return {
        "weights_accounted_bytes": accounted,
        "weights_file_bytes": weights_bytes,
        "weights_overhead": round(weights_bytes / accounted - 1, 6),
    }


def _model_dtype(model) -> str:
    return str(next(p.dtype for p in model.parameters() if p.is_floating_point())).removeprefix("torch.")


def _describe_files(directory: Path) -> dict[str, dict]:
    return {
        file.name: {"sha256": sha256_file(file), "bytes": file.stat().st_size}
        for file in sorted(directory.iterdir())
        if file.is_file() and file.name != MANIFEST
    }


def is_artifact(path: Optional[Path]) -> bool:
    return path is not None and (Path(path) / MANIFEST).is_file()


def artifact_model_type(path: Path) -> Optional[str]:
    """The model_type in an artifact's config.json (None if it names none)."""
    return read_json_object(Path(path) / "config.json", "re-export the artifact").get("model_type")


def parse_manifest(path: Path) -> dict:
    """The manifest, after checking its format, version and layout, but no file's checksum (the
    memory planner reads only this, and hashing a large model's weights would take minutes)."""
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise SlimlmError(
            f"'{path}' is not a slimlm artifact (no {MANIFEST}); export one with a recipe's export stage"
        )
    manifest = read_json_object(manifest_file, "re-export the artifact")
    if manifest.get("format") != FORMAT:
        raise SlimlmError(f"'{path}' is not a slimlm artifact (its {MANIFEST} names no format '{FORMAT}')")
    version = manifest.get("format_version")
    if type(version) is not int:
        raise SlimlmError(
            f"'{manifest_file}' is damaged (format_version {version!r} "
            "is not a whole number); re-export the artifact"
        )
    if version > FORMAT_VERSION:
        raise SlimlmError(
            f"'{path}' uses artifact format version {version}, "
            f"newer than this slimlm reads ({FORMAT_VERSION}); upgrade slimlm"
        )
    if version < OLDEST_READABLE:
        raise SlimlmError(
            f"'{path}' uses artifact format version {version}, older than "
            f"this slimlm reads ({OLDEST_READABLE}); re-export it from its run"
        )
    problem = _layout_problem(manifest)
    if problem:
        raise SlimlmError(f"'{manifest_file}' is damaged ({problem}); re-export the artifact")
    return manifest


def _layout_problem(manifest: dict) -> Optional[str]:
    """What is wrong with the parts of a manifest that loading reads, or None."""
    files, modules = manifest.get("files"), manifest.get("modules")
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and type(entry.get("bytes")) is int
        for entry in files.values()
    ):
        return "'files' must map each file to its sha256 and bytes"
    outside = [name for name in files if Path(name).name != name or name in ("", ".", "..")]
    if outside:
        return f"'files' names '{outside[0]}', which is not a file of the artifact's directory"
    if not isinstance(modules, dict) or not all(isinstance(record, dict) for record in modules.values()):
        return "'modules' must map each quantized module to its scheme"
    for name, record in modules.items():
        scheme, shape = scheme_of(record), record.get("shape")  # format 2 recorded no shapes
        if shape is not None and not (
            isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n > 0 for n in shape)
        ):
            return f"module {name} has the shape {shape!r}"
        typed = (
            type(scheme.bits) is int
            and (scheme.group_size is None or type(scheme.group_size) is int)
            and type(scheme.symmetric) is bool
            and type(scheme.method) is str
        )
        if (
            not typed
            or scheme.bits not in PACKABLE_BITS
            or (shape is not None and scheme.shape_problem(shape[1]))
        ):
            return f"module {name} has the scheme {scheme}, which slimlm does not write for its shape"
    if not isinstance(getattr(torch, str(manifest.get("dtype", "float32")), None), torch.dtype):
        return f"dtype {manifest.get('dtype')!r} is not a torch dtype"
    return None


def read_manifest(path: Path) -> dict:
    """The manifest, after checking the format, the version and every file's checksum: each file
    of the artifact's directory must be listed, so none is read unchecked (hidden files, which
    no loader reads, such as a file manager's .DS_Store, excepted)."""
    path = Path(path)
    manifest = parse_manifest(path)
    files = manifest["files"]
    unlisted = sorted(
        file.name
        for file in path.iterdir()
        if file.is_file()
        and file.name != MANIFEST
        and file.name not in files
        and not file.name.startswith(".")
    )
    if unlisted:
        raise SlimlmError(
            f"artifact '{path}' holds '{unlisted[0]}', for which its manifest "
            "has no checksum; remove the file or re-export the artifact"
        )
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise SlimlmError(f"artifact '{path}' is missing '{name}'; re-export it")
        if file.stat().st_size != expected["bytes"] or sha256_file(file) != expected["sha256"]:
            raise SlimlmError(
                f"artifact file '{file}' is damaged (checksum mismatch); re-export the artifact"
            )
    return manifest


def hf_file(reader, path: Path, what: str):
    """`reader(path)` (a transformers from_pretrained) with a file it cannot parse refused as a
    damaged artifact: the checksums tell that a file changed, not that it was written well."""
    try:
        return reader(path)
    except Exception as error:
        # transformers and tokenizers raise many kinds (a bare Exception from Rust); each means
        # the file is unusable
        raise SlimlmError(
            f"artifact '{path}': its {what} cannot be read ({first_line(error)}); re-export the artifact"
        ) from None


def artifact_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return hf_file(AutoTokenizer.from_pretrained, path, "tokenizer files")


def generation_config_of(directory: Path):
    """The generation_config.json of a checkpoint or artifact directory, None when it has none."""
    from transformers import GenerationConfig

    return (
        hf_file(GenerationConfig.from_pretrained, directory, "generation_config.json")
        if (Path(directory) / "generation_config.json").is_file()
        else None
    )


def model_skeleton(path: Path, manifest: dict):
    """The artifact's model with QuantLinear layers where the manifest says, on the meta device
    (no memory: slimlm/model_config.py checks config.json first), for a loader to fill with the
    tensors its files hold (ArtifactParts)."""
    remedy = "re-export the artifact"
    model = empty_model(
        read_model_config(path, remedy), getattr(torch, manifest.get("dtype", "float32")), path, remedy
    )
    with torch.device("meta"):
        split_experts(model)  # compression names each expert's projections (slimlm/experts.py)
        install_quantized_layers(model, manifest["modules"], bool(manifest.get("tied_word_embeddings")), path)
    return model


def install_quantized_layers(model, modules: dict[str, dict], tied: bool, path: Path) -> None:
    """Replace each Linear that `modules` (manifest records) names by an empty QuantLinear of its
    scheme, and an untied input embedding it names by a QuantTable, on the current default
    device; a tied quantized head lends the embedding its codes."""
    table_name = untied_table(model)
    for name, record in modules.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise SlimlmError(
                f"artifact '{path}' names module '{name}', which its config.json does not have"
            ) from None
        table = name == table_name
        if not (table or isinstance(module, torch.nn.Linear)):
            raise SlimlmError(
                f"artifact '{path}' names module '{name}', which is not a "
                "Linear layer of its config.json's model; re-export the artifact"
            )
        in_features, out_features = (
            (module.embedding_dim, module.num_embeddings)
            if table
            else (module.in_features, module.out_features)
        )
        shape = record.get("shape", [out_features, in_features])  # format 2 did not record shapes
        if list(shape) != [out_features, in_features]:
            raise SlimlmError(
                f"artifact '{path}': manifest gives {name} the shape {list(shape)}, "
                f"config.json gives {[out_features, in_features]}; re-export the artifact"
            )
        if record.get("packing", PACKING) != PACKING:
            raise SlimlmError(
                f"artifact '{path}': {name} is packed as '{record['packing']}', "
                f"which this slimlm does not read (it reads '{PACKING}')"
            )
        if table:
            layer = QuantTable(
                in_features, out_features, scheme_of(record), module.weight.dtype, embedding_scale(module)
            )
        else:
            layer = QuantLinear(
                in_features,
                out_features,
                scheme_of(record),
                bias=module.bias is not None,
                adapter_rank=record.get("adapter_rank", 0),
            )
        set_submodule(model, name, layer)
    if tied and isinstance(model.get_output_embeddings(), QuantLinear):
        tie_quantized_head(model)  # the embedding reads the head's codes; nothing of its own to load


def dense_tensors(
    model, tensors: dict[str, torch.Tensor], manifest: dict, path: Path
) -> dict[str, torch.Tensor]:
    """`tensors` (all of the weights file or a part of it) with bitmask-stored ones rebuilt."""
    entries = {
        key: entry for key, entry in manifest.get("sparse_tensors", {}).items() if f"{key}.bitmask" in tensors
    }
    _rebuild_sparse(model, tensors, entries, path)
    return tensors


def load_tensors(module: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path, assign: bool = False):
    """module.load_state_dict (not strict: the caller judges missing and unexpected keys), with
    a tensor of another shape than the manifest and config.json give refused as a damaged artifact."""
    try:
        return module.load_state_dict(tensors, strict=False, assign=assign)
    except RuntimeError as error:
        detail = next(
            (line.strip() for line in str(error).splitlines() if "size mismatch" in line),
            str(error).splitlines()[0],
        )
        raise SlimlmError(
            f"artifact '{path}': its weights do not match its manifest ({detail}); re-export the artifact"
        ) from None


class ArtifactParts:
    """An artifact read into its meta skeleton one module at a time (checksums verified first),
    for readers that must never hold the whole model: the decoder's loader (inference/load.py)
    and the hf export of an artifact (slimlm/hf_export.py). `unread` keeps the tensors no
    module has asked for yet, so a reader can refuse an artifact with tensors to spare."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.skeleton = model_skeleton(self.path, self.manifest)
        self.weights = Checkpoint(self.path)
        self.keys = self.weights.names()
        self.unread = set(self.keys)

    def fill(self, module: torch.nn.Module, prefix: str) -> None:
        """Read the tensors under `prefix` (a module name and a dot) into `module`, as its own
        (assigned: no second copy)."""
        part = [key for key in self.keys if key.startswith(prefix)]
        self.unread.difference_update(part)
        tensors = dense_tensors(
            self.skeleton, {key: self.weights.tensor(key) for key in part}, self.manifest, self.path
        )
        result = load_tensors(
            module, {key[len(prefix) :]: tensor for key, tensor in tensors.items()}, self.path, assign=True
        )
        if result.missing_keys or result.unexpected_keys:
            raise SlimlmError(
                f"artifact '{self.path}' does not match its config.json under {prefix}: "
                f"missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}"
            )

    def stores(self, prefix: str) -> bool:
        return any(key.startswith(prefix) for key in self.keys)


def load_artifact(path: Path, device: torch.device = torch.device("cpu")) -> Artifact:
    """Rebuild the model an artifact holds, quantized layers included, ready for evaluation."""
    parts = ArtifactParts(
        path
    )  # the model on the meta device: what the files hold decides the memory, not config.json
    path, model, manifest = parts.path, parts.skeleton, parts.manifest
    tied = bool(manifest.get("tied_word_embeddings"))
    tensors = dense_tensors(model, {name: parts.weights.tensor(name) for name in parts.keys}, manifest, path)
    result = load_tensors(model, tensors, path, assign=True)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if tied else set())
    if missing or result.unexpected_keys:
        raise SlimlmError(
            f"artifact '{path}' does not match its config.json: missing "
            f"{sorted(missing)[:3]}, unexpected {sorted(result.unexpected_keys)[:3]}"
        )
    if tied and not isinstance(model.get_output_embeddings(), QuantLinear):
        model.tie_weights()
    unfilled = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if unfilled:
        raise SlimlmError(
            f"artifact '{path}' does not fill {unfilled[0]} of "
            "its config.json's model; re-export the artifact"
        )
    tokenizer = artifact_tokenizer(path)
    return Artifact(model=model.to(device).eval(), tokenizer=tokenizer, manifest=manifest, path=path)
