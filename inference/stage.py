"""The `generate` stage: a greedy completion from the current (possibly reloaded) model,
through the bundled decoder (inference/) whenever it can run the model; a model that lies in an
artifact, not loaded, goes from disk into the decoder a layer at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from slimlm.artifact import artifact_model_type, is_artifact
from slimlm.errors import ConfigError
from slimlm.inference.generate import Completion, complete_from_artifact, greedy_complete
from slimlm.inference.model import ARCHITECTURES
from slimlm.pipeline import DiskRun, RunState, Stage


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
    record(
        state, greedy_complete(state.model, state.tokenizer, params.prompt, max_new, decoder.chat_template)
    )


def decoder_reads(state: RunState, params: GenerateParams) -> bool:
    """The current model lies in an artifact of an architecture the bundled decoder runs."""
    return is_artifact(state.on_disk) and artifact_model_type(state.on_disk) in ARCHITECTURES


def run_from_artifact(state: RunState, params: GenerateParams) -> None:
    decoder = state.cfg.decoder
    max_new = params.max_new_tokens or decoder.max_new_tokens
    record(
        state,
        complete_from_artifact(state.on_disk, params.prompt, max_new, decoder.chat_template, state.device),
    )


def record(state: RunState, completion: Completion) -> None:
    state.sections.setdefault("generations", []).append(
        {
            "model": state.memo.model_origin or "in-memory",
            "prompt": completion.prompt,
            "completion": completion.text,
            "new_tokens": completion.new_tokens,
            "decode_tok_s": round(completion.tokens_per_s, 2),
            "engine": completion.engine,
        }
    )


GENERATE = Stage(
    name="generate",
    params=GenerateParams,
    run=run,
    on_disk=(DiskRun(decoder_reads, run_from_artifact),),
    reads_only=True,
)
