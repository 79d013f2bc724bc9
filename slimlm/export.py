"""The `export` stage: write the current model out, then (by default) run from the copy on disk.

Formats: `slimlm`, the versioned artifact directory (slimlm/artifact.py); `gguf`, one file for
llama.cpp and the tools built on it (slimlm/gguf_export.py); `hf`, a plain transformers
checkpoint with the quantized layers dequantized (slimlm/hf_export.py); `compressed-tensors`, a
packed checkpoint that transformers and vLLM load as it is (slimlm/ct_export.py).

When the current model lies in an artifact that no stage has loaded (RTN streamed it, or an
earlier export was reloaded), the slimlm and hf exports work from that artifact on disk
(`run_from_disk`) and never build the model.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from slimlm.artifact import MANIFEST, is_artifact, load_artifact, save_artifact
from slimlm.ct_export import export_compressed
from slimlm.errors import ConfigError
from slimlm.gguf_export import ARCHITECTURES, GGUF_TYPES, export_gguf
from slimlm.hf_export import export_hf, export_hf_from_artifact
from slimlm.models import DTYPES, load_model
from slimlm.pipeline import DiskRun, RunState, Stage
from slimlm.rundir import directory_bytes, staged_directory

FORMATS = ("slimlm", "gguf", "hf", "compressed-tensors")
DEFAULT_NAMES = {
    "slimlm": "artifact",
    "gguf": "model.gguf",
    "hf": "hf",
    "compressed-tensors": "hf-compressed",
}


@dataclass
class ExportParams:
    format: str = "slimlm"
    name: Optional[str] = (
        None  # inside the run directory; default artifact/, model.gguf, hf/ or hf-compressed/
    )
    reload: bool = True  # continue with the model read back from disk (proves the round trip)
    gguf_type: str = "Q4_0"  # gguf: the block type of every weight matrix
    gguf_head_type: Optional[str] = (
        None  # gguf: another block type for the LM head (e.g. Q8_0; the token embedding too when tied)
    )
    requantize: bool = False  # gguf: allow rounding layers that lie on another grid again
    dtype: str = "bfloat16"  # hf, compressed-tensors: the dtype of the unquantized (or dequantized) weights

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(
                f"export.format='{self.format}' is not available; available: {', '.join(FORMATS)}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"export.dtype='{self.dtype}' is unknown; choose one of {', '.join(DTYPES)}")
        for key in ("gguf_type", "gguf_head_type"):
            value = getattr(self, key)
            if value is not None and value not in GGUF_TYPES:
                raise ConfigError(f"export.{key}='{value}' is unknown; choose one of {', '.join(GGUF_TYPES)}")
        self.name = self.name or DEFAULT_NAMES[self.format]
        if "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"export.name='{self.name}' must be a plain file or directory name")


def run(state: RunState, params: ExportParams) -> None:
    if params.format != "slimlm":
        export_file(state, params)
        return
    results = {"evaluations": state.evaluations}
    path = save_artifact(
        state.model,
        state.tokenizer,
        state.output_path(params.name),
        state.schemes,
        state.provenance(),
        state.recipe(),
        results,
    )
    record_artifact(state, path)
    if params.reload:
        artifact = load_artifact(path, state.device)
        state.model = artifact.model
        state.tokenizer = artifact.tokenizer
        state.memo.model_origin = f"reloaded from {path.name}/"


def record_artifact(state: RunState, path: Path) -> None:
    """The report's line for a slimlm artifact just written: its bytes on disk and size account."""
    account = json.loads((path / MANIFEST).read_text())[
        "size"
    ]  # just written: no need to verify every checksum again here
    state.sections.setdefault("artifacts", []).append(
        {"format": "slimlm", "path": f"{path.name}/", "bytes_on_disk": directory_bytes(path), **account}
    )


def export_file(state: RunState, params: ExportParams) -> None:
    """GGUF, HF or compressed-tensors export; with reload, the run continues on the exported
    model as transformers reads it: what a user of that format gets, measured with the same
    metrics."""
    path = state.output_path(params.name)
    if params.format == "gguf":
        source_gguf = state.source.path if state.source.kind == "gguf" else None
        summary = export_gguf(
            state.model,
            state.tokenizer,
            path,
            params.gguf_type,
            source_gguf,
            params.requantize,
            params.gguf_head_type,
        )
    elif params.format == "hf":
        summary = export_hf(state.model, state.tokenizer, path, params.dtype)
    else:
        summary = export_compressed(state.model, state.tokenizer, path, params.dtype)
    state.sections.setdefault("artifacts", []).append(summary)
    if params.reload:
        model_cfg = OmegaConf.merge(state.original_model_cfg(), {"path": str(path), "bnb": None})
        state.adopt(load_model(model_cfg, state.device), f"reloaded from {params.name}")


def exports_from_disk(state: RunState, params: ExportParams) -> bool:
    """The current model lies in an artifact (made from disk by a quantize stage, or exported and
    reloaded) that the slimlm and hf exports can read from disk."""
    return params.format in ("slimlm", "hf") and is_artifact(state.on_disk)


def run_from_disk(state: RunState, params: ExportParams) -> None:
    """The slimlm export as the artifact's files linked (or copied) under the export's name; the
    hf export dequantized from it one module at a time. With reload, the run goes on from the
    export's files (read by the next stage that needs the model)."""
    path = state.output_path(params.name)
    if params.format == "slimlm":
        copy_artifact(state.on_disk, path, {"evaluations": state.evaluations})
        record_artifact(state, path)
    else:
        state.sections.setdefault("artifacts", []).append(
            export_hf_from_artifact(state.on_disk, path, params.dtype)
        )
    if params.reload:
        state.lies_in(path, f"reloaded from {params.name}" + ("/" if params.format == "slimlm" else ""))


def copy_artifact(source: Path, target: Path, results: dict) -> None:
    """The artifact at `source` as a new one at `target` (atomically) whose manifest records
    `results` (the run's evaluations so far): its files hard-linked where the file system
    allows (artifacts are never written to once complete), the manifest a file of its own."""
    with staged_directory(target, "artifacts") as staging:
        shutil.copytree(source, staging, copy_function=_link_or_copy, dirs_exist_ok=True)
        manifest = json.loads((staging / MANIFEST).read_text())
        manifest["results"] = results
        fresh = staging / f".{MANIFEST}.new"
        fresh.write_text(json.dumps(manifest, indent=2, sort_keys=False))
        os.replace(fresh, staging / MANIFEST)  # a new file: the source's manifest, linked, is left alone


def _link_or_copy(from_path: str, to_path: str) -> None:
    try:
        os.link(from_path, to_path)
    except OSError:
        shutil.copy2(from_path, to_path)


def check(cfg, params: ExportParams, source) -> None:
    if (
        params.format == "gguf"
        and source.architecture is not None
        and source.architecture not in ARCHITECTURES
    ):
        raise ConfigError(
            f"export.format=gguf supports {', '.join(ARCHITECTURES)} "
            f"models; this one is {source.architecture}"
        )


EXPORT = Stage(
    name="export",
    params=ExportParams,
    run=run,
    check=check,
    on_disk=(DiskRun(exports_from_disk, run_from_disk),),
    reads_only=True,
)
