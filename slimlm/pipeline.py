"""The stage interface and the state a recipe's stages share while it runs.

A stage is a small record: its name as recipes write it, a dataclass for its parameters
and a function that does the work on the run state. The CLI owns the table of stages; this
module knows none of them, so the core never imports a stage.

The model is loaded when the first stage that needs it in memory starts, not before: a stage
that can work on the model where it lies on disk (its `on_disk`) runs there while nothing has
loaded it. Evaluating the source model scores its checkpoint a block at a time; RTN streams the
checkpoint into an artifact and GPTQ and AWQ calibrate it into one a block at a time; the
exports and the decoder read that artifact one part at a time. So an evaluate, quantize,
export, generate recipe never holds the full-precision model in memory.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slimlm.artifact import is_artifact, parse_manifest, scheme_of
from slimlm.errors import ConfigError
from slimlm.memory import return_freed_memory
from slimlm.processes import Launch

if TYPE_CHECKING:
    from slimlm.eval.kl import ReferenceLogits

log = logging.getLogger("slimlm")


@dataclass
class RunMemo:
    """What the stages of one run remember and reuse, never reported: how the current model
    came to be, and inputs that are computed once per run however many stages read them."""

    model_origin: Optional[str] = None
    """How the current model came to be, as the report's generations name it: "artifact <id>",
    "reloaded from hf", "streamed into ...". None: the run's source model as loaded, which is how
    RunState.is_original tells it. Set each time another model becomes the current one; loading
    the files the model lies in keeps it."""

    changes: list[str] = field(default_factory=list)
    """How stages changed the current model without quantizing it (sparsified, pruned, distilled):
    any change makes it no longer the original, although it has no schemes. Cleared when another
    model becomes the current one."""

    original_model_cfg: Optional[DictConfig] = None
    """The model config that loads the uncompressed model the current one descends from, once a
    loaded slimlm artifact named its source; None: the run's cfg.model. Kept for the whole run:
    KL references and reloads of exported files need that model."""

    calibration_ids: Optional[torch.Tensor] = None
    """data.calibration as token ids, tokenized by the first stage that needs them (quantize,
    distill) and reused by the rest."""

    eval_token_ids: Optional[torch.Tensor] = None
    """data.eval_text as token ids, tokenized once per run so that every evaluate row scores the
    same windows."""

    reference_logits: dict[Path, ReferenceLogits] = field(default_factory=dict)
    """The original model's reference pass (slimlm.eval.kl.ReferenceLogits) by its cache file:
    read from disk or computed once, then reused by every later evaluate stage of the run."""


@dataclass
class RunState:
    """What one run carries from stage to stage."""

    cfg: DictConfig
    run_dir: Path
    model: Any  # a transformers PreTrainedModel, possibly with quantized modules; None until loaded
    tokenizer: Any
    source: Any  # slimlm.models.ModelSource: where the starting model came from
    source_sha256: Any  # str or None: hash of the source weights, for provenance
    device: torch.device
    schemes: dict[str, dict] = field(default_factory=dict)  # module name -> how it was compressed
    evaluations: list[dict] = field(default_factory=list)  # one row per evaluate stage
    sections: dict[str, Any] = field(default_factory=dict)  # other report sections by name
    memo: RunMemo = field(default_factory=RunMemo)  # what stages reuse within the run, not reported
    # While model is None: the files the current model lies in (an artifact or a checkpoint a
    # stage wrote), or None for the run's source model.
    on_disk: Optional[Path] = None
    resumes: bool = False  # the run directory held an unfinished run (killed or failed) that this run redoes
    scratch: list[Path] = field(
        default_factory=list
    )  # kept for a resumed run to go on from; removed when the run completes
    launch: Launch = field(default_factory=Launch)  # this process's place among the run's processes

    def output_path(self, name: str) -> Path:
        """Where a stage writes its output `name` in the run directory. In a run that resumes an
        unfinished one, what that run left under the name is removed first: the stage writes
        it again (outputs are otherwise never overwritten)."""
        path = self.run_dir / name
        if self.resumes and (path.exists() or path.is_symlink()):
            log.warning("replacing '%s', written by the unfinished run this run resumes", path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        return path

    def is_original(self) -> bool:
        """True while the model is the source model as loaded (nothing compressed or swapped)."""
        return not self.schemes and self.memo.model_origin is None and not self.memo.changes

    def provenance(self) -> dict:
        """The source model as an artifact's manifest records it."""
        return {"id": self.source.id, "kind": self.source.kind, "sha256": self.source_sha256}

    def unloaded_local_source(self) -> bool:
        """The current model is the run's own local checkpoint (an HF directory, or a GGUF's
        converted cache), and no stage has loaded it: a stage can read its files instead. Not
        in a run of several processes: each holds the model it trains, and one writes files."""
        local = self.source is not None and self.source.kind in ("hf-dir", "gguf")
        unloaded = self.model is None and self.on_disk is None and not self.launch.several
        return unloaded and local and self.cfg.model.bnb is None

    def recipe(self) -> dict:
        return OmegaConf.to_container(self.cfg.recipe, resolve=True)

    def mark_changed(self, how: str) -> None:
        """Record that a stage changed the model's weights or shape without quantizing it
        (sparsified, pruned): its rows are no longer the original model's."""
        self.memo.changes.append(how)

    def original_model_cfg(self) -> Any:
        """The config that loads the uncompressed model this run's model descends from."""
        original = self.memo.original_model_cfg
        return self.cfg.model if original is None else original

    def load(self) -> None:
        """Load the current model into memory: the source model, or the files it lies in."""
        from slimlm.models import load_model

        if self.on_disk is None:
            self.adopt(load_model(self.cfg.model, self.device, self.source_sha256), origin=None)
            return
        model_cfg = OmegaConf.merge(self.original_model_cfg(), {"path": str(self.on_disk), "bnb": None})
        self.adopt(load_model(model_cfg, self.device), self.memo.model_origin)

    def lies_in(self, path: Path, origin: str) -> None:
        """The current model is now the files at `path` (an artifact or a checkpoint directory that
        a stage wrote), not loaded: the next stage that needs it in memory loads it from there."""
        self.model = self.tokenizer = None
        self.on_disk = Path(path)
        self.memo.model_origin = origin
        self.memo.changes = []
        self.schemes = (
            {name: scheme_of(record).to_dict() for name, record in parse_manifest(path)["modules"].items()}
            if is_artifact(path)
            else {}
        )

    def adopt(self, loaded: Any, origin: Optional[str]) -> None:
        """Make a freshly loaded model (slimlm.models.LoadedModel) the current one."""
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.on_disk = None
        self.schemes = {}
        self.memo.model_origin = origin
        self.memo.changes = []
        if loaded.manifest is not None:  # a slimlm artifact: compressed, made from its source model
            self.schemes = {
                name: scheme_of(record).to_dict() for name, record in loaded.manifest["modules"].items()
            }
            self.memo.model_origin = origin or f"artifact {loaded.source.id}"
            self.memo.original_model_cfg = OmegaConf.merge(
                self.cfg.model, {"path": loaded.manifest["source"]["id"]}
            )


