"""Publish runs' reports as one committed benchmark result: bench/results/<name>.{md,json,png}.

    python bench/publish.py NAME RUN_DIR [RUN_DIR ...] --command "bash bench/eval_default.sh" [--notes FILE]

Rows of several runs are joined in the order given; the original model's row, which every
recipe of a benchmark repeats (from the cached reference), is kept once.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from slimlm.eval.plots import plot_size_quality
from slimlm.eval.report import (
    artifact_and_generation_lines,
    compression_stage_lines,
    markdown_tables,
    perplexity_note,
    reconstruction_lines,
)

RESULTS = Path(__file__).parent / "results"


def joined_rows(reports: list[dict]) -> list[dict]:
    rows, seen_reference = [], False
    for report in reports:
        for row in report["rows"]:
            if row.get("is_reference"):
                if seen_reference:
                    continue
                seen_reference = True
            rows.append(row)
    return rows


def publish(name: str, run_dirs: list[Path], command: str, notes: Path | None) -> Path:
    reports = [json.loads((run_dir / "report.json").read_text()) for run_dir in run_dirs]
    RESULTS.mkdir(exist_ok=True)
    rows = joined_rows(reports)
    stage_seconds = [
        (f"{report['recipe']}: {stage}" if len(reports) > 1 else stage, seconds)
        for report in reports
        for stage, seconds in report.get("stage_seconds", [])
    ]
    total_s = sum(seconds for _, seconds in stage_seconds)
    machine = reports[0]["machine"]
    runs = [report["command"] for report in reports]
    record = {
        "machine": machine,
        "command": command,
        "slimlm_commands": runs,
        "wall_s": round(total_s, 1),
        "rows": rows,
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"# {name}",
        "",
        f"- command: `{command}`" + (f" (runs `{runs[0]}`)" if len(runs) == 1 else ""),
        *(["- runs: " + ", ".join(f"`{run}`" for run in runs)] if len(runs) > 1 else []),
        f"- machine: {machine['processor']}, {machine['cpu_count']} CPUs ({machine['torch_threads']} torch "
        f"threads), torch {machine['torch']}" + (f", {machine['cuda']}" if machine.get("cuda") else ""),
        f"- wall time: {total_s / 60:.1f} min",
        "",
        *perplexity_note(rows, reports[0]["eval_text"]),
        *markdown_tables(rows),
    ]
    plots = [plot_size_quality(rows, RESULTS / f"{name}_size_vs_quality.png")]
    for run_dir, report in zip(run_dirs, reports):
        prefix = f"{name}_{report['recipe']}_" if len(reports) > 1 else f"{name}_"
        for plot in sorted(p for p in run_dir.glob("*.png") if p.name != "size_vs_quality.png"):
            plots.append(shutil.copyfile(plot, RESULTS / f"{prefix}{plot.name}"))
    lines += [f"![{Path(plot).stem}]({Path(plot).name})\n" for plot in plots if plot is not None]
    for report in reports:
        stage_lines = (
            compression_stage_lines(report)
            + reconstruction_lines(report)
            + artifact_and_generation_lines(report)
        )
        lines += (
            [f"## {report['recipe']}", "", *stage_lines] if len(reports) > 1 and stage_lines else stage_lines
        )
    lines += ["## Time per stage", "", "| stage | seconds |", "|---|---:|"]
    lines += [f"| {stage} | {seconds:.1f} |" for stage, seconds in stage_seconds]
    lines.append("")
    if notes is not None:
        lines += [notes.read_text().strip(), ""]
    out = RESULTS / f"{name}.md"
    out.write_text("\n".join(lines))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--command", required=True, help="the command that reproduces the result")
    parser.add_argument("--notes", type=Path, default=None, help="a Markdown file appended to the result")
    options = parser.parse_args()
    print(publish(options.name, options.run_dirs, options.command.strip(), options.notes))
