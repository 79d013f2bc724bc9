"""Distance to the original model: KL divergence of next-token distributions and top-1 agreement.

The original model's distributions are stored once per (model, text, windows) as the top-k
log-probabilities of every position, so later runs never run the original model again. KL is
then computed over k+1 outcomes, the top-k tokens and "everything else" lumped together:

    KL(P||Q) ~= sum_{i in top-k} p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest)

By the data-processing inequality this never exceeds the full KL, and it equals it when the
top-k hold nearly all of P's mass (k=32 leaves well under 1% of the mass out on typical text).
Top-1 agreement compares the argmax of both models, exactly. As llama.cpp's perplexity tool does,
we report the mean KL, its median and 99th percentile, and top-1 agreement.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from slimlm.resources import cache_dir
from slimlm.rundir import save_tensors_atomic

REST_FLOOR = 1e-6  # a rest of P below this is float32 rounding, not probability mass


@dataclass
class ReferenceLogits:
    """Top-k log-probabilities of the original model at every scored position."""

    log_probs: torch.Tensor  # [positions, k] float32, sorted descending
    indices: torch.Tensor  # [positions, k] int32 token ids
    nll: float  # the original model's mean NLL on the same tokens (for Δppl)
    window: int
    windows: int

    def slice(self, start: int, end: int) -> "ReferenceLogits":
        return ReferenceLogits(
            self.log_probs[start:end], self.indices[start:end], self.nll, self.window, self.windows
        )

    def save(self, path: Path) -> None:
        metadata = {"nll": repr(self.nll), "window": str(self.window), "windows": str(self.windows)}
        save_tensors_atomic(
            path, {"log_probs": self.log_probs.contiguous(), "indices": self.indices.contiguous()}, metadata
        )

    @classmethod
    def load(cls, path: Path) -> "ReferenceLogits":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
            return cls(
                log_probs=handle.get_tensor("log_probs"),
                indices=handle.get_tensor("indices"),
                nll=float(meta["nll"]),
                window=int(meta["window"]),
                windows=int(meta["windows"]),
            )


def reference_path(model_sha256: str, token_ids: torch.Tensor, window: int, windows: int, top_k: int) -> Path:
    """Cache location keyed by everything the reference depends on."""
    digest = hashlib.sha256()
    digest.update(model_sha256.encode())
    digest.update(token_ids[: window * windows].numpy().tobytes())
    digest.update(json.dumps({"window": window, "windows": windows, "top_k": top_k}).encode())
    return cache_dir() / "reference" / f"{digest.hexdigest()[:32]}.safetensors"


class TopKCollector:
    def __init__(self, k: int):
        self.k = k
        self.values: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []

    def add(self, log_probs: torch.Tensor) -> None:
        values, indices = log_probs.topk(self.k, dim=-1)
        self.values.append(values.float().cpu())
        self.indices.append(indices.to(torch.int32).cpu())

    def result(self, nll: float, window: int, windows: int) -> ReferenceLogits:
        return ReferenceLogits(torch.cat(self.values), torch.cat(self.indices), nll, window, windows)


def topk_kl(reference: ReferenceLogits, log_q: torch.Tensor) -> torch.Tensor:
    """Per-position KL(P||Q) over the top-k outcomes of P plus the lumped rest.

    The rest masses are computed in float64; a rest of P below REST_FLOOR is float32 rounding
    of probabilities that sum to one (k covers the vocabulary, or P is certain) and counts as 0.
    """
    log_p = reference.log_probs.to(log_q.device).double()
    log_q_top = log_q.gather(1, reference.indices.to(log_q.device).long()).double()
    p = log_p.exp()
    kl_top = (p * (log_p - log_q_top)).sum(dim=1)
    p_rest = 1.0 - p.sum(dim=1)
    q_rest = (1.0 - log_q_top.exp().sum(dim=1)).clamp(min=1e-30)
    has_rest = p_rest > REST_FLOOR
    kl_rest = torch.where(
        has_rest,
        p_rest.clamp(min=REST_FLOOR) * (p_rest.clamp(min=REST_FLOOR).log() - q_rest.log()),
        torch.zeros_like(p_rest),
    )
    return (kl_top + kl_rest).clamp(min=0.0)


class DistanceAccumulator:
    def __init__(self) -> None:
        self.kl: list[torch.Tensor] = []
        self.agree = 0
        self.count = 0
        self.reference_nll: Optional[float] = None

    def add(self, reference: ReferenceLogits, log_q: torch.Tensor) -> None:
        self.kl.append(topk_kl(reference, log_q).cpu())
        self.agree += int((log_q.argmax(dim=1).cpu() == reference.indices[:, 0].long()).sum())
        self.count += log_q.shape[0]
        self.reference_nll = reference.nll

    def result(self) -> dict:
        kl = torch.cat(self.kl).double()
        return {
            "kl_mean": float(kl.mean()),
            "kl_median": float(kl.median()),
            "kl_p99": float(torch.quantile(kl, 0.99)) if kl.numel() <= 16_000_000 else float("nan"),
            "top1_agreement": self.agree / self.count,
            "reference_nll": self.reference_nll,
        }
