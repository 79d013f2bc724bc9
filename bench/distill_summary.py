"""Adds to bench/results/distill_default.{md,json} what the issue asks of the runs: the share of
the teacher-student perplexity gap each training closed (in log-perplexity, i.e. mean NLL per
token: (NLL_pruned - NLL_trained) / (NLL_pruned - NLL_teacher)), the KL the LoRA adapters removed
from the w4 model, the draft's acceptance before and after, and the student's decode speed-up
over the teacher (bench/results/prune_default.json: the same shapes, same bundled decoder).

    python bench/distill_summary.py [--quick]      (after bash bench/distill_default.sh)

--quick (a test) summarizes the results as they are and only prints the summary.
"""

from __future__ import annotations

import argparse
import json
import math

from benchlib import REPO, RESULTS

RUNS = REPO / "bench" / "runs" / "distill_default"


def row(rows: list[dict], name: str) -> dict:
    return next(r for r in rows if r["name"] == name)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Adds the summary to bench/results/distill_default.{md,json}."
    )
    parser.add_argument(
        "--quick", action="store_true", help="only print the summary, writing nothing (tests)"
    )
    options = parser.parse_args()
    record = json.loads((RESULTS / "distill_default.json").read_text())
    rows = record["rows"]
    teacher, pruned = row(rows, "teacher"), row(rows, "pruned student")
    gap = math.log(pruned["ppl"]) - math.log(teacher["ppl"])
    summary: dict = {"gap_recovered": {}}
    lines = [
        "## Summary",
        "",
        "| trained student | ppl | KL to teacher | share of the log-perplexity gap closed |",
        "|---|---:|---:|---:|",
    ]
    lines.append(f"| pruned, before training | {pruned['ppl']:.2f} | {pruned['kl_mean']:.3f} | 0% |")
    for name in ("distilled (forward KL)", "fine-tuned (cross-entropy)"):
        trained = row(rows, name)
        share = (math.log(pruned["ppl"]) - math.log(trained["ppl"])) / gap
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
    if options.quick:
        print("\n".join(lines))
        return
    record["summary"] = summary
    (RESULTS / "distill_default.json").write_text(json.dumps(record, indent=2) + "\n")
    markdown = (
        (RESULTS / "distill_default.md").read_text().split("\n## Summary\n")[0]
    )  # rerunning replaces the summary
    (RESULTS / "distill_default.md").write_text(markdown.rstrip() + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
