"""The `sparsify` stage: set a fraction of the selected Linear weights to exactly zero.

Methods (compress/sparsity.py): `magnitude` (no data), `wanda` and `sparsegpt` (calibrated on
data.calibration layer by layer, like GPTQ: each layer is pruned on the inputs the already
pruned layers before it produce). Patterns: `unstructured` at `sparsity`, or N:M ('2:4', '4:8').
`owl: true` gives each decoder layer its own ratio from its outlier statistics (one extra pass
over the dense model), averaging `sparsity`.

The weights stay dense tensors with zeros in them: a later quantize stage keeps the zeros
(prune, then quantize the survivors), the artifact stores them as a bitmask, and reports say
plainly that unstructured zeros do not make dense kernels faster.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import List

import torch
from tqdm import tqdm

from slimlm.compress.calibration import CalibrationParams, calibrate_sequentially
from slimlm.compress.gptq import HessianAccumulator, LayerInputStatistics, SquareSums
from slimlm.compress.quantize import calibration_windows
from slimlm.compress.sparsity import (
    SparsityPattern,
    magnitude_mask,
    outlier_ratio,
    owl_ratios,
    sparsegpt_prune,
    wanda_mask,
    wanda_scores,
)
from slimlm.compress.targets import compile_patterns, select_linear_modules
from slimlm.data import check_text_source
from slimlm.errors import ConfigError, SlimlmError
from slimlm.pipeline import RunState, Stage
from slimlm.qlinear import QuantLinear

METHODS = ("magnitude", "wanda", "sparsegpt")


@dataclass
class SparsifyParams(CalibrationParams):
    method: str = "wanda"
    sparsity: float = 0.5  # fraction of weights set to zero (unstructured)
    pattern: str = "unstructured"  # or N:M, e.g. '2:4' (N kept in every M consecutive inputs)
    targets: List[str] = field(default_factory=lambda: [r"model\.layers\.\d+\..*"])
    ignore: List[str] = field(default_factory=list)
    # OWL: per-layer ratios from the fraction of Wanda scores above owl_threshold x their mean,
    # spread over sparsity +- owl_spread.
    owl: bool = False
    owl_threshold: float = 5.0
    owl_spread: float = 0.08
    # Calibration (wanda, sparsegpt): samples, seq_len, seed (CalibrationParams).
    # SparseGPT: damping (fraction of the mean Hessian diagonal) and columns per mask block.
    damp: float = 0.01
    block_size: int = 128

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"sparsify.method='{self.method}' is unknown; available: {', '.join(METHODS)}")
        pattern = self.parsed_pattern  # checks sparsity and pattern
        if self.owl and (pattern.is_nm or self.method == "magnitude"):
            raise ConfigError(
                "sparsify.owl sets per-layer unstructured ratios from activations: "
                "use it with method wanda or sparsegpt and pattern 'unstructured'"
            )
        if self.owl and not 0 <= 2 * self.owl_spread <= min(self.sparsity, 1 - self.sparsity):
            # the ratios span 2 x spread around their mean, so one layer can sit up to 2 x spread
            # from the target
            raise ConfigError(
                f"sparsify.owl_spread={self.owl_spread} must keep every layer's ratio within [0, 1): "
                f"at most {min(self.sparsity, 1 - self.sparsity) / 2:g} here"
            )
        if self.owl_threshold <= 0:
            raise ConfigError(
                f"sparsify.owl_threshold={self.owl_threshold} must be positive (5 in the OWL paper)"
            )
        self.check_calibration("sparsify")
        if not 0 < self.damp < 1 or self.block_size < 1:
            raise ConfigError("sparsify: damp must lie between 0 and 1 and block_size be at least 1")
        if not self.targets:
            raise ConfigError("sparsify.targets is empty: give at least one regex over module names")
        compile_patterns([*self.targets, *self.ignore])

    @property
    def parsed_pattern(self) -> SparsityPattern:
        return SparsityPattern.parse(self.sparsity, self.pattern)

    @property
    def label(self) -> str:
        pattern = self.parsed_pattern
        return f"{self.method}{'+owl' if self.owl else ''} {pattern}"


@torch.no_grad()
def run(state: RunState, params: SparsifyParams) -> None:
    started = time.perf_counter()
    pattern = params.parsed_pattern
    check_not_quantized(state, params.targets)
    names = select_linear_modules(state.model, params.targets, params.ignore)
    for name in names:
        problem = pattern.shape_problem(state.model.get_submodule(name).in_features)
        if problem:
            raise SlimlmError(
                f"cannot sparsify {name}: {problem}; choose another pattern or exclude it with "
                "sparsify.ignore"
            )
    section: dict = {
        "method": params.method,
        "pattern": str(pattern),
        "sparsity": pattern.ratio,
        "owl": params.owl,
        "layers": len(names),
    }
    if params.method == "magnitude":
        for name in tqdm(names, desc="sparsify magnitude", unit="layer"):
            prune_in_place(
                state.model.get_submodule(name).weight,
                magnitude_mask(state.model.get_submodule(name).weight, pattern),
            )
    else:
        section.update(run_calibrated(state, params, names, pattern))
    state.mark_changed(f"sparsified ({params.label})")
    zeros = {
        name: round(float((state.model.get_submodule(name).weight == 0).float().mean()), 6) for name in names
    }
    total = sum(state.model.get_submodule(n).weight.numel() for n in names)
    section["achieved_sparsity"] = round(
        sum(zeros[n] * state.model.get_submodule(n).weight.numel() for n in names) / total, 6
    )
    section["layer_sparsity"] = zeros
    section["seconds"] = round(time.perf_counter() - started, 2)
    state.sections.setdefault("sparsity", []).append(section)


def prune_in_place(weight: torch.Tensor, keep: torch.Tensor) -> None:
    weight.mul_(keep.to(weight.dtype))


def run_calibrated(
    state: RunState, params: SparsifyParams, names: list[str], pattern: SparsityPattern
) -> dict:
    """Wanda or SparseGPT layer by layer; OWL first measures every layer of the dense model."""
    samples = calibration_windows(state, params.samples, params.seq_len, params.seed)
    ratios, outliers = owl_layer_ratios(state, samples, names, params) if params.owl else ({}, {})
    wanda = params.method == "wanda"
    # Wanda reads the inputs' norms, SparseGPT the whole Hessian
    statistics = LayerInputStatistics(SquareSums if wanda else HessianAccumulator)

    unseen: list[str] = []

    def finish_layer(block: str, layer_names: list[str]) -> None:
        layer_pattern = SparsityPattern(ratio=ratios[block]) if ratios else pattern
        for name in layer_names:
            weight = state.model.get_submodule(name).weight
            if name not in statistics:  # an expert no calibration token was routed to: magnitude decides
                unseen.append(name)
                prune_in_place(weight, magnitude_mask(weight, layer_pattern))
            elif wanda:
                prune_in_place(
                    weight, wanda_mask(weight, statistics.pop(name).sums.to(weight.device), layer_pattern)
                )
            else:
                hessian = statistics.take_hessian(name).to(weight.device)
                weight.copy_(
                    sparsegpt_prune(weight, hessian, layer_pattern, params.block_size, params.damp, name).to(
                        weight.dtype
                    )
                )

    peak = calibrate_sequentially(
        state.model, samples, names, statistics.observe, finish_layer, desc=params.label
    )
    result = {
        "calibration_tokens": samples.numel(),
        "samples": params.samples,
        "seq_len": params.seq_len,
        "calibration_peak_memory_bytes": peak,
    }
    if unseen:
        result["uncalibrated_layers"] = unseen
    if ratios:
        result["owl_layer_ratios"] = {name: round(ratio, 4) for name, ratio in ratios.items()}
        result["owl_outlier_ratios"] = {name: round(ratio, 6) for name, ratio in outliers.items()}
    return result


def owl_layer_ratios(
    state: RunState, samples: torch.Tensor, names: list[str], params: SparsifyParams
) -> tuple[dict[str, float], dict[str, float]]:
    """Each decoder layer's sparsity, and the outlier ratio it comes from (measured on the dense model)."""
    outliers: dict[str, float] = {}
    statistics = LayerInputStatistics(SquareSums)

    def finish_layer(block: str, layer_names: list[str]) -> None:
        scores = [
            wanda_scores(state.model.get_submodule(n).weight, statistics.pop(n).sums)
            for n in layer_names
            if n in statistics
        ]
        outliers[block] = outlier_ratio(scores, params.owl_threshold)

    calibrate_sequentially(state.model, samples, names, statistics.observe, finish_layer, desc="owl outliers")
    layers = list(outliers)
    return dict(
        zip(layers, owl_ratios([outliers[layer] for layer in layers], params.sparsity, params.owl_spread))
    ), outliers


def check_not_quantized(state: RunState, targets: list[str]) -> None:
    quantized = [
        n
        for n, m in state.model.named_modules()
        if isinstance(m, QuantLinear) and any(re.fullmatch(p, n) for p in targets)
    ]
    if quantized:
        raise SlimlmError(
            f"{quantized[0]} is already quantized: put the sparsify stage before the quantize stage (prune, "
            "then quantize the survivors)"
        )


def check(cfg, params: SparsifyParams, source) -> None:
    if params.method != "magnitude":
        check_text_source(cfg.data.calibration, "calibration")


SPARSIFY = Stage(name="sparsify", params=SparsifyParams, run=run, check=check)
