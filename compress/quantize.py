"""The `quantize` stage: replace the selected Linear layers with quantized ones.

Methods: `rtn` (round to nearest, no data), `gptq` and `awq` (calibrated on data.calibration,
layer by layer; see compress/gptq.py, compress/awq.py and compress/calibration.py). Layers
outside the decoder layers (the LM head) are rounded with RTN whatever the method; a quantized
head's untied input embedding is rounded with it, in the head's scheme. With `bpw`
set, each layer's bit width is chosen from `candidate_bits` to meet that average budget
(compress/mixed.py).

Uniform quantization of a local checkpoint that no earlier stage has loaded runs from disk into
an artifact in the run directory (`quantized/`): RTN streams the checkpoint a tensor at a time
(`run_streamed`, compress/stream_rtn.py), GPTQ and AWQ of the decoder layers calibrate it a
decoder block at a time (`run_calibrated_from_disk`, compress/calibrated_artifact.py). The
stages after it read that artifact, so a quantize-export-generate recipe never holds the model
in memory.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
from tqdm import tqdm

from slimlm.architecture import decoder_blocks, model_type, require_family, untied_table
from slimlm.checkpoint import checkpoint_tokenizer
from slimlm.compress.awq import AWQOptions, awq_quantize_layer
from slimlm.compress.calibration import CalibrationParams, calibrate_sequentially, calibration_samples
from slimlm.compress.gptq import (
    GPTQOptions,
    HessianAccumulator,
    LayerInputStatistics,
    gptq_quantize,
    precise_hessian,
)
from slimlm.compress.mixed import bits_per_weight, choose_bits, fisher_diagonal, predicted_loss
from slimlm.compress.rtn import QuantizedWeight, quantize_rtn
from slimlm.compress.stream_rtn import stream_rtn
from slimlm.compress.targets import compile_patterns, select_linear_modules
from slimlm.data import MODEL_FORMAT, check_text_source, load_text, tokenize_text_cached
from slimlm.errors import ConfigError, SlimlmError
from slimlm.experts import split_experts
from slimlm.half_linear import float32_linears
from slimlm.memory import peak_memory
from slimlm.model_samples import original_model_samples
from slimlm.models import DTYPES, checkpoint_directory
from slimlm.packing import PACKABLE_BITS
from slimlm.pipeline import DiskRun, RunState, Stage
from slimlm.qlinear import (
    QuantLinear,
    QuantScheme,
    QuantTable,
    embedding_scale,
    set_submodule,
    tie_quantized_head,
)

log = logging.getLogger(__name__)

METHODS = ("rtn", "gptq", "awq")
CALIBRATED = ("gptq", "awq")
ERROR_CHUNK_BYTES = 32 * 2**20  # float32 rows compared at once by layer_error
STREAMED_ARTIFACT = "quantized"  # in the run directory: the artifact RTN streams a checkpoint into


@dataclass
class QuantizeParams(CalibrationParams):
    method: str = "rtn"
    bits: Optional[int] = None  # uniform bit width (8 when neither bits nor bpw is given)
    group_size: Optional[int] = None  # None: one scale per output channel
    symmetric: bool = True
    targets: List[str] = field(default_factory=lambda: [r"model\.layers\.\d+\..*"])
    ignore: List[str] = field(default_factory=list)
    # Mixed precision: a budget in average bits per weight over the quantized layers (scales and
    # zero points counted), met by choosing each layer's bit width from candidate_bits by its
    # measured sensitivity (Fisher-weighted rounding error on sensitivity_samples windows).
    bpw: Optional[float] = None
    candidate_bits: List[int] = field(default_factory=lambda: [2, 3, 4, 8])
    sensitivity_samples: int = 32
    # Calibration (gptq, awq, sensitivity): samples, seq_len, seed (CalibrationParams).
    # GPTQ: damping as a fraction of the mean Hessian diagonal, lazy-update block, act-order.
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True
    # GPTQ (static groups) and AWQ: choose each group's quantization range by the layer's output error.
    clip_search: bool = True
    # AWQ: points of the scale search and of the clipping search.
    awq_grid: int = 20
    awq_clip_grid: int = 20

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"quantize.method='{self.method}' is unknown; available: {', '.join(METHODS)}")
        if self.bits is not None and self.bpw is not None:
            raise ConfigError(
                "quantize: give bits (one width for every layer) or bpw (a mixed-precision budget), not both"
            )
        for bits in [self.bits] if self.bpw is None else self.candidate_bits:
            if bits is not None and bits not in PACKABLE_BITS:
                raise ConfigError(
                    f"quantize: {bits}-bit weights are not supported; "
                    f"choose from {', '.join(map(str, PACKABLE_BITS))}"
                )
        if self.bpw is not None and len(set(self.candidate_bits)) < 2:
            raise ConfigError(
                f"quantize.candidate_bits={self.candidate_bits}: "
                "mixed precision needs at least two bit widths to choose from"
            )
        if self.group_size is not None and self.group_size < 8:
            raise ConfigError(
                f"quantize.group_size={self.group_size} must be at "
                "least 8 (or null for one scale per output channel)"
            )
        self.check_calibration("quantize")
        if self.sensitivity_samples < 1:
            raise ConfigError(f"quantize.sensitivity_samples={self.sensitivity_samples} must be at least 1")
        if not 0 < self.damp < 1:
            raise ConfigError(f"quantize.damp={self.damp} must lie between 0 and 1 (0.01 is usual)")
        if self.block_size < 1 or self.awq_grid < 1 or self.awq_clip_grid < 2:
            raise ConfigError(
                "quantize: block_size and awq_grid must be at least 1, awq_clip_grid at least 2"
            )
        if not self.targets:
            raise ConfigError(
                "quantize.targets is empty: give at least one regex "
                "over module names, e.g. 'model\\.layers\\.\\d+\\..*'"
            )
        compile_patterns([*self.targets, *self.ignore])

    def scheme_for(self, bits: int) -> QuantScheme:
        return QuantScheme(
            bits=bits, group_size=self.group_size, symmetric=self.symmetric, method=self.method
        )

    @property
    def scheme(self) -> QuantScheme:
        """The uniform scheme (mixed precision uses scheme_for each chosen width)."""
        return self.scheme_for(self.bits or 8)


def check_shapes(model, names: list[str], scheme: QuantScheme) -> None:
    """Refuse before touching any layer, naming the first one the scheme does not fit."""
    for name in names:
        problem = scheme.shape_problem(model.get_submodule(name).in_features)
        if problem:
            raise SlimlmError(
                f"cannot quantize {name}: {problem}; change the stage's group_size or exclude the "
                "layer with its ignore list (+recipe.stages.N.ignore=[...] on the command line)"
            )


@torch.no_grad()
def run(state: RunState, params: QuantizeParams) -> None:
    started = time.perf_counter()
    # a transformers model given directly: its fused experts become Linear layers, as slimlm's
    # loaders make them
    split_experts(state.model)
    names = select_linear_modules(state.model, params.targets, params.ignore)
    check_shapes(state.model, names, params.scheme)
    section = section_header(params, len(names))
    if params.bpw is None:
        schemes = {name: params.scheme for name in names}
    else:
        schemes, section["mixed_precision"] = mixed_schemes(state, params, names)
    errors: dict[str, float] = {}

    def replace(name: str, quantized: QuantizedWeight, scheme: QuantScheme) -> None:
        linear = state.model.get_submodule(name)
        layer = QuantLinear.from_codes(
            quantized.codes, quantized.scales, quantized.zeros, scheme, linear.bias
        )
        errors[name] = layer_error(linear.weight, layer)
        head = linear is state.model.get_output_embeddings()
        table = untied_table(state.model) if head else None
        tied = head and getattr(state.model.get_input_embeddings(), "weight", None) is linear.weight
        set_submodule(state.model, name, layer)
        state.schemes[name] = scheme.to_dict()
        if tied:
            tie_quantized_head(state.model)
        elif table is not None:
            state.schemes[table] = quantize_table(state.model, scheme).to_dict()

    inside = []
    if params.method in CALIBRATED:
        layer_prefix = decoder_blocks(state.model)[0] + "."
        inside = [name for name in names if name.startswith(layer_prefix)]
    if inside:
        section.update(run_calibrated(state, params, {name: schemes[name] for name in inside}, replace))
    rounded = [name for name in names if name not in inside]
    if inside and rounded:
        log.info(
            "%d layer(s) outside the decoder layers (%s) are rounded with RTN",
            len(rounded),
            ", ".join(rounded[:3]),
        )
    for name in tqdm(rounded, desc="quantize rtn", unit="layer", disable=not rounded):
        scheme = dataclasses.replace(schemes[name], method="rtn")
        replace(name, quantize_rtn(state.model.get_submodule(name).weight, scheme), scheme)
    section["seconds"] = round(time.perf_counter() - started, 2)
    state.sections.setdefault("quantization", []).append({**section, "weight_rel_error": errors})


def section_header(params: QuantizeParams, layers: int) -> dict:
    """The start of the report's quantization section: how, and how many layers."""
    return {
        "method": params.method,
        "bits": params.bits,
        "group_size": params.group_size,
        "symmetric": params.symmetric,
        "layers": layers,
    }


