"""The stage interface and the state a recipe's stages share while it runs.

A stage is a small record: its name as recipes write it, a dataclass for its parameters
and a function that does the work on the run state. The CLI owns the table of stages; this
module knows none of them, so the core never imports a stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slimlm.artifact import scheme_of
from slimlm.errors import ConfigError


@dataclass
class RunState:
    """What one run carries from stage to stage."""

    cfg: DictConfig
    run_dir: Path
    model: Any  # a transformers PreTrainedModel, possibly with quantized modules
    tokenizer: Any
    source: Any  # slimlm.models.ModelSource: where the starting model came from
    source_sha256: Any  # str or None: hash of the source weights, for provenance
    device: torch.device
    schemes: dict[str, dict] = field(default_factory=dict)  # module name -> how it was compressed
    evaluations: list[dict] = field(default_factory=list)  # one row per evaluate stage
    sections: dict[str, Any] = field(default_factory=dict)  # other report sections by name
    memo: dict[str, Any] = field(default_factory=dict)  # values stages reuse within a run, not reported

    def is_original(self) -> bool:
        """True while the model is the source model as loaded (nothing compressed or swapped)."""
        return not self.schemes and self.memo.get("model_origin") is None and not self.memo.get("changes")

    def mark_changed(self, how: str) -> None:
        """Record that a stage changed the model's weights or shape without quantizing it
        (sparsified, pruned): its rows are no longer the original model's."""
        self.memo.setdefault("changes", []).append(how)

    def original_model_cfg(self) -> Any:
        """The config that loads the uncompressed model this run's model descends from."""
        return self.memo.get("original_model_cfg", self.cfg.model)

    def adopt(self, loaded: Any, origin: Optional[str]) -> None:
        """Make a freshly loaded model (slimlm.models.LoadedModel) the current one."""
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.schemes = {}
        self.memo["model_origin"] = origin
        self.memo.pop("changes", None)
        if loaded.manifest is not None:  # a slimlm artifact: compressed, made from its source model
            self.schemes = {name: scheme_of(record).to_dict() for name, record in loaded.manifest["modules"].items()}
            self.memo["model_origin"] = origin or f"artifact {loaded.source.id}"
            self.memo["original_model_cfg"] = OmegaConf.merge(self.cfg.model, {"path": loaded.manifest["source"]["id"]})


@dataclass(frozen=True)
class Stage:
    name: str
    params: type  # a dataclass; its __post_init__ checks values
    run: Callable[[RunState, Any], None]
    # Checks that need the whole config and the model source (data files a stage will read,
    # limits of the model), run before any model loads: check(cfg, params, source).
    check: Optional[Callable[[DictConfig, Any, Any], None]] = None


@dataclass(frozen=True)
class PlannedStage:
    stage: Stage
    params: Any
    index: int

    @property
    def title(self) -> str:
        return f"stage {self.index + 1} ({self.stage.name})"


def plan_stages(stages_cfg: Any, table: Mapping[str, Stage]) -> list[PlannedStage]:
    """Check each recipe stage against its dataclass and return them ready to run."""
    if not stages_cfg:
        raise ConfigError("the recipe has no stages: add at least one under `stages:`")
    planned = []
    for index, raw in enumerate(stages_cfg):
        where = f"recipe stage {index + 1}"
        if not isinstance(raw, (Mapping, DictConfig)) or "stage" not in raw:
            raise ConfigError(f"{where} must be a mapping with a `stage:` key naming one of {sorted(table)}")
        values = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else dict(raw)
        name = values.pop("stage")
        if name not in table:
            raise ConfigError(f"{where}: unknown stage '{name}'; choose one of {', '.join(sorted(table))}")
        stage = table[name]
        params = build_params(stage.params, values, f"{where} ({name})")
        planned.append(PlannedStage(stage=stage, params=params, index=index))
    return planned


def build_params(schema: type, values: Mapping[str, Any], where: str) -> Any:
    """Merge `values` into `schema` (a dataclass): unknown keys and wrong types are errors."""
    known = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(known)}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), values)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        first_line = str(error).splitlines()[0]
        raise ConfigError(f"{where}: {first_line}") from None
