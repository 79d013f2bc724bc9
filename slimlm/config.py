"""Structured config schemas: Hydra checks every key and type against these before any work.

The primary config composes one option from each group (model, data, eval, hardware, decoder,
recipe). Values that a type cannot express (an existing path, a known device) are checked in
`slimlm.pipeline.validate`, still before any model loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from slimlm.errors import ConfigError

DEVICES = ("cpu", "cuda", "auto")
BNB_MODES = ("int8", "nf4")  # bitsandbytes quantization on load (the peer baselines)


SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class ModelPackageConfig:
    """A model file shipped on PyPI split into chunk packages (PyPI caps a file's size): each
    distribution's wheel holds `<module>/data/partNN.bin`, and the parts concatenated in order
    are the file, of exactly `bytes` bytes and this `sha256`. slimlm/model_packages.py fetches it."""

    distributions: List[str] = MISSING  # in order: part 1 first
    version: str = MISSING  # pinned: another version's bytes would not match the hash
    bytes: int = MISSING
    sha256: str = MISSING

    def __post_init__(self) -> None:
        if not self.distributions or not all(
            re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", d) for d in self.distributions
        ):
            raise ConfigError(
                f"model.package.distributions={list(self.distributions)} "
                "must list PyPI distribution names, part 1 first"
            )
        if not re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", self.version):
            raise ConfigError(f"model.package.version='{self.version}' is not a version; pin one, e.g. 0.9.0")
        if self.bytes < 1:
            raise ConfigError(f"model.package.bytes={self.bytes} must be the file's size in bytes")
        if not SHA256.match(self.sha256):
            raise ConfigError(
                "model.package.sha256 must be 64 lowercase hex digits (the whole file's sha256)"
            )


@dataclass
class ModelConfig:
    name: str = MISSING
    # A local HF checkpoint directory, a .gguf file, `pkg://module/file.gguf` inside an
    # installed package, `cache://relative/file.gguf` in slimlm's cache, or a hub id such as
    # `HuggingFaceTB/SmolLM2-135M-Instruct`.
    path: str = MISSING
    dtype: str = "float32"
    revision: Optional[str] = None
    bnb: Optional[str] = None  # int8 | nf4: quantize on load with bitsandbytes (the peer baselines)
    # Where the file at `path` comes from when it is not there yet (fetched before the run).
    package: Optional[ModelPackageConfig] = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(
                f"model.dtype='{self.dtype}' is not supported; use float32, float16 or bfloat16"
            )
        if self.bnb is not None and self.bnb not in BNB_MODES:
            raise ConfigError(f"model.bnb='{self.bnb}' is unknown; use {' or '.join(BNB_MODES)}, or null")


@dataclass
class TextSourceConfig:
    path: str = MISSING  # a local file, or a hub data set id with format=hub
    # text: the whole file is one document; jsonl: one record per line; hub; model (calibration
    # only): sampled from the original model (DataConfig.sampling)
    format: str = "text"
    field: str = "text"  # the field holding the text (jsonl and hub)
    subset: Optional[str] = None  # hub data set configuration, e.g. wikitext-2-raw-v1
    split: str = "test"  # hub data set split


@dataclass
class SamplingConfig:
    """Text sampled from the run's original model, the calibration text when
    data.calibration.format is `model` (slimlm/model_samples.py)."""

    tokens: int = 100_000  # sampled in all (rounded up to whole samples)
    length: int = 256  # tokens per sample
    temperature: float = 1.0
    batch_size: int = 128  # samples drawn together
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.length < 2 or self.batch_size < 1:
            raise ConfigError(
                f"data.sampling: tokens ({self.tokens}) and batch_size ({self.batch_size}) must be "
                f"at least 1 and length ({self.length}) at least 2"
            )
        if not 0 < self.temperature < float("inf"):
            raise ConfigError(f"data.sampling.temperature={self.temperature} must be a positive number")


@dataclass
class DataConfig:
    name: str = MISSING
    eval_text: TextSourceConfig = field(default_factory=TextSourceConfig)
    # format `model`: sampled from the original model as `sampling` says (path is not read)
    calibration: TextSourceConfig = field(default_factory=TextSourceConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # The folder holding the zero-shot benchmark sets (lambada/, arc/, piqa/, hellaswag/).
    benchmarks_root: str = "${oc.env:SLIMLM_DATA_DIR,../shared/data}"


@dataclass
class PerplexityConfig:
    window: int = 2048  # tokens per non-overlapping window (the GPTQ/AWQ papers' protocol)
    max_windows: Optional[int] = None  # None scores the whole text
    batch_size: int = 1

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ConfigError(f"eval.perplexity.window={self.window} must be at least 2 tokens")
        if self.max_windows is not None and self.max_windows < 1:
            raise ConfigError(
                f"eval.perplexity.max_windows={self.max_windows} "
                "must be at least 1 (or null for the whole text)"
            )
        if self.batch_size < 1:
            raise ConfigError(f"eval.perplexity.batch_size={self.batch_size} must be at least 1")


@dataclass
class KLConfig:
    top_k: int = 32  # the original model's top-k log-probs kept per position

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ConfigError(f"eval.kl.top_k={self.top_k} must be at least 1")


@dataclass
class ZeroShotConfig:
    tasks: List[str] = field(default_factory=lambda: ["lambada", "arc_easy", "piqa", "hellaswag"])
    # lm-evaluation-harness tasks run on the same model (pip install -e '.[harness]'): its own
    # task names, or local_arc_easy, local_piqa, local_hellaswag, local_lambada_openai (the
    # harness's tasks on the data root's files: slimlm/eval/harness.py)
    harness_tasks: List[str] = field(default_factory=list)
    limit: Optional[int] = None  # the first N items of each task; None: all
    batch_size: int = 16

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"eval.zeroshot.limit={self.limit} must be at least 1 (or null for every item)")
        if self.batch_size < 1:
            raise ConfigError(f"eval.zeroshot.batch_size={self.batch_size} must be at least 1")


@dataclass
class SpeedConfig:
    prompt_tokens: int = 16
    new_tokens: int = 128
    batch_sizes: List[int] = field(default_factory=lambda: [1, 8])
    warmup: int = 1
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.new_tokens < 1 or self.repeats < 1 or self.warmup < 0:
            raise ConfigError(
                "eval.speed: prompt_tokens, new_tokens and repeats must be at least 1, warmup at least 0"
            )
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(
                f"eval.speed.batch_sizes={list(self.batch_sizes)} must list batch sizes of at least 1"
            )


METRICS = ("perplexity", "kl", "size", "zeroshot", "speed")


def check_metrics(metrics: List[str], where: str) -> None:
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ConfigError(f"{where}: unknown metric(s) {unknown}; choose from {', '.join(METRICS)}")
    if "kl" in metrics and "perplexity" not in metrics:
        raise ConfigError(
            f"{where}: 'kl' is computed in the perplexity pass; add 'perplexity' to the metrics"
        )


@dataclass
class EvalConfig:
    name: str = MISSING
    metrics: List[str] = field(default_factory=lambda: ["perplexity", "kl", "size"])
    perplexity: PerplexityConfig = field(default_factory=PerplexityConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    zeroshot: ZeroShotConfig = field(default_factory=ZeroShotConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)

    def __post_init__(self) -> None:
        check_metrics(self.metrics, "eval.metrics")


@dataclass
class HardwareConfig:
    name: str = MISSING
    device: str = "cpu"  # cpu | cuda | auto
    threads: Optional[int] = None  # CPU threads for torch; None keeps torch's default

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"hardware.device='{self.device}' is unknown; use one of {', '.join(DEVICES)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"hardware.threads={self.threads} must be at least 1 (or null)")


@dataclass
class DecoderConfig:
    name: str = MISSING
    max_new_tokens: int = 48
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"decoder.max_new_tokens={self.max_new_tokens} must be at least 1")


@dataclass
class RecipeConfig:
    name: str = MISSING
    description: str = ""
    # Each stage is a mapping with a `stage` key; its other keys are checked against that
    # stage's own dataclass (see slimlm.pipeline.Stage) before the run starts.
    stages: List[Any] = MISSING
    file: Optional[str] = None  # the YAML file of a user's recipe (slimlm/user_recipes.py sets it)


@dataclass
class SlimlmConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    eval: EvalConfig = MISSING
    hardware: HardwareConfig = MISSING
    decoder: DecoderConfig = MISSING
    recipe: RecipeConfig = MISSING
    seed: int = 0


def register_schemas() -> None:
    ConfigStore.instance().store(name="slimlm_schema", node=SlimlmConfig)
