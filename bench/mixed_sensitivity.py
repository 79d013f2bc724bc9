"""Validate the mixed-precision sensitivity proxy on the default model.

For a sample of Linear layers (every kind, in decoder layers spread over the depth) and the
bit widths 2, 3 and 4 (g64, symmetric RTN), compare the KL the Fisher proxy predicts
(compress/mixed.py, from the calibration corpus) with the KL measured on WikiText-2 test when
that layer alone is quantized. Writes bench/results/mixed_sensitivity.{md,json,png}; --quick (the
tiny test model and the bundled data, a test) only prints.

    python bench/mixed_sensitivity.py [--layers 0 10 20 29 --windows 2 --window 512] [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from benchlib import RESULTS, bench_data_cfg, command_line, eval_ids, load_bench_model, publish

from slimlm.compress.calibration import calibration_samples
from slimlm.compress.mixed import fisher_diagonal, measure_kl_sensitivity, predicted_loss
from slimlm.data import load_text, tokenize_text
from slimlm.eval.plots import plt, save_figure
from slimlm.qlinear import QuantScheme
from slimlm.rundir import machine_info

KINDS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
BITS = (2, 3, 4)


def ranks(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).argsort().argsort().double()


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=2, help="WikiText-2 windows the KL is measured on")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=[0, 10, 20, 29],
        help="decoder layers whose Linear layers are measured",
    )
    parser.add_argument(
        "--fisher-windows",
        type=int,
        default=32,
        help="calibration windows of 256 tokens for the Fisher (the recipe's default)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=(
            "a tiny random-weight model's 2 layers, 2 Fisher windows, 1 window of 64 tokens, the bundled "
            "data; results only printed (tests)"
        ),
    )
    options = parser.parse_args()
    if options.quick:
        options.layers, options.fisher_windows, options.windows, options.window = [0, 1], 2, 1, 64
    started = time.perf_counter()
    _, loaded = load_bench_model(options.quick)
    model, tokenizer = loaded.model, loaded.tokenizer
    names = [f"model.layers.{layer}.{kind}" for layer in options.layers for kind in KINDS]
    calibration = calibration_samples(
        tokenize_text(tokenizer, load_text(bench_data_cfg(options.quick).calibration, "calibration")),
        options.fisher_windows,
        256,
        seed=1,
    )
    fisher = fisher_diagonal(model, calibration, names)
    windows = eval_ids(tokenizer, options.quick)[: options.windows * options.window].view(
        options.windows, options.window
    )
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=windows, use_cache=False).logits.float(), dim=-1)
    rows = []
    for name in names:
        for bits in BITS:
            scheme = QuantScheme(bits=bits, group_size=64)
            predicted = predicted_loss(model.get_submodule(name).weight, fisher[name], scheme, 256)
            measured = measure_kl_sensitivity(model, windows, name, scheme, reference)
            rows.append(
                {
                    "name": f"{name} int{bits}",
                    "layer": name,
                    "bits": bits,
                    "predicted_kl": predicted,
                    "measured_kl": measured,
                }
            )
            print(f"{name} int{bits}: predicted {predicted:.5f}, measured {measured:.5f}", flush=True)
    predicted = [r["predicted_kl"] for r in rows]
    measured = [r["measured_kl"] for r in rows]
    spearman = correlation(ranks(predicted), ranks(measured))
    log_pearson = correlation(torch.tensor(predicted).log(), torch.tensor(measured).clamp(min=1e-9).log())
    within_bits = {
        bits: correlation(
            ranks([r["predicted_kl"] for r in rows if r["bits"] == bits]),
            ranks([r["measured_kl"] for r in rows if r["bits"] == bits]),
        )
        for bits in BITS
    }
    ratio = sorted(p / m for p, m in zip(predicted, measured) if m > 0)[len(rows) // 2]
    summary = {
        "spearman": spearman,
        "log_pearson": log_pearson,
        "spearman_within_bits": within_bits,
        "median_predicted_over_measured": ratio,
        "seconds": time.perf_counter() - started,
    }
    command = command_line("mixed_sensitivity.py", parser, options)
    if not options.quick:
        RESULTS.mkdir(exist_ok=True)
        write_plot(rows, spearman)
    publish(
        "mixed_sensitivity",
        command,
        {"summary": summary, "rows": rows},
        markdown(rows, summary, command, options),
        options.quick,
    )


def write_plot(rows: list[dict], spearman: float) -> None:
    figure, axis = plt.subplots(figsize=(6.5, 5))
    for bits, color in zip(BITS, ("tab:red", "tab:orange", "tab:blue")):
        chosen = [r for r in rows if r["bits"] == bits]
        axis.scatter(
            [r["predicted_kl"] for r in chosen],
            [max(r["measured_kl"], 1e-6) for r in chosen],
            s=14,
            color=color,
            label=f"int{bits} g64",
        )
    low = min(min(r["predicted_kl"], max(r["measured_kl"], 1e-6)) for r in rows)
    high = max(max(r["predicted_kl"], r["measured_kl"]) for r in rows)
    axis.plot([low, high], [low, high], color="gray", linestyle="--", linewidth=1, label="y = x")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("predicted KL (Fisher proxy)")
    axis.set_ylabel("measured KL, this layer alone quantized")
    axis.set_title(f"sensitivity proxy vs measurement (Spearman {spearman:.3f})")
    axis.grid(alpha=0.3)
    axis.legend()
    save_figure(figure, RESULTS / "mixed_sensitivity.png")


def markdown(rows: list[dict], summary: dict, command: str, options) -> list[str]:
    machine = machine_info()
    by_kind = {}
    for kind in KINDS:
        chosen = [r for r in rows if r["layer"].endswith(kind) and r["bits"] == 3]
        by_kind[kind] = (
            sum(r["predicted_kl"] for r in chosen) / len(chosen),
            sum(r["measured_kl"] for r in chosen) / len(chosen),
        )
    return [
        "# mixed_sensitivity",
        "",
        f"- command: `{command}`",
        (
            f"- machine: {machine['processor']}, {machine['cpu_count']} CPUs, torch {machine['torch']}; "
            f"{summary['seconds'] / 60:.1f} min"
        ),
        (
            f"- {len(rows)} measurements: {len(KINDS)} Linear kinds in decoder layers "
            f"{', '.join(map(str, options.layers))}, at int2/int3/int4 g64 symmetric RTN"
        ),
        (
            "- predicted: ½·Σ F·(W − Q(W))² per token, F the empirical Fisher diagonal from "
            f"{options.fisher_windows} Gutenberg windows of 256 tokens"
        ),
        (
            f"- measured: mean per-token KL(original ‖ one layer quantized) on the first {options.windows} "
            f"windows of {options.window} tokens of WikiText-2 test"
        ),
        "",
        "| statistic | value |",
        "|---|---:|",
        f"| Spearman rank correlation, all | {summary['spearman']:.3f} |",
        *[f"| Spearman within int{b} | {v:.3f} |" for b, v in summary["spearman_within_bits"].items()],
        f"| Pearson correlation of log KL | {summary['log_pearson']:.3f} |",
        f"| median predicted / measured | {summary['median_predicted_over_measured']:.2f} |",
        "",
        "Mean KL at int3 by kind of layer (predicted / measured):",
        "",
        "| layer kind | predicted | measured |",
        "|---|---:|---:|",
        *[f"| {kind} | {p:.5f} | {m:.5f} |" for kind, (p, m) in by_kind.items()],
        "",
        "![mixed_sensitivity](mixed_sensitivity.png)",
        "",
    ]


if __name__ == "__main__":
    main()
