"""Reports: report.json for machines, report.md and PNG plots for people.

Rows are flat dicts with snake_case metric keys (units in the name). Δppl is taken against the
original model's perplexity on the same windows when the row was compared with it (KL on),
otherwise against the first row.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from slimlm.eval.plots import plot_bit_map, plot_layer_errors, plot_size_quality, plot_training
from slimlm.eval.size import comparable_bytes
from slimlm.rundir import machine_info, write_atomic


def decimals(places: int) -> Callable[[Any], str]:
    return lambda value: f"{value:.{places}f}"


def percent(fraction: float) -> str:
    return f"{100 * fraction:.2f}"


# Report tables: (title, [(key, header, formatter)]); a column appears when any row has its key.
Column = tuple[str, str, Callable[[Any], str]]
TABLES: list[tuple[str, list[Column]]] = [
    (
        "Accuracy and size",
        [
            ("ppl", "ppl", decimals(4)),
            ("delta_ppl_pct", "Δppl %", lambda v: f"{v:+.2f}"),
            ("kl_mean", "KL", decimals(5)),
            ("top1_agreement", "top-1 %", percent),
            ("bytes", "bytes", lambda v: f"{v:,}"),
            ("stored_bytes", "stored bytes", lambda v: f"{v:,}"),
            ("size_pct_of_first", "size %", decimals(1)),
            ("linear_zeros", "zeros %", percent),
            ("bits_per_weight", "bits/weight", decimals(2)),
            ("quant_s", "quantize s", decimals(1)),
            ("calibration_peak_memory_bytes", "calibration peak", lambda v: f"{v / 2**20:,.0f} MiB"),
        ],
    ),
    (
        "Speed and memory",
        [
            ("speed_path", "decoded by", str),
            ("ttft_s", "TTFT s", decimals(3)),
            ("prefill_tok_s", "prefill tok/s", decimals(0)),
            ("decode_tok_s", "decode tok/s (b1)", decimals(1)),
            ("decode_tok_s_b8", "decode tok/s (b8)", decimals(1)),
            ("bandwidth_fraction", "% of bandwidth (b1)", lambda v: f"{100 * v:.1f}"),
            ("peak_memory_bytes", "peak memory (b1)", lambda v: f"{v / 2**20:,.0f} MiB"),
        ],
    ),
]


def add_deltas(rows: Sequence[dict]) -> list[dict]:
    rows = [dict(row) for row in rows]
    first_ppl = next((r["ppl"] for r in rows if "ppl" in r), None)
    first_bytes = next((comparable_bytes(r) for r in rows if "bytes" in r), None)
    for row in rows:
        if "ppl" in row:
            base = math.exp(row["reference_nll"]) if row.get("reference_nll") is not None else first_ppl
            row["delta_ppl_pct"] = 100.0 * (row["ppl"] / base - 1.0)
        if "bytes" in row and first_bytes:
            row["size_pct_of_first"] = 100.0 * comparable_bytes(row) / first_bytes
    return rows


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> list[str]:
    """A Markdown table of the given columns that any row has (empty if none)."""
    present = [c for c in columns if any(r.get(c[0]) is not None for r in rows)]
    if not present:
        return []
    lines = ["| " + " | ".join(["model", *(c[1] for c in present)]) + " |", "|---|" + "---:|" * len(present)]
    for row in rows:
        cells = [row["name"]] + [
            fmt(row[key]) if row.get(key) is not None else "–" for key, _, fmt in present
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


ZEROSHOT_TITLE = "Zero-shot accuracy (%)"
TASK_TITLES = {
    "lambada": "LAMBADA",
    "arc_easy": "ARC-E",
    "piqa": "PIQA",
    "hellaswag": "HellaSwag",
}  # bundled tasks' display names


def zeroshot_tasks(rows: Sequence[dict]) -> list[str]:
    """The tasks the rows report (each writes `<task>_n` and `<task>_acc`), in order of appearance."""
    return list(
        dict.fromkeys(
            key[: -len("_n")]
            for row in rows
            for key in row
            if key.endswith("_n") and f"{key[: -len('_n')]}_acc" in row
        )
    )


def zeroshot_columns(rows: Sequence[dict]) -> list[Column]:
    """Each task's accuracy and, as lm-evaluation-harness prints them, its standard error beside
    it (±); acc_norm likewise where the task has it, and a last-word task's perplexity."""
    columns: list[Column] = []
    for task in zeroshot_tasks(rows):
        title = TASK_TITLES.get(task, task)
        for metric in ("acc", "acc_norm"):
            columns += [
                (f"{task}_{metric}", f"{title} {metric}", percent),
                (f"{task}_{metric}_stderr", "±", percent),
            ]
        columns.append((f"{task}_ppl", f"{title} ppl", decimals(2)))
    return columns


