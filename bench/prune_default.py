"""Structured pruning of the default model: smaller dense models, before any training.

Rows: the unpruned model; depth-pruned (30 to 6 decoder layers, lowest block influence removed);
width-pruned to about half the parameters (hidden 576 -> 384, MLP 1536 -> 1024, key/value groups
3 -> 2 with their query heads); and the depth-and-width student (both). Pruning is calibrated on
32 windows of 256 tokens of the Gutenberg calibration text (compress/prune.py). For each:
parameters, perplexity on the first 64 windows of 2048 tokens of WikiText-2 test, and batch-1
decode speed through the bundled decoder at the same precision for every row (fp32 weights and
activations, eager; 16-token prompt, 128 new tokens, median of repeats). The pruned models are
saved under bench/runs/prune_default/<name>/ (transformers checkpoints: the distillation
benchmark starts from them). Writes bench/results/prune_default.{md,json,png}; --quick (the tiny
test model pruned alike, a test) saves under bench/runs/prune_default/quick/ and only prints.

    python bench/prune_default.py [--repeats 5 --threads 2 --windows 64] [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from benchlib import (
    REPO,
    RESULTS,
    bench_data_cfg,
    command_line,
    eval_ids,
    load_bench_model,
    machine_line,
    publish,
)
from decode_cpu import race, slimlm_contender

from slimlm.compress.calibration import calibration_samples
from slimlm.compress.prune import PruneParams, Shape, parameter_count, prune_model
from slimlm.data import load_text, tokenize_text
from slimlm.eval.perplexity import perplexity
from slimlm.eval.plots import plt, save_figure
from slimlm.eval.speed import benchmark_prompt
from slimlm.rundir import machine_info

RUNS = REPO / "bench" / "runs" / "prune_default"
VARIANTS = {
    "depth-6": PruneParams(layers=6),
    "width-half": PruneParams(hidden_size=384, intermediate_size=1024, kv_heads=2),
    "student (depth 6 + width half)": PruneParams(
        layers=6, hidden_size=384, intermediate_size=1024, kv_heads=2
    ),
}
WINDOW = 2048  # perplexity window, tokens
# --quick: the tiny test model (2 layers, hidden 128, MLP 256, 2 key/value groups) pruned alike
QUICK_CALIBRATION = dict(samples=2, seq_len=64)
QUICK_VARIANTS = {
    "depth-1": PruneParams(layers=1, **QUICK_CALIBRATION),
    "width-half": PruneParams(hidden_size=64, intermediate_size=128, kv_heads=1, **QUICK_CALIBRATION),
    "student (depth 1 + width half)": PruneParams(
        layers=1, hidden_size=64, intermediate_size=128, kv_heads=1, **QUICK_CALIBRATION
    ),
}
QUICK_WINDOW = 64


def directory_name(name: str) -> str:
    return name.split(" ")[0]


def measure(name: str, model, tokenizer, ids: torch.Tensor, prompt: list[int], options, window: int) -> dict:
    shape = Shape.of(model.config)
    result = perplexity(model, ids, window=window, max_windows=options.windows, desc=f"perplexity [{name}]")
    (speed,) = race(
        [slimlm_contender(name, model, tokenizer, prompt, options, torch.float32)], options.repeats
    )
    row = {
        "name": name,
        **vars(shape),
        "parameters": parameter_count(model),
        "ppl": result.ppl,
        "tokens_scored": result.tokens_scored,
        "decode_tok_s": speed["decode_tok_s"],
        "weight_bytes": speed["weight_bytes"],
    }
    print(
        (
            f"{name}: {row['parameters'] / 1e6:.1f}M parameters, ppl {row['ppl']:.2f}, "
            f"{row['decode_tok_s']:.1f} tok/s"
        ),
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=(
            "the tiny test model pruned to 1 layer and half its width, 2 windows of 64 tokens, 16 new "
            "tokens, 1 repeat; results only printed (tests)"
        ),
    )
    options = parser.parse_args()
    if options.quick:
        options.windows, options.new_tokens, options.repeats = 2, 16, 1
    variants, window, runs = (
        (QUICK_VARIANTS, QUICK_WINDOW, RUNS / "quick") if options.quick else (VARIANTS, WINDOW, RUNS)
    )
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    _, loaded = load_bench_model(options.quick)
    teacher, tokenizer = loaded.model, loaded.tokenizer
    ids = eval_ids(tokenizer, options.quick)
    prompt = benchmark_prompt(tokenizer, options.prompt_tokens).tolist()
    calibration = tokenize_text(
        tokenizer, load_text(bench_data_cfg(options.quick).calibration, "calibration")
    )
    rows = [
        measure(
            f"unpruned ({teacher.config.num_hidden_layers} layers)",
            teacher,
            tokenizer,
            ids,
            prompt,
            options,
            window,
        )
    ]
    for name, params in variants.items():
        samples = calibration_samples(calibration, params.samples, params.seq_len, params.seed)
        pruned, section = prune_model(teacher, samples, params)
        rows.append(
            {
                **measure(name, pruned, tokenizer, ids, prompt, options, window),
                "removed_layers": section.get("removed_layers"),
            }
        )
        out = runs / directory_name(name)
        pruned.save_pretrained(out)
        tokenizer.save_pretrained(out)
        del pruned
    for row in rows:
        row["parameters_fraction"] = row["parameters"] / rows[0]["parameters"]
        row["speedup_vs_unpruned"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]
    summary = {
        "windows": options.windows,
        "window": window,
        "prompt_tokens": options.prompt_tokens,
        "new_tokens": options.new_tokens,
        "repeats": options.repeats,
        "threads": options.threads,
        "seconds": time.perf_counter() - started,
    }
    command = command_line("prune_default.py", parser, options)
    if not options.quick:
        RESULTS.mkdir(exist_ok=True)
        write_plot(rows)
    publish(
        "prune_default",
        command,
        {"summary": summary, "rows": rows},
        markdown(rows, summary, command),
        options.quick,
    )


def write_plot(rows: list[dict]) -> None:
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [row["name"] for row in rows]
    left.barh(names[::-1], [row["decode_tok_s"] for row in rows][::-1], color="tab:blue")
    left.set_xlabel("decode tokens/s (fp32, batch 1)")
    right.barh(names[::-1], [row["ppl"] for row in rows][::-1], color="tab:orange")
    right.set_xscale("log")
    right.set_xlabel("WikiText-2 perplexity before any training (log scale)")
    right.set_yticklabels([])
    figure.suptitle("Structured pruning of the default model")
    save_figure(figure, RESULTS / "prune_default.png")


def markdown(rows: list[dict], summary: dict, command: str) -> list[str]:
    machine = machine_info()
    tokens = rows[0]["tokens_scored"]
    return [
        "# prune_default",
        "",
        f"- command: `{command}`",
        machine_line(machine, f"{summary['threads']} threads", summary["seconds"]),
        (
            f"- perplexity: the first {summary['windows']} windows of {summary['window']} tokens of "
            f"WikiText-2 test ({tokens:,} tokens scored), before any training"
        ),
        (
            "- decode: the bundled decoder, fp32 weights and activations, eager, batch 1, a "
            f"{summary['prompt_tokens']}-token prompt, {summary['new_tokens']} new tokens, median of "
            f"{summary['repeats']} runs"
        ),
        "",
        (
            "| model | layers | hidden | MLP | heads (kv) | parameters | of unpruned | ppl | decode tok/s | "
            "speed-up |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['layers']} | {r['hidden_size']} | {r['intermediate_size']} | {r['heads']} "
            f"({r['kv_heads']}) | {r['parameters'] / 1e6:.1f}M | {100 * r['parameters_fraction']:.0f}% | "
            f"{r['ppl']:.2f} | {r['decode_tok_s']:.1f} | {r['speedup_vs_unpruned']:.2f}x |"
            for r in rows
        ],
        "",
        "![prune_default](prune_default.png)",
        "",
    ]


if __name__ == "__main__":
    main()
