"""Quantization-aware training on slimlm's integer grid, after EfficientQAT (Chen et al., 2024):
first each decoder block's scales (optionally its codes) are trained to reproduce the original
block's outputs (block-wise reconstruction, one block at a time, like GPTQ's walk), then the
scales are trained end to end against the teacher's distribution (the distill stage's
`quant_scales`).

Scales learn as the log of their ratio to the starting scales: one learning rate fits every
layer whatever the size of its weights (a step of lr changes a scale by about lr, relatively).
With the codes fixed their gradient is exact. Codes can learn, block-wise only, as latent values in
code units rounded with a straight-through estimator, starting from GPTQ's codes
(RoundingTrainedLinear says why from the centre of each cell). Scales are rounded to fp16 in the
forward pass, so a trained layer computes exactly what its QuantLinear (codes and fp16 scales)
computes after `to_quant_linear`: exported, reloaded and decoded by the packed kernels like any
GPTQ model.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from slimlm.compress.rtn import grid_values
from slimlm.errors import SlimlmError
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule


class ScaleTrainedLinear(nn.Module):
    """A QuantLinear whose codes are frozen and whose per-group scales train (as log-ratios to
    the starting scales, read through fp16 rounding); zero points and bias stay."""

    def __init__(self, layer: QuantLinear):
        super().__init__()
        if layer.adapter_rank:
            raise SlimlmError(
                "quantization-aware training of a layer that carries a LoRA adapter would train "
                "the codes under it; run it before the LoRA stage"
            )
        self.scheme: QuantScheme = layer.scheme
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.register_buffer("initial_scales", layer.scales.float())
        self.log_scales = nn.Parameter(torch.zeros_like(self.initial_scales))
        offsets = (
            torch.full_like(layer.scales, layer.scheme.symmetric_zero, dtype=torch.float32)
            if layer.zeros is None
            else layer.zeros.float()
        )
        self.register_buffer("offsets", offsets)
        groups = self.initial_scales.shape[1]
        self.register_buffer("codes", layer.codes().float().view(self.out_features, groups, -1))
        self.bias = layer.bias

    def grid_scales(self) -> torch.Tensor:
        """The scales as the QuantLinear will store them (fp16), [out, groups, 1]."""
        scales = (self.initial_scales * self.log_scales.exp()).clamp(min=torch.finfo(torch.float16).tiny)
        return (scales + (scales.half().float() - scales).detach()).unsqueeze(-1)

    def grid_codes(self) -> torch.Tensor:
        """The codes the forward pass uses, [out, groups, group_size]: fixed here."""
        return self.codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = grid_values(self.grid_codes(), self.grid_scales(), self.offsets.unsqueeze(-1))
        weight = weight.view(self.out_features, self.in_features)
        return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def to_quant_linear(self) -> QuantLinear:
        """The QuantLinear of this layer's codes and fp16 scales: the same function, frozen."""
        zeros = None if self.scheme.symmetric else self.offsets.to(torch.uint8)
        bias = None if self.bias is None else self.bias.detach()
        codes = self.grid_codes().view(self.out_features, self.in_features).to(torch.uint8)
        return QuantLinear.from_codes(codes, self.grid_scales().squeeze(-1).half(), zeros, self.scheme, bias)


class RoundingTrainedLinear(ScaleTrainedLinear):
    """A ScaleTrainedLinear whose codes train too: each is a latent value in code units, rounded
    to the nearest grid code in the forward pass with a straight-through gradient.

    Every latent starts at the centre of its code's rounding cell: the layer starts exactly as
    the quantized one computes, and a code moves only once its gradient has pushed the latent
    half a grid step the same way over many steps, which Adam does for consistent gradients and
    not for noise. (Starting latents at the original weight's place in the cell instead puts
    every code GPTQ moved at the cell's edge, where the first noisy step flips it back: on the
    default model's first blocks that raised the error above GPTQ's.) Latents in code units
    make the learning rate a fraction of a grid step for every layer. Weights that are exactly
    zero in `original` (pruned) keep their code."""

    def __init__(self, layer: QuantLinear, original: torch.Tensor):
        super().__init__(layer)
        if original.shape != (self.out_features, self.in_features):
            raise SlimlmError(
                f"the original weight has shape {tuple(original.shape)}, the quantized layer "
                f"({self.out_features}, {self.in_features}): not the model it was quantized from"
            )
        self.latents = nn.Parameter(self.codes.clone())
        self.register_buffer("movable", original.detach().view_as(self.codes) != 0)

    def grid_codes(self) -> torch.Tensor:
        levels = self.latents.clamp(0, self.scheme.max_code)
        rounded = levels + (levels.round() - levels).detach()
        return torch.where(self.movable, rounded, self.codes)


def replace_quantized(module: nn.Module) -> list[ScaleTrainedLinear]:
    """Every QuantLinear under `module` replaced by a ScaleTrainedLinear; returns those."""
    return replace_each_quantized(module, lambda name, layer: ScaleTrainedLinear(layer))


def replace_quantized_with_rounding(module: nn.Module, original: nn.Module) -> list[RoundingTrainedLinear]:
    """Every QuantLinear under `module` replaced by a RoundingTrainedLinear; the weight of the
    same name under `original` (the module it was quantized from) tells which weights were
    pruned."""
    return replace_each_quantized(
        module, lambda name, layer: RoundingTrainedLinear(layer, original.get_submodule(name).weight)
    )


def replace_each_quantized(
    module: nn.Module, make: Callable[[str, QuantLinear], ScaleTrainedLinear]
) -> list[ScaleTrainedLinear]:
    """Every QuantLinear under `module` replaced by `make(its name, it)`; returns the new layers."""
    names = [name for name, child in module.named_modules() if isinstance(child, QuantLinear)]
    for name in names:
        set_submodule(module, name, make(name, module.get_submodule(name)))
    return [module.get_submodule(name) for name in names]


def freeze_quantized(module: nn.Module) -> None:
    """The trained layers under `module` back to QuantLinears."""
    for name, child in list(module.named_modules()):
        if isinstance(child, ScaleTrainedLinear):
            set_submodule(module, name, child.to_quant_linear())
