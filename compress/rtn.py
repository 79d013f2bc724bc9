"""Round-to-nearest weight quantization: the baseline every other method is measured against.

`group_params` and `grid_codes` are also the grid GPTQ rounds onto, so both methods
produce exactly the storage format of slimlm.qlinear.QuantLinear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from slimlm.qlinear import QuantScheme


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [out, in]
    scales: torch.Tensor  # float16 [out, groups]
    zeros: Optional[torch.Tensor]  # uint8 [out, groups], asymmetric schemes only


def group_params(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Scale (fp16-rounded) and integer zero point of each row of `weight` [rows, cols] (one group).

    Symmetric: scale = max|w| / (2**(b-1) - 1), zero fixed at 2**(b-1).
    Asymmetric: scale = (max - min) / (2**b - 1) over a range that includes 0, zero = round(-min / scale).
    """
    w = weight.detach().float()
    tiny = torch.finfo(torch.float16).tiny
    if scheme.symmetric:
        scale = (w.abs().amax(dim=1) / (scheme.symmetric_zero - 1)).clamp(min=tiny).half()
        return scale, None
    low = w.amin(dim=1).clamp(max=0.0)
    high = w.amax(dim=1).clamp(min=0.0)
    scale = ((high - low) / scheme.max_code).clamp(min=tiny).half()
    zero = torch.round(-low / scale.float()).clamp(0, scheme.max_code).to(torch.uint8)
    return scale, zero


def quantize_to_codes(
    weight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], scheme: QuantScheme
) -> torch.Tensor:
    """Codes of `weight` [rows, cols] on the grid given by per-row `scale` and `zero`."""
    offset = scheme.symmetric_zero if zero is None else zero.float().unsqueeze(1)
    return grid_codes(weight.detach().float(), scale.float().unsqueeze(1), offset, scheme).to(torch.uint8)


def grid_codes(weight: torch.Tensor, scale: torch.Tensor, offset, scheme: QuantScheme) -> torch.Tensor:
    """The codes, as float32, of float32 `weight` on the grid of `scale` and `offset` (the code of
    0.0), which broadcast against it: the one rounding rule of RTN, GPTQ and AWQ."""
    return torch.round(weight / scale).add_(offset).clamp_(0, scheme.max_code)


def grid_values(codes: torch.Tensor, scale: torch.Tensor, offset) -> torch.Tensor:
    """The float32 values that float32 `codes` stand for on the grid of `scale` and `offset`."""
    return (codes - offset) * scale


def keep_zeros(
    codes: torch.Tensor, keep: torch.Tensor, zero: Optional[torch.Tensor], scheme: QuantScheme
) -> torch.Tensor:
    """`codes` [rows, cols] with the entries outside `keep` set to the code of 0.0 (per-row `zero`),
    so that pruned weights stay exactly zero after quantization."""
    offset = (
        torch.full_like(codes, scheme.symmetric_zero)
        if zero is None
        else zero.to(codes.dtype).unsqueeze(1).expand_as(codes)
    )
    return torch.where(keep, codes, offset)


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], scheme: QuantScheme
) -> torch.Tensor:
    offset = scheme.symmetric_zero if zero is None else zero.float().unsqueeze(1)
    return grid_values(codes.float(), scale.float().unsqueeze(1), offset)


def quantize_rtn(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Every group rounded to its nearest grid point independently; exact zeros stay zero."""
    out_features, in_features = weight.shape
    groups = scheme.groups(in_features)
    grouped = weight.detach().float().reshape(out_features * groups, in_features // groups)
    scale, zero = group_params(grouped, scheme)
    codes = keep_zeros(quantize_to_codes(grouped, scale, zero, scheme), grouped != 0, zero, scheme)
    return QuantizedWeight(
        codes=codes.reshape(out_features, in_features),
        scales=scale.reshape(out_features, groups),
        zeros=None if zero is None else zero.reshape(out_features, groups),
    )


def dequantize_weight(quantized: QuantizedWeight, scheme: QuantScheme) -> torch.Tensor:
    """The float32 weight [out, in] that `quantized` stands for."""
    out_features, in_features = quantized.codes.shape
    groups = quantized.scales.shape[1]
    codes = quantized.codes.reshape(out_features * groups, in_features // groups)
    zeros = None if quantized.zeros is None else quantized.zeros.reshape(-1)
    return dequantize_codes(codes, quantized.scales.reshape(-1), zeros, scheme).reshape(
        out_features, in_features
    )


def fake_quantize(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """RTN quantize and dequantize: the weight as the quantized layer will see it (float32)."""
    return dequantize_weight(quantize_rtn(weight, scheme), scheme)
