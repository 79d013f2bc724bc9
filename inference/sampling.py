"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty.

The same rules as transformers' logits processors, applied in the same order (repetition
penalty, temperature, top-k, top-p), so a seed-for-seed comparison is meaningful and greedy
decoding is exactly argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from slimlm.errors import ConfigError

# Below float32's smallest normal number a temperature is decoded as greedy, its limit: sampling
# divides float32 logits by it, and one that rounds to 0 there makes the largest logit 0/0 (NaN).
SMALLEST_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: List[int] = field(default_factory=list)  # besides the tokenizer's end-of-sequence token
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature={self.temperature} must be 0 (greedy) or a positive number")
        if self.temperature < SMALLEST_TEMPERATURE:
            self.temperature = 0.0
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k} must be at least 1 (or null for no limit)")
        if self.top_p is not None and not 0 < self.top_p <= 1:  # also refuses NaN
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigError(
                f"repetition_penalty={self.repetition_penalty} must be a positive number (1.0: off)"
            )
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ConfigError(
                f"seed={self.seed} must fit 64 bits (torch's generators take -2**63 .. 2**64-1)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_state(
    prompts, params: SamplingParams, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, Optional[torch.Generator]]:
    """What sampling carries from step to step for these prompts: the tokens each row has seen
    [rows, vocab] (the repetition penalty's memory) and the seeded generator, if any."""
    seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
    if params.repetition_penalty != 1.0:
        for row, prompt in enumerate(prompts):
            seen[row, torch.tensor(list(prompt), device=device)] = True
    generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)
    return seen, generator


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty: a seen token's logit is divided by `penalty` if positive, multiplied if not.
    `seen` [batch, vocab] is a boolean mask of tokens in each row's prompt and output."""
    if penalty == 1.0:
        return logits
    largest = torch.finfo(
        logits.dtype
    ).max  # a tiny penalty must not make a logit infinite (inf - inf is NaN later)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(-largest, largest)
    return torch.where(seen, penalized, logits)


def filter_top_k_top_p(logits: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """Logits outside the top k, or outside the smallest set whose probability reaches top_p, set to -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (
            cumulative - sorted_logits.softmax(-1) >= top_p
        )  # the mass before this token already reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension, taken on an fp32 copy: the copy is exact (same order,
    same ties) and torch's bf16 argmax takes three times as long (180 us over 49k logits)."""
    return logits.float().argmax(-1)


def sampling_probabilities(
    logits: torch.Tensor, params: SamplingParams, seen: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The distribution [batch, vocab] (fp32) that sampling draws the next token from at a
    temperature above 0: repetition penalty, temperature, top-k, top-p, softmax."""
    logits = (
        logits.float()
        if seen is None
        else penalize_repetition(logits.float(), seen, params.repetition_penalty)
    )
    # Shifted so the largest is 0 before dividing: a tiny temperature then sends the others to
    # -inf and never the largest to +inf (whose softmax is NaN). Softmax ignores the shift.
    logits = logits - logits.amax(-1, keepdim=True)
    return filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p).softmax(-1)


def next_tokens(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, generator: Optional[torch.Generator]
) -> torch.Tensor:
    """One token per row [batch] from the last position's logits [batch, vocab]."""
    if params.greedy:
        return greedy_tokens(
            penalize_repetition(logits.float(), seen, params.repetition_penalty)
            if params.repetition_penalty != 1.0
            else logits
        )
    return torch.multinomial(sampling_probabilities(logits, params, seen), 1, generator=generator).squeeze(-1)
