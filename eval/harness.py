"""lm-evaluation-harness on slimlm's models, and the harness's tasks on local data.

`slimlm lm-eval --model slimlm --model_args path=ARTIFACT --tasks local_piqa` runs the harness's
own command line with a model type `slimlm` registered: the model is loaded by slimlm (an
artifact with its checksums verified and its weights kept packed, a checkpoint or a GGUF file) and
scored through the harness's Hugging Face model class. The stock `lm_eval` command cannot find
it: lm-eval 0.4 looks model types up in a fixed table, with no hook for other packages.

The harness fetches its tasks' data from the Hugging Face Hub. `local_tasks` writes variants of
the tasks slimlm bundles that read the same files slimlm scores from its data root instead
(`local_arc_easy`, `local_piqa`, `local_hellaswag`, `local_lambada_openai`): each includes the
harness's own task file and replaces only where the data come from, so the prompts, targets and
preprocessing stay the harness's. An evaluate stage runs harness tasks on the run's model in
memory (`eval.zeroshot.harness_tasks`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from slimlm.errors import SlimlmError

# local task name -> (the harness's task file under lm_eval/tasks, its split, the data file
# under the data root)
LOCAL_TASKS: dict[str, tuple[str, str, str]] = {
    "local_arc_easy": ("arc/arc_easy.yaml", "test", "arc/ARC-Easy-test.jsonl"),
    "local_piqa": ("piqa/piqa.yaml", "validation", "piqa/valid.jsonl"),
    "local_hellaswag": (
        "hellaswag/hellaswag.yaml",
        "validation",
        "hellaswag/hellaswag_val_random1000_subset.raw.jsonl",
    ),
    "local_lambada_openai": ("lambada/lambada_openai.yaml", "test", "lambada/lambada_test.jsonl"),
}
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
INSTALL_HINT = "lm-evaluation-harness is not installed; pip install -e '.[harness]'"


def _lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise SlimlmError(INSTALL_HINT) from None
    return lm_eval


def local_tasks(data_root: Path, folder: Path) -> Path:
    """Write the local task files whose data the root holds into `folder` (for the harness's
    --include_path) and return it. PIQA's labels are a separate file in slimlm's data: they are
    joined into its rows here."""
    harness_tasks = Path(_lm_eval().__file__).parent / "tasks"
    folder.mkdir(parents=True, exist_ok=True)
    for name, (task_file, split, data) in LOCAL_TASKS.items():
        source = data_root / data
        if not source.is_file():  # that task is then unknown to the harness, which says so
            continue
        if name == "local_piqa":
            source = _labelled_piqa(
                source, source.with_name("valid-labels.lst"), folder / "piqa-valid-labelled.jsonl"
            )
        splits = {key: (split if key == f"{split}_split" else None) for key in SPLIT_KEYS}
        spec = {
            "include": str(harness_tasks / task_file),
            "task": name,
            "tag": [],
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(source.resolve())}},
            **splits,
        }
        (folder / f"{name}.yaml").write_text(json.dumps(spec, indent=2) + "\n")  # JSON is YAML
    return folder


def _labelled_piqa(rows: Path, labels: Path, target: Path) -> Path:
    lines = [line for line in rows.read_text(encoding="utf-8").splitlines() if line.strip()]
    answers = labels.read_text().split()
    if len(answers) != len(lines):
        raise SlimlmError(
            f"'{labels}' has {len(answers)} labels for {len(lines)} rows of '{rows}'; re-fetch the data set"
        )
    target.write_text(
        "".join(
            json.dumps({**json.loads(line), "label": int(answer)}) + "\n"
            for line, answer in zip(lines, answers)
        ),
        encoding="utf-8",
    )
    return target


def without_retying(model: Any) -> Any:
    """`model`, safe for the harness's call of transformers' tie_weights: a quantized head tied to
    the embedding (QuantEmbedding) already shares one packed table with it, and tie_weights,
    looking for the embedding's float weight, would fail."""
    from slimlm.qlinear import QuantEmbedding

    if isinstance(model.get_input_embeddings(), QuantEmbedding):
        model.tie_weights = lambda *args, **kwargs: None
    return model


def wrap_model(model: Any, tokenizer: Any, batch_size: int) -> Any:
    """A model in memory as the harness's Hugging Face model class sees one (on its device)."""
    from lm_eval.models.huggingface import HFLM

    device = str(next(model.parameters()).device)
    return HFLM(pretrained=without_retying(model), tokenizer=tokenizer, batch_size=batch_size, device=device)


def run_tasks(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    include_path: Optional[Path],
    batch_size: int,
    limit: Optional[int],
) -> dict[str, float]:
    """Harness tasks on a model in memory: flat `<task>_<metric>` keys as slimlm's own zero-shot
    rows have them (acc, acc_stderr, acc_norm, ...; the harness's `,none` filter suffix dropped)."""
    lm_eval = _lm_eval()
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path) if include_path else None)
    with torch.inference_mode():
        results = lm_eval.simple_evaluate(
            model=wrap_model(model, tokenizer, batch_size),
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
        )
    flat: dict[str, float] = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filtered = key.partition(",")
            if filtered == "none" and isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"{task}_{metric}"] = float(value)
        flat[f"{task}_n"] = results["n-samples"][task]["effective"]
    return flat
