"""The `quantize` stage: replace the selected Linear layers with quantized ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch
from tqdm import tqdm

from slimlm.compress.rtn import quantize_int8_per_channel
from slimlm.compress.targets import select_linear_modules
from slimlm.errors import ConfigError
from slimlm.pipeline import RunState, Stage
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule

METHODS = ("rtn",)


@dataclass
class QuantizeParams:
    method: str = "rtn"
    bits: int = 8
    targets: List[str] = field(default_factory=lambda: [r"model\.layers\.\d+\..*"])
    ignore: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"quantize.method='{self.method}' is unknown; available: {', '.join(METHODS)}")
        if self.bits != 8:
            raise ConfigError(f"quantize.bits={self.bits} is not available yet; this version quantizes weights to int8 per channel (bits: 8)")
        if not self.targets:
            raise ConfigError("quantize.targets is empty: give at least one regex over module names, e.g. 'model\\.layers\\.\\d+\\..*'")


@torch.no_grad()
def run(state: RunState, params: QuantizeParams) -> None:
    names = select_linear_modules(state.model, params.targets, params.ignore)
    scheme = QuantScheme(bits=params.bits, group_size=None, symmetric=True, method=params.method)
    errors = {}
    for name in tqdm(names, desc=f"quantize {params.method} int{params.bits}", unit="layer"):
        linear = state.model.get_submodule(name)
        qweight, scales = quantize_int8_per_channel(linear.weight)
        layer = QuantLinear.from_quantized(qweight, scales, scheme, linear.bias)
        errors[name] = relative_error(linear.weight, layer.dequantize())
        set_submodule(state.model, name, layer)
        state.schemes[name] = scheme.to_dict()
    state.sections.setdefault("quantization", []).append(
        {"method": params.method, "bits": params.bits, "layers": len(names), "weight_rel_error": errors}
    )


def relative_error(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """||W - Q(W)|| / ||W||, the per-layer number reports plot."""
    reference = reference.detach().float()
    return float(torch.linalg.norm(reference - approximation.float()) / torch.linalg.norm(reference).clamp(min=1e-12))


QUANTIZE = Stage(name="quantize", params=QuantizeParams, run=run)
