"""The `evaluate` stage: one report row for the current model, every metric on one code path.

Metrics (eval.metrics, or the stage's own list): perplexity on the evaluation text; kl, the
distance to the original model's next-token distributions (computed in the same pass, against
a cached reference); size; zeroshot accuracy; speed.

While no stage has loaded the model and it is the run's own local checkpoint, perplexity, KL
and size read it a decoder block at a time (eval/offloaded.py, `run_from_disk`): a model
larger than memory gets its reference row without being loaded.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from slimlm.checkpoint import checkpoint_tokenizer
from slimlm.config import check_metrics
from slimlm.data import check_text_source, load_text, tokenize_text_cached
from slimlm.errors import ConfigError
from slimlm.eval.kl import ReferenceLogits, reference_path
from slimlm.eval.perplexity import PerplexityResult, TextScores, score_text, window_count
from slimlm.eval.size import model_size
from slimlm.half_linear import float32_linears
from slimlm.models import DTYPES, checkpoint_directory, load_model
from slimlm.pipeline import DiskRun, RunState, Stage


@dataclass
class EvaluateParams:
    label: str = "model"  # the row's name in the report
    metrics: Optional[List[str]] = None  # None: eval.metrics

    def __post_init__(self) -> None:
        if not self.label.strip():
            raise ConfigError("evaluate.label is empty: name the row, e.g. 'fp32' or 'w8-rtn'")
        if self.metrics is not None:
            check_metrics(self.metrics, "evaluate.metrics")


DISK_METRICS = {"perplexity", "kl", "size"}  # what an evaluation of a checkpoint on disk can measure


def metrics_of(state_cfg, params: EvaluateParams) -> list[str]:
    return list(params.metrics if params.metrics is not None else state_cfg.eval.metrics)


def run(state: RunState, params: EvaluateParams) -> None:
    metrics = metrics_of(state.cfg, params)
    row = row_header(state, params)
    with float32_linears(
        next(state.model.parameters()).dtype, state.device
    ):  # the same scores, faster on most CPUs
        if "perplexity" in metrics:
            ppl_cfg = state.cfg.eval.perplexity
            check_window(ppl_cfg.window, getattr(state.model.config, "max_position_embeddings", None))

            def score(ids, reference: Optional[ReferenceLogits], collect_top_k: int) -> TextScores:
                return score_text(
                    state.model,
                    ids,
                    ppl_cfg.window,
                    ppl_cfg.max_windows,
                    ppl_cfg.batch_size,
                    reference=reference,
                    collect_top_k=collect_top_k,
                    desc=f"perplexity [{params.label}]",
                )

            row.update(
                timed("perplexity", lambda: text_metrics(state, state.tokenizer, "kl" in metrics, score))
            )
        if "zeroshot" in metrics:
            row.update(timed("zeroshot", lambda: zeroshot_metrics(state)))
    if "size" in metrics:
        row.update(model_size(state.model).to_dict())
    if "speed" in metrics:
        row.update(timed("speed", lambda: speed_metrics(state)))
    state.evaluations.append(row)


def timed(metric: str, compute: Callable[[], dict]) -> dict:
    """`compute()`'s keys and its wall seconds as `<metric>_s`: where an evaluation's time goes."""
    began = time.perf_counter()
    values = compute()
    return {**values, f"{metric}_s": round(time.perf_counter() - began, 1)}


def row_header(state: RunState, params: EvaluateParams) -> dict:
    """The row's name and, for a quantized model, how long quantizing took and its peak memory."""
    row: dict = {"name": params.label}
    quantization = state.sections.get("quantization", [])
    if quantization and not state.is_original():
        row["quant_s"] = round(sum(section["seconds"] for section in quantization), 1)
        peaks = [
            section["calibration_peak_memory_bytes"]
            for section in quantization
            if "calibration_peak_memory_bytes" in section
        ]
        if peaks:
            row["calibration_peak_memory_bytes"] = max(peaks)
    return row


def scores_from_disk(state: RunState, params: EvaluateParams) -> bool:
    """The source model's perplexity, KL reference and size need no model in memory: its
    checkpoint is read a decoder block at a time (eval/offloaded.py)."""
    return state.unloaded_local_source() and set(metrics_of(state.cfg, params)) <= DISK_METRICS


