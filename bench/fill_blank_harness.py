"""A fill-in-the-blank task in slimlm's task format against lm-evaluation-harness, on the same model and data.

The task is examples/tasks/fill_blank_example.yaml (40 sentences in WinoGrande's layout: a blank
"_", two options, the answer as "1" or "2"). slimlm scores it with its `fill_blank` kind; the
harness (lm-eval, `pip install -e '.[harness]'`) scores the same JSONL file with WinoGrande's own
preprocessing functions (lm_eval.tasks.winogrande: partial evaluation, each option's context
and the shared rest of the sentence) through its Hugging Face model class, given the very model
object slimlm scored. Both report accuracy; each option's log-likelihood is compared item by
item.

    python bench/fill_blank_harness.py [--batch-size 8] [--quick]

Writes bench/results/fill_blank_harness.{md,json}; --quick (a tiny random model, a test) only prints.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from benchlib import REPO, command_line, load_bench_model, publish_table

from slimlm.eval.zeroshot import evaluate_task, load_task, score_items
from slimlm.rundir import machine_info

TASK_FILE = REPO / "examples" / "tasks" / "fill_blank_example.yaml"
RUNS = REPO / "bench" / "runs" / "fill_blank_harness"
# The harness task: the example's JSONL read by the harness's JSON loader, WinoGrande's functions.
HARNESS_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: !function winogrande_functions.doc_to_text
doc_to_target: !function winogrande_functions.doc_to_target
doc_to_choice: !function winogrande_functions.doc_to_choice
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
FUNCTIONS = (
    "from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_choice, doc_to_target, "
    "doc_to_text  # noqa: F401\n"
)


def harness_task_dir(name: str, data: Path, workdir: Path) -> Path:
    """A folder the harness's TaskManager includes: the task YAML and the module its functions come from."""
    folder = workdir / "harness_task"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(HARNESS_YAML.format(name=name, data=data.resolve()))
    (folder / "winogrande_functions.py").write_text(FUNCTIONS)
    return folder


def harness_scores(
    model, tokenizer, name: str, folder: Path, batch_size: int
) -> tuple[float, float, list[list[float]]]:
    """The harness's accuracy, its standard error and, per document in file order, each option's
    log-likelihood."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device="cpu")
    results = lm_eval.simple_evaluate(
        model=wrapped, tasks=[name], task_manager=TaskManager(include_path=str(folder)), log_samples=True
    )
    samples = sorted(results["samples"][name], key=lambda sample: sample["doc_id"])
    metrics = results["results"][name]
    return (
        metrics["acc,none"],
        metrics["acc_stderr,none"],
        [[float(response[0]) for response in sample["filtered_resps"]] for sample in samples],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny random-weight model instead of the default model; results only printed (tests)",
    )
    options = parser.parse_args()
    started = time.perf_counter()
    _, loaded = load_bench_model(options.quick)
    model, tokenizer = loaded.model.float().eval(), loaded.tokenizer
    task = load_task(str(TASK_FILE))
    ours = evaluate_task(model, tokenizer, task, batch_size=options.batch_size)
    our_lls = [
        [ll for ll, _ in item] for item in score_items(model, tokenizer, task.items, options.batch_size)
    ]
    workdir = RUNS / "quick" if options.quick else RUNS
    folder = harness_task_dir(task.spec.name, TASK_FILE.parent / task.spec.data, workdir)
    with torch.inference_mode():
        harness_acc, harness_stderr, their_lls = harness_scores(
            model, tokenizer, task.spec.name, folder, options.batch_size
        )
    difference = max(
        abs(a - b)
        for mine, theirs in zip(our_lls, their_lls, strict=True)
        for a, b in zip(mine, theirs, strict=True)
    )
    same_choice = sum(
        max(range(2), key=mine.__getitem__) == max(range(2), key=theirs.__getitem__)
        for mine, theirs in zip(our_lls, their_lls)
    )
    rows = [
        {
            "name": "slimlm fill_blank",
            "acc": ours.acc,
            "acc_stderr": ours.acc_stderr,
            "n": ours.n,
            "seconds": ours.seconds,
        },
        {
            "name": "lm-evaluation-harness (winogrande functions)",
            "acc": harness_acc,
            "acc_stderr": harness_stderr,
            "n": len(their_lls),
            "max_loglikelihood_difference": difference,
            "same_choice_items": same_choice,
        },
    ]
    table = [
        "| scorer | items | acc % | ± | same choice as the other | largest log-likelihood difference |",
        "|---|---:|---:|---:|---:|---:|",
        (
            f"| {rows[0]['name']} | {ours.n} | {100 * ours.acc:.2f} | {100 * ours.acc_stderr:.2f} | "
            f"{same_choice} of {ours.n} | {difference:.2e} |"
        ),
        (
            f"| {rows[1]['name']} | {len(their_lls)} | {100 * harness_acc:.2f} | {100 * harness_stderr:.2f} "
            "|  |  |"
        ),
        "",
        f"Accuracies {'identical' if ours.acc == harness_acc else 'DIFFERENT'}.",
    ]
    model_name = (
        "a tiny random-weight Llama" if options.quick else "the default model (SmolLM2-135M-Instruct, fp32)"
    )
    details = [
        f"- {model_name}; task `{TASK_FILE.relative_to(REPO)}`; batch size {options.batch_size} in both"
    ]
    publish_table(
        "fill_blank_harness",
        "fill_blank_harness",
        command_line("fill_blank_harness.py", parser, options),
        machine_info(),
        time.perf_counter() - started,
        details,
        table,
        rows,
        options.quick,
    )
    print(
        json.dumps({"acc": ours.acc, "harness_acc": harness_acc, "max_loglikelihood_difference": difference})
    )


if __name__ == "__main__":
    main()
