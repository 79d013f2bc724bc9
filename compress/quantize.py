"""The `quantize` stage: replace the selected Linear layers with quantized ones.

Methods: `rtn` (round to nearest, no data) and `gptq` (calibrated on data.calibration, layer by
layer; see compress/gptq.py and compress/calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
from tqdm import tqdm

from slimlm.compress.calibration import calibrate_sequentially, calibration_samples
from slimlm.compress.gptq import GPTQOptions, HessianAccumulator, gptq_quantize
from slimlm.compress.rtn import QuantizedWeight, quantize_rtn
from slimlm.compress.targets import select_linear_modules
from slimlm.data import check_text_source, load_text, tokenize_text
from slimlm.errors import ConfigError, SlimlmError
from slimlm.packing import PACKABLE_BITS
from slimlm.pipeline import RunState, Stage
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule

METHODS = ("rtn", "gptq")


@dataclass
class QuantizeParams:
    method: str = "rtn"
    bits: int = 8
    group_size: Optional[int] = None  # None: one scale per output channel
    symmetric: bool = True
    targets: List[str] = field(default_factory=lambda: [r"model\.layers\.\d+\..*"])
    ignore: List[str] = field(default_factory=list)
    # Calibration (gptq): windows of data.calibration, chosen at random with `seed`.
    samples: int = 64
    seq_len: int = 256
    seed: int = 0
    # GPTQ: damping as a fraction of the mean Hessian diagonal, lazy-update block, act-order.
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"quantize.method='{self.method}' is unknown; available: {', '.join(METHODS)}")
        if self.bits not in PACKABLE_BITS:
            raise ConfigError(f"quantize.bits={self.bits} is not supported; choose one of {', '.join(map(str, PACKABLE_BITS))}")
        if self.group_size is not None and self.group_size < 8:
            raise ConfigError(f"quantize.group_size={self.group_size} must be at least 8 (or null for one scale per output channel)")
        if self.samples < 1 or self.seq_len < 2:
            raise ConfigError(f"quantize: samples ({self.samples}) must be at least 1 and seq_len ({self.seq_len}) at least 2")
        if not 0 < self.damp < 1:
            raise ConfigError(f"quantize.damp={self.damp} must lie between 0 and 1 (0.01 is usual)")
        if self.block_size < 1:
            raise ConfigError(f"quantize.block_size={self.block_size} must be at least 1")
        if not self.targets:
            raise ConfigError("quantize.targets is empty: give at least one regex over module names, e.g. 'model\\.layers\\.\\d+\\..*'")

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(bits=self.bits, group_size=self.group_size, symmetric=self.symmetric, method=self.method)


def check_shapes(model, names: list[str], scheme: QuantScheme) -> None:
    """Refuse before touching any layer, naming the first one the scheme does not fit."""
    for name in names:
        problem = scheme.shape_problem(model.get_submodule(name).in_features)
        if problem:
            raise SlimlmError(f"cannot quantize {name}: {problem}; change quantize.group_size or exclude it with quantize.ignore")


@torch.no_grad()
def run(state: RunState, params: QuantizeParams) -> None:
    scheme = params.scheme
    names = select_linear_modules(state.model, params.targets, params.ignore)
    check_shapes(state.model, names, scheme)
    errors: dict[str, float] = {}

    def replace(name: str, quantized: QuantizedWeight) -> None:
        linear = state.model.get_submodule(name)
        layer = QuantLinear.from_codes(quantized.codes, quantized.scales, quantized.zeros, scheme, linear.bias)
        errors[name] = relative_error(linear.weight, layer.dequantize())
        set_submodule(state.model, name, layer)
        state.schemes[name] = scheme.to_dict()

    section = {"method": params.method, "bits": params.bits, "group_size": params.group_size, "symmetric": params.symmetric, "layers": len(names)}
    if params.method == "gptq":
        section.update(run_gptq(state, params, names, replace))
    else:
        for name in tqdm(names, desc=f"quantize rtn int{params.bits}", unit="layer"):
            replace(name, quantize_rtn(state.model.get_submodule(name).weight, scheme))
    state.sections.setdefault("quantization", []).append({**section, "weight_rel_error": errors})


def run_gptq(state: RunState, params: QuantizeParams, names: list[str], replace) -> dict:
    """GPTQ layer by layer on calibration windows; returns what the report states about it."""
    token_ids = tokenize_text(state.tokenizer, load_text(state.cfg.data.calibration, "calibration"))
    samples = calibration_samples(token_ids, params.samples, params.seq_len, params.seed)
    options = GPTQOptions(damp=params.damp, block_size=params.block_size, act_order=params.act_order)
    hessians: dict[str, HessianAccumulator] = {}
    previous: list = [None, None]  # the last input tensor seen and its accumulator

    def observe(name: str, inputs: torch.Tensor) -> None:
        # q/k/v (and gate/up) read the very same activations: share one Hessian between them.
        if inputs is previous[0]:
            hessians[name] = previous[1]
            return
        accumulator = hessians.setdefault(name, HessianAccumulator(inputs.shape[-1]))
        accumulator.add(inputs)
        previous[:] = [inputs, accumulator]

    def finish_layer(layer_names: list[str]) -> None:
        for name in layer_names:
            weight = state.model.get_submodule(name).weight
            replace(name, gptq_quantize(weight, hessians.pop(name).hessian, params.scheme, options, name))

    peak = calibrate_sequentially(state.model, samples, names, observe, finish_layer, desc=f"gptq int{params.bits}")
    return {"calibration_tokens": samples.numel(), "samples": params.samples, "seq_len": params.seq_len, "peak_rss_bytes": peak}


def check(cfg, params: QuantizeParams, source) -> None:
    if params.method == "gptq":
        check_text_source(cfg.data.calibration, "calibration")


def relative_error(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """||W - Q(W)|| / ||W||, the per-layer number reports plot."""
    reference = reference.detach().float()
    return float(torch.linalg.norm(reference - approximation.float()) / torch.linalg.norm(reference).clamp(min=1e-12))


QUANTIZE = Stage(name="quantize", params=QuantizeParams, run=run, check=check)