def report_tables(rows: Sequence[dict]) -> list[tuple[str, list[Column]]]:
    """The report's tables: accuracy and size, zero-shot (a column pair per task the rows have), speed."""
    return [TABLES[0], (ZEROSHOT_TITLE, zeroshot_columns(rows)), *TABLES[1:]]


def markdown_tables(rows: Sequence[dict]) -> list[str]:
    """Every report table that has data, each under its own heading."""
    lines: list[str] = []
    for title, columns in report_tables(rows):
        table = markdown_table(rows, columns)
        if table:
            lines += [f"### {title}", "", *table, ""]
    return lines


def perplexity_note(rows: Sequence[dict], eval_text: str) -> list[str]:
    row = next((r for r in rows if "windows" in r), None)
    if row is None:
        return []
    return [
        f"Perplexity over {row['windows']} non-overlapping windows of {row['window']} tokens "
        f"({row['tokens_scored']:,} tokens scored) of `{eval_text}`. KL: mean per-token KL "
        "divergence to the original model's next-token distribution (its top-k log-probs plus "
        "the rest, k = eval.kl.top_k); top-1: how often both models' most likely token agree.",
        "",
    ]


def render_markdown(report: dict[str, Any], plots: Sequence[str]) -> str:
    machine = report["machine"]
    lines = [
        f"# slimlm run: recipe `{report['recipe']}` on `{report['model']}`",
        "",
        f"- command: `{report['command']}`",
        f"- run directory: `{report['run_dir']}`",
        f"- machine: {machine['processor']}, {machine['cpu_count']} CPUs "
        f"({machine['torch_threads']} torch threads), torch {machine['torch']}"
        + (f", {machine['cuda']}" if machine.get("cuda") else ""),
        "",
    ]
    if report.get("stages_done", 0) < report.get("stages", 0):
        lines[-1:-1] = [
            f"- **incomplete**: {report['stages_done']} of {report['stages']} stages finished "
            "(the run is still going, or stopped); the rows below are those measured so far"
        ]
    if report["rows"]:
        lines += [
            "## Results",
            "",
            *perplexity_note(report["rows"], report["eval_text"]),
            *markdown_tables(report["rows"]),
        ]
    lines += [f"![{Path(p).stem}]({p})" for p in plots]
    if plots:
        lines.append("")
    samples = report.get("calibration_samples")
    if samples:
        lines += [
            "## Calibration text",
            "",
            f"{samples['tokens']:,} tokens sampled from the original model "
            + ("(read from the cache)." if samples["reused"] else f"in {samples['seconds']:.0f} s."),
            "",
        ]
    for quant in report.get("quantization", []):
        errors = list(quant["weight_rel_error"].values())
        lines += [
            "## Quantization",
            "",
            f"{quantization_title(quant)}: {quant['layers']} Linear layers "
            f"in {quant['seconds']:.1f} s; relative weight error ‖W−Q(W)‖/‖W‖ "
            f"mean {sum(errors) / len(errors):.5f}, max {max(errors):.5f}."
            + (
                " Peak memory while calibrating layer by layer: "
                f"{quant['calibration_peak_memory_bytes'] / 2**20:,.0f} MiB."
                if "calibration_peak_memory_bytes" in quant
                else ""
            ),
            "",
        ]
        mixed = quant.get("mixed_precision")
        if mixed:
            counts = {
                b: sum(1 for chosen in mixed["bits"].values() if chosen == b) for b in mixed["candidate_bits"]
            }
            lines += [
                f"Mixed precision: budget {mixed['budget_bpw']} bits per weight, "
                f"achieved {mixed['achieved_bpw']:.3f} (scales counted); layers per width: "
                + ", ".join(f"int{b}: {n}" for b, n in counts.items())
                + f"; predicted KL {mixed['predicted_kl']:.4f} (Fisher proxy, "
                f"{mixed['sensitivity_windows']} windows; peak memory of that "
                f"pass {mixed['sensitivity_peak_memory_bytes'] / 2**20:,.0f} MiB).",
                "",
            ]
    lines += compression_stage_lines(report)
    lines += reconstruction_lines(report)
    lines += artifact_and_generation_lines(report)
    if report.get("stage_seconds"):
        lines += ["## Time", "", "| stage | seconds |", "|---|---:|"]
        lines += [f"| {name} | {seconds:.1f} |" for name, seconds in report["stage_seconds"]]
        lines.append("")
    return "\n".join(lines)


