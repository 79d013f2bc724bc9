"""The `evaluate` stage: perplexity and size of the current model, as one report row."""

from __future__ import annotations

from dataclasses import dataclass

from slimlm.data import load_text
from slimlm.errors import ConfigError
from slimlm.eval.perplexity import perplexity, tokenize_text
from slimlm.eval.size import model_size
from slimlm.pipeline import RunState, Stage


@dataclass
class EvaluateParams:
    label: str = "model"  # the row's name in the report

    def __post_init__(self) -> None:
        if not self.label.strip():
            raise ConfigError("evaluate.label is empty: name the row, e.g. 'fp32' or 'w8-rtn'")


def run(state: RunState, params: EvaluateParams) -> None:
    ppl_cfg = state.cfg.eval.perplexity
    token_ids = state.memo.get("eval_token_ids")
    if token_ids is None:  # tokenized once per run; every row scores the same windows
        token_ids = tokenize_text(state.tokenizer, load_text(state.cfg.data.eval_text, "eval_text"))
        state.memo["eval_token_ids"] = token_ids
    context = getattr(state.model.config, "max_position_embeddings", None)
    if context is not None and ppl_cfg.window > context:
        raise ConfigError(f"eval.perplexity.window={ppl_cfg.window} is longer than the model's context ({context}); lower it")
    result = perplexity(state.model, token_ids, ppl_cfg.window, ppl_cfg.max_windows, ppl_cfg.batch_size, desc=f"perplexity [{params.label}]")
    row = {"name": params.label, **result.to_dict(), **model_size(state.model).to_dict()}
    state.evaluations.append(row)


EVALUATE = Stage(name="evaluate", params=EvaluateParams, run=run, needs_eval_text=True)
