"""GPTQ (Frantar et al., 2022): quantize a weight matrix column by column, each rounding error
spread over the columns not yet quantized, in proportion to the inverse Hessian of the layer's
reconstruction loss ||XW^T - XQ^T||^2 (H = 2 X^T X over calibration inputs X).

Lazy batch updates: columns are processed in blocks; inside a block updates are immediate,
the rest of the matrix is updated once per block. With act-order, columns go by decreasing
H diagonal (the inputs with most energy first); group parameters are then fixed up front from
the original weights (static groups), so the groups still follow the stored column order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from slimlm.compress.clipping import search_clip
from slimlm.compress.rtn import QuantizedWeight, grid_codes, grid_values, group_params
from slimlm.errors import SlimlmError
from slimlm.qlinear import QuantScheme

log = logging.getLogger(__name__)

# Hessians are accumulated in float32, as in the GPTQ authors' code, GPTQModel and llm-compressor:
# half the memory of float64 (an 8B down projection's H is 0.8 GB, not 1.6) for every layer a
# block holds at once.
WORK_DTYPE = torch.float32
# One layer's solve (its Hessian's factorization, GPTQ's and SparseGPT's working weight) runs in
# float64 where that Hessian takes at most this many bytes in float64: float32 solves cost the
# default model's w4 GPTQ about 3% of its KL (bench/results/quantize_default.md). Wider layers
# (an 8B model's down projection, 14336 inputs: 1.6 GB in float64, twice that while it is
# factorized) solve in float32, which keeps an 8B model's calibration under 6 GB.
SOLVE_FLOAT64_BYTES = 2**28


def solve_dtype(in_features: int) -> torch.dtype:
    return torch.float64 if in_features * in_features * 8 <= SOLVE_FLOAT64_BYTES else torch.float32


@dataclass(frozen=True)
class GPTQOptions:
    damp: float = 0.01  # fraction of the mean Hessian diagonal added to it
    block_size: int = 128
    act_order: bool = True
    clip_search: bool = True  # static group ranges chosen by output error (compress/clipping.py)


def calibration_rows(inputs: torch.Tensor) -> torch.Tensor:
    """A Linear layer's calibration inputs as float32 rows [n, in_features], refused if not finite."""
    x = inputs.detach().reshape(-1, inputs.shape[-1]).float()
    if not torch.isfinite(x).all():
        raise SlimlmError(
            "calibration activations contain NaN or Inf; "
            "the model or calibration text is broken (check the fp32 perplexity first)"
        )
    return x


class HessianAccumulator:
    """Running H = 2/n sum x x^T over every input row a Linear layer sees, and the mean |x| of
    each input feature (AWQ's activation statistic)."""

    BAND = 256  # rows of H computed per product: its temporary stays under 15 MB for 14336 inputs

    def __init__(
        self, in_features: int, device: torch.device = torch.device("cpu"), dtype: torch.dtype = WORK_DTYPE
    ):
        # on the inputs' device: a GPU calibration keeps its statistics next to the block
        self.hessian = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self.abs_mean = torch.zeros(in_features, dtype=dtype, device=device)
        self.rows = 0

    def add(self, inputs: torch.Tensor) -> None:
        x = calibration_rows(inputs).to(self.hessian.dtype)  # the products in the statistics' dtype
        total = self.rows + x.shape[0]
        self.hessian *= self.rows / total
        # H is symmetric: each band of rows is computed from its diagonal on (about half the
        # products) and mirrored below it; a band at a time keeps the temporary small beside an
        # 8B down projection's H.
        for start in range(0, x.shape[1], self.BAND):
            end = min(start + self.BAND, x.shape[1])
            band = (x[:, start:end].T @ x[:, start:]).to(self.hessian.device).mul_(2.0 / total)
            self.hessian[start:end, start:] += band
            self.hessian[end:, start:end] += band[:, end - start :].T
        self.abs_mean *= self.rows / total
        self.abs_mean += x.abs().sum(dim=0).to(self.abs_mean.device) / total
        self.rows = total

    def divide_inputs(self, scale: torch.Tensor) -> None:
        """The statistics of x / scale: what the layer sees after AWQ moves `scale` into its weight."""
        scale = scale.to(self.hessian.device, WORK_DTYPE)
        self.hessian.div_(scale[:, None]).div_(scale[None, :])  # in place: no second in_features^2 matrix
        self.abs_mean /= scale


def precise_hessian(in_features: int, device: torch.device = torch.device("cpu")) -> HessianAccumulator:
    """An accumulator whose products and sums run in the layer's solve_dtype (float64 where its
    Hessian takes at most 256 MiB). AWQ picks its scales and clipping ranges by comparing output
    errors that differ in float32's last digits: float32 statistics cost the default model's w4
    AWQ 3% of its KL (bench/results/quantize_default.md), where GPTQ loses nothing measurable."""
    return HessianAccumulator(in_features, device, solve_dtype(in_features))


