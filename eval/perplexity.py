"""Perplexity, and distance to the original model, over non-overlapping windows of one text.

The GPTQ/AWQ protocol: the text is tokenized once without special tokens and cut into windows
of `window` tokens; each window is scored independently, every token but its first being
predicted. Leftover tokens after the last full window are dropped, so every row of a report
scores the same tokens.

One forward pass per window serves three consumers: the negative log-likelihood (perplexity),
the KL divergence and top-1 agreement to a reference (`slimlm.eval.kl`), and the collection of
the reference itself when the model being scored is the original.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from slimlm.errors import SlimlmError
from slimlm.eval.kl import DistanceAccumulator, ReferenceLogits, TopKCollector


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens_scored: int
    windows: int
    window: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TextScores:
    perplexity: PerplexityResult
    distance: Optional[dict]  # kl_mean, top1_agreement, ... when a reference was given
    reference: Optional[ReferenceLogits]  # collected when asked (the model is the original)


def window_count(n_tokens: int, window: int, max_windows: Optional[int]) -> int:
    available = n_tokens // window
    if available == 0:
        raise SlimlmError(f"the evaluation text has {n_tokens} tokens, fewer than one window of {window}; lower eval.perplexity.window or use a longer text")
    return available if max_windows is None else min(available, max_windows)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def score_text(
    model,
    token_ids: torch.Tensor,
    window: int,
    max_windows: Optional[int] = None,
    batch_size: int = 1,
    reference: Optional[ReferenceLogits] = None,
    collect_top_k: int = 0,
    desc: str = "perplexity",
) -> TextScores:
    """Score every window once; optionally compare with `reference` and/or collect a new one."""
    n_windows = window_count(token_ids.numel(), window, max_windows)
    windows = token_ids[: n_windows * window].view(n_windows, window)
    if reference is not None and reference.log_probs.shape[0] != n_windows * (window - 1):
        raise SlimlmError("the cached reference logits do not cover the same windows; delete the reference cache entry and rerun")
    collector = TopKCollector(collect_top_k) if collect_top_k else None
    distance = DistanceAccumulator() if reference is not None else None
    device = model_device(model)
    total_nll = 0.0
    for start in tqdm(range(0, n_windows, batch_size), desc=desc, unit="batch"):
        batch = windows[start : start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        log_probs = F.log_softmax(logits, dim=-1).flatten(0, 1)
        targets = batch[:, 1:].flatten()
        total_nll -= float(log_probs.gather(1, targets[:, None]).sum())
        if collector is not None:
            collector.add(log_probs)
        if distance is not None:
            first = start * (window - 1)
            distance.add(reference.slice(first, first + log_probs.shape[0]), log_probs)
    scored = n_windows * (window - 1)
    mean_nll = total_nll / scored
    result = PerplexityResult(ppl=math.exp(mean_nll), nll=mean_nll, tokens_scored=scored, windows=n_windows, window=window)
    collected = collector.result(nll=mean_nll, window=window, windows=n_windows) if collector is not None else None
    return TextScores(perplexity=result, distance=distance.result() if distance is not None else None, reference=collected)


def perplexity(model, token_ids: torch.Tensor, window: int, max_windows: Optional[int] = None, batch_size: int = 1, desc: str = "perplexity") -> PerplexityResult:
    return score_text(model, token_ids, window, max_windows, batch_size, desc=desc).perplexity
