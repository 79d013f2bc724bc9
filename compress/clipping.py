"""Clipping search: the quantization range of each group, shrunk where that lowers the error.

Rounding to a grid that spans a group's whole range wastes resolution on its one or two largest
weights. Shrinking the range clips them but rounds all the others more finely; which wins is
measured on the layer's output error over the calibration data, through the input Hessian
H = 2/n X^T X: for a weight change D the summed squared output error is tr(D H D^T) / 2.
AWQ searches clipping after its scales; GPTQ fixes its static group parameters with it.
"""

from __future__ import annotations

import torch

from slimlm.compress.rtn import fake_quantize
from slimlm.qlinear import QuantScheme


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """tr(D H D^T) / 2 = ||X D^T||^2 / n: the summed squared output error per input row."""
    return ((delta @ hessian) * delta).sum() / 2


def search_clip(weight: torch.Tensor, scheme: QuantScheme, hessian: torch.Tensor, grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """The weight clipped, group by group, to the range that minimises that group's output error
    (each group's error through its own block of the Hessian). Ratios 1, 1 - 1/grid, ... down to
    1 - max_shrink of the group's range are tried; 1 (no clipping) is always among them."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    group = scheme.group_size or in_features
    groups = in_features // group
    blocks = torch.stack([hessian[g * group : (g + 1) * group, g * group : (g + 1) * group] for g in range(groups)]).to(w.device, torch.float32)
    grouped = w.reshape(out_features, groups, group)
    high = grouped.amax(dim=2, keepdim=True)
    low = grouped.amin(dim=2, keepdim=True)
    if scheme.symmetric:
        high = torch.maximum(high.abs(), low.abs())
        low = -high
    best = grouped
    best_error = torch.full((out_features, groups), float("inf"), device=w.device)
    for step in range(int(max_shrink * grid)):
        ratio = 1 - step / grid
        clipped = torch.minimum(torch.maximum(grouped, low * ratio), high * ratio)
        delta = grouped - fake_quantize(clipped.reshape(out_features, in_features), scheme).reshape(grouped.shape)
        error = torch.einsum("ogi,gij,ogj->og", delta, blocks, delta)
        better = error < best_error
        best = torch.where(better[:, :, None], clipped, best)
        best_error = torch.where(better, error, best_error)
    return best.reshape(out_features, in_features)
