"""Adds to a distillation benchmark's results what the issue asks of its runs, as a `## Summary`
section of bench/results/NAME.md and a "summary" entry of NAME.json:

- distill_default (after bash bench/distill_default.sh): the share of the teacher-student
  perplexity gap each training closed, the KL the LoRA adapters removed from the w4 model, the
  draft's acceptance before and after, and the student's decode speed-up over the teacher
  (bench/results/prune_default.json: the same shapes, same bundled decoder);
- distill_keep (after bash bench/distill_keep.sh) and distill_keep_samples (DATA=samples): the gap
  closed, decode speed-up over the teacher and mean zero-shot accuracy of the distilled student and
  its w4 GPTQ.

The gap is in log-perplexity, i.e. mean NLL per token: (NLL_pruned - NLL_trained) /
(NLL_pruned - NLL_teacher).

    python bench/distill_summary.py [NAME ...] [--quick]      (every result present by default)

--quick (a test) summarizes the results as they are and only prints the summaries.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable, Optional

from benchlib import REPO, RESULTS

from slimlm.eval.report import zeroshot_tasks

RUNS = REPO / "bench" / "runs" / "distill_default"


def row(rows: list[dict], name: str) -> dict:
    return next(r for r in rows if r["name"] == name)


def gap_closed(rows: list[dict], name: str) -> float:
    """The share of the pruned student's log-perplexity gap to the teacher that row `name` closed."""
    teacher, pruned, trained = (row(rows, n)["ppl"] for n in ("teacher", "pruned student", name))
    return (math.log(pruned) - math.log(trained)) / (math.log(pruned) - math.log(teacher))


def default_summary(rows: list[dict]) -> tuple[dict, list[str]]:
    """The pruned students' gap closed, LoRA recovery, the drafts, the student's speed-up."""
    teacher, pruned = row(rows, "teacher"), row(rows, "pruned student")
    summary: dict = {"gap_recovered": {}}
    lines = [
        "| trained student | ppl | KL to teacher | share of the log-perplexity gap closed |",
        "|---|---:|---:|---:|",
    ]
    lines.append(f"| pruned, before training | {pruned['ppl']:.2f} | {pruned['kl_mean']:.3f} | 0% |")
    for name in ("distilled (forward KL)", "fine-tuned (cross-entropy)"):
        trained = row(rows, name)
        share = gap_closed(rows, name)
        summary["gap_recovered"][name] = share
        lines.append(f"| {name} | {trained['ppl']:.2f} | {trained['kl_mean']:.3f} | {100 * share:.1f}% |")
    lines.append(f"| teacher | {teacher['ppl']:.2f} | 0 | 100% |")
    quantized, recovered = row(rows, "w4-g64-gptq"), row(rows, "w4-g64-gptq + LoRA (distilled)")
    summary["lora_kl"] = {"before": quantized["kl_mean"], "after": recovered["kl_mean"]}
    lines += [
        "",
        (
            f"LoRA recovery of w4 g64 GPTQ: KL to the fp32 model {quantized['kl_mean']:.4f} → "
            f"{recovered['kl_mean']:.4f}, perplexity {quantized['ppl']:.2f} → {recovered['ppl']:.2f}."
        ),
    ]
    for recipe in ("prune-distill", "draft"):
        if not (RUNS / recipe / "report.json").is_file():
            continue
        report = json.loads((RUNS / recipe / "report.json").read_text())
        section = report["distillation"][0]
        if "draft_before" in section:
            before, after = section["draft_before"], section["draft_after"]
            summary[f"draft_{recipe}"] = {"before": before, "after": after}
            lines.append(
                f"{recipe} student as the teacher's draft: acceptance {100 * before['acceptance_rate']:.1f}% "
                f"→ {100 * after['acceptance_rate']:.1f}%, speed-up over plain greedy decoding "
                f"{before['speedup']:.2f}x → {after['speedup']:.2f}x (outputs identical: "
                f"{after['identical_to_plain']})."
            )
    prune_file = RESULTS / "prune_default.json"
    if prune_file.is_file():
        student = next(
            r for r in json.loads(prune_file.read_text())["rows"] if r["name"].startswith("student")
        )
        summary["student_decode_speedup"] = student["speedup_vs_unpruned"]
        lines.append(
            f"The student's shape decodes {student['speedup_vs_unpruned']:.2f}x as fast as the teacher in "
            "the bundled decoder (fp32, batch 1; `bench/results/prune_default.md`)."
        )
    return summary, lines


def zeroshot_mean(record: dict) -> Optional[float]:
    """Mean accuracy over the zero-shot tasks a row reports (None if it reports none)."""
    accuracies = [record[f"{task}_acc"] for task in zeroshot_tasks([record])]
    return sum(accuracies) / len(accuracies) if accuracies else None


def keep_summary(rows: list[dict]) -> tuple[dict, list[str]]:
    """Each model's gap closed, speed-up over the teacher (same run, same decoder) and zero-shot mean."""
    teacher = row(rows, "teacher")
    lines = [
        "| model | ppl | KL to teacher | gap closed | decode tok/s (b1) | speed-up | zero-shot mean acc % |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    summary: dict = {}
    for record in rows:
        name, speed = record["name"], record.get("decode_tok_s")  # a row may skip the speed metric
        entry = {
            "gap_closed": gap_closed(rows, name),
            "speedup": None if speed is None else speed / teacher["decode_tok_s"],
            "zeroshot_mean_acc": zeroshot_mean(record),
        }
        summary[name] = entry
        mean, speedup = entry["zeroshot_mean_acc"], entry["speedup"]
        lines.append(
            f"| {name} | {record['ppl']:.2f} | {record['kl_mean']:.3f} | {100 * entry['gap_closed']:.1f}% | "
            f"{'–' if speed is None else f'{speed:.1f}'} | {'–' if speedup is None else f'{speedup:.2f}x'} | "
            f"{'–' if mean is None else f'{100 * mean:.1f}'} |"
        )
    return {"models": summary}, lines


SUMMARIES: dict[str, Callable[[list[dict]], tuple[dict, list[str]]]] = {
    "distill_default": default_summary,
    "distill_keep": keep_summary,
    "distill_keep_samples": keep_summary,
}


def main() -> None:
    parser = argparse.ArgumentParser(description="Adds the summary to bench/results/NAME.{md,json}.")
    parser.add_argument(
        "names", nargs="*", help=f"any of {', '.join(SUMMARIES)} (default: every one present)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="only print the summaries, writing nothing (tests)"
    )
    options = parser.parse_args()
    unknown = [name for name in options.names if name not in SUMMARIES]
    if unknown:
        parser.error(f"no summary for {', '.join(unknown)}: choose from {', '.join(SUMMARIES)}")
    names = options.names or [name for name in SUMMARIES if (RESULTS / f"{name}.json").is_file()]
    for name in names:
        record = json.loads((RESULTS / f"{name}.json").read_text())
        summary, lines = SUMMARIES[name](record["rows"])
        lines = ["## Summary", "", *lines]
        if options.quick:
            print("\n".join(lines))
            continue
        record["summary"] = summary
        (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        markdown = (RESULTS / f"{name}.md").read_text().split("\n## Summary\n")[0]  # a rerun replaces it
        (RESULTS / f"{name}.md").write_text(markdown.rstrip() + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
