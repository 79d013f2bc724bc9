"""Which weights to zero: magnitude, Wanda and SparseGPT masks, unstructured or N:M.

- magnitude: the smallest |W| of the whole matrix (the baseline the papers beat).
- Wanda (Sun et al., 2023): score |W_ij| * ||X_j||, the weight times the norm of the input
  feature it multiplies, compared within each output row; no weight update.
- SparseGPT (Frantar & Alistarh, 2023): GPTQ's column sweep with pruning in place of rounding:
  in each block of columns the weights with the least w^2 / [H^-1]_jj^2 are zeroed and their
  error is spread over the columns not yet visited, through the inverse Hessian of the layer's
  reconstruction loss (the same H = 2 X^T X that GPTQ uses).
- N:M (2:4, 4:8): in every run of M consecutive inputs of a row, N weights are kept; the pattern
  NVIDIA's sparse tensor cores run.
- OWL (Yin et al., 2023): layers with more outlier scores (|W| * ||X|| above M times the layer
  mean) keep more weights; per-layer ratios span 2 lambda, linear in the outlier ratio, average S.

All functions take a weight [out, in] and return a boolean keep-mask of the same shape (or,
for SparseGPT, the updated weight with its zeros in place).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from slimlm.compress.gptq import inverse_hessian_factor, solve_dtype
from slimlm.errors import ConfigError, SlimlmError


@dataclass(frozen=True)
class SparsityPattern:
    """An unstructured ratio of zeros, or N kept weights in every M consecutive inputs."""

    ratio: float = 0.5  # fraction of weights set to zero (N:M: 1 - N/M)
    n: Optional[int] = None
    m: Optional[int] = None

    @classmethod
    def parse(cls, sparsity: float, pattern: str) -> "SparsityPattern":
        """From a recipe's `sparsity` and `pattern` ('unstructured', '2:4', '4:8', ...)."""
        if pattern == "unstructured":
            if not 0 <= sparsity < 1:
                raise ConfigError(
                    f"sparsity={sparsity} must lie in [0, 1): the fraction of weights set to zero"
                )
            return cls(ratio=float(sparsity))
        match = re.fullmatch(r"(\d+):(\d+)", pattern)
        if not match or not 0 < int(match[1]) < int(match[2]):
            raise ConfigError(
                f"pattern='{pattern}' is neither 'unstructured' nor N:M with 0 < N < M (e.g. '2:4')"
            )
        n, m = int(match[1]), int(match[2])
        if abs(sparsity - (1 - n / m)) > 1e-9:
            raise ConfigError(
                f"sparsity={sparsity} disagrees with pattern '{pattern}', "
                f"which zeroes {1 - n / m:g} of the weights; set sparsity: {1 - n / m:g}"
            )
        return cls(ratio=1 - n / m, n=n, m=m)

    @property
    def is_nm(self) -> bool:
        return self.n is not None

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.is_nm else f"{self.ratio:.0%} unstructured"

    def shape_problem(self, in_features: int) -> Optional[str]:
        if self.is_nm and in_features % self.m:
            return (
                f"its {in_features} input features are not a multiple of {self.m}, "
                f"so the {self} pattern cannot tile them"
            )
        return None


