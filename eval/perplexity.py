"""Perplexity over non-overlapping windows of a tokenized text (the GPTQ/AWQ protocol).

The text is tokenized once without special tokens and cut into windows of `window` tokens;
each window is scored independently, every token but its first being predicted. Leftover
tokens after the last full window are dropped, so every row of a report scores the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from slimlm.errors import SlimlmError


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens_scored: int
    windows: int
    window: int

    def to_dict(self) -> dict:
        return asdict(self)


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def window_count(n_tokens: int, window: int, max_windows: Optional[int]) -> int:
    available = n_tokens // window
    if available == 0:
        raise SlimlmError(f"the evaluation text has {n_tokens} tokens, fewer than one window of {window}; lower eval.perplexity.window or use a longer text")
    return available if max_windows is None else min(available, max_windows)


@torch.inference_mode()
def perplexity(model, token_ids: torch.Tensor, window: int, max_windows: Optional[int] = None, batch_size: int = 1, desc: str = "perplexity") -> PerplexityResult:
    n_windows = window_count(token_ids.numel(), window, max_windows)
    windows = token_ids[: n_windows * window].view(n_windows, window)
    device = next(model.parameters()).device
    total_nll = 0.0
    for start in tqdm(range(0, n_windows, batch_size), desc=desc, unit="batch"):
        batch = windows[start : start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
        total_nll += float(nll)
    scored = n_windows * (window - 1)
    mean_nll = total_nll / scored
    return PerplexityResult(ppl=math.exp(mean_nll), nll=mean_nll, tokens_scored=scored, windows=n_windows, window=window)
