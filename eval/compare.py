"""`slimlm compare`: one table and one plot across runs, or across every run of a sweep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from slimlm.errors import SlimlmError
from slimlm.eval.plots import plot_size_quality
from slimlm.eval.report import TASK_TITLES, markdown_tables, zeroshot_tasks
from slimlm.resources import read_json_object
from slimlm.rundir import write_atomic


def find_reports(paths: Sequence[Path]) -> list[Path]:
    """report.json of each run directory given, or of every run below a sweep directory."""
    found: list[Path] = []
    for path in paths:
        if (path / "report.json").is_file():
            found.append(path / "report.json")
        elif path.is_dir():
            below = sorted(path.rglob("report.json"))
            if not below:
                raise SlimlmError(
                    f"'{path}' holds no finished run (no report.json below it); "
                    "give run directories or a sweep directory"
                )
            found.extend(below)
        else:
            raise SlimlmError(
                f"'{path}' {'is not a directory' if path.exists() else 'does not exist'}; "
                "give run directories (runs/<recipe>/<time>) or a sweep directory (multirun/<time>)"
            )
    return found


def compare(paths: Sequence[Path], out_dir: Path) -> str:
    """Write comparison.md/.json/.png into out_dir; returns the Markdown."""
    rows = []
    for report_file in find_reports(paths):
        report = read_json_object(report_file, "rerun that run, or leave its directory out")
        rows_ok = isinstance(report.get("rows"), list) and all(
            isinstance(row, dict) and isinstance(row.get("name"), str) for row in report["rows"]
        )
        if not rows_ok or not isinstance(report.get("recipe"), str):
            raise SlimlmError(
                f"'{report_file}' is not a slimlm report (no recipe "
                "and rows); rerun that run, or leave its directory out"
            )
        for row in report["rows"]:
            rows.append(
                {
                    **row,
                    "run": report["recipe"],
                    "name": f"{report['recipe']}: {row['name']}",
                    "run_dir": str(report_file.parent),
                }
            )
    if not rows:
        raise SlimlmError(
            "the runs given have no evaluation rows to compare; add an evaluate stage to their recipes"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = plot_size_quality(rows, out_dir / "comparison.png")
    lines = [
        "# slimlm comparison",
        "",
        f"{len(rows)} rows from {len({r['run_dir'] for r in rows})} runs.",
        "",
        *markdown_tables(rows),
        *zeroshot_differences(rows),
    ]
    if plot is not None:
        lines += [f"![comparison]({plot.name})", ""]
    markdown = "\n".join(lines)
    write_atomic(out_dir / "comparison.json", json.dumps({"rows": rows}, indent=2) + "\n")
    write_atomic(out_dir / "comparison.md", markdown + "\n")
    return markdown


# Two accuracies differ beyond their noise when the difference exceeds 1.96 standard errors of
# the difference (a two-sided test at 5%, the two samples taken as independent).
Z_95 = 1.96


def zeroshot_differences(rows: Sequence[dict]) -> list[str]:
    """Each row's zero-shot accuracies against the first row's: the difference in points and
    whether it is beyond the two standard errors combined."""
    first, cells = rows[0], []
    for task in zeroshot_tasks(rows):
        key = f"{task}_acc"
        if key not in first or f"{key}_stderr" not in first:
            continue
        for row in rows[1:]:
            if key in row and f"{key}_stderr" in row:
                difference = row[key] - first[key]
                noise = Z_95 * (row[f"{key}_stderr"] ** 2 + first[f"{key}_stderr"] ** 2) ** 0.5
                cells.append(
                    f"| {row['name']} | {TASK_TITLES.get(task, task)} | {100 * difference:+.2f} "
                    f"| {100 * noise:.2f} | {'yes' if abs(difference) > noise else 'no'} |"
                )
    if not cells:
        return []
    header = [
        "### Zero-shot differences from the first row",
        "",
        f"Against `{first['name']}`; noise: 1.96 standard errors of the difference (95%).",
        "",
    ]
    return [
        *header,
        "| model | task | Δ acc (points) | noise (points) | beyond noise |",
        "|---|---|---:|---:|---|",
        *cells,
        "",
    ]
