"""How long `eval=quick` takes on larger models: each metric of the quick profile, timed through
the real command on a random-weight checkpoint in a real model's shape.

Writes a Qwen2.5-1.5B-shaped checkpoint (random bf16 weights, the Qwen2.5 tokenizer from the
Qwen2.5-Coder-0.5B model package; --shape picks another) and runs
`slimlm recipe=evaluate model=custom model.path=CHECKPOINT eval=quick data=shared` in a fresh
process with an empty slimlm cache (no reference or bandwidth measurement reused). Reports
each metric's seconds (report.json's `<metric>_s`), tokens and tokens/s, the
arithmetic rate that implies (2 x parameters per token), and the rate of torch's float32
matrix product of the model's MLP shape on this machine: the ceiling for a float32 forward.
Random weights give honest times: no metric's cost depends on the values.

    python bench/eval_quick_sizes.py [--shape qwen2.5-1.5b] [--workdir bench/runs/eval_quick_sizes] [--quick]

Writes bench/results/eval_quick_sizes.{md,json}; --quick (a tiny shape, the bundled data) only prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from benchlib import REPO, command_line, publish_table

from slimlm.rundir import machine_info

SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12
    ),
    "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
}
METRICS = ("perplexity", "zeroshot", "speed")  # eval=quick's, kl riding on perplexity's pass
QWEN_MODEL = REPO / "conf" / "model" / "qwen2.5-coder-0.5b.yaml"
QUICK_TASK = REPO / "examples" / "tasks" / "fill_blank_example.yaml"  # its data beside it: no data root
DATA_ROOT = REPO.parent / "shared" / "data"  # data=shared's default, as seen from the repository


def qwen_tokenizer():
    """The Qwen2.5 tokenizer, from the 0.5B model package's converted checkpoint."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from slimlm.config import ModelConfig
    from slimlm.models import checkpoint_directory, resolve_model, source_sha256

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(QWEN_MODEL))
    source = resolve_model(cfg)
    return AutoTokenizer.from_pretrained(checkpoint_directory(source, source_sha256(source)))


def test_tokenizer():
    sys.path.insert(0, str(REPO))
    from tests.conftest import build_tokenizer

    return build_tokenizer()


