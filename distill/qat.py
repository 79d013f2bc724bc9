"""Quantization-aware training on slimlm's integer grid, after EfficientQAT (Chen et al., 2024):
first each decoder block's weights and scales are trained to reproduce the original block's
outputs (block-wise reconstruction, one block at a time, like GPTQ's walk), then only the scales
are trained end to end against the teacher's distribution (the distill stage's `quant_scales`).

The estimator is the straight-through one: the forward pass rounds the latent weight onto the
grid, the backward pass treats the rounding as the identity (and clamping as a gate), so a
scale gets LSQ's gradient (Esser et al., 2020) and a latent weight moves its code once it
crosses a rounding boundary. Scales are rounded to fp16 in the forward pass the same way, so
the trained layer computes exactly what its QuantLinear (codes and fp16 scales) computes after
`to_quant_linear`: exported, reloaded and decoded by the packed kernels like any GPTQ model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from slimlm.compress.rtn import grid_codes, grid_values
from slimlm.errors import SlimlmError
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, the identity backward."""
    return x + (torch.round(x) - x).detach()


class GridTrainedLinear(nn.Module, ABC):
    """What the two kinds of trained quantized layer share: per-group scales as a float32
    parameter (read through fp16 rounding), fixed zero points, the layer's bias."""

    def __init__(self, layer: QuantLinear):
        super().__init__()
        if layer.adapter_rank:
            raise SlimlmError(
                "quantization-aware training of a layer that carries a LoRA adapter would train "
                "the codes under it; run it before the LoRA stage"
            )
        self.scheme: QuantScheme = layer.scheme
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.scales = nn.Parameter(layer.scales.float())
        offsets = (
            torch.full_like(layer.scales, layer.scheme.symmetric_zero, dtype=torch.float32)
            if layer.zeros is None
            else layer.zeros.float()
        )
        self.register_buffer("offsets", offsets)
        self.bias = layer.bias

    def grid_scales(self) -> torch.Tensor:
        """The scales as the QuantLinear will store them (fp16), [out, groups, 1]."""
        scales = self.scales.clamp(min=torch.finfo(torch.float16).tiny)
        return (scales + (scales.half().float() - scales).detach()).unsqueeze(-1)

    def grouped(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.view(self.out_features, self.scales.shape[1], -1)

    @abstractmethod
    def codes(self) -> torch.Tensor:
        """The integer codes [out, in] the layer computes with (float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = grid_values(self.grouped(self.codes()), self.grid_scales(), self.offsets.unsqueeze(-1))
        weight = grouped.view(self.out_features, self.in_features)
        return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def to_quant_linear(self) -> QuantLinear:
        """The QuantLinear of this layer's codes and fp16 scales: the same function, frozen."""
        zeros = None if self.scheme.symmetric else self.offsets.to(torch.uint8)
        bias = None if self.bias is None else self.bias.detach()
        return QuantLinear.from_codes(
            self.codes().to(torch.uint8), self.grid_scales().squeeze(-1).half(), zeros, self.scheme, bias
        )


class LatentWeightLinear(GridTrainedLinear):
    """Block-wise reconstruction's layer: a float latent weight, started at the dequantized
    weight (so it rounds back to the starting codes), rounded onto the grid in every forward
    pass; the latent weight and the scales are both trained."""

    def __init__(self, layer: QuantLinear):
        super().__init__(layer)
        self.weight = nn.Parameter(layer.dequantize(torch.float32))

    def codes(self) -> torch.Tensor:
        codes = grid_codes(
            self.grouped(self.weight), self.grid_scales(), self.offsets.unsqueeze(-1), self.scheme, round_ste
        )
        return codes.view(self.out_features, self.in_features)


class ScaleTrainedLinear(GridTrainedLinear):
    """End-to-end training's layer: the codes are frozen, only the scales learn."""

    def __init__(self, layer: QuantLinear):
        super().__init__(layer)
        self.register_buffer("frozen_codes", layer.codes().float())

    def codes(self) -> torch.Tensor:
        return self.frozen_codes


def replace_quantized(module: nn.Module, kind: type[GridTrainedLinear]) -> list[str]:
    """Every QuantLinear under `module` replaced by a trainable `kind`; returns their names."""
    names = [name for name, child in module.named_modules() if isinstance(child, QuantLinear)]
    for name in names:
        set_submodule(module, name, kind(module.get_submodule(name)))
    return names


def freeze_quantized(module: nn.Module, names: Optional[list[str]] = None) -> None:
    """The trained layers under `module` (or those `names`) back to QuantLinears."""
    for name, child in list(module.named_modules()):
        if isinstance(child, GridTrainedLinear) and (names is None or name in names):
            set_submodule(module, name, child.to_quant_linear())
