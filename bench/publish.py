"""Publish a run's report as a committed benchmark result: bench/results/<name>.{md,json,png}.

    python bench/publish.py RUN_DIR NAME --command "bash bench/eval_default.sh" [--notes FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from slimlm.eval.report import markdown_tables, perplexity_note

RESULTS = Path(__file__).parent / "results"


def publish(run_dir: Path, name: str, command: str, notes: Path | None) -> Path:
    report = json.loads((run_dir / "report.json").read_text())
    RESULTS.mkdir(exist_ok=True)
    rows = [{k: v for k, v in row.items()} for row in report["rows"]]
    total_s = sum(seconds for _, seconds in report.get("stage_seconds", []))
    machine = report["machine"]
    record = {"machine": machine, "command": command, "slimlm_command": report["command"], "wall_s": round(total_s, 1), "rows": rows}
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"# {name}",
        "",
        f"- command: `{command}` (runs `{report['command']}`)",
        f"- machine: {machine['processor']}, {machine['cpu_count']} CPUs ({machine['torch_threads']} torch threads), "
        f"torch {machine['torch']}" + (f", {machine['cuda']}" if machine.get("cuda") else ""),
        f"- wall time: {total_s / 60:.1f} min",
        "",
        *perplexity_note(rows, report["eval_text"]),
        *markdown_tables(rows),
    ]
    for plot in sorted(run_dir.glob("*.png")):
        target = RESULTS / f"{name}_{plot.name}"
        shutil.copyfile(plot, target)
        lines += [f"![{plot.stem}]({target.name})", ""]
    lines += ["## Time per stage", "", "| stage | seconds |", "|---|---:|"]
    lines += [f"| {stage} | {seconds:.1f} |" for stage, seconds in report.get("stage_seconds", [])]
    lines.append("")
    if notes is not None:
        lines += [notes.read_text().strip(), ""]
    out = RESULTS / f"{name}.md"
    out.write_text("\n".join(lines))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("name")
    parser.add_argument("--command", required=True, help="the command that reproduces the run")
    parser.add_argument("--notes", type=Path, default=None, help="a Markdown file appended to the result")
    options = parser.parse_args()
    print(publish(options.run_dir, options.name, options.command.strip(), options.notes))