def streams(state: RunState, params: QuantizeParams) -> bool:
    """Uniform RTN of a local checkpoint that no stage has loaded needs no model in memory."""
    return params.method == "rtn" and params.bpw is None and state.unloaded_local_source()


def calibrates_from_disk(state: RunState, params: QuantizeParams) -> bool:
    """Uniform GPTQ or AWQ of the decoder layers of a local checkpoint that no stage has loaded
    needs one decoder block in memory at a time."""
    from slimlm.compress.calibrated_artifact import targets_outside_blocks

    if params.method not in CALIBRATED or params.bpw is not None or not state.unloaded_local_source():
        return False
    return not targets_outside_blocks(checkpoint_directory(state.source, state.source_sha256), params)


def run_streamed(state: RunState, params: QuantizeParams) -> None:
    """RTN from the checkpoint's files straight into an artifact (compress/stream_rtn.py), one
    tensor in memory at a time; the artifact is then the current model, read from disk by the
    stages that follow (or loaded by the first that needs it in memory)."""
    started = time.perf_counter()
    directory = checkpoint_directory(state.source, state.source_sha256)
    path = state.output_path(STREAMED_ARTIFACT)
    streamed = stream_rtn(
        directory,
        path,
        params.scheme,
        params.targets,
        params.ignore,
        source=state.provenance(),
        recipe=state.recipe(),
        dtype=DTYPES[state.cfg.model.dtype],
    )
    state.lies_in(streamed.path, f"streamed into {STREAMED_ARTIFACT}/")
    section = section_header(params, len(streamed.weight_rel_error))
    section.update(
        streamed=f"{STREAMED_ARTIFACT}/",
        seconds=round(time.perf_counter() - started, 2),
        weight_rel_error=streamed.weight_rel_error,
    )
    state.sections.setdefault("quantization", []).append(section)


