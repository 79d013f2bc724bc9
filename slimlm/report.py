"""A run's report: report.json for machines, report.md for people, and the run's status file.

`status.json` says whether a run directory holds a finished result: it is written as
"running" before any work and becomes "complete" only after the report is in place, so an
interrupted or failed run never looks complete.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

STATUS = "status.json"


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(temp, path)


def write_status(run_dir: Path, status: str, error: Optional[str] = None) -> None:
    record = {"status": status, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if error:
        record["error"] = error
    write_atomic(run_dir / STATUS, json.dumps(record, indent=2) + "\n")


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def build_report(header: dict[str, Any], evaluations: list[dict], sections: dict[str, Any]) -> dict[str, Any]:
    """Add the deltas against the first evaluation row (the reference) to every row."""
    rows = [dict(row) for row in evaluations]
    if rows:
        base = rows[0]
        for row in rows:
            row["delta_ppl_pct"] = round(100.0 * (row["ppl"] / base["ppl"] - 1.0), 3)
            row["size_pct_of_first"] = round(100.0 * row["bytes"] / base["bytes"], 2)
    return {**header, "machine": machine_info(), "rows": rows, **sections}


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# slimlm run: recipe `{report['recipe']}` on `{report['model']}`", ""]
    lines += [f"- command: `{report['command']}`", f"- run directory: `{report['run_dir']}`"]
    machine = report["machine"]
    lines += [f"- machine: {machine['processor']}, {machine['cpu_count']} CPUs ({machine['torch_threads']} torch threads), torch {machine['torch']}", ""]
    rows = report["rows"]
    if rows:
        first = rows[0]
        lines += [
            f"## Perplexity and size",
            "",
            f"WikiText-style perplexity over {first['windows']} non-overlapping windows of {first['window']} tokens "
            f"({first['tokens_scored']} tokens scored), on `{report['eval_text']}`.",
            "",
            "| model | ppl | Δppl % | bytes | size vs first | params | bits/weight |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            lines.append(
                f"| {row['name']} | {row['ppl']:.4f} | {row['delta_ppl_pct']:+.3f} | {row['bytes']:,} | "
                f"{row['size_pct_of_first']:.1f}% | {row['parameters']:,} | {row['bits_per_weight']:.2f} |"
            )
        lines.append("")
    for quant in report.get("quantization", []):
        errors = list(quant["weight_rel_error"].values())
        mean = sum(errors) / len(errors) if errors else float("nan")
        lines += [
            "## Quantization",
            "",
            f"{quant['method']} int{quant['bits']}: {quant['layers']} Linear layers; mean relative weight error "
            f"‖W−Q(W)‖/‖W‖ = {mean:.5f} (max {max(errors, default=float('nan')):.5f}).",
            "",
        ]
    for artifact in report.get("artifacts", []):
        lines += ["## Artifact", "", f"`{artifact['path']}` ({artifact['format']}), {artifact['bytes_on_disk']:,} bytes on disk.", ""]
    for gen in report.get("generations", []):
        lines += [
            "## Greedy completion",
            "",
            f"Model: {gen['model']}; {gen['new_tokens']} new tokens at {gen['decode_tok_s']} tokens/s (transformers `generate`).",
            "",
            f"> **Prompt:** {gen['prompt']}",
            ">",
            f"> **Completion:** {gen['completion']}",
            "",
        ]
    if report.get("stage_seconds"):
        lines += ["## Time", "", "| stage | seconds |", "|---|---:|"]
        lines += [f"| {name} | {seconds:.1f} |" for name, seconds in report["stage_seconds"]]
        lines.append("")
    return "\n".join(lines)


def write_report(run_dir: Path, report: dict[str, Any]) -> str:
    markdown = render_markdown(report)
    write_atomic(run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    write_atomic(run_dir / "report.md", markdown + "\n")
    return markdown
