"""The `generate` stage: a greedy completion from the current (possibly reloaded) model,
through the bundled decoder (inference/) whenever it can run the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from slimlm.errors import ConfigError
from slimlm.inference.generate import greedy_complete
from slimlm.pipeline import RunState, Stage


@dataclass
class GenerateParams:
    prompt: str = "What is the capital of France?"
    max_new_tokens: Optional[int] = None  # None: the decoder config's max_new_tokens

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ConfigError("generate.prompt is empty: give the text to complete")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"generate.max_new_tokens={self.max_new_tokens} must be at least 1")


def run(state: RunState, params: GenerateParams) -> None:
    decoder = state.cfg.decoder
    max_new = params.max_new_tokens or decoder.max_new_tokens
    completion = greedy_complete(state.model, state.tokenizer, params.prompt, max_new, decoder.chat_template)
    state.sections.setdefault("generations", []).append(
        {
            "model": state.memo.get("model_origin", "in-memory"),
            "prompt": completion.prompt,
            "completion": completion.text,
            "new_tokens": completion.new_tokens,
            "decode_tok_s": round(completion.tokens_per_s, 2),
            "engine": completion.engine,
        }
    )


GENERATE = Stage(name="generate", params=GenerateParams, run=run)