def run_calibrated_from_disk(state: RunState, params: QuantizeParams) -> None:
    """GPTQ or AWQ from the checkpoint's files, one decoder block read, calibrated, quantized and
    written at a time, into an artifact in the run directory (compress/calibrated_artifact.py);
    the artifact is then the current model, as after run_streamed."""
    from slimlm.compress.calibrated_artifact import calibrate_into_artifact

    started = time.perf_counter()
    directory = checkpoint_directory(state.source, state.source_sha256)
    samples = calibration_samples(
        calibration_token_ids(state, checkpoint_tokenizer(directory)),
        params.samples,
        params.seq_len,
        params.seed,
    )
    path = state.output_path(STREAMED_ARTIFACT)
    progress = state.run_dir / f"{STREAMED_ARTIFACT}-blocks"
    state.scratch.append(progress)  # a rerun of this run, killed later, rewrites the artifact from it
    made = calibrate_into_artifact(
        directory,
        path,
        progress,
        params,
        samples,
        state.provenance(),
        state.recipe(),
        DTYPES[state.cfg.model.dtype],
        state.device,
    )
    state.lies_in(made.path, f"calibrated block by block into {STREAMED_ARTIFACT}/")
    section = section_header(params, made.calibration.quantized_layers)
    section.update(
        calibration_facts(samples, params, made.calibration.peak_memory_bytes, made.calibration.report())
    )
    section.update(
        streamed=f"{STREAMED_ARTIFACT}/",
        seconds=round(time.perf_counter() - started, 2),
        weight_rel_error=made.calibration.weight_rel_error,
    )
    state.sections.setdefault("quantization", []).append(section)