class SquareSums:
    """Running sum of x_j^2 over every input row a Linear layer sees, per input feature: Wanda's
    ||X_j||^2. All Wanda reads of the inputs: in_features numbers instead of a Hessian's
    in_features^2 (0.8 GB for an 8B model's down projection) and its product."""

    def __init__(self, in_features: int, device: torch.device = torch.device("cpu")):
        self.sums = torch.zeros(in_features, dtype=torch.float64, device=device)

    def add(self, inputs: torch.Tensor) -> None:
        x = calibration_rows(inputs)
        self.sums += (x * x).sum(dim=0).double().to(self.sums.device)


class LayerInputStatistics(dict):
    """name -> statistics of the inputs each observed Linear layer sees, made by `kind(in_features,
    device)`: a HessianAccumulator (GPTQ, SparseGPT), a precise_hessian (AWQ) or a SquareSums
    (Wanda). Layers that read the very same activations (q/k/v, gate/up) share one: computed once."""

    def __init__(self, kind: Callable[[int, torch.device], Any] = HessianAccumulator) -> None:
        super().__init__()
        self._kind = kind
        self._last: tuple = (None, None)  # the last input tensor seen and its statistics

    def observe(self, name: str, inputs: torch.Tensor) -> None:
        if inputs is self._last[0]:
            self[name] = self._last[1]
            return
        statistics = self.setdefault(name, self._kind(inputs.shape[-1], inputs.device))
        statistics.add(inputs)
        self._last = (inputs, statistics)

    def take_hessian(self, name: str) -> torch.Tensor:
        """`name`'s Hessian for a consumer that overwrites it (gptq_quantize): the accumulator's own
        tensor when no other layer shares it, a copy while one still does. Nothing here keeps
        it, or the last inputs seen, alive afterwards."""
        statistics = self.pop(name)
        self._last = (None, None)
        shared = any(other is statistics for other in self.values())
        return statistics.hessian.clone() if shared else statistics.hessian


