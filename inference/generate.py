"""Greedy completion of a prompt, through transformers' `generate` for now."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Completion:
    prompt: str
    text: str
    new_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def prompt_ids(tokenizer, prompt: str, chat_template: bool) -> torch.Tensor:
    """Token ids for a user prompt, wrapped in the chat template when asked and available."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


@torch.inference_mode()
def greedy_complete(model, tokenizer, prompt: str, max_new_tokens: int, chat_template: bool = True) -> Completion:
    input_ids = prompt_ids(tokenizer, prompt, chat_template).to(next(model.parameters()).device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    seconds = time.perf_counter() - start
    new_ids = output[0, input_ids.shape[1] :]
    text = tokenizer.decode(new_ids, skip_special_tokens=True).strip()
    return Completion(prompt=prompt, text=text, new_tokens=int(new_ids.numel()), seconds=seconds)
