"""Per-layer mixed precision: spend a bits-per-weight budget where it buys the most accuracy.

Sensitivity. Quantizing one Linear layer moves its weights by D = W - Q(W). To second order the
loss grows by 1/2 sum F * D^2, with F the diagonal of the Fisher information of the model's
next-token distribution, which is also the second-order term of the KL divergence from the
original model. F is estimated from squared gradients of the language-model loss on
calibration windows (the empirical Fisher, as in SqueezeLLM), so one forward and backward pass
per window scores every layer at every candidate bit width. `measure_kl_sensitivity` measures the
real thing (the KL when one layer alone is quantized) for validating this proxy.

Choice. Each layer picks one candidate bit width; the average bits per weight over the
quantized layers, scales and zero points included, must not exceed the budget; the sum of
predicted losses is minimised. This multiple-choice knapsack is solved greedily on each
layer's lower convex hull of (bits, loss): repeatedly take the upgrade that removes the most
predicted loss per extra bit while it fits.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from tqdm import tqdm

from slimlm.compress.rtn import fake_quantize
from slimlm.errors import SlimlmError
from slimlm.qlinear import QuantScheme


def bits_per_weight(scheme: QuantScheme, in_features: int) -> float:
    """Stored bits per weight: the codes, an fp16 scale and (asymmetric) a uint8 zero per group."""
    group = scheme.group_size or in_features
    return scheme.bits + (16 + (0 if scheme.symmetric else 8)) / group


def fisher_diagonal(model: nn.Module, samples: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Mean squared gradient of the LM loss with respect to each named Linear weight, one
    calibration window at a time (per-window gradients, as the empirical Fisher needs)."""
    weights = {name: model.get_submodule(name).weight for name in names}
    previous = {p: p.requires_grad for p in model.parameters()}
    fisher = {name: torch.zeros_like(w, dtype=torch.float32) for name, w in weights.items()}
    try:
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for weight in weights.values():
            weight.requires_grad_(True)
        device = next(model.parameters()).device
        for window in tqdm(samples, desc="sensitivity (Fisher)", unit="window"):
            ids = window[None].to(device)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            if not torch.isfinite(loss):
                raise SlimlmError(
                    "the model's loss on a calibration window is NaN or Inf; "
                    "check the model's fp32 perplexity first"
                )
            loss.backward()
            for name, weight in weights.items():
                fisher[name] += weight.grad.float().pow(2) / len(samples)
                weight.grad = None
    finally:
        for parameter, flag in previous.items():
            parameter.requires_grad_(flag)
    return fisher


def predicted_loss(
    weight: torch.Tensor, fisher: torch.Tensor, scheme: QuantScheme, tokens_per_window: int
) -> float:
    """Predicted KL per token, in nats, from rounding `weight` with `scheme` (RTN).

    The Fisher was taken of a window's mean loss; a single token's Fisher is `tokens_per_window`
    times larger (gradients of independent tokens add up as variances)."""
    delta = weight.detach().float() - fake_quantize(weight, scheme)
    return float(0.5 * tokens_per_window * (fisher * delta.pow(2)).sum())


@dataclass(frozen=True)
class Allocation:
    bits: dict[str, int]  # chosen bit width per layer
    bpw: float  # achieved average bits per weight
    predicted_loss: float  # sum over layers


def choose_bits(
    costs: dict[str, dict[int, float]], sizes: dict[str, tuple[int, dict[int, float]]], budget_bpw: float
) -> Allocation:
    """Pick a bit width per layer: `costs[name][bits]` is its predicted loss, `sizes[name]` its
    weight count and bits per weight for each candidate; the weighted average stays within
    `budget_bpw`."""
    total_weights = sum(count for count, _ in sizes.values())
    budget = budget_bpw * total_weights
    hulls = {
        name: _lower_hull([(sizes[name][0] * sizes[name][1][b], costs[name][b], b) for b in costs[name]])
        for name in costs
    }
    position = {name: 0 for name in hulls}
    used = sum(hull[0][0] for hull in hulls.values())
    if used > budget + 1e-6:
        smallest = min(min(per_bits.values()) for _, per_bits in sizes.values())
        raise SlimlmError(
            f"a budget of {budget_bpw} bits per weight is below what the smallest candidate "
            f"needs ({used / total_weights:.3f}; {smallest:.3f} per weight at best); "
            "raise quantize.bpw or add smaller bit widths to quantize.candidate_bits"
        )
    heap = [_upgrade(name, hulls[name], 0) for name in hulls if len(hulls[name]) > 1]
    heapq.heapify(heap)
    while heap:
        _, name, step = heapq.heappop(heap)
        hull = hulls[name]
        extra = hull[step + 1][0] - hull[step][0]
        if used + extra > budget + 1e-6:
            continue  # this layer's next step does not fit; smaller steps elsewhere still may
        used += extra
        position[name] = step + 1
        if step + 2 < len(hull):
            heapq.heappush(heap, _upgrade(name, hull, step + 1))
    bits = {name: hulls[name][position[name]][2] for name in hulls}
    loss = sum(costs[name][bits[name]] for name in hulls)
    return Allocation(bits=bits, bpw=used / total_weights, predicted_loss=loss)


def _lower_hull(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """Points (size, loss, bits) on the lower-left convex hull, by increasing size: the choices
    a greedy upgrade should ever stop at (dominated or non-convex ones never pay off first)."""
    hull: list[tuple[float, float, int]] = []
    for point in sorted(points):
        if hull and point[1] >= hull[-1][1]:
            continue  # more bits, no less loss
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], point) <= 0:
            hull.pop()
        hull.append(point)
    return hull


def _cross(a, b, c) -> float:
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


def _upgrade(name: str, hull: list[tuple[float, float, int]], step: int) -> tuple[float, str, int]:
    """Heap entry: loss removed per extra bit, negated (heapq pops the smallest)."""
    gain = (hull[step][1] - hull[step + 1][1]) / (hull[step + 1][0] - hull[step][0])
    return (-gain, name, step)


@torch.no_grad()
def measure_kl_sensitivity(
    model: nn.Module,
    token_ids: torch.Tensor,
    name: str,
    scheme: QuantScheme,
    reference_log_probs: torch.Tensor,
) -> float:
    """Mean per-token KL(original || model with only `name` rounded by `scheme`), on `token_ids`
    [batch, seq]; `reference_log_probs` are the original model's log-probabilities there."""
    linear = model.get_submodule(name)
    original = linear.weight.data.clone()
    try:
        linear.weight.data.copy_(fake_quantize(original, scheme).to(original.dtype))
        log_probs = torch.log_softmax(model(input_ids=token_ids, use_cache=False).logits.float(), dim=-1)
    finally:
        linear.weight.data.copy_(original)
    return float((reference_log_probs.exp() * (reference_log_probs - log_probs)).sum(-1).mean())