def run_from_disk(state: RunState, params: EvaluateParams) -> None:
    """run() for the source model where it lies on disk, one decoder block in memory at a time."""
    from slimlm.eval.offloaded import checkpoint_size, score_checkpoint

    metrics = metrics_of(state.cfg, params)
    directory = checkpoint_directory(state.source, state.source_sha256)
    dtype = DTYPES[state.cfg.model.dtype]
    row = row_header(state, params)
    if "perplexity" in metrics:
        ppl_cfg = state.cfg.eval.perplexity

        def score(ids, reference: Optional[ReferenceLogits], collect_top_k: int) -> TextScores:
            return score_checkpoint(
                directory,
                ids,
                ppl_cfg.window,
                ppl_cfg.max_windows,
                reference=reference,
                collect_top_k=collect_top_k,
                dtype=dtype,
                device=state.device,
            )

        tokenizer = checkpoint_tokenizer(directory)
        row.update(timed("perplexity", lambda: text_metrics(state, tokenizer, "kl" in metrics, score)))
    if "size" in metrics:
        row.update(checkpoint_size(directory, dtype).to_dict())
    state.evaluations.append(row)


def check_window(window: int, context: Optional[int]) -> None:
    if context is not None and window > context:
        raise ConfigError(
            f"eval.perplexity.window={window} is longer than the model's context ({context}); lower it"
        )


def eval_token_ids(state: RunState, tokenizer: Any):
    """The evaluation text, tokenized once per run: every row scores the same windows."""
    if state.memo.eval_token_ids is None:
        text = load_text(state.cfg.data.eval_text, "eval_text")
        state.memo.eval_token_ids = tokenize_text_cached(tokenizer, text)
    return state.memo.eval_token_ids


def text_metrics(
    state: RunState,
    tokenizer: Any,
    with_kl: bool,
    score: Callable[[Any, Optional[ReferenceLogits], int], TextScores],
) -> dict:
    """Perplexity and, `with_kl`, the distance to the original model, from one pass of `score`
    (ids, reference, collect_top_k) over the evaluation windows, or from the cached reference
    when the model is the original itself."""
    ids = eval_token_ids(state, tokenizer)
    reference = cached_reference(state, ids) if with_kl or state.is_original() else None
    if reference is not None and state.is_original():
        return original_from_reference(reference, with_kl)
    collect = 0
    if with_kl:
        if reference is None and state.is_original():
            collect = state.cfg.eval.kl.top_k  # this pass is the reference
        elif reference is None:
            reference = compute_reference_from_source(state, ids)
    scores = score(ids, reference, collect)
    row = scores.perplexity.to_dict()
    if scores.reference is not None:
        store_reference(state, ids, scores.reference)
        row.update(self_distance(scores.reference.nll))
    elif scores.distance is not None:
        row.update(scores.distance)
    return row


def original_from_reference(reference: ReferenceLogits, with_kl: bool) -> dict:
    """The original model's row from its cached reference pass on the same windows (its NLL is
    stored there): the same numbers a new pass would give, without the pass."""
    row = PerplexityResult(
        ppl=math.exp(reference.nll),
        nll=reference.nll,
        tokens_scored=reference.log_probs.shape[0],
        windows=reference.windows,
        window=reference.window,
    ).to_dict()
    row["from_cached_reference"] = True
    if with_kl:
        row.update(self_distance(reference.nll))
    return row


def self_distance(nll: float) -> dict:
    """The distance columns of the original model's own row."""
    return {
        "kl_mean": 0.0,
        "kl_median": 0.0,
        "kl_p99": 0.0,
        "top1_agreement": 1.0,
        "reference_nll": nll,
        "is_reference": True,
    }


def reference_file(state: RunState, ids):
    """The cached reference of this run's original model: keyed by its weights (their hash, or
    its id and revision), the dtype it runs in, the text, windows and top-k, so that no run is
    shown a reference another precision or revision computed."""
    ppl_cfg, model = state.cfg.eval.perplexity, state.cfg.model
    windows = window_count(ids.numel(), ppl_cfg.window, ppl_cfg.max_windows)
    model_key = json.dumps(
        {
            "weights": state.source_sha256 or f"id:{state.source.id}",
            "revision": model.revision,
            "dtype": model.dtype,
        },
        sort_keys=True,
    )
    return reference_path(model_key, ids, ppl_cfg.window, windows, state.cfg.eval.kl.top_k)


def cached_reference(state: RunState, ids) -> Optional[ReferenceLogits]:
    path = reference_file(state, ids)
    cached = state.memo.reference_logits
    if path not in cached:
        if not path.is_file():
            return None
        cached[path] = ReferenceLogits.load(path)
    return cached[path]


def store_reference(state: RunState, ids, reference: ReferenceLogits) -> None:
    path = reference_file(state, ids)
    reference.save(path)
    state.memo.reference_logits[path] = reference


def compute_reference_from_source(state: RunState, ids) -> ReferenceLogits:
    """The model was already changed and no reference is cached: run the original once."""
    ppl_cfg = state.cfg.eval.perplexity
    original = load_model(state.original_model_cfg(), state.device).model
    scores = score_text(
        original,
        ids,
        ppl_cfg.window,
        ppl_cfg.max_windows,
        ppl_cfg.batch_size,
        collect_top_k=state.cfg.eval.kl.top_k,
        desc="reference [original]",
    )
    del original
    gc.collect()
    store_reference(state, ids, scores.reference)
    return scores.reference


