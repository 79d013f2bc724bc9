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
        raise SlimlmError(
            f"the evaluation text has {n_tokens} tokens, fewer than one window "
            f"of {window}; lower eval.perplexity.window or use a longer text"
        )
    return available if max_windows is None else min(available, max_windows)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


class WindowScorer:
    """Scores windows as their logits come, in order: the negative log-likelihood of each
    token but the first, and optionally the distance to `reference` and a top-k collection.
    Whatever computes the logits (a model in memory, or one block at a time from disk) feeds it."""

    def __init__(
        self, n_windows: int, window: int, reference: Optional[ReferenceLogits] = None, collect_top_k: int = 0
    ):
        if reference is not None and reference.log_probs.shape[0] != n_windows * (window - 1):
            raise SlimlmError(
                "the cached reference logits do not cover the same windows; "
                "delete the reference cache entry and rerun"
            )
        self.n_windows, self.window, self.reference = n_windows, window, reference
        self.collector = TopKCollector(collect_top_k) if collect_top_k else None
        self.distance = DistanceAccumulator() if reference is not None else None
        self.total_nll = 0.0
        self.scored = 0  # positions scored so far

    def add(self, windows: torch.Tensor, logits: torch.Tensor) -> None:
        """The next windows' token ids [n, window] and the logits predicted for them [n, window, vocab]."""
        log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1).flatten(0, 1)
        targets = windows[:, 1:].flatten().to(log_probs.device)
        self.total_nll -= float(log_probs.gather(1, targets[:, None]).sum())
        if self.collector is not None:
            self.collector.add(log_probs)
        if self.distance is not None:
            self.distance.add(self.reference.slice(self.scored, self.scored + log_probs.shape[0]), log_probs)
        self.scored += log_probs.shape[0]

    def result(self) -> TextScores:
        expected = self.n_windows * (self.window - 1)
        if self.scored != expected:
            raise SlimlmError(
                f"scored {self.scored} positions of the {expected} the windows hold"
            )  # a caller's bug, not the user's
        mean_nll = self.total_nll / expected
        result = PerplexityResult(
            ppl=math.exp(mean_nll),
            nll=mean_nll,
            tokens_scored=expected,
            windows=self.n_windows,
            window=self.window,
        )
        collected = (
            self.collector.result(nll=mean_nll, window=self.window, windows=self.n_windows)
            if self.collector is not None
            else None
        )
        return TextScores(
            perplexity=result,
            distance=self.distance.result() if self.distance is not None else None,
            reference=collected,
        )


def text_windows(token_ids: torch.Tensor, window: int, max_windows: Optional[int]) -> torch.Tensor:
    """The text's scored windows [n, window]: leftover tokens after the last full one dropped."""
    n_windows = window_count(token_ids.numel(), window, max_windows)
    return token_ids[: n_windows * window].view(n_windows, window)


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
    windows = text_windows(token_ids, window, max_windows)
    scorer = WindowScorer(windows.shape[0], window, reference, collect_top_k)
    device = model_device(model)
    for batch in tqdm(windows.split(batch_size), desc=desc, unit="batch"):
        scorer.add(batch, model(input_ids=batch.to(device), use_cache=False).logits)
    return scorer.result()


def perplexity(
    model,
    token_ids: torch.Tensor,
    window: int,
    max_windows: Optional[int] = None,
    batch_size: int = 1,
    desc: str = "perplexity",
) -> PerplexityResult:
    return score_text(model, token_ids, window, max_windows, batch_size, desc=desc).perplexity
