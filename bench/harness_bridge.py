"""lm-evaluation-harness through slimlm's bridge against slimlm's own zero-shot, on the demo's w8 artifact.

The artifact is what `make demo` writes (int8 RTN of every decoder Linear and the tied head,
exported and reloaded): this script runs the demo recipe into bench/runs/harness_bridge/ once.
Then, on the first `--limit` items of each bundled task:
  - slimlm's zero-shot (eval/zeroshot.py) on the artifact as slimlm loads it;
  - `slimlm lm-eval --model slimlm --model_args path=ARTIFACT --tasks local_...`, the harness's
    own command line in a process of its own, on the harness's task files pointed at the same
    local data (slimlm/eval/harness.py).
Both report acc (and acc_norm; LAMBADA's perplexity); the table shows whether they agree.

    python bench/harness_bridge.py [--limit 200] [--quick]

Writes bench/results/harness_bridge.{md,json}; --quick (the tiny test model, 8 items) only prints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from benchlib import REPO, bench_model_cfg, command_line, publish_table

from slimlm.config import ModelConfig
from slimlm.eval.zeroshot import DATA_ROOT_ENV, evaluate_task, load_task
from slimlm.models import load_model
from slimlm.rundir import machine_info

RUNS = REPO / "bench" / "runs" / "harness_bridge"
DATA_ROOT = Path(
    os.environ.get(DATA_ROOT_ENV, REPO.parent / "shared" / "data")
).resolve()  # both read the tasks' data here
# slimlm's bundled task -> the harness's task on the same local data
TASKS = {
    "arc_easy": "local_arc_easy",
    "piqa": "local_piqa",
    "hellaswag": "local_hellaswag",
    "lambada": "local_lambada_openai",
}
METRICS = ("acc", "acc_norm", "ppl")  # the harness calls LAMBADA's ppl `perplexity`


def demo_artifact(workdir: Path, quick: bool) -> Path:
    """The demo recipe's artifact (run once into `workdir`): the default model's, or the tiny one's."""
    run = workdir / "demo"
    artifact = run / "artifact"
    if (
        not (run / "status.json").is_file()
        or json.loads((run / "status.json").read_text())["status"] != "complete"
    ):
        model = bench_model_cfg(quick)
        overrides = [
            f"model.name={model.name}",
            f"model.path={model.path}",
            *(["data=demo"] if quick else []),
        ]
        argv = [sys.executable, "-m", "slimlm.cli", "recipe=demo", f"hydra.run.dir={run}", *overrides]
        if subprocess.run(argv, cwd=REPO).returncode != 0:
            raise SystemExit(f"the demo recipe failed; see {run}")
    return artifact


def slimlm_scores(artifact: Path, limit: int, batch_size: int) -> dict[str, dict]:
    loaded = load_model(ModelConfig(name="w8-rtn", path=str(artifact)), torch.device("cpu"))
    scores = {}
    for name in TASKS:
        result = evaluate_task(
            loaded.model, loaded.tokenizer, load_task(name, DATA_ROOT), limit=limit, batch_size=batch_size
        )
        scores[name] = {
            metric: getattr(result, metric) for metric in METRICS if getattr(result, metric) is not None
        } | {"n": result.n}
    return scores


def harness_scores(artifact: Path, limit: int, batch_size: int, workdir: Path) -> dict[str, dict]:
    """`slimlm lm-eval` in a process of its own; its results file read back."""
    out = workdir / "harness-output"
    argv = [
        sys.executable,
        "-m",
        "slimlm.cli",
        "lm-eval",
        "--model",
        "slimlm",
        "--model_args",
        f"path={artifact}",
        "--tasks",
        ",".join(TASKS.values()),
        "--limit",
        str(limit),
        "--batch_size",
        str(batch_size),
        "--output_path",
        str(out),
    ]
    if subprocess.run(argv, cwd=REPO, env={**os.environ, DATA_ROOT_ENV: str(DATA_ROOT)}).returncode != 0:
        raise SystemExit("slimlm lm-eval failed")
    results = json.loads(max(out.rglob("results_*.json"), key=lambda path: path.stat().st_mtime).read_text())
    scores = {}
    for name, theirs in TASKS.items():
        metrics = results["results"][theirs]
        scores[name] = {
            metric: metrics[f"{key},none"]
            for metric, key in (("acc", "acc"), ("acc_norm", "acc_norm"), ("ppl", "perplexity"))
            if f"{key},none" in metrics
        }
        scores[name]["n"] = results["n-samples"][theirs]["effective"]
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=200, help="the first N items of each task, in both")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny test model's demo artifact and 8 items a task; results only printed (tests)",
    )
    options = parser.parse_args()
    if options.quick:
        options.limit = 8
    started = time.perf_counter()
    workdir = RUNS / "quick" if options.quick else RUNS
    artifact = demo_artifact(workdir, options.quick)
    ours = slimlm_scores(artifact, options.limit, options.batch_size)
    theirs = harness_scores(artifact, options.limit, options.batch_size, workdir)
    rows, table = (
        [],
        [
            "| task | items | metric | slimlm | lm-eval --model slimlm | same |",
            "|---|---:|---|---:|---:|---|",
        ],
    )
    for name in TASKS:
        for metric in METRICS:
            if metric not in ours[name]:
                continue
            a, b = ours[name][metric], theirs[name].get(metric)
            same = b is not None and abs(a - b) <= (1e-4 * abs(a) if metric == "ppl" else 0)
            rows.append(
                {
                    "name": f"{name} {metric}",
                    "items": ours[name]["n"],
                    "harness_items": theirs[name]["n"],
                    "slimlm": a,
                    "harness": b,
                    "same": same,
                }
            )
            shown = (lambda v: f"{v:.4f}") if metric == "ppl" else (lambda v: f"{100 * v:.2f}")
            table.append(
                f"| {name} | {ours[name]['n']} | {metric} | {shown(a)} | {'–' if b is None else shown(b)} | "
                f"{'yes' if same else 'NO'} |"
            )
    agree = sum(row["same"] for row in rows)
    table += ["", f"{agree} of {len(rows)} numbers identical (perplexity: within 1e-4 relative)."]
    model_name = "the tiny test model" if options.quick else "the default model (SmolLM2-135M-Instruct)"
    details = [
        f"- the demo recipe's w8 RTN artifact of {model_name}; the first {options.limit} items of each task "
        f"in both; batch size {options.batch_size}"
    ]
    publish_table(
        "harness_bridge",
        "harness_bridge",
        command_line("harness_bridge.py", parser, options),
        machine_info(),
        time.perf_counter() - started,
        details,
        table,
        rows,
        options.quick,
    )


if __name__ == "__main__":
    main()