def zeroshot_metrics(state: RunState) -> dict:
    """Flat keys per task, under the task's `name:` (a task file's too, not its path):
    `<task>_acc`, `<task>_acc_stderr`, `<task>_acc_norm`, `<task>_n`, ..."""
    from slimlm.eval.zeroshot import evaluate_task, load_task

    cfg = state.cfg.eval.zeroshot
    flat = {}
    for name in cfg.tasks:
        task = load_task(name, state.cfg.data.benchmarks_root)
        result = evaluate_task(
            state.model, state.tokenizer, task, limit=cfg.limit, batch_size=cfg.batch_size
        ).to_dict()
        flat.update(
            {
                f"{task.spec.name}_{key}": value
                for key, value in result.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)
            }
        )
    if cfg.harness_tasks:
        from slimlm.eval.harness import local_tasks, run_tasks
        from slimlm.eval.zeroshot import default_data_root

        folder = local_tasks(
            default_data_root(state.cfg.data.benchmarks_root), state.run_dir / "harness-tasks"
        )
        flat.update(
            run_tasks(state.model, state.tokenizer, cfg.harness_tasks, folder, cfg.batch_size, cfg.limit)
        )
    return flat


def speed_metrics(state: RunState) -> dict:
    """Batch 1 under plain names (decode_tok_s, ttft_s, ...), other batches suffixed `_b<N>`."""
    from slimlm.eval.bandwidth import bandwidth_fraction, decode_bytes_per_token, memory_bandwidth

    cfg = state.cfg.eval.speed
    bandwidth = memory_bandwidth(state.device)
    path, measure = speed_path(state)
    flat: dict = {"speed_path": path}
    for batch_size in cfg.batch_sizes:
        result = measure(
            state.model,
            state.tokenizer,
            cfg.prompt_tokens,
            cfg.new_tokens,
            batch_size,
            cfg.warmup,
            cfg.repeats,
        ).to_dict()
        suffix = "" if batch_size == 1 else f"_b{batch_size}"
        flat.update(
            {
                f"{key}{suffix}": result[key]
                for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "peak_memory_bytes")
            }
        )
        if batch_size == 1:
            per_token = decode_bytes_per_token(state.model, cfg.prompt_tokens + cfg.new_tokens // 2)
            flat["decode_bytes_per_token"] = per_token
            flat["bandwidth_bytes_s"] = bandwidth.bytes_per_s
            flat["bandwidth_fraction"] = bandwidth_fraction(
                result["decode_tok_s"], per_token, bandwidth.bytes_per_s
            )
    return flat


def speed_path(state: RunState) -> tuple[str, Callable]:
    """The path's name and measurement: the bundled decoder for a family it runs (how slimlm
    deploys a model); transformers' forward for the rest, bitsandbytes peers included (its
    layers are not slimlm's)."""
    from slimlm.eval.speed import measure_decoder_speed, measure_speed
    from slimlm.inference.families import FAMILIES

    if state.cfg.model.bnb is None and getattr(state.model.config, "model_type", None) in FAMILIES:
        return "bundled decoder", measure_decoder_speed
    return "transformers", measure_speed


def check(cfg, params: EvaluateParams, source) -> None:
    """The data this stage will read exists, windows fit the model, zero-shot tasks are valid."""
    metrics = metrics_of(cfg, params)
    if "perplexity" in metrics:
        check_text_source(cfg.data.eval_text, "eval_text")
        check_window(cfg.eval.perplexity.window, source.context_length)
    if "zeroshot" in metrics:
        check_tasks(cfg.eval.zeroshot.tasks, cfg.data.benchmarks_root)
        if cfg.eval.zeroshot.harness_tasks and importlib.util.find_spec("lm_eval") is None:
            raise ConfigError(
                f"eval.zeroshot.harness_tasks={list(cfg.eval.zeroshot.harness_tasks)} "
                "needs lm-evaluation-harness: pip install -e '.[harness]', or drop them"
            )


def check_tasks(tasks: List[str], data_root) -> None:
    """Every zero-shot task loads, and no two share a name (results are reported by name)."""
    from slimlm.eval.zeroshot import load_task

    names: dict[str, str] = {}
    for given in tasks:
        name = load_task(given, data_root).spec.name
        if name in names:
            raise ConfigError(
                f"eval.zeroshot.tasks: '{given}' and '{names[name]}' are both named '{name}', "
                "and results are reported by name; give one of them another name:"
            )
        names[name] = given


EVALUATE = Stage(
    name="evaluate",
    params=EvaluateParams,
    run=run,
    check=check,
    on_disk=(DiskRun(scores_from_disk, run_from_disk),),
    reads_only=True,
)
