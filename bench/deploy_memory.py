"""Deploy memory: the peak RSS of a w8 deployment recipe against the size of the model's bf16 weights.

Runs `bench/quantize_qwen05_w8.yaml` (int8 RTN of every decoder Linear and the LM head, the
slimlm export and its reload, a greedy completion through the bundled decoder, the hf export)
with `slimlm` in a process of its own under GNU time, which reports the kernel's maximum
resident set size of that process (measured from outside; mapped files' pages included). Two
ways:
  from disk   the recipe as written: nothing loads the model, RTN streams the checkpoint into
              an artifact and every later stage reads that artifact a part at a time
  in memory   the same stages after a `load` stage: the whole model is loaded first (the path
              every recipe took before the pipeline loaded the model lazily)
Goal (issue 35): the from-disk peak at most 1.5x the bf16 weights, and the w8 artifact at most
8.5 bits per weight. Writes bench/results/deploy_memory.{md,json}; --quick runs both on a tiny
random-weight Llama in the work directory and prints the table (tests).

    python bench/deploy_memory.py [--model qwen2.5-coder-0.5b] [--workdir bench/runs/deploy_memory] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import REPO, command_line, machine_info, publish_table  # noqa: E402

TIME = "/usr/bin/time"
RECIPE = REPO / "bench" / "quantize_qwen05_w8.yaml"
GB = 1e9
GOAL = 1.5


def in_memory_recipe(workdir: Path) -> Path:
    """The recipe with a `load` stage first, which loads the whole model before anything else."""
    from omegaconf import OmegaConf

    recipe = OmegaConf.load(RECIPE)
    recipe.name = f"{recipe.name}_in_memory"
    recipe.stages = [{"stage": "load"}, *recipe.stages]
    path = workdir / f"{recipe.name}.yaml"
    OmegaConf.save(recipe, path)
    return path


def run_recipe(label: str, recipe: Path, model_args: list[str], workdir: Path) -> dict:
    """One slimlm run under GNU time: its peak RSS, its report and its run directory."""
    run_dir = workdir / label.replace(" ", "-")
    peak_file = workdir / f"{label.replace(' ', '-')}.maxrss"
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier run's exports would be refused, never overwritten
    argv = [
        TIME,
        "-f",
        "%M",
        "-o",
        str(peak_file),
        sys.executable,
        "-m",
        "slimlm.cli",
        f"recipe={recipe}",
        *model_args,
        f"hydra.run.dir={run_dir}",
    ]
    print(f"{label} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    if subprocess.run(argv, cwd=REPO).returncode != 0:
        raise SystemExit(f"the {label} run failed; its log is in {run_dir}/slimlm.log")
    report = json.loads((run_dir / "report.json").read_text())
    return {
        "peak_kib": int(peak_file.read_text().split()[-1]),
        "report": report,
        "wall_s": time.perf_counter() - started,
        "run_dir": run_dir,
    }


def parameters_of(run_dir: Path) -> int:
    """The model's parameter count, from its hf export's safetensors headers (every weight, dequantized)."""
    from slimlm.checkpoint import Checkpoint

    checkpoint = Checkpoint(run_dir / "hf")
    return sum(math.prod(checkpoint.shape(name)) for name in checkpoint.names())


def row(label: str, result: dict, bf16_bytes: int, parameters: int) -> dict:
    report = result["report"]
    artifact = next(entry for entry in report["artifacts"] if entry["format"] == "slimlm")
    peak = result["peak_kib"] * 1024
    return {
        "name": label,
        "peak_rss_bytes": peak,
        "peak_to_bf16": round(peak / bf16_bytes, 3),
        "artifact_weight_bytes": artifact["weights_accounted_bytes"],
        "bits_per_weight": round(8 * artifact["weights_accounted_bytes"] / parameters, 3),
        "stage_seconds": {stage: round(seconds, 1) for stage, seconds in report["stage_seconds"]},
        "completion": report["generations"][0]["completion"],
        "wall_s": round(result["wall_s"], 1),
    }


def tiny_model(workdir: Path) -> list[str]:
    """A tiny random-weight Llama saved in `workdir` (for --quick)."""
    sys.path.insert(0, str(REPO))
    from tests.conftest import build_tiny_llama, build_tokenizer

    directory = workdir / "tiny-llama"
    if not directory.is_dir():
        tokenizer = build_tokenizer()
        build_tiny_llama(len(tokenizer), tie_word_embeddings=False).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return ["model=custom", f"model.path={directory}", "decoder.max_new_tokens=8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a model config name (conf/model)")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "runs" / "deploy_memory")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny random-weight model; results only printed"
    )
    options = parser.parse_args()
    if not Path(TIME).is_file():
        raise SystemExit(
            f"{TIME} (GNU time) is needed to measure the peak memory from outside: install the 'time' package"
        )
    options.workdir.mkdir(parents=True, exist_ok=True)
    model_args = tiny_model(options.workdir) if options.quick else [f"model={options.model}", "data=shared"]
    started = time.perf_counter()
    results = {
        "from disk": run_recipe("from disk", RECIPE, model_args, options.workdir),
        "in memory": run_recipe("in memory", in_memory_recipe(options.workdir), model_args, options.workdir),
    }
    parameters = parameters_of(results["from disk"]["run_dir"])
    bf16_bytes = 2 * parameters
    rows = [row(label, result, bf16_bytes, parameters) for label, result in results.items()]
    table = [
        (
            "| run | peak RSS GB | x bf16 weights | artifact weights MB | bits/weight | stage seconds | "
            "completion |"
        ),
        "|---|---:|---:|---:|---:|---|---|",
        *(
            f"| {r['name']} | {r['peak_rss_bytes'] / GB:.2f} | {r['peak_to_bf16']:.2f} | "
            f"{r['artifact_weight_bytes'] / 1e6:.1f} | {r['bits_per_weight']:.2f} | "
            + ", ".join(f"{stage} {seconds}" for stage, seconds in r["stage_seconds"].items())
            + f" | {r['completion'][:60].replace('|', '/').replace(chr(10), ' ')} |"
            for r in rows
        ),
    ]
    details = [
        (
            f"- model: `{' '.join(model_args)}`, {parameters:,} parameters: bf16 weights "
            f"{bf16_bytes / GB:.3f} GB, goal peak <= {GOAL}x = {GOAL * bf16_bytes / GB:.2f} GB"
        ),
        (
            f"- recipe: `{RECIPE.relative_to(REPO)}` (quantize rtn w8 with the head, export slimlm + reload, "
            "generate, export hf); peak RSS of the whole `slimlm` process by GNU time"
        ),
    ]
    publish_table(
        "deploy_memory",
        "Deploy memory: a w8 recipe's peak RSS against the bf16 weights",
        command_line("deploy_memory.py", parser, options),
        machine_info(),
        time.perf_counter() - started,
        details,
        table,
        rows,
        options.quick,
    )
    if options.quick:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