def compression_stage_lines(report: dict[str, Any]) -> list[str]:
    """Markdown for the sparsify, prune and distill stages a run went through."""
    lines: list[str] = []
    for section in report.get("sparsity", []):
        lines += [
            "## Sparsity",
            "",
            f"{section['method']}{' + OWL per-layer ratios' if section['owl'] else ''}, "
            f"{section['pattern']}: {section['layers']} Linear layers, "
            f"{100 * section['achieved_sparsity']:.2f}% of their weights zero, "
            f"in {section['seconds']:.1f} s. Zeros do not make dense kernels faster; they make the "
            "artifact smaller (bitmask storage) and, as 2:4, can run on GPUs with sparse tensor cores.",
            "",
        ]
    for section in report.get("pruning", []):
        before, after = section["shape_before"], section["shape_after"]
        changed = ", ".join(
            f"{key} {before[key]} → {after[key]}"
            for key in ("layers", "hidden_size", "intermediate_size", "heads", "kv_heads")
            if before[key] != after[key]
        )
        lines += [
            "## Structured pruning",
            "",
            f"{changed}: {section['parameters_before']:,} → "
            f"{section['parameters_after']:,} parameters, in {section['seconds']:.1f} s."
            + (
                f" Removed layers (lowest block influence): {section['removed_layers']}."
                if section.get("removed_layers")
                else ""
            ),
            "",
        ]
    for section in report.get("distillation", []):
        first, last = section["history"][0], section["history"][-1]
        evals = section["evals"]
        lines += [
            "## Distillation" if section["loss"] != "ce" else "## Fine-tuning (cross-entropy)",
            "",
            f"{section['loss']}, teacher {section.get('teacher_signal', 'none')}: {section['steps']} "
            f"optimizer steps, {section['tokens']:,} tokens, {section['processes']} process(es), "
            f"{section['train_seconds']:.0f} s of training ({section['seconds']:.0f} s "
            f"with the teacher's cache)"
            + (f" on {section['data']}" if "data" in section else "")
            + f"; loss {first['loss']:.4f} → {last['loss']:.4f}"
            + (
                f"; held-out perplexity {evals[0]['held_out_ppl']:.2f} (step {evals[0]['step']}) "
                f"→ {evals[-1]['held_out_ppl']:.2f} (step {evals[-1]['step']})"
                if evals
                else ""
            )
            + (
                f"; resumed from step {section['resumed_from_step']}"
                if section.get("resumed_from_step")
                else ""
            )
            + ".",
            "",
        ]
        if "draft_before" in section:
            before, after = section["draft_before"], section["draft_after"]
            lines += [
                f"As a speculative-decoding draft for the teacher ({before['prompts']} held-out "
                f"prompts, {before['new_tokens']} new tokens, lookahead {before['lookahead']}, "
                f"greedy): acceptance {100 * before['acceptance_rate']:.1f}% "
                f"before training → {100 * after['acceptance_rate']:.1f}% after; "
                f"tokens per teacher pass {before['tokens_per_teacher_pass']:.2f} → "
                f"{after['tokens_per_teacher_pass']:.2f}; speed-up over plain decoding "
                f"{before['speedup']:.2f}x → {after['speedup']:.2f}x (outputs identical to plain "
                f"decoding: {before['identical_to_plain'] and after['identical_to_plain']}).",
                "",
            ]
    return lines


def percent_change(before: float, after: float) -> float:
    return 100 * (after / before - 1) if before else 0.0


