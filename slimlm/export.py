"""The `export` stage: write the current model as a slimlm artifact, then run from the copy on disk."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from slimlm.artifact import load_artifact, save_artifact
from slimlm.errors import ConfigError
from slimlm.pipeline import RunState, Stage

FORMATS = ("slimlm",)


@dataclass
class ExportParams:
    format: str = "slimlm"
    name: str = "artifact"  # directory name inside the run directory
    reload: bool = True  # continue with the model read back from disk (proves the round trip)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"export.format='{self.format}' is not available; available: {', '.join(FORMATS)}")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"export.name='{self.name}' must be a plain directory name")


def run(state: RunState, params: ExportParams) -> None:
    source = {"id": state.source.id, "kind": state.source.kind, "sha256": state.source_sha256}
    recipe = OmegaConf.to_container(state.cfg.recipe, resolve=True)
    results = {"evaluations": state.evaluations}
    path = save_artifact(state.model, state.tokenizer, state.run_dir / params.name, state.schemes, source, recipe, results)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    state.sections.setdefault("artifacts", []).append({"format": params.format, "path": f"{path.name}/", "bytes_on_disk": size})
    if params.reload:
        artifact = load_artifact(path, state.device)
        state.model = artifact.model
        state.tokenizer = artifact.tokenizer
        state.memo["model_origin"] = f"reloaded from {path.name}/"


EXPORT = Stage(name="export", params=ExportParams, run=run)