def quantize_table(model, scheme: QuantScheme) -> QuantScheme:
    """Round the model's untied input embedding (RTN) in its quantized head's scheme, one row per
    token: beside an 8-bit head a float table would stay a quarter of a 0.5B model's bytes.
    Returns the table's scheme."""
    embedding = model.get_input_embeddings()
    rounded = dataclasses.replace(scheme, method="rtn")
    quantized = quantize_rtn(embedding.weight, rounded)
    layer = QuantLinear.from_codes(quantized.codes, quantized.scales, quantized.zeros, rounded, None)
    model.set_input_embeddings(QuantTable.holding(layer, embedding.weight.dtype, embedding_scale(embedding)))
    return rounded


def run_calibrated(
    state: RunState, params: QuantizeParams, schemes: dict[str, QuantScheme], replace: Callable
) -> dict:
    """GPTQ or AWQ layer by layer on calibration windows; returns what the report states about it."""
    samples = calibration_windows(state, params.samples, params.seq_len, params.seed)
    quantizer = CalibratedQuantizer(state.model, params, schemes, replace)
    peak = calibrate_sequentially(
        state.model,
        samples,
        list(schemes),
        quantizer.hessians.observe,
        quantizer,
        desc=f"{params.method} {describe_bits(schemes)}",
    )
    return calibration_facts(samples, params, peak, quantizer.report())


def calibration_facts(samples: torch.Tensor, params: QuantizeParams, peak_bytes: int, report: dict) -> dict:
    """What the report states about a calibrated quantization."""
    return {
        "calibration_tokens": samples.numel(),
        "samples": params.samples,
        "seq_len": params.seq_len,
        "calibration_peak_memory_bytes": peak_bytes,
        **report,
    }


@dataclass
class CalibratedQuantizer:
    """calibrate_sequentially's finish_layer: GPTQ or AWQ for a finished block's layers, from the
    input statistics it gathered. An expert no calibration token was routed to has none: it is
    rounded (RTN), and its scheme says so."""

    model: Any
    params: QuantizeParams
    schemes: dict[str, QuantScheme]
    replace: Callable[[str, QuantizedWeight, QuantScheme], None]
    hessians: LayerInputStatistics = field(init=False)
    awq_errors: dict[str, list[float]] = field(default_factory=dict)
    unseen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        awq = self.params.method == "awq"
        self.mappings = require_family(model_type(self.model), "AWQ").mappings if awq else ()
        self.hessians = LayerInputStatistics(precise_hessian if awq else HessianAccumulator)

    def __call__(self, block: str, layer_names: list[str]) -> None:
        seen = [name for name in layer_names if name in self.hessians]
        if self.params.method == "gptq":
            self._gptq(seen)
        else:
            self._awq(block, seen)
        for name in layer_names:
            self.hessians.pop(name, None)
            if name not in seen:
                self.unseen.append(name)
                rounded = dataclasses.replace(self.schemes[name], method="rtn")
                self.replace(name, quantize_rtn(self.model.get_submodule(name).weight, rounded), rounded)

    def _gptq(self, names: list[str]) -> None:
        params = self.params
        options = GPTQOptions(
            damp=params.damp,
            block_size=params.block_size,
            act_order=params.act_order,
            clip_search=params.clip_search,
        )
        for name in names:
            weight = self.model.get_submodule(name).weight
            self.replace(
                name,
                gptq_quantize(weight, self.hessians.take_hessian(name), self.schemes[name], options, name),
                self.schemes[name],
            )

    def _awq(self, block: str, names: list[str]) -> None:
        params = self.params
        module = self.model.get_submodule(block)
        first = next(module.parameters())
        with float32_linears(first.dtype, first.device):  # its search runs the block's layers many times
            quantized = awq_quantize_layer(
                module,
                block,
                {n: self.schemes[n] for n in names},
                self.hessians,
                self.mappings,
                AWQOptions(grid=params.awq_grid, clip_grid=params.awq_clip_grid, clip=params.clip_search),
                on_scaled=lambda name, error, rtn: self.awq_errors.__setitem__(
                    name, [round(error, 6), round(rtn, 6)]
                ),
            )
        for name, weight in quantized.items():
            self.replace(name, weight, self.schemes[name])

    def report(self) -> dict:
        result: dict[str, Any] = {}
        if self.unseen:
            log.info(
                "%d layer(s) saw no calibration token (experts "
                "nothing was routed to) and were rounded with RTN",
                len(self.unseen),
            )
            result["uncalibrated_layers"] = self.unseen
        if self.awq_errors:
            result["awq_output_error"] = (
                self.awq_errors
            )  # per scaled mapping: [with the chosen scale, plain RTN]
        return result