def reconstruction_lines(report: dict[str, Any]) -> list[str]:
    """Markdown for the reconstruct stage: each block's output error before and after."""
    lines: list[str] = []
    for section in report.get("reconstruction", []):
        blocks = section["blocks"]
        lines += [
            "## Block-wise reconstruction",
            "",
            f"{len(blocks)} blocks, {section['samples']} windows of {section['seq_len']} tokens, "
            f"{section['epochs']} passes, {section['seconds']:.0f} s; "
            f"{sum(not block['kept'] for block in blocks)} block(s) put back untrained "
            "(training did not lower their error). Error: mean squared difference of the block's "
            "outputs from the original's hidden state after the layers the block stands for.",
            "",
            "| block | original layers | error before | after | change % | codes changed | seconds |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {b['block']} | {b.get('original_layers', '')} | "  # absent from older runs' reports
                f"{b['mse_before']:.5f} | {b['mse_after']:.5f} | "
                f"{percent_change(b['mse_before'], b['mse_after']):+.1f} | {b['codes_changed']:,} | "
                f"{b['seconds']:.1f} |"
                for b in blocks
            ),
            "",
        ]
    return lines


def artifact_and_generation_lines(report: dict[str, Any]) -> list[str]:
    """Markdown for what a run wrote out (exports) and the completions it generated."""
    lines: list[str] = []
    for artifact in report.get("artifacts", []):
        line = (
            f"`{artifact['path']}` in the run directory ({artifact['format']}), "
            f"{artifact['bytes_on_disk']:,} bytes on disk."
        )
        if artifact["format"] == "gguf":
            line += (
                f" Block type {artifact['gguf_type']}: {len(artifact['exact'])} quantized "
                f"weights written exactly as slimlm chose them, {len(artifact['requantized'])} "
                f"re-quantized from another grid, {len(artifact['dequantized'])} "
                f"dequantized, {len(artifact['rounded'])} rounded from float."
                + (
                    f" Token embedding and LM head in {artifact['head_type']}."
                    if artifact.get("head_type", artifact["gguf_type"]) != artifact["gguf_type"]
                    else ""
                )
            )
        if "weights_accounted_bytes" in artifact:
            line += (
                f" Weights file {artifact['weights_file_bytes']:,} bytes against "
                f"{artifact['weights_accounted_bytes']:,} accounted for by the codes, scales, zero points "
                f"and float tensors ({100 * artifact['weights_overhead']:+.3f}%: the safetensors header)."
            )
        if artifact.get("quantized_layers"):
            line += f" {artifact['quantized_layers']} quantized layers kept packed."
        lines += ["## Artifact", "", line, ""]
    for gen in report.get("generations", []):
        lines += [
            "## Greedy completion",
            "",
            f"Model: {gen['model']}; {gen['new_tokens']} new tokens at {gen['decode_tok_s']} "
            f"tokens/s (prefill included), through the {gen.get('engine', 'transformers generate')}.",
            "",
            f"> **Prompt:** {gen['prompt']}",
            ">",
            f"> **Completion:** {gen['completion']}",
            "",
        ]
    return lines


def quantization_title(quant: dict) -> str:
    mixed = quant.get("mixed_precision")
    width = f"mixed {mixed['budget_bpw']} bpw" if mixed else f"int{quant['bits'] or 8}"
    group = f" g{quant['group_size']}" if quant.get("group_size") else ""
    return f"{quant['method']} {width}{group}"


def write_plots(run_dir: Path, report: dict[str, Any]) -> list[str]:
    """Plots next to the report; returns their names relative to the run directory."""
    written = [plot_size_quality(report["rows"], run_dir / "size_vs_quality.png")]
    for index, quant in enumerate(report.get("quantization", [])):
        title = f"{quantization_title(quant)}: per-layer weight error"
        written.append(
            plot_layer_errors(quant["weight_rel_error"], title, run_dir / f"layer_error_{index + 1}.png")
        )
        if quant.get("mixed_precision"):
            written.append(
                plot_bit_map(
                    quant["mixed_precision"]["bits"],
                    f"{quantization_title(quant)}: bits per layer",
                    run_dir / f"bit_map_{index + 1}.png",
                )
            )
    for index, section in enumerate(report.get("distillation", [])):
        written.append(
            plot_training(
                section["history"],
                f"distillation ({section['loss']}, {section['tokens']:,} tokens)",
                run_dir / f"training_{index + 1}.png",
            )
        )
    return [p.name for p in written if p is not None]


def write_report(
    run_dir: Path, header: dict[str, Any], evaluations: Sequence[dict], sections: dict[str, Any]
) -> str:
    report = {**header, "machine": machine_info(), "rows": add_deltas(evaluations), **sections}
    plots = write_plots(run_dir, report)
    markdown = render_markdown(report, plots)
    write_atomic(run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    write_atomic(run_dir / "report.md", markdown + "\n")
    return markdown
