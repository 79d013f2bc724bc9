"""Distillation losses: divergences between teacher and student next-token distributions.

Every divergence takes two log-probability tensors of the same shape [..., V] (over the whole
vocabulary, or over the teacher's top-k tokens plus one bucket for the rest, see `bucketed`) and
returns one value per position [...]; `token_mean` averages them over the positions that count.

- forward KL  KL(p || q) = sum p (log p - log q): mass-covering (the student spreads over every
  token the teacher likes); the classic Hinton loss.
- reverse KL  KL(q || p): mode-seeking (the student concentrates on the teacher's main modes).
- generalized JSD(beta) (Agarwal et al. 2024, GKD): beta KL(p || m) + (1 - beta) KL(q || m) with
  m = beta p + (1 - beta) q, mixed in probability space; bounded, between the two KLs in character.
- total variation  1/2 sum |p - q|: bounded in [0, 1].
- skew KL (Ko et al. 2024, DistiLLM)  KL(p || alpha p + (1 - alpha) q): forward KL that stays finite
  and smooth where the student gives a token no mass.
Temperature T softens both distributions (logits / T) and the loss is multiplied by T^2, so its
gradients keep their scale as T changes (Hinton et al. 2015).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from slimlm.errors import ConfigError

LOSSES = ("forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl")


def forward_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    p = teacher_logp.exp()
    return torch.where(p > 0, p * (teacher_logp - student_logp), 0.0).sum(dim=-1)  # 0 log 0 = 0


def reverse_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    return forward_kl(student_logp, teacher_logp)


def _log_mixture(a_logp: torch.Tensor, b_logp: torch.Tensor, weight: float) -> torch.Tensor:
    """log(weight * a + (1 - weight) * b), computed stably in log space."""
    if weight <= 0.0:
        return b_logp
    if weight >= 1.0:
        return a_logp
    return torch.logaddexp(a_logp + math.log(weight), b_logp + math.log1p(-weight))


def jsd(teacher_logp: torch.Tensor, student_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    if beta <= 0.0 or beta >= 1.0:  # the mixture is one of the two: both terms vanish
        return torch.zeros(teacher_logp.shape[:-1], dtype=teacher_logp.dtype, device=teacher_logp.device)
    mixture = _log_mixture(teacher_logp, student_logp, beta)
    return beta * forward_kl(teacher_logp, mixture) + (1 - beta) * forward_kl(student_logp, mixture)


def tvd(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (teacher_logp.exp() - student_logp.exp()).abs().sum(dim=-1)


def skew_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor, alpha: float = 0.1) -> torch.Tensor:
    return forward_kl(teacher_logp, _log_mixture(teacher_logp, student_logp, alpha))


def divergence(
    name: str, teacher_logp: torch.Tensor, student_logp: torch.Tensor, beta: float = 0.5
) -> torch.Tensor:
    """The named divergence per position; `beta` is JSD's beta or skew KL's alpha."""
    if name == "forward_kl":
        return forward_kl(teacher_logp, student_logp)
    if name == "reverse_kl":
        return reverse_kl(teacher_logp, student_logp)
    if name == "jsd":
        return jsd(teacher_logp, student_logp, beta)
    if name == "tvd":
        return tvd(teacher_logp, student_logp)
    if name == "skew_kl":
        return skew_kl(teacher_logp, student_logp, beta)
    raise ConfigError(f"distillation loss '{name}' is unknown; choose one of {', '.join(LOSSES)}")


def bucketed(log_probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """A distribution over the vocabulary folded onto `indices` [..., k] plus one bucket for
    every other token: [..., k + 1] log-probs. The teacher's top-k cache stores exactly this, so
    the student is folded the same way; every divergence of the folded pair is at most the full
    one (data processing inequality) and equals it when k covers the vocabulary."""
    top = log_probs.gather(-1, indices)
    rest = torch.log1p(-top.exp().sum(dim=-1).clamp(max=1 - 1e-6)).unsqueeze(-1)
    return torch.cat([top, rest], dim=-1)


def distillation_loss(
    student_logits: torch.Tensor,
    teacher: torch.Tensor,
    name: str = "forward_kl",
    temperature: float = 1.0,
    beta: float = 0.5,
    teacher_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-position loss x T^2. `teacher` holds logits [..., V] (online), or with
    `teacher_indices` [..., k] the cached bucketed log-probs [..., k + 1] at this temperature."""
    student_logp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    if teacher_indices is None:
        teacher_logp = F.log_softmax(teacher.float() / temperature, dim=-1)
    else:
        student_logp, teacher_logp = bucketed(student_logp, teacher_indices.long()), teacher.float()
    return divergence(name, teacher_logp, student_logp, beta) * temperature**2


def token_mean(values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean over positions, counting only those where `mask` is true."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


class HiddenProjector(nn.Module):
    """Hidden-state distillation: each chosen student layer's output, linearly projected to the
    teacher's width (learned, trained with the student), against the teacher layer at the same
    relative depth; mean squared error or 1 - cosine similarity."""

    def __init__(
        self,
        student_width: int,
        teacher_width: int,
        student_layers: int,
        teacher_layers: int,
        kind: str = "mse",
    ):
        super().__init__()
        if kind not in ("mse", "cosine"):
            raise ConfigError(f"hidden-state loss '{kind}' is unknown; choose mse or cosine")
        self.kind = kind
        # Student layer i (output i + 1 of the hidden states) matches teacher layer round((i + 1) * Lt / Ls).
        self.pairs = [(i, round(i * teacher_layers / student_layers)) for i in range(1, student_layers + 1)]
        self.projections = nn.ModuleList(
            nn.Identity()
            if student_width == teacher_width
            else nn.Linear(student_width, teacher_width, bias=False)
            for _ in self.pairs
        )

    def forward(
        self, student_hidden: tuple[torch.Tensor, ...], teacher_hidden: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """Per-position loss averaged over the matched layers."""
        losses = []
        for (s, t), projection in zip(self.pairs, self.projections):
            projected, target = projection(student_hidden[s].float()), teacher_hidden[t].float()
            if self.kind == "mse":
                losses.append(((projected - target) ** 2).mean(dim=-1))
            else:
                losses.append(1 - F.cosine_similarity(projected, target, dim=-1))
        return torch.stack(losses).mean(dim=0)