@dataclass(frozen=True)
class DiskRun:
    """A stage's way to work on the current model where it lies on disk, not loaded:
    `applies(state, params)` says whether it can this time, `run` does it."""

    applies: Callable[[RunState, Any], bool]
    run: Callable[[RunState, Any], None]


@dataclass(frozen=True)
class Stage:
    name: str
    params: type  # a dataclass; its __post_init__ checks values
    run: Callable[[RunState, Any], None]
    # Checks that need the whole config and the model source (data files a stage will read,
    # limits of the model), run before any model loads: check(cfg, params, source).
    check: Optional[Callable[[DictConfig, Any, Any], None]] = None
    on_disk: tuple[DiskRun, ...] = ()  # the first that applies runs
    # It reads the model without changing it (evaluate, export, generate): of several
    # processes, only the main one runs it (slimlm/processes.py).
    reads_only: bool = False


@dataclass(frozen=True)
class PlannedStage:
    stage: Stage
    params: Any
    index: int

    @property
    def title(self) -> str:
        return f"stage {self.index + 1} ({self.stage.name})"


def run_stage(state: RunState, planned: PlannedStage) -> Optional[float]:
    """Run one planned stage, loading the model first if the stage needs it in memory and no
    stage has loaded it yet; returns the seconds loading took (None: nothing loaded)."""
    try:
        disk = (
            next((way for way in planned.stage.on_disk if way.applies(state, planned.params)), None)
            if state.model is None
            else None
        )
        if disk is not None:
            disk.run(state, planned.params)
            return None
        load_seconds = None
        if state.model is None:
            started = time.perf_counter()
            state.load()
            load_seconds = time.perf_counter() - started
        planned.stage.run(state, planned.params)
        return load_seconds
    finally:
        return_freed_memory()  # what the stage freed is not counted against the next


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