def describe_bits(schemes: dict[str, QuantScheme]) -> str:
    widths = sorted({scheme.bits for scheme in schemes.values()})
    return f"int{widths[0]}" if len(widths) == 1 else "mixed int" + "/".join(map(str, widths))


def calibration_token_ids(state: RunState, tokenizer: Any = None) -> torch.Tensor:
    """data.calibration as token ids, tokenized once per run (by `tokenizer` while no model is
    loaded: the one of the files the model lies in), or the original model's own samples."""
    if state.memo.calibration_ids is not None:
        return state.memo.calibration_ids
    source = state.cfg.data.calibration
    if source.format == MODEL_FORMAT:
        state.memo.calibration_ids = original_model_samples(state)
    else:
        state.memo.calibration_ids = tokenize_text_cached(
            tokenizer or state.tokenizer, load_text(source, "calibration")
        )
    return state.memo.calibration_ids


def calibration_windows(state: RunState, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """Windows of data.calibration chosen at random with `seed`."""
    return calibration_samples(calibration_token_ids(state), samples, seq_len, seed)


def mixed_schemes(
    state: RunState, params: QuantizeParams, names: list[str]
) -> tuple[dict[str, QuantScheme], dict]:
    """Each layer's scheme under the bpw budget, and the report section that explains the choice."""
    windows = calibration_windows(state, params.sensitivity_samples, params.seq_len, params.seed + 1)
    with torch.enable_grad(), peak_memory(state.device) as peak:
        fisher = fisher_diagonal(state.model, windows, names)
    candidates = sorted(set(params.candidate_bits))
    costs, sizes = {}, {}
    for name in tqdm(names, desc="sensitivity per layer", unit="layer"):
        linear = state.model.get_submodule(name)
        costs[name] = {
            b: predicted_loss(linear.weight, fisher[name], params.scheme_for(b), params.seq_len)
            for b in candidates
        }
        sizes[name] = (
            linear.weight.numel(),
            {b: bits_per_weight(params.scheme_for(b), linear.in_features) for b in candidates},
        )
    allocation = choose_bits(costs, sizes, params.bpw)
    section = {
        "budget_bpw": params.bpw,
        "achieved_bpw": round(allocation.bpw, 4),
        "candidate_bits": candidates,
        "predicted_kl": round(allocation.predicted_loss, 6),
        "sensitivity_windows": params.sensitivity_samples,
        "sensitivity_peak_memory_bytes": peak.bytes,
        "bits": allocation.bits,
        "predicted_kl_per_layer": {
            name: {str(b): cost for b, cost in per_bits.items()} for name, per_bits in costs.items()
        },
    }
    return {name: params.scheme_for(allocation.bits[name]) for name in names}, section


def check(cfg, params: QuantizeParams, source) -> None:
    if params.method == "awq" and source.architecture is not None:
        require_family(source.architecture, "AWQ")
    if params.method in CALIBRATED or params.bpw is not None:
        check_text_source(cfg.data.calibration, "calibration")


def layer_error(weight: torch.Tensor, layer: QuantLinear) -> float:
    """||W - Q(W)|| / ||W|| of `layer` against the float `weight` it replaces, the per-layer number
    reports plot; a run of rows at a time (an 8B down projection's float32 copies would be 0.7 GB)."""
    step = max(1, ERROR_CHUNK_BYTES // (4 * layer.in_features))
    error, norm = 0.0, 0.0
    for start in range(0, layer.out_features, step):
        rows = weight[start : start + step].detach().float()
        rounded = layer.dequantize(rows=torch.arange(start, start + rows.shape[0], device=rows.device))
        error += float(torch.sum((rows - rounded) ** 2))
        norm += float(torch.sum(rows**2))
    return (error / max(norm, 1e-24)) ** 0.5


QUANTIZE = Stage(
    name="quantize",
    params=QuantizeParams,
    run=run,
    check=check,
    on_disk=(DiskRun(streams, run_streamed), DiskRun(calibrates_from_disk, run_calibrated_from_disk)),
)
