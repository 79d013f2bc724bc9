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


ROWS = 1024  # output rows searched together


def search_clip(
    weight: torch.Tensor, scheme: QuantScheme, hessian: torch.Tensor, grid: int = 20, max_shrink: float = 0.5
) -> torch.Tensor:
    """The weight clipped, group by group, to the range that minimises that group's output error
    (each group's error through its own block of the Hessian). Ratios 1, 1 - 1/grid, ... down to
    1 - max_shrink of the group's range are tried; 1 (no clipping) is always among them. Rows are
    independent: a band of ROWS at a time keeps the search's copies of the weight small."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    group = scheme.group_size or in_features
    groups = in_features // group
    blocks = torch.stack(
        [hessian[g * group : (g + 1) * group, g * group : (g + 1) * group] for g in range(groups)]
    ).to(w.device, torch.float32)
    bands = [
        _clip_rows(rows.reshape(rows.shape[0], groups, group), scheme, blocks, grid, max_shrink)
        for rows in w.split(ROWS)
    ]
    return torch.cat(bands).reshape(out_features, in_features)


def _clip_rows(
    grouped: torch.Tensor, scheme: QuantScheme, blocks: torch.Tensor, grid: int, max_shrink: float
) -> torch.Tensor:
    """search_clip for a band of rows, [rows, groups, group]."""
    high = grouped.amax(dim=2, keepdim=True)
    low = grouped.amin(dim=2, keepdim=True)
    if scheme.symmetric:
        high = torch.maximum(high.abs(), low.abs())
        low = -high
    best = grouped
    best_error = torch.full(grouped.shape[:2], float("inf"), device=grouped.device)
    for step in range(int(max_shrink * grid)):
        ratio = 1 - step / grid
        clipped = torch.minimum(torch.maximum(grouped, low * ratio), high * ratio)
        delta = grouped - fake_quantize(clipped.flatten(1), scheme).reshape(grouped.shape)
        error = torch.einsum("ogi,gij,ogj->og", delta, blocks, delta)
        better = error < best_error
        best = torch.where(better[:, :, None], clipped, best)
        best_error = torch.where(better, error, best_error)
    return best