def keep_mask(scores: torch.Tensor, pattern: SparsityPattern, per_row: bool) -> torch.Tensor:
    """Keep the highest scores: N of every M along a row, or all but `ratio` of each row
    (per_row) or of the whole matrix. Exactly floor(ratio * count) entries are dropped."""
    rows, cols = scores.shape
    keep = torch.ones_like(scores, dtype=torch.bool)
    if pattern.is_nm:
        runs = scores.reshape(rows, cols // pattern.m, pattern.m)
        drop = runs.topk(pattern.m - pattern.n, dim=-1, largest=False).indices
        return keep.view_as(runs).scatter(-1, drop, False).view(rows, cols)
    if per_row:
        dropped = int(pattern.ratio * cols)
        if dropped:
            keep.scatter_(1, scores.topk(dropped, dim=1, largest=False).indices, False)
        return keep
    dropped = int(pattern.ratio * scores.numel())
    if dropped:
        keep.view(-1)[scores.flatten().topk(dropped, largest=False).indices] = False
    return keep


def wanda_scores(weight: torch.Tensor, square_sums: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j|| from sum_t x_tj^2 per input (or anything proportional to it, such as the
    Hessian's diagonal 2/n sum_t x_tj^2: a constant factor changes no ranking)."""
    return weight.detach().abs().float() * square_sums.float().clamp(min=0).sqrt().unsqueeze(0)


def magnitude_mask(weight: torch.Tensor, pattern: SparsityPattern) -> torch.Tensor:
    return keep_mask(weight.detach().abs().float(), pattern, per_row=False)


def wanda_mask(weight: torch.Tensor, square_sums: torch.Tensor, pattern: SparsityPattern) -> torch.Tensor:
    return keep_mask(wanda_scores(weight, square_sums), pattern, per_row=True)


def outlier_ratio(scores: Sequence[torch.Tensor], threshold: float) -> float:
    """Fraction of a layer's Wanda scores above `threshold` times their mean (OWL's statistic)."""
    flat = torch.cat([s.flatten() for s in scores])
    return float((flat > threshold * flat.mean()).float().mean())


def owl_ratios(outliers: Sequence[float], target: float, spread: float) -> list[float]:
    """Per-layer sparsity from outlier ratios, as OWL computes it: the kept fractions are spread
    linearly over a range 2 x `spread` wide (most outliers: most kept), shifted so that the mean
    ratio is `target`."""
    values = torch.tensor(outliers, dtype=torch.float64)
    width = float(values.max() - values.min())
    keep = torch.zeros_like(values) if width == 0 else (values - values.min()) / width * 2 * spread
    keep = keep - keep.mean() + (1 - target)
    ratios = (1 - keep).clamp(0.0, 0.99)
    return [float(r) for r in ratios]


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    pattern: SparsityPattern,
    block_size: int = 128,
    damp: float = 0.01,
    name: str = "layer",
) -> torch.Tensor:
    """The weight with `pattern` pruned SparseGPT's way (float32, zeros in place). `hessian` is
    overwritten when it is already in the layer's solve_dtype on the weight's device, as in
    gptq_quantize.

    Masks are chosen on the partly updated weights (adaptive mask selection): N:M per run of M
    columns as the sweep reaches it; unstructured per block of columns, each block dropping its
    share of the whole matrix's budget (running total), so the matrix ends with exactly
    floor(ratio * numel) zeros.
    """
    rows, cols = weight.shape
    problem = pattern.shape_problem(cols)
    if problem:
        raise SlimlmError(f"cannot prune {name}: {problem}")
    W = weight.detach().to(solve_dtype(cols), copy=True)
    H = hessian.to(W.device, W.dtype)  # consumed: factorized in place
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    Hinv = inverse_hessian_factor(H, damp, name)
    if pattern.is_nm:
        block_size = max(pattern.m, block_size - block_size % pattern.m)
    budget, dropped = int(pattern.ratio * W.numel()), 0
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        W1, diag = W[:, start:end].clone(), Hinv[start:end, start:end].diagonal().unsqueeze(0)
        keep = torch.ones_like(W1, dtype=torch.bool)
        if not pattern.is_nm:
            share = round(budget * end / cols) - dropped
            if share > 0:
                saliency = W1**2 / diag**2
                keep.view(-1)[saliency.flatten().topk(share, largest=False).indices] = False
            dropped += share
        errors = torch.zeros_like(W1)
        for i in range(end - start):
            if pattern.is_nm and i % pattern.m == 0:  # each run's mask from the weights as updated so far
                run = slice(i, i + pattern.m)
                keep[:, run] = keep_mask(W1[:, run] ** 2 / diag[:, run] ** 2, pattern, per_row=True)
            pruned = torch.where(keep[:, i], W1[:, i], torch.zeros_like(W1[:, i]))
            error = (W1[:, i] - pruned) / Hinv[start + i, start + i]
            W1[:, i:] -= error.unsqueeze(1) @ Hinv[start + i, start + i : end].unsqueeze(0)
            W1[:, i] = pruned
            errors[:, i] = error
        W[:, start:end] = W1
        W[:, end:] -= errors @ Hinv[start:end, end:]
    return W.float()