def write_checkpoint(directory: Path, shape: str) -> int:
    """A qwen2 checkpoint of `shape` with random bf16 weights (kept when it is there); its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (directory / "config.json").is_file():
        with torch.device("meta"):  # counted without allocating the weights
            return Qwen2ForCausalLM(Qwen2Config.from_pretrained(directory)).num_parameters()
    tokenizer = test_tokenizer() if shape == "quick" else qwen_tokenizer()
    config = Qwen2Config(
        **SHAPES[shape],
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    staging = directory.with_name(directory.name + ".partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(directory)
    return model.num_parameters()


def run_quick_eval(checkpoint: Path, workdir: Path, quick: bool) -> dict:
    """eval=quick through the real command, in a fresh process and an empty cache: its wall
    seconds and its report row (which holds each metric's seconds)."""
    where = workdir / "run"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    command = [
        str(Path(sys.executable).with_name("slimlm")),
        "recipe=evaluate",
        "model=custom",
        f"model.path={checkpoint}",
        "eval=quick",
        f"data={'demo' if quick else 'shared'}",
        *([f"eval.zeroshot.tasks=[{QUICK_TASK}]"] if quick else []),
    ]
    env = {**os.environ, "SLIMLM_CACHE": str(where / "cache")}
    env.setdefault("SLIMLM_DATA_DIR", str(DATA_ROOT))
    began = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=where, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - began
    (report,) = where.glob("runs/evaluate/*/report.json")
    return {"wall_s": round(seconds, 1), "row": json.loads(report.read_text())["rows"][0]}


def zeroshot_tokens(checkpoint: Path, quick: bool) -> int:
    """Tokens of the quick profile's zero-shot items: each context once and each of its
    continuations, as the scorer packs them (it feeds all of these but each continuation's last
    token, which is only predicted)."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from slimlm.eval.zeroshot import load_task

    profile = OmegaConf.load(REPO / "conf" / "eval" / "quick.yaml").zeroshot
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    total = 0
    for name in [str(QUICK_TASK)] if quick else profile.tasks:
        task = load_task(name, os.environ.get("SLIMLM_DATA_DIR", DATA_ROOT))
        for item in task.items[: profile.limit]:
            for pair in item.scored_pairs():
                context = len(tokenizer(pair.context, add_special_tokens=False)["input_ids"])
                wholes = tokenizer([pair.context + c for c in pair.continuations], add_special_tokens=False)
                total += context + sum(len(ids) - context for ids in wholes["input_ids"])
    return total


def matmul_gflops(shape: str, repeats: int = 3) -> float:
    """torch's float32 product of 512 rows by the model's MLP weight, best of `repeats`."""
    hidden, inner = SHAPES[shape]["hidden_size"], SHAPES[shape]["intermediate_size"]
    x, w = torch.randn(512, hidden), torch.randn(hidden, inner)
    best = float("inf")
    for _ in range(repeats + 1):
        began = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - began)
    return 2 * 512 * hidden * inner / best / 1e9


def metric_row(metric: str, seconds: float, tokens: int, parameters: int) -> dict:
    row = {"name": metric, "wall_s": round(seconds, 1)}
    if tokens and seconds > 0:  # a tiny model's metric can round to 0.0 s: no rate then
        row.update(tokens=tokens, tok_s=round(tokens / seconds, 1))
        row["gflop_s"] = round(2 * parameters * tokens / seconds / 1e9, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "quick"], default="qwen2.5-1.5b")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "runs" / "eval_quick_sizes")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny shape and the bundled data; results only printed"
    )
    options = parser.parse_args()
    started = time.perf_counter()
    shape = "quick" if options.quick else options.shape
    workdir = (options.workdir / "quick" if options.quick else options.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = workdir / f"checkpoint-{shape}"
    parameters = write_checkpoint(checkpoint, shape)
    measured = run_quick_eval(checkpoint, workdir, options.quick)
    tokens = {
        "perplexity": measured["row"]["tokens_scored"],
        "zeroshot": zeroshot_tokens(checkpoint, options.quick),
        "speed": 0,
    }
    rows = [metric_row(m, measured["row"][f"{m}_s"], tokens[m], parameters) for m in METRICS]
    rows.append({"name": "the whole command (load included)", "wall_s": measured["wall_s"]})
    ceiling = matmul_gflops(shape)
    table = [
        "| metric | tokens | wall s | tokens/s | GFLOP/s (2 x params x tokens) |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {r['name']} | {r.get('tokens', '')} | {r['wall_s']:.1f} | {r.get('tok_s', '')} "
            f"| {r.get('gflop_s', '')} |"
            for r in rows
        ],
        "",
        f"torch's float32 product of 512 rows by a {SHAPES[shape]['hidden_size']} x "
        f"{SHAPES[shape]['intermediate_size']} weight runs at {ceiling:.0f} GFLOP/s here.",
    ]
    details = [
        f"- model: random bf16 weights in {shape}'s shape, {parameters / 1e9:.2f} B parameters, loaded in "
        "float32 (conf/model/custom.yaml); one run of the command in a fresh process with an empty "
        "slimlm cache (so the speed metric includes measuring the memory bandwidth once)"
    ]
    publish_table(
        "eval_quick_sizes",
        f"eval=quick on a {shape}-shaped model",
        command_line("eval_quick_sizes.py", parser, options),
        machine_info(),
        time.perf_counter() - started,
        details,
        table,
        [*rows, {"name": "float32 matmul", "gflop_s": round(ceiling, 1)}],
        options.quick,
    )


if __name__ == "__main__":
    main()