def inverse_hessian_factor(H: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of H^-1, written over H: an 8B model's down projection has 14336
    inputs (0.8 GB a copy), so the work holds H and one temporary, never more. Raises
    the damping tenfold (up to 3 times) if H is singular."""
    mean_diag = float(H.diagonal().mean())
    added = 0.0
    for attempt in range(4):
        damping = damp * 10**attempt * mean_diag
        H.diagonal().add_(damping - added)  # H + damping * I without an identity matrix
        added = damping
        lower, info = torch.linalg.cholesky_ex(H)  # into a new matrix: H stays whole for a retry
        if int(info) == 0:
            H.copy_(lower)  # H is no longer needed: its memory takes the factor, and each step
            del lower  # below needs one temporary at most
            torch.cholesky_inverse(H, out=H)
            try:
                return torch.linalg.cholesky(H, upper=True, out=H)
            except torch.linalg.LinAlgError as error:
                raise SlimlmError(
                    f"{name}: the inverse Hessian is not positive definite at damping {damping:.3g}; "
                    "raise quantize.damp"
                ) from error
        del lower
        log.warning("%s: Hessian not positive definite at damping %.3g; raising it", name, damping)
    raise SlimlmError(
        f"{name}: the Hessian stayed singular with damping up to {damp * 1000:g} of its mean diagonal; "
        "use more or longer calibration samples"
    )


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: QuantScheme,
    options: GPTQOptions = GPTQOptions(),
    name: str = "layer",
) -> QuantizedWeight:
    """`weight` quantized by GPTQ against `hessian`, which it overwrites when it is already in the
    layer's solve_dtype on the weight's device (pass a copy to keep it;
    LayerInputStatistics.take_hessian decides)."""
    out_features, in_features = weight.shape
    group = scheme.group_size or in_features
    device = weight.device  # every tensor below lives where the weight does (a block on a GPU)
    # exact zeros (a sparsify stage's work) stay zero; their error is spread like any other
    pruned = weight.detach() == 0
    H = hessian.to(device, solve_dtype(in_features))  # consumed: reordered and factorized in place
    dead = H.diagonal() == 0  # inputs that were always zero carry no information
    # Group parameters: from the original weights up front when act-order reorders columns (or one
    # group spans the row); otherwise from the updated weights when a group's first column is reached.
    static = options.act_order or scheme.group_size is None
    scales = torch.zeros(out_features, in_features // group, dtype=torch.float16, device=device)
    zeros = (
        None
        if scheme.symmetric
        else torch.zeros(out_features, in_features // group, dtype=torch.uint8, device=device)
    )
    grid = _StaticGrid(scales, zeros, scheme, group) if static else _DynamicGrid(scales, zeros, scheme, group)
    if static:
        W = _working_weight(weight, None, dead)
        ranges = search_clip(W, scheme, H) if options.clip_search else W
        for g in range(in_features // group):
            _set_group(scales, zeros, g, *group_params(ranges[:, g * group : (g + 1) * group], scheme))
        del W, ranges  # made again after H's reorder, whose temporary is the peak: not alive beside it
    order = torch.arange(in_features, device=device)
    if options.act_order:
        order = torch.argsort(H.diagonal(), descending=True)
        pruned, dead = pruned[:, order], dead[order]
        H.copy_(H[order[:, None], order])  # one temporary (a single gather), then H in the new order
    W = _working_weight(weight, order if options.act_order else None, dead)
    H[dead, dead] = 1.0
    keep = ~pruned if bool(pruned.any()) else None
    Hinv = inverse_hessian_factor(H, options.damp, name)
    codes = torch.zeros(out_features, in_features, dtype=torch.uint8, device=device)
    block = group * max(1, options.block_size // group) if not static else options.block_size
    for start in range(0, in_features, block):
        end = min(start + block, in_features)
        grid.enter_block(order[start:end])
        block_codes, errors = _quantize_block(
            W[:, start:end].clone(),
            Hinv[start:end, start:end],
            grid,
            None if keep is None else keep[:, start:end],
        )
        codes[:, order[start:end]] = block_codes
        W[:, end:] -= errors @ Hinv[start:end, end:]
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros)


def _quantize_block(
    W1: torch.Tensor, Hinv1: torch.Tensor, grid: "_StaticGrid | _DynamicGrid", keep: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ inside one block of columns: each column rounded onto its grid (float32, as
    compress/rtn.py rounds), its error divided by the inverse Hessian's diagonal and spread at
    once over the block's later columns (W1, updated in place). Returns the block's codes (uint8)
    and its scaled errors, which the caller spreads over the columns after the block."""
    codes = torch.empty(W1.shape, dtype=torch.float32, device=W1.device)
    errors = torch.empty_like(W1)
    for i in range(W1.shape[1]):
        scale, offset = grid.column(i, W1)
        w = W1[:, i]
        q = grid_codes(w.float(), scale, offset, grid.scheme)
        if keep is not None:  # an exact zero keeps the code of 0.0
            q = torch.where(keep[:, i], q, offset)
        codes[:, i] = q
        error = (w - grid_values(q, scale, offset).to(W1.dtype)) / Hinv1[i, i]
        W1[:, i:] -= torch.outer(error, Hinv1[i, i:])
        errors[:, i] = error
    return codes.to(torch.uint8), errors


class _StaticGrid:
    """Group parameters fixed before the solve (act-order, or one group spanning the row): each
    block's column scales and offsets (the code of 0.0) gathered up front, as float32."""

    def __init__(self, scales: torch.Tensor, zeros: Optional[torch.Tensor], scheme: QuantScheme, group: int):
        self.scales, self.zeros, self.scheme, self.group = scales, zeros, scheme, group
        self.symmetric_zero = float(scheme.symmetric_zero)

    def enter_block(self, columns: torch.Tensor) -> None:
        groups = columns // self.group
        self.block_scales = self.scales[:, groups].float()
        self.block_offsets = None if self.zeros is None else self.zeros[:, groups].float()

    def column(self, i: int, W1: torch.Tensor) -> tuple[torch.Tensor, "torch.Tensor | float"]:
        offset = self.symmetric_zero if self.block_offsets is None else self.block_offsets[:, i]
        return self.block_scales[:, i], offset


class _DynamicGrid:
    """Group parameters fixed from the updated weights when a group's first column is reached
    (no act-order: columns in stored order, a block holds whole groups)."""

    def __init__(self, scales: torch.Tensor, zeros: Optional[torch.Tensor], scheme: QuantScheme, group: int):
        self.scales, self.zeros, self.scheme, self.group = scales, zeros, scheme, group

    def enter_block(self, columns: torch.Tensor) -> None:
        self.first = int(columns[0])

    def column(self, i: int, W1: torch.Tensor) -> tuple[torch.Tensor, "torch.Tensor | float"]:
        if (self.first + i) % self.group == 0:
            g = (self.first + i) // self.group
            _set_group(self.scales, self.zeros, g, *group_params(W1[:, i : i + self.group], self.scheme))
            self.scale = self.scales[:, g].float()
            self.offset = (
                float(self.scheme.symmetric_zero) if self.zeros is None else self.zeros[:, g].float()
            )
        return self.scale, self.offset


def _working_weight(weight: torch.Tensor, order: Optional[torch.Tensor], dead: torch.Tensor) -> torch.Tensor:
    """A solve_dtype copy of `weight` (its columns in `order`, when given) with the `dead` columns
    (in that order) zeroed: GPTQ's working copy, 0.23 GB for an 8B down projection."""
    dtype = solve_dtype(weight.shape[1])
    W = weight.detach().to(dtype, copy=True) if order is None else weight.detach()[:, order].to(dtype)
    W[:, dead] = 0.0
    return W


def _set_group(scales: torch.Tensor, zeros, g: int, scale: torch.Tensor, zero) -> None:
    scales[:, g] = scale
    if zeros is not None:
        zeros[:, g] = zero
